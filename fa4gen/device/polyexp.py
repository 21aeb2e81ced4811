"""Device helpers: exp2 evaluated on the FMA pipe (FA4's software exp2), shared by SM90 and SM100.

2**x = 2**floor(x) * 2**frac(x). floor comes from one add in round-toward-minus-infinity mode
against 1.5 * 2**23, which leaves floor(x) in the low mantissa bits of the sum; 2**frac is a
polynomial in Horner form (coefficients fitted at plan time, see fa4gen.plan.polyfit); the integer
part is added straight into the exponent bits. Inputs below -126 (masked scores included) give 0.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: adding it rounds to an integer kept in the low mantissa bits


@dsl_user_op
def add_round_down(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
            "add.rm.f32 $0, $1, $2;",
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def exp2_poly(x: Float32, coeffs: cutlass.Constexpr[tuple]) -> Float32:
    """2**x with `coeffs` = (c0, c1, ..., cd) approximating 2**f on [0, 1) as sum c_k f**k."""
    xc = cute.arch.fmax(x, Float32(-127.0))
    t = add_round_down(xc, Float32(_ROUND_MAGIC))
    j = t - Float32(_ROUND_MAGIC)
    f = xc - j
    degree = len(coeffs) - 1
    p = Float32(coeffs[degree])
    for k in cutlass.range_constexpr(degree - 1, -1, -1):
        p = p * f + Float32(coeffs[k])
    return _scale_by_exponent(p, t, x)


@dsl_user_op
def _scale_by_exponent(p: Float32, t: Float32, x: Float32, *, loc=None, ip=None) -> Float32:
    """as_float(as_int(p) + (as_int(t) << 23)), or 0 when x < -126."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [
                Float32(p).ir_value(loc=loc, ip=ip),
                Float32(t).ir_value(loc=loc, ip=ip),
                Float32(x).ir_value(loc=loc, ip=ip),
            ],
            "{\n"
            ".reg .b32 pb, tb;\n"
            ".reg .pred lo;\n"
            "mov.b32 pb, $1;\n"
            "mov.b32 tb, $2;\n"
            "shl.b32 tb, tb, 23;\n"
            "add.s32 pb, pb, tb;\n"
            "setp.lt.f32 lo, $3, 0fC2FC0000;\n"
            "selp.b32 pb, 0, pb, lo;\n"
            "mov.b32 $0, pb;\n"
            "}",
            "=f,f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def exp2_poly2(x0: Float32, x1: Float32, coeffs: tuple) -> tuple:
    """`exp2_poly` of two values at once with Blackwell's packed fp32 ops (sm_100+: add / sub / fma .f32x2, one
    instruction for both lanes, each lane rounded exactly as the scalar op rounds it, so either value is
    bit-identical to `exp2_poly`'s). The clamp and the exponent add stay scalar (no packed form)."""
    magic = (Float32(_ROUND_MAGIC), Float32(_ROUND_MAGIC))
    xc = (cute.arch.fmax(x0, Float32(-127.0)), cute.arch.fmax(x1, Float32(-127.0)))
    t = cute.arch.add_packed_f32x2(xc, magic, rnd="rm")
    j = cute.arch.sub_packed_f32x2(t, magic)
    f = cute.arch.sub_packed_f32x2(xc, j)
    degree = len(coeffs) - 1
    p = (Float32(coeffs[degree]), Float32(coeffs[degree]))
    for k in range(degree - 1, -1, -1):
        p = cute.arch.fma_packed_f32x2(p, f, (Float32(coeffs[k]), Float32(coeffs[k])))
    return _scale_by_exponent(p[0], t[0], x0), _scale_by_exponent(p[1], t[1], x1)

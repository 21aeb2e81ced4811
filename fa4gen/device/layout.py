"""Device helpers: register-fragment views shared by the SM90 and SM100 kernels.

A WGMMA/UMMA accumulator fragment is laid out per thread as ((2 cols, 2 rows, N/8), M_tiles, N_tiles).
Softmax and masking want it as (rows, cols); the P·V GEMM wants the P accumulator re-read as an
A-operand fragment of the 16-bit MMA. Both are pure layout algebra on static layouts: no data moves.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@cute.jit
def rows_cols_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2c, 2r, N8), M, N) -> ((2r, M), (2c, N8, N)): a (row, col) view of a C fragment."""
    s0 = acc_layout.shape[0]
    d0 = acc_layout.stride[0]
    return cute.make_layout(
        ((s0[1], acc_layout.shape[1]), (s0[0], s0[2], acc_layout.shape[2])),
        stride=((d0[1], acc_layout.stride[1]), (d0[0], d0[2], acc_layout.stride[2])),
    )


def rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """The (row, col) view of an accumulator fragment (same registers)."""
    return cute.make_tensor(acc.iterator, rows_cols_layout(acc.layout))


@cute.jit
def c_as_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2c, 2r, N8), M, N) -> ((2c, 2r, 2), M, N8/2 * N): a C fragment re-read as a k16 A fragment.

    Valid for 16-bit operands: two neighbouring 8-column groups of S form one 16-wide K block of P.
    """
    s0 = acc_layout.shape[0]
    d0 = acc_layout.stride[0]
    return cute.make_layout(
        ((s0[0], s0[1], 2), acc_layout.shape[1], (s0[2] // 2, acc_layout.shape[2])),
        stride=((d0[0], d0[1], d0[2]), acc_layout.stride[1], (d0[2] * 2, acc_layout.stride[2])),
    )


def operand_buffer(acc: cute.Tensor, dtype):
    """Registers for P: (the buffer in acc's C layout, to store into; its A-operand view)."""
    buf = cute.make_rmem_tensor(acc.layout, dtype)
    return buf, cute.make_tensor(buf.iterator, c_as_a_layout(acc.layout))


@dsl_user_op
def _pack2_pinned(lo: Float32, hi: Float32, to_bf16: cutlass.Constexpr[bool], *, loc=None, ip=None) -> Int32:
    """Two fp32 values rounded to nearest into one register of 16-bit halves (lo in the low half), as inline
    PTX: LLVM leaves it where it is written, where it sank the arith conversions below a following branch (see
    `convert`'s `pinned`); ptxas still schedules it freely within its block."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{'bf16x2' if to_bf16 else 'f16x2'}.f32 $0, $2, $1;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def convert(dst: cute.Tensor, src: cute.Tensor, pinned: cutlass.Constexpr[bool] = False):
    """dst = src converted to dst's type (same layout, registers). A fragment whose value count is a power of two
    converts as one vector, whose lowering packs neighbouring values two per instruction. Other counts (tile_n 80:
    40 values) lowered to one conversion per value, and ptxas then paired them up and swapped every pair's halves
    into place with a PRMT before the P·V WGMMA read them (20 per key block at tile_n 80), so those convert in
    vectors of 8 (storage order: a C fragment's neighbouring columns stay neighbours); the same rounding either
    way.

    `pinned` (fp32 to bf16 / fp16 only): the conversions stay where they are written, in pairs of neighbouring
    values (storage order), instead of where LLVM would sink them. The SM90 forward converts P before the
    conditional O rescale, a branch: sunk below it, the 32 conversions of a key block ran as one burst at the
    block's end (stalled on the conversion pipe, 6% of the (192, 128) forward's stall samples on the H200), while
    above it ptxas spreads them through the exp2 stream, as in flash-attn-4's loop."""
    n = cute.size(src)
    if cutlass.const_expr(pinned):
        if cutlass.const_expr(src.element_type != cutlass.Float32
                              or dst.element_type not in (cutlass.BFloat16, cutlass.Float16)):
            raise TypeError(f"frag.convert(pinned=True) converts Float32 to BFloat16 / Float16, "
                            f"got {src.element_type} to {dst.element_type}")
        to_bf16 = cutlass.const_expr(dst.element_type == cutlass.BFloat16)
        s1 = cute.make_tensor(src.iterator, cute.make_layout(n))
        d2 = cute.recast_tensor(cute.make_tensor(dst.iterator, cute.make_layout(n)), Int32)
        for i in cutlass.range_constexpr(n // 2):
            d2[i] = _pack2_pinned(s1[2 * i], s1[2 * i + 1], to_bf16)
    elif cutlass.const_expr(n & (n - 1) == 0 or n % 8 != 0):
        dst.store(src.load().to(dst.element_type))
    else:
        s8 = cute.logical_divide(cute.make_tensor(src.iterator, cute.make_layout(n)), cute.make_layout(8))
        d8 = cute.logical_divide(cute.make_tensor(dst.iterator, cute.make_layout(n)), cute.make_layout(8))
        for g in cutlass.range_constexpr(n // 8):
            d8[None, g].store(s8[None, g].load().to(dst.element_type))


__all__ = ["rows_cols", "rows_cols_layout", "c_as_a_layout", "operand_buffer", "convert"]

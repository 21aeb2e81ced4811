"""Device helpers of traced builds (tools/bwd_timeline.py): timestamps a kernel writes into a trace tensor, one
row per CTA or tile. Only rendered into a kernel when the package is rendered with `trace=` (never by the
planner or `fa4gen build`), so the kernels users run contain none of this.

`clock64()` is the SM's own cycle counter: comparable between the CTAs one SM runs one after another (their
gap), not across SMs. `globaltimer()` is the GPU-wide nanosecond timer, for ordering across SMs. `smid()` is
the SM the CTA runs on.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _read_special(register: str, wide: bool, loc, ip):
    # volatile (has_side_effects): read where it is written, never merged with another read or hoisted
    return llvm.inline_asm(
        T.i64() if wide else T.i32(), [], f"mov.{'u64' if wide else 'u32'} $0, %{register};", "=l" if wide else "=r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )


@dsl_user_op
def clock64(*, loc=None, ip=None) -> Int64:
    """The SM's cycle counter (%clock64)."""
    return Int64(_read_special("clock64", True, loc, ip))


@dsl_user_op
def globaltimer(*, loc=None, ip=None) -> Int64:
    """The GPU's global timer in nanoseconds (%globaltimer)."""
    return Int64(_read_special("globaltimer", True, loc, ip))


@dsl_user_op
def smid(*, loc=None, ip=None) -> Int32:
    """The SM this thread runs on (%smid)."""
    return Int32(_read_special("smid", False, loc, ip))


@dsl_user_op
def cta_row(*, loc=None, ip=None) -> Int32:
    """The CTA's linear index in its grid (x fastest): the trace row of a one-tile-per-CTA kernel."""
    bx, by, bz = cute.arch.block_idx(loc=loc, ip=ip)
    gx, gy, _ = cute.arch.grid_dim(loc=loc, ip=ip)
    return bx + gx * (by + gy * bz)


@cute.jit
def record(trace: cute.Tensor, row: Int32, event: cutlass.Constexpr[int], value: Int64):
    """trace[row, event] = value (one thread writes each entry)."""
    trace[row, event] = value

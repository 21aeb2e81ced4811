"""Device helpers: fake (shape-only) arguments for ahead-of-time compilation without a GPU.

Batch, sequence lengths and head counts are symbolic, so one compile serves every shape; strides
are symbolic multiples of 8 elements (16 bytes, what TMA needs) with a unit last-dim stride.
"""

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute import runtime


def _stride():
    return cute.sym_int64(divisibility=8)


def bshd(dtype, b, s, h, d: int):
    """A (batch, seqlen, heads, head_dim) tensor, last dim contiguous, 16-byte aligned."""
    return runtime.make_fake_tensor(dtype, (b, s, h, d), (_stride(), _stride(), _stride(), 1), assumed_align=16)


def bhs_lse(b, h, s):
    """The fp32 (batch, heads, seqlen_q) log-sum-exp tensor, contiguous."""
    return runtime.make_fake_compact_tensor(Float32, (b, h, s), stride_order=(2, 1, 0), assumed_align=4)


def accumulator(b, h):
    """The backward's fp32 (batch, heads, n) dQ accumulator (its tiles as flat chunks), contiguous; n is a
    whole number of 64-row tiles of head_dim >= 16 floats, so every head's slice is 4 KiB-aligned."""
    n = cute.sym_int(divisibility=1024)
    return runtime.make_fake_compact_tensor(Float32, (b, h, n), stride_order=(2, 1, 0), assumed_align=16)


def padded_stats(b, h):
    """The backward's fp32 (batch, heads, s_pad) LSE2 and D, s_pad = seqlen_q rounded up to whole query tiles
    (a multiple of 16: 16-byte aligned rows for bulk copies), contiguous; one symbolic s_pad for both."""
    s = cute.sym_int(divisibility=16)
    return tuple(
        runtime.make_fake_compact_tensor(Float32, (b, h, s), stride_order=(2, 1, 0), assumed_align=16) for _ in range(2)
    )


def semaphores(b, h, n):
    """A zeroed int32 (batch, heads, blocks) counter array of the deterministic backward, contiguous."""
    return runtime.make_fake_compact_tensor(Int32, (b, h, n), stride_order=(2, 1, 0), assumed_align=4)


def cu_seqlens():
    """(cu_seqlens_q, cu_seqlens_k, seqused_k) of a varlen call: int32, batch + 1 / batch + 1 / batch."""
    n = cute.sym_int()
    return tuple(
        runtime.make_fake_compact_tensor(Int32, (size,), stride_order=(0,), assumed_align=4)
        for size in (n, n, cute.sym_int())
    )


def trace(events: int):
    """A traced build's int64 (rows, events) timestamp tensor (fa4gen/device/trace.py), contiguous."""
    return runtime.make_fake_compact_tensor(Int64, (cute.sym_int(), events), stride_order=(1, 0), assumed_align=8)


def stream():
    """The caller's current CUDA stream, picked up at call time through TVM-FFI."""
    return runtime.make_fake_stream(use_tvm_ffi_env_stream=True)

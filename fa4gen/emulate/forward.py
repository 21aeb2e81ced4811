"""Emulator: the SM90 forward kernel's arithmetic, step by step, in torch on the CPU.

For one KernelPlan this computes what the generated kernel computes, in the same order and the
same precisions: per query tile of tile_m rows, the key blocks of tile_n columns from the tile's
mask bounds, last block first; S = Q·Kᵀ in fp32; softcap as tanh(S * scale / cap) with the cap
folded into scale_log2; masked scores -inf; the online softmax with the running max kept in raw
score units and moved only when it grows by more than rescale_threshold (exp2 domain); every
k-th exp2 of a thread's row on the FMA polynomial (same coefficients, same range reduction),
the rest on MUFU; P rounded to the input dtype before P·V; O and the row sums in fp32; finally
O / l rounded to the dtype and LSE = (m * scale_log2 + log2 l) * ln 2.

What is modelled, not copied: MUFU ex2/rcp/lg2 and tanh.approx are the exact fp32 functions
(ex2.approx is within 2^-22 relative; tanh.approx within 2^-11), and fp32 sums run in torch's
order instead of the tensor core's. Those are the only differences a correct kernel may show
against this emulator; see fa4gen.golden.tolerance for what they allow.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from fa4gen.api.runtime import clamp_window
from fa4gen.emulate import tiling

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
EMULATED_ARCHS = ("sm90",)
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_ROUND_DOWN_FLOOR = -127.0  # the polynomial clamps its input here before the range reduction
_POLY_ZERO_BELOW = -126.0  # ... and returns 0 below this (masked scores included)
_SMALLEST_NORMAL = 2.0**-126  # ex2.approx.ftz flushes smaller results to 0


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """The plan fields the kernel's arithmetic depends on (and nothing else)."""

    arch: str
    dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    tile_m: int
    tile_n: int
    causal: bool
    local: bool
    chunked: bool
    window_left: int
    window_right: int
    chunk_size: int
    softcap: float
    rescale_threshold: float
    poly_every: int
    poly_coeffs: tuple[float, ...]

    @property
    def has_mask(self) -> bool:
        return self.causal or self.local or self.chunked

    @classmethod
    def from_plan(cls, plan: Any) -> "Algorithm":
        """From a KernelPlan or its dict (spec.lock.json's `plans` entries)."""
        get = (lambda k: plan[k]) if isinstance(plan, Mapping) else (lambda k: getattr(plan, k))
        arch = get("arch")
        if arch not in EMULATED_ARCHS:
            raise NotImplementedError(
                f"no emulator for {arch} kernels yet (emulated: {', '.join(EMULATED_ARCHS)})"
            )
        if get("direction") != "fwd":
            raise NotImplementedError(f"no emulator for the {get('direction')} direction yet")
        return cls(
            arch=arch, dtype=TORCH_DTYPES[get("dtype")], head_dim=get("head_dim"), head_dim_v=get("head_dim_v"),
            tile_m=get("tile_m"), tile_n=get("tile_n"), causal=bool(get("causal")), local=bool(get("local")),
            chunked=bool(get("chunked")), window_left=get("window_left"), window_right=get("window_right"),
            chunk_size=get("chunk_size"), softcap=float(get("softcap")),
            rescale_threshold=float(get("rescale_threshold")), poly_every=get("poly_every"),
            poly_coeffs=tuple(float(c) for c in get("poly_coeffs")),
        )


# --- exp2, the two ways the kernel evaluates it ---------------------------------------------------


def exp2_mufu(x: torch.Tensor) -> torch.Tensor:
    """ex2.approx.ftz.f32: 2**x in fp32 with results below the smallest normal flushed to 0."""
    y = torch.exp2(x)
    return y.masked_fill(y < _SMALLEST_NORMAL, 0.0)


def exp2_poly(x: torch.Tensor, coeffs: tuple[float, ...]) -> torch.Tensor:
    """fa4gen.device.polyexp.exp2_poly on fp32 `x`: clamp, floor, Horner in fp32 on the fraction,
    integer part added into the exponent bits; 0 for x < -126."""
    x = x.to(torch.float32)
    xc = torch.clamp_min(x, _ROUND_DOWN_FLOOR)
    j = torch.floor(xc)
    f = xc - j
    c = [torch.tensor(v, dtype=torch.float32) for v in coeffs]
    p = c[-1].expand_as(f).clone()
    for ck in reversed(c[:-1]):
        p = p * f + ck
    bits = p.view(torch.int32) + (j.to(torch.int32) << 23)
    out = bits.view(torch.float32)
    return out.masked_fill(x < _POLY_ZERO_BELOW, 0.0)


def _fma(a: torch.Tensor, b: float, c: torch.Tensor) -> torch.Tensor:
    """a * b + c with one rounding (the kernel's `s * scale_log2 - max_scaled` is one FFMA)."""
    return (a.to(torch.float64) * b + c.to(torch.float64)).to(torch.float32)


# --- the online softmax of one key block ----------------------------------------------------------


@dataclasses.dataclass
class RowState:
    """softmax.RowState for a batch of rows: running max (raw units), row sum and O (fp32)."""

    row_max: torch.Tensor
    row_sum: torch.Tensor
    acc_o: torch.Tensor


def online_softmax_step(s, rows: RowState, scale_log2, *, threshold, poly_mask, poly_coeffs):
    """softmax.online_softmax_step: returns (P unnormalized fp32, the O rescale factor per row);
    updates rows.row_max and rows.row_sum."""
    tile_max = s.amax(dim=-1)
    old_max = rows.row_max
    new_max = torch.maximum(old_max, tile_max)
    if threshold > 0:
        # -inf -> finite gives +inf > threshold (move); -inf -> -inf gives NaN (keep).
        move = (new_max - old_max) * scale_log2 > threshold
        factor = torch.where(move, exp2_mufu((old_max - new_max) * scale_log2), torch.ones_like(old_max))
        cur_max = torch.where(move, new_max, old_max)
        max_scaled = (cur_max * scale_log2).masked_fill(cur_max == float("-inf"), 0.0)
    else:  # threshold 0: the max always moves; the factor in one FFMA from the guarded max_scaled (never NaN)
        cur_max = new_max
        max_scaled = (cur_max * scale_log2).masked_fill(cur_max == float("-inf"), 0.0)
        factor = exp2_mufu(_fma(old_max, float(scale_log2), -max_scaled))
    x = _fma(s, float(scale_log2), -max_scaled[..., None])
    p = exp2_mufu(x)
    if poly_mask is not None:
        p = torch.where(poly_mask, exp2_poly(x, poly_coeffs), p)
    rows.row_max = cur_max
    rows.row_sum = rows.row_sum * factor + p.sum(dim=-1)
    return p, factor


# --- the forward kernel ---------------------------------------------------------------------------


def runtime_scalars(algo: Algorithm, softmax_scale=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale_log2, softcap_pre) as fa4gen.api.runtime passes them: computed in Python, then fp32."""
    scale = 1.0 / math.sqrt(algo.head_dim) if softmax_scale is None else float(softmax_scale)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    if algo.softcap > 0:
        return f32(algo.softcap * LOG2_E), f32(scale / algo.softcap)
    return f32(scale * LOG2_E), None


def _mask_values(algo: Algorithm, window, chunk_size) -> tuple[int, int, int]:
    left, right = (algo.window_left, algo.window_right) if window is None else window
    left = tiling.NO_BOUND if left is None else left
    right = tiling.NO_BOUND if right is None else right
    chunk = (algo.chunk_size if chunk_size is None else chunk_size) if algo.chunked else 1
    return (left, right, chunk) if algo.local else (tiling.NO_BOUND, tiling.NO_BOUND, chunk)


def _mask_block(s, algo, m_block, n_block, seqlen_q, seqlen_k, mask_values):
    """mask.apply_mask (or softmax.mask_columns without a mask) on one (rows, tile_n) block."""
    tile_m, tile_n = algo.tile_m, algo.tile_n
    col = n_block * tile_n + torch.arange(tile_n)
    if not algo.has_mask:
        if (n_block + 1) * tile_n > seqlen_k:
            s = s.masked_fill(col >= seqlen_k, float("-inf"))
        return s
    first = m_block * tile_m
    bounds_per_row = [
        tiling.row_bounds(r + seqlen_k - seqlen_q, seqlen_k, *mask_values,
                          causal=algo.causal, local=algo.local, chunked=algo.chunked)
        for r in range(first, min(first + tile_m, seqlen_q))
    ]
    lo = torch.tensor([b[0] for b in bounds_per_row])[:, None]
    hi = torch.tensor([b[1] for b in bounds_per_row])[:, None]
    return s.masked_fill((col >= hi) | (col < lo), float("-inf"))


def emulate_forward(q, k, v, plan_or_algo, *, softmax_scale=None, window=None, chunk_size=None):
    """(out, lse) of the generated kernel for BSHD q, k, v (CPU tensors of the plan's dtype).

    out is (batch, seqlen_q, heads, head_dim_v) in the plan's dtype; lse (batch, heads, seqlen_q) fp32.
    `window` / `chunk_size` are the run-time overrides a generated attention() accepts.
    """
    algo = plan_or_algo if isinstance(plan_or_algo, Algorithm) else Algorithm.from_plan(plan_or_algo)
    b, s_q, h, _ = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    scale_log2, softcap_pre = runtime_scalars(algo, softmax_scale)
    left, right, chunk = _mask_values(algo, window, chunk_size)
    # what the generated attention() passes to the kernel: window sides clamped to the sequences
    mask_values = (*clamp_window(left, right, s_q, s_k), chunk)
    tile_m, tile_n = algo.tile_m, algo.tile_n
    n_blocks = -(-s_k // tile_n)
    # (b, h, s, d) fp32 views; kv heads repeated over their q-head group; K/V zero-filled past
    # seqlen_k like TMA loads of the ragged last block.
    qf = q.to(torch.float32).transpose(1, 2)
    pad = n_blocks * tile_n - s_k
    kf = torch.nn.functional.pad(k.to(torch.float32), (0, 0, 0, 0, 0, pad)).repeat_interleave(h // h_kv, dim=2)
    vf = torch.nn.functional.pad(v.to(torch.float32), (0, 0, 0, 0, 0, pad)).repeat_interleave(h // h_kv, dim=2)
    kf, vf = kf.transpose(1, 2), vf.transpose(1, 2)
    poly = tiling.poly_columns(tile_n, algo.poly_every)
    poly_mask = torch.tensor(poly) if any(poly) else None
    out = torch.zeros(b, h, s_q, algo.head_dim_v, dtype=torch.float32)
    lse = torch.full((b, h, s_q), float("-inf"), dtype=torch.float32)
    mask_kw = dict(causal=algo.causal, local=algo.local, chunked=algo.chunked)
    for m_block in range(-(-s_q // tile_m)):
        r0, r1 = m_block * tile_m, min(m_block * tile_m + tile_m, s_q)
        bounds = tiling.tile_bounds(m_block, tile_m, s_q, s_k, *mask_values, **mask_kw)
        n_min, n_max = tiling.n_block_range(bounds, tile_n) if algo.has_mask else (0, n_blocks)
        rows = RowState(
            row_max=torch.full((b, h, r1 - r0), float("-inf")), row_sum=torch.zeros(b, h, r1 - r0),
            acc_o=torch.zeros(b, h, r1 - r0, algo.head_dim_v),
        )
        for n_block, masked in tiling.schedule(bounds, n_min, n_max, tile_n, **mask_kw):
            c0, c1 = n_block * tile_n, n_block * tile_n + tile_n
            s = qf[:, :, r0:r1] @ kf[:, :, c0:c1].transpose(-1, -2)  # S = Q·Kᵀ, fp32
            if softcap_pre is not None:
                s = torch.tanh(s * softcap_pre)
            if masked:
                s = _mask_block(s, algo, m_block, n_block, s_q, s_k, mask_values)
            p, factor = online_softmax_step(
                s, rows, scale_log2, threshold=algo.rescale_threshold, poly_mask=poly_mask,
                poly_coeffs=algo.poly_coeffs,
            )
            # O = O * factor + P·V with P rounded to the input dtype, fp32 accumulation
            rows.acc_o = rows.acc_o * factor[..., None] + p.to(algo.dtype).to(torch.float32) @ vf[:, :, c0:c1]
        # softmax.finalize: O / l and LSE; rows that saw no key keep O = 0 and LSE = -inf
        seen = rows.row_sum > 0
        total = torch.where(seen, rows.row_sum, torch.ones_like(rows.row_sum))
        out[:, :, r0:r1] = rows.acc_o * torch.where(seen, 1.0 / total, torch.zeros_like(total))[..., None]
        lse[:, :, r0:r1] = ((rows.row_max * scale_log2 + torch.log2(total)) * LN_2).masked_fill(~seen, float("-inf"))
    return out.transpose(1, 2).to(algo.dtype), lse

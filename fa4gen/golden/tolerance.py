"""Golden tests: how far a result may be from the exact reference, and from the emulator.

Against the exact reference (FlashAttention's rule): the max abs error over the output may be at
most 2x the max abs error of the same attention computed in the input precision (scores and P
rounded to bf16/fp16, what PyTorch's low-precision attention does) plus 1e-5, which covers
outputs the low-precision path gets exactly right (one visible key). LSE: fp32 statistics from
the same inputs, so within 1e-3 abs / 1e-4 rel, with identical -inf rows.

Against the emulator (much tighter): the emulator performs the kernel's own roundings (P to the
input dtype, O to the output dtype) in the kernel's order, so the two fp32 values that get
rounded differ only by what the emulator models rather than copies — ex2/rcp/lg2.approx
(within 2^-22 relative), the tensor core's fp32 summation order, and tanh.approx (within 2^-11
relative) when softcap is on. Before the final rounding the outputs then agree to a small
fraction of an output ulp, except where a P element sat next to a rounding boundary and went the
other way; after it, each element may differ by the rounding of that residue. The check is
therefore per element and relative to the element's own magnitude: |kernel - emulator| <=
EMU_ULPS ulps of the dtype at that magnitude (+ a floor of EMU_ULPS ulps at 2^-10 for outputs
near 0), where the reference rule allows a whole-tensor absolute error of about one or two ulps
*of the largest output* to every element. LSE: within EMU_LSE_ATOL (+ the tanh.approx term).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

REF_ATOL = 1e-5
LSE_ATOL, LSE_RTOL = 1e-3, 1e-4
EMU_ULPS = 2
EMU_FLOOR = 2.0**-10  # outputs smaller than this are judged in ulps of 2^-10
EMU_LSE_ATOL = 1e-5
EMU_LSE_RTOL = 2.0**-20
EMU_LSE_SOFTCAP = 1e-4
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


@dataclass(frozen=True)
class Comparison:
    """One comparison's outcome: the worst error, what it was allowed, and a one-line detail."""

    ok: bool
    worst: float  # worst error / allowed error (<= 1 passes)
    detail: str


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` values at |x| (fp32 tensor), floored at EMU_FLOOR's spacing."""
    mag = x.abs().to(torch.float32).clamp_min(EMU_FLOOR)
    return torch.exp2(torch.floor(torch.log2(mag)) - MANTISSA_BITS[dtype])


def against_reference(out: torch.Tensor, exact: torch.Tensor, low: torch.Tensor) -> Comparison:
    if torch.isnan(out).any():
        return Comparison(False, math.inf, "NaN (or unwritten) output")
    err = (out.to(exact.dtype) - exact).abs().max().item() if out.numel() else 0.0
    budget = 2.0 * ((low.to(exact.dtype) - exact).abs().max().item() if low.numel() else 0.0) + REF_ATOL
    return Comparison(err <= budget, err / budget, f"max err {err:.3g} (budget {budget:.3g})")


def against_emulator(out: torch.Tensor, emu: torch.Tensor, dtype: torch.dtype) -> Comparison:
    if out.numel() == 0:
        return Comparison(True, 0.0, "empty")
    a, b = out.to(torch.float32).cpu(), emu.to(torch.float32).cpu()
    if torch.isnan(a).any() or torch.isnan(b).any():
        return Comparison(False, math.inf, "NaN output")
    diff = (a - b).abs()
    ulps = diff / ulp(torch.maximum(a.abs(), b.abs()), dtype)
    worst = ulps.max().item()
    same = (diff == 0).float().mean().item()
    return Comparison(
        worst <= EMU_ULPS, worst / EMU_ULPS,
        f"max {worst:.2g} ulp (allowed {EMU_ULPS}), {100 * same:.1f}% identical, max abs {diff.max().item():.3g}",
    )


def _lse_rows(lse: torch.Tensor, other: torch.Tensor) -> tuple[bool, torch.Tensor]:
    same_inf = torch.equal(lse.isinf(), other.isinf())
    return same_inf, ~other.isinf()


def lse_against_reference(lse: torch.Tensor, exact: torch.Tensor) -> Comparison:
    lse, exact = lse.to(exact.device, exact.dtype), exact
    same_inf, fin = _lse_rows(lse, exact)
    if not same_inf or torch.isnan(lse).any():
        return Comparison(False, math.inf, "LSE -inf rows (or NaN) differ from the reference")
    if not fin.any():
        return Comparison(True, 0.0, "all rows masked")
    allowed = LSE_ATOL + LSE_RTOL * exact[fin].abs()
    worst = ((lse[fin] - exact[fin]).abs() / allowed).max().item()
    return Comparison(worst <= 1, worst, f"LSE max err {(lse[fin] - exact[fin]).abs().max().item():.3g}")


def lse_against_emulator(lse: torch.Tensor, emu: torch.Tensor, *, softcap: float) -> Comparison:
    lse, emu = lse.to(torch.float32).cpu(), emu.to(torch.float32).cpu()
    same_inf, fin = _lse_rows(lse, emu)
    if not same_inf or torch.isnan(lse).any():
        return Comparison(False, math.inf, "LSE -inf rows (or NaN) differ from the emulator")
    if not fin.any():
        return Comparison(True, 0.0, "all rows masked")
    allowed = EMU_LSE_ATOL + EMU_LSE_RTOL * emu[fin].abs() + (EMU_LSE_SOFTCAP if softcap else 0.0)
    err = (lse[fin] - emu[fin]).abs()
    worst = (err / allowed).max().item()
    return Comparison(worst <= 1, worst, f"LSE max diff {err.max().item():.3g}")


__all__ = [
    "Comparison", "EMU_ULPS", "LSE_ATOL", "LSE_RTOL", "REF_ATOL", "against_emulator", "against_reference",
    "lse_against_emulator", "lse_against_reference", "ulp",
]

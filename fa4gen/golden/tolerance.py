"""Golden tests: how far a result may be from the exact reference, and from the emulator.

Against the exact reference (FlashAttention's rule): the max abs error over the output may be at
most B = 2x the max abs error of the same attention computed in the input precision (scores and
P rounded to bf16/fp16, what PyTorch's low-precision attention does) + 1e-5, which covers outputs
the low-precision path gets exactly right (one visible key). LSE: fp32 statistics from the same
inputs, within 1e-3 abs + 1e-4 rel, with identical -inf rows.

Against the emulator (tighter). The emulator performs the kernel's own roundings (P to the input
dtype, O to the output dtype) in the kernel's order, so the fp32 values that get rounded differ
only by what the emulator models instead of copying: ex2/rcp/lg2.approx (2^-22 relative), the
tensor core's summation order, tanh.approx (2^-11 relative) with softcap. Consequences:
  * most output elements are bit-identical: at least EMU_MIN_IDENTICAL of them. A systematic
    deviation in the arithmetic (a wrong mask on one block, a missed rescale, the polynomial on
    other columns, P truncated instead of rounded) changes most elements, however small it is.
  * the others differ where a P element or the output sat at a rounding boundary and went the
    other way: one ulp of the output, plus the effect of flipped P elements, each one P ulp of one
    term of the P·V sum. Those flips are a small part of the P rounding error, itself at most the
    low-precision reference's error (B / 2). So every element must satisfy
    |kernel - emulator| <= 1 ulp of the dtype at |emulator| + B / 4,
    where the reference allows B to every element.
  * LSE: fp32 on both sides from the same fp32 scores: 1e-5 + 2^-20 |lse| (+ 1e-4 when softcap's
    tanh.approx or the polynomial exp2 is in play), against 1e-3 + 1e-4 |lse| for the reference.
Measured on the H200 over every golden case (python -m fa4gen.golden.calibrate): >= 94.9%
identical (>= 97.4% without softcap), and LSE within 1.5e-6 (3.4e-5 with softcap or poly-exp).

Gradients (the backward), against the exact reference gradients (fp32 autograd of the reference):
each of dq, dk, dv at most 2x the max abs error of the same gradients computed in the input
precision (autograd through the low-precision reference: input-dtype matmuls, P rounded) +
GRAD_ATOL, which covers fp32 summation-order noise where both are exact (one visible key gives
dS = 0); + one ulp of the input dtype at the largest exact gradient (the kernel rounds its fp32
gradient to the input dtype, and dS to it before the dQ/dK GEMMs: on small cases, where the
low-precision path happens to round well, that alone reached 1.1x the 2x rule — qwen2_7b_packed,
H200, session 4; FlashAttention's tests add 2x the input-dtype rounding of the reference gradient,
the same ulp); + GRAD_SOFTCAP_ATOL with softcap (tanh.approx; FlashAttention's tests add 3e-4).
`grad_budget` is the rule; tests/test_gpu_backward.py and tests/test_gpu_varlen.py use it too. A
deterministic backward must repeat bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

REF_ATOL = 1e-5
LSE_ATOL, LSE_RTOL = 1e-3, 1e-4
EMU_MIN_IDENTICAL = 0.90
EMU_BUDGET_SHARE = 0.25
EMU_LSE_ATOL, EMU_LSE_RTOL, EMU_LSE_APPROX = 1e-5, 2.0**-20, 1e-4
GRAD_ATOL, GRAD_SOFTCAP_ATOL = 1e-4, 3e-4
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}


@dataclass(frozen=True)
class Comparison:
    """One comparison's outcome: ok, the worst error / allowed error (<= 1 passes), a detail line."""

    ok: bool
    worst: float
    detail: str


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` values at |x| (normal range; tiny values get the spacing at 2^-14)."""
    mag = x.abs().to(torch.float32).clamp_min(2.0**-14)
    return torch.exp2(torch.floor(torch.log2(mag)) - MANTISSA_BITS[dtype])


def reference_budget(exact: torch.Tensor, low: torch.Tensor, *, atol: float = REF_ATOL) -> float:
    low_err = (low.to(exact.device, exact.dtype) - exact).abs().max().item() if low.numel() else 0.0
    return 2.0 * low_err + atol


def against_reference(out: torch.Tensor, exact: torch.Tensor, low: torch.Tensor) -> Comparison:
    if torch.isnan(out).any():
        return Comparison(False, math.inf, "NaN (or unwritten) output")
    err = (out.to(exact.device, exact.dtype) - exact).abs().max().item() if out.numel() else 0.0
    budget = reference_budget(exact, low)
    return Comparison(err <= budget, err / budget, f"max err {err:.3g} (budget {budget:.3g})")


def against_emulator(
    out: torch.Tensor, emu: torch.Tensor, dtype: torch.dtype, budget: float, *,
    min_identical: float = EMU_MIN_IDENTICAL,
) -> Comparison:
    """`budget`: the reference budget B of the same call (reference_budget). `min_identical`: the
    bit-identical share to require (lower it only where the scores are ill-conditioned: at |s| ~ 1e6
    the tensor core's summation order alone moves exp2 arguments by ~0.1)."""
    if out.numel() == 0:
        return Comparison(True, 0.0, "empty")
    a, e = out.to(torch.float32).cpu(), emu.to(torch.float32).cpu()
    if torch.isnan(a).any() or torch.isnan(e).any():
        return Comparison(False, math.inf, "NaN output")
    diff = (a - e).abs()
    allowed = ulp(e, dtype) + EMU_BUDGET_SHARE * budget
    worst = (diff / allowed).max().item()
    same = (diff == 0).double().mean().item()
    ok = worst <= 1 and same >= min_identical
    return Comparison(
        ok, max(worst, min_identical / max(same, 1e-9)),
        f"{100 * same:.1f}% identical (>= {100 * min_identical:.0f}%), max diff {diff.max().item():.3g} "
        f"= {worst:.2f} of 1 ulp + B/4",
    )


def _lse_rows(lse: torch.Tensor, other: torch.Tensor) -> tuple[bool, torch.Tensor]:
    return torch.equal(lse.isinf(), other.isinf()), ~other.isinf()


def lse_against_reference(lse: torch.Tensor, exact: torch.Tensor) -> Comparison:
    lse = lse.to(exact.device, exact.dtype)
    same_inf, fin = _lse_rows(lse, exact)
    if not same_inf or torch.isnan(lse).any():
        return Comparison(False, math.inf, "LSE -inf rows (or NaN) differ from the reference")
    if not fin.any():
        return Comparison(True, 0.0, "all rows masked")
    err = (lse[fin] - exact[fin]).abs()
    worst = (err / (LSE_ATOL + LSE_RTOL * exact[fin].abs())).max().item()
    return Comparison(worst <= 1, worst, f"LSE max err {err.max().item():.3g}")


def lse_against_emulator(
    lse: torch.Tensor, emu: torch.Tensor, *, approx: bool, rtol: float = EMU_LSE_RTOL
) -> Comparison:
    """`approx`: softcap (tanh.approx) or the polynomial exp2 is in the kernel. `rtol`: raise it only
    for ill-conditioned scores (|s| ~ 1e6 carries fp32 summation-order differences of a few units)."""
    lse, emu = lse.to(torch.float32).cpu(), emu.to(torch.float32).cpu()
    same_inf, fin = _lse_rows(lse, emu)
    if not same_inf or torch.isnan(lse).any():
        return Comparison(False, math.inf, "LSE -inf rows (or NaN) differ from the emulator")
    if not fin.any():
        return Comparison(True, 0.0, "all rows masked")
    allowed = EMU_LSE_ATOL + rtol * emu[fin].abs() + (EMU_LSE_APPROX if approx else 0.0)
    err = (lse[fin] - emu[fin]).abs()
    worst = (err / allowed).max().item()
    return Comparison(worst <= 1, worst, f"LSE max diff {err.max().item():.3g}")


def grad_budget(exact: torch.Tensor, low: torch.Tensor, dtype: torch.dtype, *, softcap: bool) -> float:
    """What a kernel's gradient may miss the exact one by (module docstring): 2x the low-precision
    gradient's max error + GRAD_ATOL + one `dtype` ulp at max |exact| (+ GRAD_SOFTCAP_ATOL)."""
    top = exact.abs().max() if exact.numel() else torch.zeros(())
    rounding = ulp(top, dtype).item() if exact.numel() else 0.0
    return reference_budget(exact, low, atol=GRAD_ATOL + rounding + (GRAD_SOFTCAP_ATOL if softcap else 0.0))


def grad_against_reference(
    name: str, grad: torch.Tensor | None, exact: torch.Tensor, low: torch.Tensor, *, softcap: bool
) -> Comparison:
    """One gradient (`name`: dq, dk or dv) of the kernel against the exact reference gradient, with
    `low` the same gradient in the input precision (see the module docstring)."""
    if grad is None:
        return Comparison(False, math.inf, f"{name}: no gradient")
    if not torch.isfinite(grad).all():
        return Comparison(False, math.inf, f"{name}: NaN/inf (or unwritten) elements")
    err = (grad.to(exact.device, exact.dtype) - exact).abs().max().item() if grad.numel() else 0.0
    budget = grad_budget(exact, low, low.dtype, softcap=softcap)  # low: a gradient in the input dtype
    return Comparison(err <= budget, err / budget, f"{name} max err {err:.3g} (budget {budget:.3g})")


def bitwise_repeats(runs: list[tuple[torch.Tensor, ...]], names: tuple[str, ...] = ("dq", "dk", "dv")) -> Comparison:
    """Whether every run's tensors are bit for bit run 0's (NaN payloads and the sign of zero included)."""
    bits = lambda t: t.detach().reshape(-1).contiguous().view(torch.uint8)  # noqa: E731
    for i, again in enumerate(runs[1:], 1):
        for name, a, b in zip(names, runs[0], again):
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(bits(a), bits(b)):
                differ = (a != b).sum().item() if a.shape == b.shape else a.numel()
                return Comparison(False, math.inf, f"{name} of run {i} differs from run 0 ({differ} elements)")
    return Comparison(True, 0.0, f"{len(runs)} runs bitwise identical ({', '.join(names)})")


__all__ = [
    "Comparison", "EMU_MIN_IDENTICAL", "GRAD_ATOL", "GRAD_SOFTCAP_ATOL", "LSE_ATOL", "LSE_RTOL", "REF_ATOL",
    "against_emulator", "against_reference", "bitwise_repeats", "grad_against_reference", "grad_budget", "lse_against_emulator",
    "lse_against_reference", "reference_budget", "ulp",
]

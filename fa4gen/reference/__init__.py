"""Reference stage: exact attention with fa4gen's semantics, for tests and golden checks.

Masks are flash_attn's, bottom-right aligned (query row i sits at key position
i + seqlen_k - seqlen_q): causal, sliding window (left, right; negative or None = unbounded),
chunked (causal inside the chunk of the row's position). Softcap is cap * tanh(s / cap) on the
scaled scores; GQA/MQA repeat each kv head over its group of q heads. Rows that see no key give
output 0 and LSE -inf, never NaN.

`upcast=True` (the default) computes exactly: fp64 on the CPU, fp32 on a GPU (or `dtype`).
`upcast=False` mimics a low-precision implementation (scores and P rounded to the input dtype,
output in the input dtype), which sets the error budget (`error_budget`): a kernel may be at most
2x as far from the exact result as that low-precision computation, plus a small atol (the
FlashAttention test rule). `attention_ref_grads` gives dq, dk, dv by torch autograd through
`attention_ref`, exact or in low precision, for the same rule on gradients.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["attention_ref", "attention_ref_grads", "attention_ref_varlen", "check_cu_seqlens_values", "check_seqused_values",
           "error_budget",
           "mask_semantics", "spec_mask_semantics", "visible"]


def visible(seqlen_q: int, seqlen_k: int, *, causal=False, window=None, chunk=None, device=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k) matrix of the keys each query row may attend to."""
    pos = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    col = torch.arange(seqlen_k, device=device)[None, :]
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if causal or chunk:
        ok &= col <= pos
    if chunk:
        ok &= col >= torch.div(pos.clamp(min=0), chunk, rounding_mode="floor") * chunk
    if window is not None:
        left, right = window
        if left is not None and left >= 0:
            ok &= col >= pos - left
        if right is not None and right >= 0:
            ok &= col <= pos + right
    return ok


def _exact_dtype(device: torch.device, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.float64 if device.type == "cpu" else torch.float32


def attention_ref(
    q, k, v, *, softmax_scale=None, causal=False, window=None, chunk=None, softcap=0.0,
    upcast=True, dtype=None,
):
    """(out, lse) for BSHD q/k/v; lse is (batch, heads, seqlen_q), natural log.

    upcast=True: out and lse in `dtype` (default fp64 on the CPU, fp32 on a GPU).
    upcast=False: scores and P rounded to q's dtype, out in v's dtype, lse in fp32.
    """
    b, s_q, h, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    exact = _exact_dtype(q.device, dtype)
    work = exact if upcast else q.dtype
    qf, kf, vf = q.to(work), k.to(work), v.to(work)
    kf = kf.repeat_interleave(h // h_kv, dim=2)
    vf = vf.repeat_interleave(h // h_kv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf).to(exact if upcast else torch.float32) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    ok = visible(s_q, s_k, causal=causal, window=window, chunk=chunk, device=q.device)
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # Rows that see no key have lse -inf; subtracting 0 instead keeps their P at exactly 0.
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    if not upcast:
        p = p.to(q.dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(vf.dtype), vf)
    return (out if upcast else out.to(v.dtype)), lse


def attention_ref_grads(q, k, v, dout, *, dlse=None, upcast=True, dtype=None, packed=None, **kw):
    """(dq, dk, dv): the gradients of attention_ref's (out, lse) against (dout, dlse) for q, k, v, by
    torch autograd; dlse None = the LSE is not differentiated. `kw` are attention_ref's mask,
    softcap and softmax_scale arguments; `packed` = attention_ref_varlen's sequence arguments
    (cu_seqlens_q, cu_seqlens_k[, seqused_k]) for packed q, k, v.

    upcast=True: exact, in `dtype` (default fp64 on the CPU, fp32 on a GPU).
    upcast=False: autograd through the low-precision forward (input-dtype matmuls, P rounded), so
    dP = dO·Vᵀ, dV = Pᵀ·dO, dQ and dK come out in the input dtype: the error budget of a kernel's
    gradients, as FlashAttention's tests take it.
    """
    work = _exact_dtype(q.device, dtype) if upcast else None
    leaves = [t.detach().to(work).requires_grad_() if upcast else t.detach().clone().requires_grad_()
              for t in (q, k, v)]
    with torch.enable_grad():
        if packed is None:
            out, lse = attention_ref(*leaves, upcast=upcast, dtype=dtype, **kw)
        else:
            out, lse = attention_ref_varlen(*leaves, upcast=upcast, dtype=dtype, **packed, **kw)
        outputs, grads = [out], [dout.detach().to(out.dtype)]
        if dlse is not None:
            outputs.append(lse)
            grads.append(dlse.detach().to(lse.dtype))
        dq, dk, dv = torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip((dq, dk, dv), leaves))


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, batch: int | None) -> list[int]:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected a 1-D int32/int64 tensor")
    return check_cu_seqlens_values(name, cu.tolist(), total, batch)


def check_cu_seqlens_values(name: str, values: list[int], total: int, batch: int | None) -> list[int]:
    """Cumulative sequence lengths as flash_attn_varlen_func takes them: `batch` + 1 entries from 0,
    non-decreasing, ending at the packed length `total`. Raises ValueError naming `name`."""
    if batch is not None and len(values) != batch + 1:
        raise ValueError(f"{name}: expected {batch + 1} entries (batch + 1), got {len(values)}")
    if not values or values[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {values[:1]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name}: must be non-decreasing, got {values}")
    if values[-1] != total:
        raise ValueError(f"{name}: last entry must equal the packed length {total}, got {values[-1]}")
    return values


def check_seqused_values(used: list[int], cu_k: list[int]) -> list[int]:
    """seqused_k: one key count per sequence, each within that sequence's cu_seqlens_k length."""
    if len(used) != len(cu_k) - 1:
        raise ValueError(f"seqused_k: expected {len(cu_k) - 1} entries (batch), got {len(used)}")
    for i, (n, k0, k1) in enumerate(zip(used, cu_k, cu_k[1:])):
        if not 0 <= n <= k1 - k0:
            raise ValueError(f"seqused_k: entry {i} must be in [0, {k1 - k0}], got {n}")
    return used


def attention_ref_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, seqused_k=None, softmax_scale=None, causal=False,
    window=None, chunk=None, softcap=0.0, upcast=True, dtype=None,
):
    """(out, lse) for packed sequences in flash_attn_varlen_func conventions.

    q (total_q, heads, d), k/v (total_k, kv_heads, d[_v]); sequence i holds q rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1] and keys cu_seqlens_k[i]:cu_seqlens_k[i+1], of which only the
    first seqused_k[i] are used when seqused_k is given. Masks are bottom-right aligned per sequence.
    out is (total_q, heads, d_v), lse (heads, total_q).
    """
    cq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], None)
    ck = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], len(cq) - 1)
    used = None if seqused_k is None else check_seqused_values(seqused_k.tolist(), ck)
    kw = dict(softmax_scale=softmax_scale, causal=causal, window=window, chunk=chunk, softcap=softcap,
              upcast=upcast, dtype=dtype)
    outs, lses = [], []
    for i in range(len(cq) - 1):
        k0, k1 = ck[i], ck[i + 1]
        if used is not None:
            k1 = k0 + used[i]
        o, lse = attention_ref(q[None, cq[i]:cq[i + 1]], k[None, k0:k1], v[None, k0:k1], **kw)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def error_budget(low: torch.Tensor, exact: torch.Tensor, *, atol: float = 1e-5) -> float:
    """2 x the max abs error of the low-precision reference + atol: what an implementation may reach."""
    if low.numel() == 0:
        return atol
    return 2.0 * (low.to(exact.dtype) - exact).abs().max().item() + atol


def _get(plan: Any, key: str) -> Any:
    return plan[key] if isinstance(plan, Mapping) else getattr(plan, key)


def spec_mask_semantics(spec: Any) -> dict:
    """mask_semantics' dict (mask + softcap) from a resolved spec itself, not from a plan: what a plan's
    mask fields must reproduce."""
    sem: dict[str, Any] = dict(softcap=float(spec.softcap))
    mask = spec.mask
    if mask.kind == "sliding_window":
        sem["window"] = tuple(-1 if w is None else w for w in (mask.left, mask.right))
    elif mask.kind == "chunked":
        sem["chunk"] = mask.chunk_size
    else:
        sem["causal"] = mask.kind == "causal"
    return sem


def mask_semantics(plan: Any, *, window=None, chunk_size=None) -> dict:
    """attention_ref keyword arguments (mask + softcap) of a plan (KernelPlan or its dict), with the
    run-time `window` / `chunk_size` overrides a generated `attention()` accepts."""
    sem: dict[str, Any] = dict(softcap=float(_get(plan, "softcap")))
    if _get(plan, "local"):
        left, right = window if window is not None else (_get(plan, "window_left"), _get(plan, "window_right"))
        sem["window"] = (left, right)
    elif _get(plan, "chunked"):
        sem["chunk"] = chunk_size if chunk_size is not None else _get(plan, "chunk_size")
    else:
        sem["causal"] = bool(_get(plan, "causal"))
    return sem

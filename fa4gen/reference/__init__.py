"""Reference stage: exact attention with fa4gen's semantics, for tests and golden checks.

Masks are flash_attn's, bottom-right aligned (query row i sits at key position
i + seqlen_k - seqlen_q). Rows that see no key give output 0 and LSE -inf, never NaN.
`upcast=True` computes in fp32 (or fp64 with `dtype`); `upcast=False` mimics a low-precision
implementation (scores and P rounded to the input dtype), which sets the error budget: a kernel
may be at most ~2x as far from the exact result as that low-precision computation.
"""

from __future__ import annotations

import math

import torch


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


def attention_ref(
    q, k, v, *, softmax_scale=None, causal=False, window=None, chunk=None, softcap=0.0,
    upcast=True, dtype=torch.float32,
):
    """(out, lse) for BSHD q/k/v; GQA by repeating kv heads. out has v's dtype unless upcast."""
    b, s_q, h, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    work = dtype if upcast else q.dtype
    qf, kf, vf = q.to(work), k.to(work), v.to(work)
    kf = kf.repeat_interleave(h // h_kv, dim=2)
    vf = vf.repeat_interleave(h // h_kv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf).to(dtype if upcast else torch.float32) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    ok = visible(s_q, s_k, causal=causal, window=window, chunk=chunk, device=q.device)
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if not upcast:
        p = p.to(q.dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(vf.dtype), vf)
    return (out if upcast else out.to(v.dtype)), lse

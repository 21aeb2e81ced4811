"""Golden tests for `varlen: true` variants: each batched case (b, seqlen_q, seqlen_k, heads,
kv_heads) becomes a packed batch of b + 1 sequences of mixed lengths (the case's own lengths and
shorter ones, none empty), called in flash_attn_varlen_func conventions and checked against the
per-sequence reference (fa4gen.reference.attention_ref_varlen) and the per-sequence emulator.
For batched variants every helper here falls through to the batched form, so the checks call them
unconditionally."""

from __future__ import annotations

from typing import Any

import torch

from fa4gen.emulate import emulate_forward
from fa4gen.reference import attention_ref, attention_ref_varlen

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def packed_lengths(shape: tuple[int, int, int, int, int]) -> tuple[list[int], list[int]]:
    """(query lengths, key lengths) of the packed form of a batched case: b + 1 sequences, the even
    ones at the case's lengths, the odd ones shorter (and off the tile grid)."""
    b, s_q, s_k, _, _ = shape
    lens_q = [s_q if i % 2 == 0 else max(1, s_q // 3 + 7 * i) for i in range(b + 1)]
    lens_k = [s_k if i % 2 == 0 else max(1, s_k // 2 + 5 * i) for i in range(b + 1)]
    return lens_q, lens_k


def _cu(lengths: list[int], device) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def case_inputs(plan: dict, shape, *, seed: int, device="cpu"):
    """(q, k, v, seq): the case's inputs — BSHD, or packed (total, heads, dim) with `seq` holding
    cu_seqlens_q / cu_seqlens_k for a varlen plan ({} otherwise)."""
    b, s_q, s_k, h, h_kv = shape
    dtype = TORCH_DTYPES[plan["dtype"]]
    gen = torch.Generator(device=device).manual_seed(seed)
    if not plan.get("varlen"):
        mk = lambda s, hh, d: torch.randn(b, s, hh, d, device=device, dtype=dtype, generator=gen)  # noqa: E731
        return mk(s_q, h, plan["head_dim"]), mk(s_k, h_kv, plan["head_dim"]), mk(s_k, h_kv, plan["head_dim_v"]), {}
    lens_q, lens_k = packed_lengths(shape)
    mk = lambda n, hh, d: torch.randn(n, hh, d, device=device, dtype=dtype, generator=gen)  # noqa: E731
    q = mk(sum(lens_q), h, plan["head_dim"])
    k, v = mk(sum(lens_k), h_kv, plan["head_dim"]), mk(sum(lens_k), h_kv, plan["head_dim_v"])
    return q, k, v, dict(cu_seqlens_q=_cu(lens_q, device), cu_seqlens_k=_cu(lens_k, device))


def lse_shape(q: torch.Tensor, seq: dict) -> tuple[int, ...]:
    """The LSE's shape for these inputs: (batch, heads, seqlen_q), or (heads, total_q) packed."""
    return (q.shape[1], q.shape[0]) if seq else (q.shape[0], q.shape[2], q.shape[1])


def reference(q, k, v, seq: dict, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_ref, or attention_ref_varlen over the packed sequences."""
    if not seq:
        return attention_ref(q, k, v, **kw)
    return attention_ref_varlen(q, k, v, seq["cu_seqlens_q"], seq["cu_seqlens_k"], **kw)


def emulate(q, k, v, algo, seq: dict, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The emulator's (out, lse) on CPU copies: batched, or one sequence at a time and re-packed."""
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    if not seq:
        return emulate_forward(q, k, v, algo, **kw)
    cq, ck = seq["cu_seqlens_q"].tolist(), seq["cu_seqlens_k"].tolist()
    outs, lses = [], []
    for i in range(len(cq) - 1):
        o, lse = emulate_forward(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]], v[None, ck[i]:ck[i + 1]], algo, **kw)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


__all__ = ["case_inputs", "emulate", "lse_shape", "packed_lengths", "reference"]

"""Golden tests: a catalogue of bad calls to a generated `attention()`, for fuzzing its input checks.

Each mutation turns one valid call into a call with exactly one bad argument and says which
argument the error must name. A generated API must answer every one with ValueError, TypeError
or RuntimeError naming that argument, before anything is launched. The fuzz tests
(tests/test_fuzz_runtime.py on the CPU, tests/test_gpu_robustness.py on a GPU) draw the
mutation, its variant and the base shape; nothing here depends on hypothesis.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NOT_TENSORS: tuple[Any, ...] = (None, 1.0, [[1.0]], "q", b"\x00")
BAD_SCALES: tuple[Any, ...] = (
    -1.0, 0.0, -0.0, math.nan, math.inf, -math.inf, "0.1", True, 1j, [0.125],
    1e39, 10**400,  # finite in Python, not as the kernels' fp32 scale * log2(e)
)
BAD_WINDOWS: tuple[Any, ...] = (
    (1,), (1, 2, 3), (-2, 0), (0, -2), (-1, -1), (1.5, 0), (True, 0), "1,2", 7, (None, None), (2**31, 0),
)
BAD_CHUNKS: tuple[Any, ...] = (0, -1, -64, 1.5, True, "64", [64])


@dataclass
class Call:
    """One call of a generated attention(): q, k, v and keyword arguments."""

    q: Any
    k: Any
    v: Any
    kwargs: dict[str, Any] = field(default_factory=dict)

    def run(self, attention: Callable[..., Any]) -> Any:
        return attention(self.q, self.k, self.v, **self.kwargs)


def good_call(plan: Mapping[str, Any], *, device="cpu", shape=(1, 64, 96, 4, 2), seed=0) -> Call:
    """A valid call for `plan` (the lock's plan dict): BSHD tensors of the plan's dtype, or for a
    varlen plan the same batch packed — (total, heads, dim) with cu_seqlens_q / cu_seqlens_k."""
    b, s_q, s_k, h, h_kv = shape
    if not plan["allow_gqa"]:
        h_kv = h
    dtype = TORCH_DTYPES[plan["dtype"]]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if plan.get("varlen"):
        mk = lambda s, hh, d: torch.randn(b * s, hh, d, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
        cu = lambda s: torch.arange(0, b * s + 1, max(s, 1), dtype=torch.int32, device=device)[: b + 1]  # noqa: E731
        kwargs = dict(cu_seqlens_q=cu(s_q), cu_seqlens_k=cu(s_k) if s_k else torch.zeros(b + 1, dtype=torch.int32,
                                                                                        device=device))
        return Call(mk(s_q, h, plan["head_dim"]), mk(s_k, h_kv, plan["head_dim"]), mk(s_k, h_kv, plan["head_dim_v"]),
                    kwargs)
    mk = lambda s, hh, d: torch.randn(b, s, hh, d, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    return Call(mk(s_q, h, plan["head_dim"]), mk(s_k, h_kv, plan["head_dim"]), mk(s_k, h_kv, plan["head_dim_v"]))


def _heads_dim(call: Call) -> int:
    """The heads mode of the call's tensors: 2 in BSHD, 1 packed."""
    return 1 if "cu_seqlens_q" in call.kwargs else 2


def _swap(call: Call, name: str, value: Any) -> Call:
    if name in ("q", "k", "v"):
        return replace(call, **{name: value})
    return replace(call, kwargs={**call.kwargs, name: value})


def _last_dim_strided(t: torch.Tensor) -> torch.Tensor:
    """Same values, last dim not contiguous (stride 2)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def _other_dtype(t: torch.Tensor, i: int) -> torch.Tensor:
    other_half = torch.float16 if t.dtype == torch.bfloat16 else torch.bfloat16
    choices = [torch.float32, torch.float64, torch.int32, other_half]
    return t.to(choices[i % len(choices)])


def _tensor_mutations(name: str):
    return {
        f"{name}_type": (name, len(NOT_TENSORS), lambda c, i, p: _swap(c, name, NOT_TENSORS[i])),
        f"{name}_dtype": (name, 4, lambda c, i, p: _swap(c, name, _other_dtype(getattr(c, name), i))),
        f"{name}_rank": (name, 2, lambda c, i, p: _swap(c, name, _one_dim_less(getattr(c, name)) if i else getattr(c, name)[None])),
        f"{name}_head_dim": (name, 2, lambda c, i, p: _swap(c, name, _resize_last(getattr(c, name), -16 if i else 16))),
        f"{name}_stride": (name, 1, lambda c, i, p: _swap(c, name, _last_dim_strided(getattr(c, name)))),
        f"{name}_grad": (name, 1, lambda c, i, p: _swap(c, name, getattr(c, name).clone().requires_grad_())),
        f"{name}_device": (name, 1, lambda c, i, p: _swap(c, name, getattr(c, name).cpu())),
    }


def _one_dim_less(t: torch.Tensor) -> torch.Tensor:
    """t with one dim fewer: its first entry along dim 0, or, when dim 0 is empty (a packed call without keys),
    the first two dims merged."""
    return t[0] if t.shape[0] else t.flatten(0, 1)


def _resize_last(t: torch.Tensor, delta: int) -> torch.Tensor:
    d = t.shape[-1] + delta
    if d <= 0:
        return t[..., :8].contiguous()
    if delta < 0:
        return t[..., :d].contiguous()
    return torch.cat([t, torch.zeros(*t.shape[:-1], delta, dtype=t.dtype, device=t.device)], dim=-1)


def _kv_heads(call: Call, i: int, plan) -> Call:
    """k/v with a head count that does not divide q's (or, without GQA, differs from it)."""
    hd = _heads_dim(call)
    h = call.q.shape[hd]
    h_kv = [h + 1, h - 1 if h > 2 else h + 1][i] if plan["allow_gqa"] else [h // 2 or h + 1, h + 1][i]

    def heads(t):
        return torch.zeros(*t.shape[:hd], h_kv, *t.shape[hd + 1:], dtype=t.dtype, device=t.device)

    return replace(call, k=heads(call.k), v=heads(call.v))


def _one_more_key(call: Call, i: int, plan) -> Call:
    """v with one key more than k (packed: one more row)."""
    v = call.v
    dim = _heads_dim(call) - 1
    more = v.new_zeros(*v.shape[:dim], 1, *v.shape[dim + 1:])
    return _swap(call, "v", torch.cat([v, more], dim=dim))


def _heads_overlapping(t: torch.Tensor) -> torch.Tensor:
    """A view of `t` whose heads start 8 elements apart: aligned, last dim contiguous, no stride 0, yet
    each head's row shares memory with the next one's."""
    return t.as_strided(t.shape, (*t.stride()[:-2], 8, 1))


def _bad_out(call: Call, i: int, plan) -> Call:
    q, dv = call.q, plan["head_dim_v"]
    shape = (*q.shape[:-1], dv)
    dtype, device = q.dtype, q.device
    outs = [
        torch.empty(*shape[:-1], dv + 8, dtype=dtype, device=device),  # wrong head dim
        torch.empty(shape[0] + 1, *shape[1:], dtype=dtype, device=device),  # wrong batch
        torch.empty(shape, dtype=torch.float32, device=device),  # wrong dtype
        _last_dim_strided(torch.empty(shape, dtype=dtype, device=device)),  # last dim not contiguous
        [[0.0]],  # not a tensor
        torch.empty(*shape[:-2], 1, dv, dtype=dtype, device=device).expand(shape),  # heads sharing memory
        q[..., :dv],  # overlapping q (tiles would store O over queries others still load)
        torch.empty(shape, dtype=dtype, device=device, requires_grad=True),  # written behind autograd's back
        _heads_overlapping(torch.empty(shape, dtype=dtype, device=device)),  # heads 8 elements apart
    ]
    return _swap(call, "out", outs[i % len(outs)])


def _window(call: Call, i: int, plan) -> Call:
    return _swap(call, "window", BAD_WINDOWS[i] if plan["local"] else (3, 0))


def _chunk(call: Call, i: int, plan) -> Call:
    return _swap(call, "chunk_size", BAD_CHUNKS[i] if plan["chunked"] else 64)


MUTATIONS: dict[str, tuple[str, int, Callable[[Call, int, Any], Call]]] = {
    # kind: (argument the error must name, number of variants, mutate(call, variant, plan))
    **_tensor_mutations("q"),
    **_tensor_mutations("k"),
    **_tensor_mutations("v"),
    "kv_heads": ("k", 2, _kv_heads),
    "kv_batch": ("k", 1, lambda c, i, p: replace(c, k=torch.cat([c.k, c.k]), v=torch.cat([c.v, c.v]))),
    "v_seqlen": ("v", 1, _one_more_key),
    "v_heads": ("v", 1, lambda c, i, p: _swap(c, "v", torch.cat([c.v, c.v], dim=_heads_dim(c)))),
    "out": ("out", 9, _bad_out),
    "softmax_scale": ("softmax_scale", len(BAD_SCALES), lambda c, i, p: _swap(c, "softmax_scale", BAD_SCALES[i])),
    "window": ("window", len(BAD_WINDOWS), _window),
    "chunk_size": ("chunk_size", len(BAD_CHUNKS), _chunk),
    "return_lse": ("return_lse", 1, lambda c, i, p: _swap(c, "return_lse", True)),
    "return_lse_type": ("return_lse", 2, lambda c, i, p: _swap(c, "return_lse", ["no", torch.tensor([1, 0])][i])),
    "cu_seqlens": ("cu_seqlens_q", 1, lambda c, i, p: _swap(c, "cu_seqlens_q", torch.tensor([0, 5, 3]))),  # not monotone
    # packed sequences (varlen specs; any other spec has no such argument and must say so)
    "cu_seqlens_k": ("cu_seqlens_k", 3, lambda c, i, p: _swap(c, "cu_seqlens_k", [
        torch.zeros(1, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32), [0, 1]][i])),
    "seqused_k": ("seqused_k", 2, lambda c, i, p: _swap(c, "seqused_k", [
        torch.zeros(99, dtype=torch.int32), torch.zeros(1, dtype=torch.float32)][i])),
    "max_seqlen_q": ("max_seqlen_q", 3, lambda c, i, p: _swap(c, "max_seqlen_q", [-1, 1.5, True][i])),
}
# Mutations whose checks come before any device work (ForwardOp now checks every argument before it asks
# for CUDA tensors, so on a CPU the others are named too; tests/test_fuzz_runtime.py checks both).
CHECKED_BEFORE_DEVICE = ("q_type", "q_grad", "k_grad", "v_grad", "cu_seqlens", "cu_seqlens_k", "seqused_k",
                         "max_seqlen_q")


def applicable(kind: str, plan: Mapping[str, Any], call: Call, *, has_backward: bool = False) -> bool:
    """Whether `kind` makes `call` bad for this plan: return_lse=True is fine when LSE is written,
    moving a tensor to the CPU only matters for CUDA calls, an input that requires grad is fine when
    the package has a backward. (window/chunk_size on a spec without them is bad: the generated
    signature has no such argument.)"""
    if kind.endswith("_grad"):
        return not has_backward
    if kind == "return_lse":
        return not plan["write_lse"]
    if kind.endswith("_device"):
        return call.q.device.type == "cuda"
    if kind == "kv_batch":
        # packed sequences have no batch mode: doubled k/v rows only disagree with cu_seqlens_k's
        # values, a check of that argument
        return not plan.get("varlen")
    return True


def bad_call(plan: Mapping[str, Any], call: Call, kind: str, variant: int) -> tuple[Call, str]:
    """(`call` with one bad argument, the argument the error must name)."""
    arg, n, mutate = MUTATIONS[kind]
    return mutate(call, variant % n, plan), arg


def names_argument(message: str, arg: str) -> bool:
    """Whether an error message names `arg`: `arg: ...` (fa4gen's form), `k, v: ...`, `'arg'`
    (Python's unexpected-keyword TypeError) or `arg requires grad`."""
    a = re.escape(arg)
    return re.search(rf"(^|[\s(])({a}(:|, )|'{a}'|{a} requires grad)", message) is not None


__all__ = [
    "BAD_CHUNKS", "BAD_SCALES", "BAD_WINDOWS", "CHECKED_BEFORE_DEVICE", "Call", "MUTATIONS", "applicable",
    "bad_call", "good_call", "names_argument",
]

"""torch.compile support: a generated package's attention as torch.library custom operators.

Eager calls never come here: `ForwardOp.__call__` keeps its own fast path (call-signature cache, no
dispatcher round trip). While torch.compile traces a call (`torch.compiler.is_compiling()`), the call
becomes one opaque operator, `<namespace>::fwd`, whose fake implementation gives Dynamo and AOTAutograd
the output shapes and runs every device-independent check on the traced tensors; with backward: true its
registered autograd formula calls `<namespace>::bwd`, so the backward kernels land in the compiled
backward graph and `fullgraph=True` holds. At run time both operators run the eager code path
(`ForwardOp.__call__` / `ForwardOp.backward`), so a compiled call computes exactly what an eager one does.

The namespace is per package directory (`fa4gen_<spec name>_<8 hex digits>`), registered once per
process; a package imported again (a fresh ForwardOp for the same directory) takes over the operators.
"""

import hashlib
from typing import TYPE_CHECKING, Optional, Sequence

import torch

if TYPE_CHECKING:  # (runtime imports this module: no cycle at run time)
    from fa4gen.api.runtime import ForwardOp

# (no `from __future__ import annotations` here: torch.library infers the operators' schemas from these
# functions' annotations, which must be real types)

# namespace -> the ForwardOp its operators run (the latest one built for that package directory)
_OWNERS: dict[str, "ForwardOp"] = {}
_REGISTERED: set[str] = set()


def namespace(op: "ForwardOp") -> str:
    """The operator namespace of `op`'s package: its spec name (a Python identifier, checked by the spec
    stage) and a digest of its directory, so two packages of one spec name built into different
    directories (tests, `fa4gen.build(..., out_dir=...)`) never share operators."""
    digest = hashlib.sha256(str(op.dir).encode()).hexdigest()[:8]
    return f"fa4gen_{op.name}_{digest}"


def _owner(ns: str) -> "ForwardOp":
    return _OWNERS[ns]


def register(op: "ForwardOp") -> "CompiledOps":
    """The custom operators of `op`'s package (registered on the first call for its directory)."""
    ns = namespace(op)
    _OWNERS[ns] = op
    if ns not in _REGISTERED:
        _define(ns, with_backward=bool(op.bwd_plans))
        _REGISTERED.add(ns)
    return CompiledOps(ns)


def _hint(n):
    """A size or scalar of a traced call: its example value where it is symbolic (dynamic shapes); other
    values (None, plain ints and floats) unchanged."""
    if isinstance(n, (torch.SymInt, torch.SymFloat)):
        hint = n.node.hint
        return (int if isinstance(n, torch.SymInt) else float)(hint if hint is not None else 0)
    return n


def _example(t):
    """A meta tensor with the sizes, strides and dtype of traced tensor `t` (None stays None)."""
    if t is None:
        return None
    return torch.empty_strided([_hint(n) for n in t.shape], [_hint(n) for n in t.stride()], dtype=t.dtype,
                               device="meta")


def _window_tuple(window):
    return None if window is None else (_hint(window[0]), _hint(window[1]))


def _define(ns: str, *, with_backward: bool) -> None:
    @torch.library.custom_op(f"{ns}::fwd", mutates_args=())
    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Optional[float],
            window: Optional[Sequence[int]], chunk_size: Optional[int], cu_seqlens_q: Optional[torch.Tensor],
            cu_seqlens_k: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], max_seqlen_q: Optional[int],
            max_seqlen_k: Optional[int], out_like: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        # out_like: the caller's out= (the traced call copies the result into it), only checked here
        op = _owner(ns)
        write_lse = op.writes_lse()
        with torch.no_grad():  # the operator's autograd formula (below) records the call, not AttentionFunction
            res = op(q, k, v, softmax_scale=softmax_scale, window=_window_tuple(window), chunk_size=chunk_size,
                     return_lse=write_lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=max_seqlen_q, seqused_k=seqused_k, max_seqlen_k=max_seqlen_k)
        out, lse = res if write_lse else (res, q.new_empty((0,), dtype=torch.float32))
        return out.contiguous(), lse.contiguous()

    @fwd.register_fake
    def _(q, k, v, softmax_scale, window, chunk_size, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
          max_seqlen_k, out_like):
        op = _owner(ns)
        # the checks on stand-ins with the traced tensors' example sizes: an error names numbers, not symbols,
        # and adds no guards (the run-time implementation checks every call's real tensors again)
        plan, packed = op.validate(*map(_example, (q, k, v)), softmax_scale=_hint(softmax_scale),
                                   window=_window_tuple(window), chunk_size=_hint(chunk_size),
                                   cu_seqlens_q=_example(cu_seqlens_q), cu_seqlens_k=_example(cu_seqlens_k),
                                   max_seqlen_q=_hint(max_seqlen_q), seqused_k=_example(seqused_k),
                                   max_seqlen_k=_hint(max_seqlen_k))
        out = q.new_empty((*q.shape[:-1], plan["head_dim_v"]))
        if out_like is not None:
            op.check_out_like(_example(out_like), _example(out))
        if not op.writes_lse():
            return out, q.new_empty((0,), dtype=torch.float32)
        lse_shape = (q.shape[1], q.shape[0]) if packed is not None else (q.shape[0], q.shape[2], q.shape[1])
        return out, q.new_empty(lse_shape, dtype=torch.float32)

    if not with_backward:
        return

    @torch.library.custom_op(f"{ns}::bwd", mutates_args=())
    def bwd(dout: Optional[torch.Tensor], dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, softmax_scale: Optional[float],
            window: Optional[Sequence[int]], chunk_size: Optional[int], cu_seqlens_q: Optional[torch.Tensor],
            cu_seqlens_k: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], max_seqlen_q: Optional[int],
            max_seqlen_k: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        op = _owner(ns)
        packed = op.packed_for_backward(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_k, max_seqlen_k)
        from fa4gen.api.runtime import tma_ready  # (runtime imports this module)

        with torch.no_grad():
            grads = op.backward(tma_ready(q), tma_ready(k), tma_ready(v), out, dout, lse, dlse,
                                softmax_scale=softmax_scale, window=_window_tuple(window), chunk_size=chunk_size,
                                packed=packed)
        return tuple(g.contiguous() for g in grads)

    @bwd.register_fake
    def _(dout, dlse, q, k, v, out, lse, *rest):
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))

    def setup_context(ctx, inputs, output):
        q, k, v, softmax_scale, window, chunk_size, cu_q, cu_k, seqused_k, max_q, max_k, _ = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seqused_k)
        ctx.args = (softmax_scale, window, chunk_size, max_q, max_k)

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k, seqused_k = ctx.saved_tensors
        softmax_scale, window, chunk_size, max_q, max_k = ctx.args
        dq, dk, dv = bwd(dout, dlse, q, k, v, out, lse, softmax_scale, window, chunk_size, cu_q, cu_k, seqused_k,
                         max_q, max_k)
        return (dq, dk, dv) + (None,) * 9

    fwd.register_autograd(backward, setup_context=setup_context)


class CompiledOps:
    """What `ForwardOp.__call__` runs while torch.compile traces it: the argument checks that need no tensor
    and no value (types, autograd state), then the package's `fwd` operator, whose fake implementation
    checks the rest."""

    def __init__(self, ns: str):
        self.ns = ns

    def fwd(self):
        return getattr(torch.ops, self.ns).fwd

    def __call__(self, op: "ForwardOp", q, k, v, *, softmax_scale, window, chunk_size, return_lse, out,
                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_k, max_seqlen_k):
        from fa4gen.api.runtime import (  # (runtime imports this module)
            needs_grad, refuse_out_requiring_grad, refuse_out_with_grad,
        )

        op.check_call_types(softmax_scale=softmax_scale, window=window, chunk_size=chunk_size, return_lse=return_lse)
        grad = needs_grad(q, k, v)
        if grad:
            op.check_grad_allowed(q, k, v)
        if out is not None and grad:
            refuse_out_with_grad()
        window = None if window is None else list(window)
        if out is not None and out.requires_grad:
            refuse_out_requiring_grad()
        res, lse = self.fwd()(q, k, v, softmax_scale, window, chunk_size, cu_seqlens_q, cu_seqlens_k, seqused_k,
                              max_seqlen_q, max_seqlen_k, out)
        if out is not None:
            out.copy_(res)
            res = out
        return (res, lse) if return_lse else res

"""flash-attn-style entry points that write the spec for you: `fa4gen.flash_attn_func` and
`fa4gen.flash_attn_varlen_func` take flash_attn_func / flash_attn_varlen_func calls, derive the spec a call
needs from its tensors and keywords (dtype, head dims, mask kind, softcap, GQA, varlen, determinism, the
GPU's arch), build that spec's package on first use (rendered into the kernel cache's packages/ folder,
its kernels compiled on first call and then loaded from the disk cache, as any package's are) and call
its `attention`. `flash_attn_spec` returns the spec dict of a call, to freeze into a spec file for
ahead-of-time builds.

What varies per call at run time stays out of the spec, so it does not multiply packages: softmax_scale,
the window's sizes (sliding-window kernels take them at run time) and the sequence lengths. What the
kernels are specialised on is the package key: dtype, head_dim / head_dim_v, mask kind (none, causal,
sliding window), softcap, GQA or not, varlen, deterministic, arch.

Conventions are flash-attn's: window_size=(left, right) with -1 for unbounded, causal=True meaning
window right = 0 (bottom-right aligned when seqlen_q != seqlen_k). Keywords are keyword-only (flash-attn 2
and 3 order their positional parameters differently). Dropout, ALiBi and attention probabilities are not
supported and are refused by name.
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

import torch

from fa4gen.api.runtime import CAPABILITY_TO_ARCH

# spec name (which carries a digest of the spec) -> the imported package: one build per spec and process
_PACKAGES: dict[str, Any] = {}
# an eager call's plain argument values -> (package, window keyword): see _resolve
_RESOLVED: dict[tuple, tuple] = {}
_LOCK = threading.Lock()

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _fail(message: str, kind=ValueError):
    raise kind(message)


def _arch(q) -> str:
    if not isinstance(q, torch.Tensor):
        _fail(f"q: expected a torch.Tensor, got {type(q).__name__}", TypeError)
    return _arch_of_device(q.device)


def _arch_of_device(device: torch.device) -> str:
    if device.type != "cuda":
        _fail(f"q: expected a CUDA tensor, got device {device}")
    cap = torch.cuda.get_device_capability(device)
    arch = CAPABILITY_TO_ARCH.get(cap)
    if arch is None:
        _fail(f"q: no fa4gen kernels for this GPU (compute capability {cap[0]}.{cap[1]}); fa4gen targets "
              "Hopper (sm90) and Blackwell (sm100)", RuntimeError)
    return arch


def _window(causal, window_size) -> tuple[str, tuple[int, int] | None]:
    """(mask kind, the run-time window or None) of flash-attn's causal / window_size."""
    if not isinstance(causal, bool):
        _fail(f"causal: expected True or False, got {causal!r}", TypeError)
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
        isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    if not ok:
        _fail(f"window_size: expected (left, right) ints, -1 for unbounded, got {window_size!r}")
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        if right not in (-1, 0):
            _fail(f"window_size: causal=True sees no key right of the diagonal, so right must be -1 or 0, got {right}")
        return ("causal", None) if left == -1 else ("sliding_window", (left, 0))
    if left == -1 and right == -1:
        return "none", None
    if (left, right) == (-1, 0):  # flash-attn's other spelling of causal: the causal kernels
        return "causal", None
    return "sliding_window", (left, right)


def _unsupported(dropout_p, alibi_slopes, return_attn_probs) -> None:
    if dropout_p != 0.0:
        _fail(f"dropout_p: fa4gen kernels have no attention dropout; expected 0.0, got {dropout_p!r}")
    if alibi_slopes is not None:
        _fail("alibi_slopes: fa4gen kernels have no ALiBi bias; expected None")
    if return_attn_probs:
        _fail("return_attn_probs: fa4gen kernels never materialise the attention probabilities; use "
              "return_lse=True for the log-sum-exp")


def _describe(q, k, v, *, causal, window_size, softcap, deterministic, varlen) -> tuple:
    """What a call's package depends on, as plain values (under torch.compile, Dynamo specialises on
    them): (dtype, head_dim, head_dim_v, mask kind, GQA, softcap, deterministic, varlen, device); every
    argument checked, naming it."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name}: expected a torch.Tensor, got {type(t).__name__}", TypeError)
        if t.dim() != (3 if varlen else 4):
            layout = "(total, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
            _fail(f"{name}: expected {3 if varlen else 4} dims {layout}, got {t.dim()}")
    dtype = DTYPES.get(q.dtype)
    if dtype is None:
        _fail(f"q: expected dtype torch.bfloat16 or torch.float16, got {q.dtype}", TypeError)
    kind, _ = _window(causal, window_size)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap >= 0:
        _fail(f"softcap: expected a float >= 0 (0 = off), got {softcap!r}")
    if not isinstance(deterministic, bool):
        _fail(f"deterministic: expected True or False, got {deterministic!r}", TypeError)
    gqa = True if k.shape[-2] != q.shape[-2] else False  # (a plain bool where the sizes are symbolic)
    softcap = 0.0 if softcap == 0 else float(softcap)  # (0 a constant where Dynamo made the default symbolic)
    return (dtype, _static_dim("q", q.shape[-1]), _static_dim("v", v.shape[-1]), kind, gqa, softcap,
            deterministic, bool(varlen), str(q.device))


def _static_dim(name: str, n) -> int:
    """A head dim as a plain int. Traced by torch.compile with dynamic shapes it is a symbol, which the
    package key cannot hold: comparing it with each head dim the specs allow (multiples of 8 up to 256)
    specialises it, as Dynamo does for any size that picks a code path."""
    if not torch.compiler.is_compiling():
        return int(n)
    for d in range(8, 257, 8):
        if n == d:
            return d
    _fail(f"{name}: expected a head dim that is a multiple of 8 up to 256")


def _spec(desc: tuple, arch: str) -> dict:
    dtype, head_dim, head_dim_v, kind, gqa, softcap, deterministic, varlen, _ = desc
    backward = arch == "sm90"  # (sm100 packages are forward-only)
    mask: dict = {"kind": kind}
    if kind == "sliding_window":  # the package's default window, never used: every call passes its own
        mask.update(left=0, right=0)
    spec = dict(targets=[arch], dtype=dtype, head_dim=head_dim, mask=mask, softcap=softcap, allow_gqa=gqa,
                varlen=varlen, return_lse=True, backward=backward, deterministic=deterministic and backward)
    if head_dim_v != head_dim:
        spec["head_dim_v"] = head_dim_v
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    return dict(name=f"fa_{dtype}_d{head_dim}_{kind}_{digest}", **spec)


def flash_attn_spec(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False,
                    varlen=False, arch: str | None = None) -> dict:
    """The spec dict that fa4gen builds for such a call (q, k, v as flash_attn_func takes them, or packed
    (total, heads, dim) with varlen=True); arch defaults to q's GPU's. Written to a YAML file it builds
    the same package ahead of time (`fa4gen build`)."""
    desc = _describe(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                     deterministic=deterministic, varlen=varlen)
    return _spec(desc, arch or _arch(q))


@torch._dynamo.assume_constant_result
def _package_key(*desc) -> str:
    """The key in _PACKAGES of the package for `desc`, built first if needed. Under torch.compile Dynamo
    runs this eagerly while tracing and keeps the key as a constant, so building (files, imports) never
    enters the traced graph."""
    spec = _spec(desc, _arch_of_device(torch.device(desc[-1])))
    package_for(spec)
    return spec["name"]


def package_for(spec: dict):
    """The imported package of a spec from `flash_attn_spec` (built on first use in this process)."""
    key = spec["name"]
    if key not in _PACKAGES:
        with _LOCK:
            if key not in _PACKAGES:
                from fa4gen.builder import build_module

                _PACKAGES[key] = build_module(dict(spec))
    return _PACKAGES[key]


def _check_grad(pkg, q, k, v) -> None:
    """A call that records autograd needs backward kernels, which only the sm90 packages have."""
    if not pkg._forward.bwd_plans and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                                   or v.requires_grad):
        _fail("q, k, v: a call that records autograd needs backward kernels, and fa4gen has them for Hopper "
              "(sm90) only, not for this GPU; run the training step on Hopper, or this call under torch.no_grad()",
              RuntimeError)


def _resolve(q, k, v, causal, window_size, softcap, deterministic, *, varlen: bool):
    """(the call's package, its window keyword), every argument checked. Eager calls repeat their
    specialisation: after the first, a dict hit on the plain values the checks and the package depend on
    skips deriving the spec (json + sha256, ~16 us of host time per call)."""
    key = None
    if (not torch.compiler.is_compiling() and type(causal) is bool and type(deterministic) is bool
            and type(window_size) is tuple and type(softcap) in (float, int) and type(q) is torch.Tensor
            and type(k) is torch.Tensor and type(v) is torch.Tensor):
        key = (q.dtype, q.device, q.dim(), k.dim(), v.dim(), q.shape[-1], v.shape[-1], k.shape[-2] != q.shape[-2],
               causal, window_size, softcap, deterministic, varlen)
        hit = _RESOLVED.get(key)
        if hit is not None:
            _check_grad(hit[0], q, k, v)
            return hit
    desc = _describe(q, k, v, causal=causal, window_size=window_size, softcap=softcap, deterministic=deterministic,
                     varlen=varlen)
    pkg = _PACKAGES[_package_key(*desc)]
    _check_grad(pkg, q, k, v)
    kind, window = _window(causal, window_size)
    resolved = pkg, ({"window": window} if kind == "sliding_window" else {})
    if key is not None:
        _RESOLVED[key] = resolved
    return resolved


def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    deterministic=False, return_lse=False, out=None, dropout_p=0.0, alibi_slopes=None,
                    return_attn_probs=False):
    """flash_attn_func's attention through an fa4gen package derived from the call (module docstring).
    q (batch, seqlen_q, heads, head_dim), k / v (batch, seqlen_k, kv_heads, head_dim[_v]), bf16 or fp16
    on a Hopper (forward + backward) or Blackwell (forward) GPU. Returns out, or (out, lse) with
    return_lse=True (lse: (batch, heads, seqlen_q) fp32, natural log)."""
    _unsupported(dropout_p, alibi_slopes, return_attn_probs)
    pkg, kw = _resolve(q, k, v, causal, window_size, softcap, deterministic, varlen=False)
    return pkg.attention(q, k, v, softmax_scale=softmax_scale, return_lse=return_lse, out=out, **kw)


def flash_attn_qkvpacked_func(qkv, **kwargs):
    """flash_attn_qkvpacked_func: qkv (batch, seqlen, 3, heads, head_dim), as a fused QKV projection writes
    it; the three are strided views (no copy when their strides suit TMA), gradients flow back into qkv.
    Keywords as flash_attn_func's."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        shape = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
        _fail(f"qkv: expected a (batch, seqlen, 3, heads, head_dim) tensor, got {shape}")
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, **kwargs)


def flash_attn_kvpacked_func(q, kv, **kwargs):
    """flash_attn_kvpacked_func: q (batch, seqlen_q, heads, head_dim), kv (batch, seqlen_k, 2, kv_heads,
    head_dim). Keywords as flash_attn_func's."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        _fail(f"kv: expected a (batch, seqlen_k, 2, kv_heads, head_dim) tensor, got {shape}")
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, **kwargs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                           seqused_k=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           deterministic=False, return_lse=False, out=None, dropout_p=0.0, alibi_slopes=None,
                           return_attn_probs=False):
    """flash_attn_varlen_func's attention over packed sequences through an fa4gen varlen package derived
    from the call: q (total_q, heads, head_dim), k / v (total_k, kv_heads, head_dim[_v]), int32
    cu_seqlens_q / cu_seqlens_k (batch + 1 entries from 0); masks are bottom-right aligned per sequence.
    max_seqlen_q / max_seqlen_k are optional (given, fa4gen skips its one read-back of the sequence
    tensors). Returns out, or (out, lse) with lse (heads, total_q)."""
    _unsupported(dropout_p, alibi_slopes, return_attn_probs)
    pkg, kw = _resolve(q, k, v, causal, window_size, softcap, deterministic, varlen=True)
    return pkg.attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, softmax_scale=softmax_scale,
                         return_lse=return_lse, out=out, **kw)

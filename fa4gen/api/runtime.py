"""API stage: what a generated package's `attention()` calls — input checks, compile-on-first-use
through the disk cache, the launch, and (for specs with backward: true) the autograd Function whose
backward launches the package's backward kernels.

Conventions are flash_attn_func's: q (batch, seqlen_q, heads, head_dim), k/v (batch, seqlen_k,
kv_heads, head_dim[_v]), GQA/MQA when kv_heads divides heads; the LSE is (batch, heads, seqlen_q)
fp32 in natural log. Specs with varlen: true take flash_attn_varlen_func's packed form instead:
q (total_q, heads, head_dim), k/v (total_k, kv_heads, ...), cu_seqlens_q/k, optional seqused_k and
max_seqlen_q/k; the LSE is (heads, total_q). Every bad argument raises ValueError/TypeError naming
the argument and what was expected, before anything is launched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from fa4gen.api import library
from fa4gen.compile.cache import DiskCache
from fa4gen.compile.generated import compile_generated
from fa4gen.reference import check_cu_seqlens_values, check_seqused_values

LOG2_E = math.log2(math.e)
FP32_MAX = 3.4028234663852886e38  # the largest finite float32
CAPABILITY_TO_ARCH = {(9, 0): "sm90", (10, 0): "sm100", (10, 3): "sm100"}
GRID_LIMIT = 65535

log = logging.getLogger("fa4gen")
if not log.handlers and os.environ.get("FA4GEN_QUIET", "") != "1":
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("fa4gen: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def check_dq_accumulator(rows: int, head_dim: int) -> None:
    """The backward addresses a (batch, head)'s dQ accumulator (query rows padded to whole tiles, times
    head_dim fp32) with 32-bit offsets: refuse what would overflow them instead of a wrong answer."""
    if rows * head_dim >= 2**31:
        _fail(f"q: the backward supports up to {2**31 // head_dim - 1} query rows per (batch, head) at head_dim "
              f"{head_dim} (its dQ accumulator is indexed with 32-bit offsets), got {rows} (padded to whole tiles)")


def _fail(message: str, kind=ValueError):
    raise kind(message)


def _autocast_on(t: torch.Tensor) -> bool:
    try:
        return torch.is_autocast_enabled(t.device.type)
    except TypeError:  # torch before 2.4: no device argument
        return torch.is_autocast_enabled()


def check_tensor(name: str, t: Any, *, dtype: torch.dtype, last_dim: int, packed: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name}: expected a torch.Tensor, got {type(t).__name__}", TypeError)
    if packed and t.dim() != 3:
        _fail(f"{name}: expected 3 dims (total, heads, head_dim) — a varlen spec takes packed sequences — "
              f"got shape {tuple(t.shape)}")
    if not packed and t.dim() != 4:
        _fail(f"{name}: expected 4 dims (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        hint = ""
        if t.is_floating_point() and _autocast_on(t):
            hint = f" (autocast does not cast this function's inputs: cast {name} with .to({dtype}))"
        _fail(f"{name}: expected dtype {dtype} (the spec's dtype), got {t.dtype}{hint}", TypeError)
    if t.shape[-1] != last_dim:
        _fail(f"{name}: expected head_dim {last_dim} (from the spec), got {t.shape[-1]}")
    if t.stride(-1) != 1:
        _fail(f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(t.stride())}; call .contiguous()")


def needs_grad(q, k, v) -> bool:
    """Whether this call records autograd: grad mode on and q, k or v requiring grad."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


CALL_CACHE_SIZE = 256  # signatures kept per package (cleared when full)
DLSE_VIEWS = 64  # zero-dLSE views kept per package (cleared when full), see ForwardOp._zero_dlse


class CachedCall(NamedTuple):
    """What a replayed call of one signature needs (ForwardOp._calls; tools/launch_cost.py reads it by name)."""

    fn: Any  # the compiled kernel
    args: list  # its run-time arguments after the tensors
    out_shape: tuple | None  # None: out is made like q (its shape and dtype)
    dtype: torch.dtype  # out's
    lse_shape: tuple | None  # None: the kernel writes no LSE
    lse: torch.Tensor | None  # the scratch LSE a call that does not return it writes into, else None
    spans: tuple  # the extents of q, k, v and out (out= overlap checks)


def _typed(x):
    """A hashable stand-in for an argument value that keeps its type: True and 1 must not share a key
    (one is refused, the other not); lists become tuples (an unhashable value raises TypeError)."""
    if type(x) in (tuple, list):
        return (type(x), tuple(_typed(e) for e in x))
    hash(x)
    return (type(x), x)


def call_key(q, k, v, softmax_scale, window, chunk_size, return_lse, out=None) -> tuple | None:
    """Everything the checks of a batched call depend on, other than base addresses and autograd state:
    the tensors' shapes, strides, dtypes and devices (out's too, when given) and the keyword values,
    typed. None for inputs that are not plain tensors (subclasses, other objects: the full checks
    handle them)."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    if out is not None:
        if type(out) is not torch.Tensor:
            return None
        given = ("out", out.shape, out.stride(), out.dtype, out.device)
    else:
        given = ()
    if softmax_scale is None and window is None and chunk_size is None and type(return_lse) is bool:
        extra = (return_lse,)  # the common call, cheaper to key (never equal to the typed form below)
    else:
        try:
            extra = ("typed", _typed(softmax_scale), _typed(window), _typed(chunk_size), _typed(return_lse))
        except TypeError:
            return None
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
            v.shape, v.stride(), v.dtype, v.device) + extra + given


def packed_key(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_k, max_seqlen_k) -> tuple | None:
    """What the checks of a packed call's sequence arguments depend on, for `call_key`'s cache: their tensors'
    shapes, dtypes and devices and the typed maxima. Only calls that vouch for their values (max_seqlen_q given:
    nothing is read back, as in training and flash_attn_varlen_func) with plain, contiguous tensors (launched
    as given) have one; None for the others, which take the full path (a check of the values every call)."""
    if max_seqlen_q is None or cu_seqlens_q is None or cu_seqlens_k is None:
        return None
    parts = []
    for t in (cu_seqlens_q, cu_seqlens_k, seqused_k):
        if t is None:
            parts.append(None)
            continue
        if type(t) is not torch.Tensor or not t.is_contiguous():
            return None
        parts.append((t.shape, t.dtype, t.device))
    try:
        return ("packed", *parts, _typed(max_seqlen_q), _typed(max_seqlen_k))
    except TypeError:
        return None


def _remember(table: dict, key: tuple, value) -> None:
    """Keep a signature's entry in one of a ForwardOp's caches, at most CALL_CACHE_SIZE (cleared when full)."""
    if len(table) >= CALL_CACHE_SIZE:
        table.clear()
    table[key] = value


def extent(t: torch.Tensor) -> int:
    """Bytes from t's first element to one past its last (0 when empty); with its data_ptr, the address
    range it touches."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


def overlaps(a_ptr: int, a_len: int, b_ptr: int, b_len: int) -> bool:
    return a_len > 0 and b_len > 0 and a_ptr < b_ptr + b_len and b_ptr < a_ptr + a_len


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA needs 16-byte aligned base and strides; other layouts get a contiguous copy."""
    aligned = t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])
    # .contiguous() would return a contiguous but misaligned tensor unchanged: copy explicitly
    return t if aligned else torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of `t` may share memory: with its dims (of extent > 1) ordered by stride, each
    stride must step past everything the smaller ones span (gaps are fine). Conservative: a layout that
    interleaves without overlapping is refused too."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    span = 1  # elements covered by the dims so far, in units of the element
    for st, n in dims:
        if st < span:
            return True
        span = st * (n - 1) + span
    return False


class Packed:
    """The sequence arguments of a varlen call, checked: cu_seqlens_q/k (int32, batch + 1),
    seqused_k (int32, batch, or None), max_seqlen_q/k (int, or None until resolved)."""

    __slots__ = ("cu_q", "cu_k", "seqused_k", "max_seqlen_q", "max_seqlen_k", "checked")

    def __init__(self, cu_q, cu_k, seqused_k, max_seqlen_q, max_seqlen_k=None):
        self.cu_q, self.cu_k, self.seqused_k = cu_q, cu_k, seqused_k
        self.max_seqlen_q, self.max_seqlen_k = max_seqlen_q, max_seqlen_k
        self.checked = False  # the values were read back and checked (resolve without max_seqlen_q)

    @property
    def batch(self) -> int:
        return self.cu_q.shape[0] - 1

    def tensors(self):
        return (("cu_seqlens_q", self.cu_q), ("cu_seqlens_k", self.cu_k)) + (
            (("seqused_k", self.seqused_k),) if self.seqused_k is not None else ())

    def seqused_or_dummy(self):
        """The seqused_k tensor the kernels take; cu_seqlens_k stands in (unread) when there is none."""
        return self.seqused_k if self.seqused_k is not None else self.cu_k

    @classmethod
    def check(cls, name: str, varlen: bool, cu_q, cu_k, max_seqlen_q, seqused_k, max_seqlen_k=None) -> "Packed | None":
        given = [n for n, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k), ("max_seqlen_q", max_seqlen_q),
                                ("max_seqlen_k", max_seqlen_k), ("seqused_k", seqused_k)) if t is not None]
        if not varlen:
            if given:
                _fail(f"{given[0]}: spec {name} was built without varlen; set varlen: true in the spec to pass packed "
                      "sequences")
            return None
        for arg, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            if t is None:
                _fail(f"{arg}: spec {name} is varlen: pass cu_seqlens_q and cu_seqlens_k (int32 cumulative sequence "
                      "lengths, batch + 1 entries starting at 0)")
        for arg, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k), ("seqused_k", seqused_k)):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                _fail(f"{arg}: expected a torch.Tensor, got {type(t).__name__}", TypeError)
            if t.dtype != torch.int32 or t.dim() != 1:
                _fail(f"{arg}: expected a 1-D int32 tensor, got {t.dim()}-D {t.dtype}", TypeError)
        if cu_q.shape[0] < 2:
            _fail(f"cu_seqlens_q: expected batch + 1 >= 2 entries, got {cu_q.shape[0]}")
        if cu_k.shape[0] != cu_q.shape[0]:
            _fail(f"cu_seqlens_k: expected {cu_q.shape[0]} entries like cu_seqlens_q, got {cu_k.shape[0]}")
        if cu_q.shape[0] - 1 > GRID_LIMIT:
            _fail(f"cu_seqlens_q: at most {GRID_LIMIT} sequences, got {cu_q.shape[0] - 1}")
        if seqused_k is not None and seqused_k.shape[0] != cu_q.shape[0] - 1:
            _fail(f"seqused_k: expected {cu_q.shape[0] - 1} entries (one per sequence), got {seqused_k.shape[0]}")
        for arg, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if m is not None and (isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < 2**31):
                _fail(f"{arg}: expected None or an int in [0, 2**31), got {m!r}")
        return cls(cu_q.contiguous(), cu_k.contiguous(), None if seqused_k is None else seqused_k.contiguous(),
                   max_seqlen_q, max_seqlen_k)

    def resolve(self, total_q: int, total_k: int) -> None:
        """Without max_seqlen_q, read the sequence tensors back once (one device sync), check their
        values and record the longest sequences. With it, the caller vouches for them, as with
        flash_attn_varlen_func (the forward kernels clamp every offset into the packed tensors, so bad
        values give wrong rows, never a stray memory access; the backward's kernels read them monotone, see
        `backward_tensors`). The kernels need neither maximum: their grids number the tiles of all
        sequences back to back."""
        if self.max_seqlen_q is not None:
            return
        parts = [self.cu_q, self.cu_k] + ([self.seqused_k] if self.seqused_k is not None else [])
        values = torch.cat(parts).tolist()
        n = self.cu_q.shape[0]
        cu_q = check_cu_seqlens_values("cu_seqlens_q", values[:n], total_q, None)
        cu_k = check_cu_seqlens_values("cu_seqlens_k", values[n:2 * n], total_k, None)
        if self.seqused_k is not None:
            check_seqused_values(values[2 * n:], cu_k)
        self.max_seqlen_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
        self.max_seqlen_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
        self.checked = True

    def backward_tensors(self) -> tuple:
        """(cu_seqlens_q, cu_seqlens_k, seqused_k or its stand-in) as the backward launches them: the caller's
        tensors, checked or not. The backward numbers the query tiles of all sequences back to back into
        buffers of ceil(total_q / tile_m) + batch tiles (LSE, D, the dQ accumulator, the claim flags / turn
        counters), which overlapping or negative sequences would overrun: its kernels read the values monotone
        (fa4gen/device/varlen.py `monotone_chunk`: the first 0, each entry clamped into [0, total], then the
        running maximum), so unchecked values (max_seqlen_q given) cost neither a device sync nor a sanitised
        copy (three torch operations, ~28 us of host time per backward on the H200), and valid ones read as
        they are."""
        return self.cu_q, self.cu_k, self.seqused_or_dummy()


class ForwardOp:
    """The attention of one generated package: plans from its spec.lock.json, kernels per arch and
    direction. When the package has backward kernels (spec backward: true), calls whose q, k or v
    require grad go through `AttentionFunction`, so out (and the LSE) support .backward()."""

    def __init__(self, package_file: str, package_name: str, *, operators: bool = True):
        """`operators`: register the package's torch.compile operators (fa4gen/api/library.py); off for a
        runtime made only to ask its kernel selection (`fa4gen dispatch`), which must not take them over."""
        self.dir = Path(package_file).resolve().parent
        self.package = package_name
        lock = json.loads((self.dir / "spec.lock.json").read_text())
        self.spec = lock["spec"]
        self.name = self.spec["name"]
        fwd = [p for p in lock["plans"] if p["direction"] == "fwd"]
        self.plans = {p["arch"]: p for p in fwd if not p.get("min_seqlen_q") and not p.get("seqlen_q_ranges")}
        # per arch, the forwards picked by seqlen_q (plan min_seqlen_q), longest threshold first
        self.long_plans = {a: sorted((p for p in fwd if p["arch"] == a and p.get("min_seqlen_q")),
                                     key=lambda p: -p["min_seqlen_q"]) for a in self.plans}
        # per arch, the forwards picked by seqlen_q ranges (plan seqlen_q_ranges: a d <= 64 spec's 128-row twin for
        # the lengths that pad its 192-row tiles worst; lock files written before session 49 have none)
        self.range_plans = {a: [p for p in fwd if p["arch"] == a and p.get("seqlen_q_ranges")] for a in self.plans}
        self._fwd_modules = {p["module"]: p for p in fwd}
        self._pinned: str | None = None
        # call_key -> what a launch of that signature needs (see _replay): calls repeat their shapes
        self._calls: dict[tuple, CachedCall] = {}
        # call_key (+ packed_key) -> the softmax scale of a signature whose autograd calls passed every check:
        # a repeated training call goes straight to AttentionFunction (its forward allocates and launches)
        self._grad_calls: dict[tuple, float] = {}
        # per device index, the fp32 LSE that calls without grad and without return_lse write into (the
        # kernels always write one when the package has a backward): a call that needs more grows it to
        # at least twice its size, and the old one is kept, not freed — a buffer a kernel may still be
        # writing on some stream must not go back to the allocator — so they hold at most 4x the largest
        # such LSE (1/64 of that call's output at head dim 128 in bf16)
        self._lse_scratch: dict[int | None, torch.Tensor] = {}
        self._lse_retired: list[torch.Tensor] = []
        # per device index, zeros that backwards without an LSE gradient read as their dLSE (the kernels
        # never write it), grown like the scratch LSE; a fresh torch.zeros per call was a fill kernel of its
        # own (1.0-1.4 us on the H200 at 16k tokens, session 19) between the launches
        self._dlse_zeros: dict[int | None, torch.Tensor] = {}
        self._dlse_retired: list[torch.Tensor] = []
        # (device index, shape) -> a view of those zeros, made once: slicing and viewing them per call cost
        # ~4 us of host time on the H200 (session 28). A view of a buffer since replaced still reads zeros
        # (retired buffers are kept and never written)
        self._dlse_views: dict[tuple, torch.Tensor] = {}
        bwd = [p for p in lock["plans"] if p["direction"] == "bwd"]
        self.bwd_plans = {p["arch"]: p for p in bwd if not (p.get("mha_only") or p.get("gqa_head_loop"))}
        # per arch, the backward that GQA / MQA calls with enough CTAs run (plan gqa_head_loop: a CTA per kv head runs
        # its group's q heads, dK/dV stored from registers; min_kv_ctas: key blocks x kv heads x batch)
        self.bwd_gqa_plans = {p["arch"]: p for p in bwd if p.get("gqa_head_loop")}
        # per arch, the backward that MHA calls run when the spec allows GQA (plan mha_only: dK/dV stored from the
        # CTA instead of summed in fp32 workspaces; lock files written before session 38 have none)
        self.bwd_mha_plans = {p["arch"]: p for p in bwd if p.get("mha_only")}
        self._bwd_modules = {p["module"]: p for p in bwd}
        self._pinned_bwd: str | None = None
        self.unavailable = lock.get("unavailable_targets", {})
        self._functions: dict[tuple[str, str], Any] = {}
        self._arch_by_device: dict[int | None, str] = {}
        self._sm_count_by_device: dict[int | None, int] = {}
        self._lock = threading.Lock()
        # what a call runs while torch.compile traces it (see fa4gen/api/library.py); without it (a torch
        # whose torch.library refuses the operators) Dynamo traces the eager path and breaks the graph there
        self._compiled = None
        if not operators:
            return
        try:
            self._compiled = library.register(self)
        except Exception as exc:  # noqa: BLE001 - any failure only costs torch.compile its whole graph
            log.warning("%s: no torch.compile operators (%s: %s); compiled models break the graph at attention",
                        self.name, type(exc).__name__, exc)
            self._compiled = None

    # -- compile / load -------------------------------------------------------------------
    def arch_for(self, device: torch.device) -> str:
        arch = self._arch_by_device.get(device.index)
        if arch is None:
            arch = self._arch_by_device[device.index] = self._resolve_arch(device)
        return arch

    def _resolve_arch(self, device: torch.device) -> str:
        cap = torch.cuda.get_device_capability(device)
        arch = CAPABILITY_TO_ARCH.get(cap)
        if arch in self.plans:
            return arch
        why = self.unavailable.get(arch, "") if arch else ""
        _fail(
            f"{self.name}: no kernel for this GPU (compute capability {cap[0]}.{cap[1]}, "
            f"{arch or 'unsupported arch'}); this package has kernels for {sorted(self.plans) or 'no arch'}"
            + (f" ({arch}: {why})" if why else ""),
            RuntimeError,
        )

    def forward_plan(self, arch: str, seqlen_q: int, window=None, chunk_size=None) -> dict:
        """The forward plan that runs a call with this seqlen_q (the longest sequence, packed), `window` and
        `chunk_size` (the call's arguments; None: the spec's): the first whose min_seqlen_q it reaches (and, for a
        plan with min_window_keys, whose window or chunk is that wide), else the first with a seqlen_q range holding
        it, else the arch's default; `pinned` overrides."""
        if self._pinned is not None:
            return self._fwd_modules[self._pinned]
        for plan in self.long_plans.get(arch, ()):
            if seqlen_q >= plan["min_seqlen_q"] and (
                    not plan.get("min_window_keys")
                    or self._window_keys(plan, window, chunk_size) >= plan["min_window_keys"]):
                return plan
        for plan in self.range_plans.get(arch, ()):
            if any(first <= seqlen_q <= last for first, last in plan["seqlen_q_ranges"]):
                return plan
        return self.plans[arch]

    @staticmethod
    def _window_keys(plan: dict, window, chunk_size=None) -> float:
        """Keys a row of this sliding window spans (left + right + 1), inf with an unbounded side, or of this
        chunked mask (the chunk size); `window` / `chunk_size` are the call's (checked here, as the launch checks
        them) or None for the spec's."""
        if plan["chunked"]:
            return _chunk(plan, chunk_size)
        left, right = (plan["window_left"], plan["window_right"]) if window is None else _window(window)
        return math.inf if left < 0 or right < 0 else left + right + 1

    def persistent_ctas(self, plan: dict, device: torch.device, seqlen_q: int = 0, pairs: int = 0) -> int:
        """The CTA count a persistent forward launches on `device` (at most; fewer when there are fewer work
        units): its SM count (cached per device), so an H100 PCIe (114), an H20 (78) or a MIG slice runs one
        CTA per SM as an H200 does (132), with no CTA waiting for another's whole tile list. Off CUDA (the
        CPU tests' stand-in launches) the plan's `persistent_ctas`. A kernel whose idle warpgroups skip a
        sequence's last, partial tile (plan skip_idle_warpgroups) gets `spread_ctas` of it for `seqlen_q` and
        `pairs` (batch x heads)."""
        if device.type != "cuda":
            count = plan["persistent_ctas"]
        else:
            count = self._sm_count_by_device.get(device.index)
            if count is None:
                count = self._sm_count_by_device[device.index] = \
                    torch.cuda.get_device_properties(device).multi_processor_count
        if plan.get("skip_idle_warpgroups") and plan["mask_kind"] == "none":
            count = spread_ctas(count, seqlen_q, plan["tile_m"], pairs)
        return count

    def backward_plan(self, arch: str, heads: int, kv_heads: int, batch: int = 0, seqlen_k: int = 0) -> dict | None:
        """The backward plan that runs a call with these head counts: the MHA kernel (plan mha_only) when the
        package has one and the call has as many K/V heads as query heads; for other calls the head-loop GQA kernel
        (plan gqa_head_loop) when the package has one and the call (`batch` sequences of `seqlen_k` keys; 0: a
        packed call, which it does not take) launches at least its min_kv_ctas CTAs; else the arch's backward (None:
        the package has none for `arch`); `pinned` overrides."""
        if self._pinned_bwd is not None:
            plan = self._bwd_modules[self._pinned_bwd]
            if plan.get("mha_only") and heads != kv_heads:
                _fail(f"{self.name}: kernel {plan['module']} is pinned, but it runs only calls with as many k/v "
                      f"heads as q heads; this call has {heads} q heads and {kv_heads} k/v heads")
            return plan
        mha = self.bwd_mha_plans.get(arch)
        if mha is not None and heads == kv_heads:
            return mha
        loop = self.bwd_gqa_plans.get(arch)
        if loop is not None and heads != kv_heads and batch > 0:
            if -(-seqlen_k // loop["tile_n"]) * kv_heads * batch >= loop["min_kv_ctas"]:
                return loop
        return self.bwd_plans.get(arch)

    @contextlib.contextmanager
    def pinned(self, module: str):
        """Within the block, every forward call runs kernel `module` whatever its seqlen_q, or, for a backward
        kernel, every backward runs it whatever the call's head counts (golden checks run each kernel of a
        package on the same small cases)."""
        if module in self._fwd_modules:
            self._pinned = module
        elif module in self._bwd_modules:
            self._pinned_bwd = module
        else:
            raise ValueError(f"{self.name}: no kernel {module!r} (this package has "
                             f"{', '.join(sorted([*self._fwd_modules, *self._bwd_modules]))})")
        try:
            yield
        finally:
            self._pinned = self._pinned_bwd = None

    def function(self, plan: dict):
        """The compiled kernel of `plan` (compiled, or loaded from the disk cache, on first use); a
        backward launches the preprocess, main kernel and postprocess."""
        fn = self._functions.get((plan["arch"], plan["module"]))
        return fn if fn is not None else self._compile(plan)

    def _compile(self, plan):
        key = (plan["arch"], plan["module"])
        with self._lock:
            if key not in self._functions:
                start = time.perf_counter()
                result = compile_generated(
                    self.dir / f"{plan['module']}.py", f"{self.package}.{plan['module']}", plan, cache=DiskCache()
                )
                took = time.perf_counter() - start
                what = (self.name if plan["direction"] == "fwd"
                        else f"{self.name} backward{' (MHA calls)' if plan.get('mha_only') else ''}")
                if result.cache_hit:
                    log.info("loaded %s for %s from the disk cache (%.0f ms)", what, plan["cute_arch"], took * 1e3)
                else:
                    log.info("compiling %s for %s ... done in %.1f s", what, plan["cute_arch"], took)
                self._functions[key] = result.function
        return self._functions[key]

    def precompile(self, arch: str | None = None, *, jobs: int = 0) -> dict[str, str]:
        """Compile (or find in the disk cache) every kernel of this package for `arch` now, `jobs` compile
        processes at once (fa4gen.builder.compile_jobs; 0: one per CPU as memory allows); when `arch` is the
        current CUDA device's, load them too, so that no call waits. {kernel module: "cached" | "compiled"}."""
        return precompile_ops([(self, self.precompile_arch(arch))], jobs=jobs)[self.name]

    def precompile_arch(self, arch: str | None) -> str:
        """The arch a precompile of this package compiles for: `arch`, checked, or (None) the current GPU's."""
        if arch is None:
            if not torch.cuda.is_available():
                _fail(f"{self.name}: precompile: arch: no CUDA device here to take it from; name one of "
                      f"{sorted(self.plans)} (compiling needs no GPU)")
            arch = self.arch_for(torch.device("cuda", torch.cuda.current_device()))
        if arch not in self.plans:
            why = self.unavailable.get(arch)
            _fail(f"{self.name}: precompile: arch: expected one of {sorted(self.plans)}, got {arch!r}"
                  + (f" ({why})" if why else ""))
        return arch

    def kernel_plans(self, arch: str) -> list[dict]:
        """Every kernel plan of this package for `arch`: the forwards, then the backwards (the MHA-call and the
        GQA head-loop ones too)."""
        plans = [self.plans[arch], *self.long_plans.get(arch, ()), *self.range_plans.get(arch, ())]
        return plans + [p[arch] for p in (self.bwd_plans, self.bwd_mha_plans, self.bwd_gqa_plans) if arch in p]

    @staticmethod
    def _launch(fn, device: torch.device, args: list) -> None:
        if device.index == torch.cuda.current_device():
            fn(*args)  # launches on the current stream of the current device
        else:
            with torch.cuda.device(device):
                fn(*args)

    # -- call -----------------------------------------------------------------------------
    def __call__(self, q, k, v, *, softmax_scale=None, window=None, chunk_size=None, return_lse=False, out=None,
                 cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, seqused_k=None, max_seqlen_k=None):
        if self._compiled is not None and torch.compiler.is_compiling():  # one opaque operator (api/library.py)
            return self._compiled(self, q, k, v, softmax_scale=softmax_scale, window=window, chunk_size=chunk_size,
                                  return_lse=return_lse, out=out, cu_seqlens_q=cu_seqlens_q,
                                  cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, seqused_k=seqused_k,
                                  max_seqlen_k=max_seqlen_k)
        key = None
        if self._pinned is None:
            batched = (cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None
                       and seqused_k is None and max_seqlen_k is None)
            # packed sequences whose values the caller vouches for share the cache, the sequence arguments keyed
            seq_key = None if batched else packed_key(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_k, max_seqlen_k)
            if batched or seq_key is not None:
                key = call_key(q, k, v, softmax_scale, window, chunk_size, return_lse, out)
                if key is not None and seq_key is not None:
                    key += seq_key
            grad = key is not None and needs_grad(q, k, v)
            found = (self._grad_calls if grad else self._calls).get(key) if key is not None else None
            if found is not None:
                # what Packed.check makes of contiguous sequence tensors, left unresolved (packed_key: unchecked)
                packed = None if batched else Packed(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k)
                if grad:  # a checked training signature (out= is refused with autograd: never here); found: its scale
                    out, lse = AttentionFunction.apply(self, q, k, v, found, window, chunk_size, packed)
                    return (out, lse) if return_lse else out
                res = self._replay(found, q, k, v, out, packed)
                if res is not None:
                    return res if return_lse else res[0]
        plan, packed = self.validate(q, k, v, softmax_scale=softmax_scale, window=window, chunk_size=chunk_size,
                                     return_lse=return_lse, out=out, cu_seqlens_q=cu_seqlens_q,
                                     cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, seqused_k=seqused_k,
                                     max_seqlen_k=max_seqlen_k)
        # device checks come after every device-independent one, so errors name the real problem
        self._check_devices(q.device, (("q", q), ("k", k), ("v", v)) + ((("out", out),) if out is not None else ())
                            + (packed.tensors() if packed is not None else ()))
        scale = self._scale(softmax_scale, plan)
        if packed is not None:
            packed.resolve(q.shape[0], k.shape[0])
        if self.bwd_plans and needs_grad(q, k, v):
            out, lse = AttentionFunction.apply(self, q, k, v, scale, window, chunk_size, packed)
            if key is not None:  # (out= is refused with autograd: the result is never the caller's buffer)
                _remember(self._grad_calls, key, scale)
        else:
            out, lse, _ = self._forward(q, k, v, scale, window, chunk_size, out, packed, remember=key,
                                        lse_scratch=not return_lse)
        return (out, lse) if return_lse else out

    def _replay(self, hit: CachedCall, q, k, v, out=None, packed: "Packed | None" = None):
        """A call whose signature (call_key, with packed_key for packed sequences, whose arguments `packed`
        holds unchecked) passed every check before: allocate and launch, nothing else. None when a tensor's
        base address is not 16-byte aligned (the slow path copies an input and names a misaligned out)."""
        fn, args, out_shape, dtype, lse_shape, lse, spans = hit
        qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if qp % 16 or kp % 16 or vp % 16:
            return None
        if out is not None:
            # out's own checks depend on its address and autograd state too: overlap with an input, or
            # requiring grad, go to the full checks (which name the problem)
            op = out.data_ptr()
            q_len, k_len, v_len, o_len = spans
            if (op % 16 or out.requires_grad or overlaps(op, o_len, qp, q_len) or overlaps(op, o_len, kp, k_len)
                    or overlaps(op, o_len, vp, v_len)):
                return None
        device = q.device
        if out is None:
            # out_shape None: q's shape and dtype (empty_like skips torch.empty's argument parsing, ~1 us)
            out = (torch.empty_like(q, memory_format=torch.contiguous_format) if out_shape is None
                   else torch.empty(out_shape, dtype=dtype, device=device))
        if lse_shape is not None and lse is None:  # returned to the caller: its own
            lse = torch.empty(lse_shape, dtype=torch.float32, device=device)
        tensors = [q, k, v, out] if lse_shape is None else [q, k, v, out, lse]
        if packed is not None:  # one batch of extent 1 whose rows the sequence tensors cut up, as `_forward` does
            tensors = [t[None] for t in tensors] + [packed.cu_q, packed.cu_k, packed.seqused_or_dummy()]
        self._launch(fn, device, tensors + args)
        return out, lse

    def _device_buffer(self, table: dict, retired: list, n: int, device: torch.device, make) -> torch.Tensor:
        """This device's buffer in `table` with at least n elements: a smaller one is replaced by make(size),
        size at least twice its, and kept in `retired` (a kernel may still use it on some stream)."""
        buf = table.get(device.index)
        if buf is None or buf.numel() < n:
            with self._lock:
                buf = table.get(device.index)
                if buf is None or buf.numel() < n:
                    if buf is not None:
                        retired.append(buf)
                    size = max(n, 2 * buf.numel()) if buf is not None else n
                    buf = table[device.index] = make(size)
        return buf

    def _scratch_lse(self, shape: tuple, device: torch.device) -> torch.Tensor:
        """A view of this device's scratch LSE (see __init__) with `shape`, for a call that discards it."""
        n = math.prod(shape)

        def make(size):
            return torch.empty(size, dtype=torch.float32, device=device)

        return self._device_buffer(self._lse_scratch, self._lse_retired, n, device, make)[:n].view(shape)

    def _zero_dlse(self, shape: tuple, device: torch.device) -> torch.Tensor:
        """A view of this device's read-only zeros (see __init__) with `shape`: the dLSE of a backward
        without an LSE gradient. A new buffer is filled and the fill waited for before any stream may read
        it; while a CUDA graph is being captured (no waiting allowed) a growing call takes its own zeros."""
        key = (device.index, shape)
        view = self._dlse_views.get(key)
        if view is not None:
            return view
        n = math.prod(shape)
        buf = self._dlse_zeros.get(device.index)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing and (buf is None or buf.numel() < n):
            return torch.zeros(shape, dtype=torch.float32, device=device)

        def make(size):
            zeros = torch.zeros(size, dtype=torch.float32, device=device)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            return zeros

        view = self._device_buffer(self._dlse_zeros, self._dlse_retired, n, device, make)[:n].view(shape)
        if len(self._dlse_views) >= DLSE_VIEWS:  # packed calls bring a new total each batch
            self._dlse_views.clear()
        self._dlse_views[key] = view
        return view

    def _forward(self, q, k, v, scale: float, window, chunk_size, out, packed: Packed | None = None, remember=None,
                 lse_scratch: bool = False):
        """Launch the forward on checked CUDA tensors — BSHD, or packed sequences when `packed` (checked
        and resolved) is given: (out, lse or None, the (q, k, v) launched on). `remember`: the call's
        call_key, under which a launch on the inputs as given is kept for `_replay`. `lse_scratch`: the
        caller discards the LSE, so the kernel writes it into the device's scratch buffer."""
        seq_dim = 0 if packed is not None else 1
        s_q, s_k, h = q.shape[seq_dim], k.shape[seq_dim], q.shape[-2]
        plan = self.forward_plan(self.arch_for(q.device), packed.max_seqlen_q if packed is not None else s_q, window,
                                 chunk_size)
        if out is None:
            out = torch.empty((*q.shape[:-1], plan["head_dim_v"]), dtype=getattr(torch, plan["torch_dtype"]),
                              device=q.device)
        lse_shape = (h, s_q) if packed is not None else (q.shape[0], h, s_q)
        if not plan["write_lse"]:
            lse = None
        elif lse_scratch:
            lse = self._scratch_lse(lse_shape, q.device)
        else:
            lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        # packed: the totals bound every sequence's lengths, so clamping windows / chunks to them keeps
        # each sequence's mask
        args = self._runtime_args(plan, scale, window, chunk_size, seqlens=(s_q, s_k))
        if plan["scheduler"] == "persistent":  # (never packed: no use_seqused after it)
            args.append(self.persistent_ctas(plan, q.device, s_q, q.shape[0] * h))
        if out.numel() == 0 or s_k == 0:
            out.zero_()
            if lse is not None:
                lse.fill_(-math.inf)
            return out, lse, (q, k, v)
        given = (q, k, v)
        q, k, v = tma_ready(q), tma_ready(k), tma_ready(v)
        tensors = [q, k, v, out] + ([lse] if lse is not None else [])
        if packed is not None:
            # the kernels see one batch of extent 1 whose rows the sequence tensors cut up
            tensors = [t[None] for t in tensors] + [packed.cu_q, packed.cu_k, packed.seqused_or_dummy()]
            args.append(int(packed.seqused_k is not None))
        fn = self.function(plan)
        self._launch(fn, q.device, tensors + args)
        # none copied (packed: remember is only given for contiguous sequence tensors, which Packed keeps as they are)
        if remember is not None and all(a is b for a, b in zip((q, k, v), given)):
            out_shape = None if out.shape == q.shape and out.dtype == q.dtype else tuple(out.shape)  # like q
            _remember(self._calls, remember, CachedCall(
                fn, args, out_shape, out.dtype, None if lse is None else lse_shape, lse if lse_scratch else None,
                (extent(q), extent(k), extent(v), extent(out))))
        return out, lse, (q, k, v)

    def validate(self, q, k, v, *, softmax_scale=None, window=None, chunk_size=None, return_lse=False, out=None,
                 cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, seqused_k=None, max_seqlen_k=None):
        """Every check that needs no GPU, in argument order; returns (a plan of this package, the
        checked varlen arguments or None)."""
        plan = self.first_plan()
        dtype = getattr(torch, plan["torch_dtype"])
        packed_spec = bool(plan.get("varlen", False))
        check_tensor("q", q, dtype=dtype, last_dim=plan["head_dim"], packed=packed_spec)
        check_tensor("k", k, dtype=dtype, last_dim=plan["head_dim"], packed=packed_spec)
        check_tensor("v", v, dtype=dtype, last_dim=plan["head_dim_v"], packed=packed_spec)
        grad = needs_grad(q, k, v)
        if grad:
            self.check_grad_allowed(q, k, v)
        self.check_shapes(q, k, v, plan)
        seqlens = (q.shape[0], k.shape[0]) if packed_spec else (q.shape[1], k.shape[1])
        out_shape = (*q.shape[:-1], plan["head_dim_v"])
        self._scale(softmax_scale, plan)
        self._runtime_args(plan, 1.0, window, chunk_size, seqlens=seqlens)
        self._check_return_lse(return_lse, plan)
        if out is not None:
            if grad:
                refuse_out_with_grad()
            self._check_out(out, out_shape, dtype, (("q", q), ("k", k), ("v", v)))
        packed = Packed.check(self.name, packed_spec, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_k, max_seqlen_k)
        return plan, packed

    def first_plan(self) -> dict:
        """A plan of this package (they agree on everything a call's checks read)."""
        plan = next(iter(self.plans.values()), None)
        if plan is None:
            _fail(f"{self.name}: this package has no kernels ({self.unavailable})", RuntimeError)
        return plan

    def writes_lse(self) -> bool:
        """Whether the forward kernels write an LSE (return_lse: true, or a backward that reads it)."""
        return bool(self.first_plan()["write_lse"])

    def check_grad_allowed(self, q, k, v) -> None:
        """For a call that records autograd: refused when the package has no backward kernels."""
        if not self.bwd_plans:
            name = next(n for n, t in (("q", q), ("k", k), ("v", v)) if t.requires_grad)
            _fail(
                f"{self.name}: {name} requires grad but this spec has no backward (backward: false); "
                "run under torch.no_grad() or build a spec with backward: true",
                RuntimeError,
            )

    def _check_return_lse(self, return_lse, plan) -> None:
        if not isinstance(return_lse, bool):
            _fail(f"return_lse: expected True or False, got {return_lse!r}", TypeError)
        if return_lse and not plan["write_lse"]:
            _fail(f"return_lse: spec {self.name} was built without return_lse; set return_lse: true in the spec")

    def check_call_types(self, *, softmax_scale, window, chunk_size, return_lse) -> None:
        """The traced path's checks of the non-tensor arguments (fa4gen/api/library.py): their types, which
        the operator's schema needs, and return_lse, which picks the result. Their values are checked by the
        operator's fake implementation (`validate`, on the traced call's example values); under dynamic
        shapes a number may be symbolic, so these messages name types, not values (the exception classes are
        the eager checks')."""
        if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))):
            _fail(f"softmax_scale: expected a positive float, got {type(softmax_scale).__name__}", TypeError)
        if window is not None and not (isinstance(window, (tuple, list)) and len(window) == 2 and all(
                isinstance(w, int) and not isinstance(w, bool) for w in window)):
            got = (tuple(type(w).__name__ for w in window) if isinstance(window, (tuple, list))
                   else type(window).__name__)
            _fail(f"window: expected (left, right) ints >= 0, or -1 for unbounded, got {got}")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)):
            _fail(f"chunk_size: expected an int in [1, 2**31), got {type(chunk_size).__name__}")
        self._check_return_lse(return_lse, self.first_plan())

    def check_out_like(self, out, result) -> None:
        """out= of a traced call, which copies the result into it: a tensor of the result's shape and dtype."""
        if not isinstance(out, torch.Tensor):
            _fail(f"out: expected a torch.Tensor, got {type(out).__name__}", TypeError)
        if out.shape != result.shape or out.dtype != result.dtype:
            _fail(f"out: expected shape {tuple(result.shape)} and dtype {result.dtype}; got {tuple(out.shape)}, "
                  f"{out.dtype}")

    def packed_for_backward(self, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_k,
                            max_seqlen_k) -> "Packed | None":
        """The forward call's sequence arguments, checked and resolved again for a backward run from them
        (the traced path's operator, which cannot carry a Packed across)."""
        packed = Packed.check(self.name, bool(self.first_plan().get("varlen", False)), cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, seqused_k, max_seqlen_k)
        if packed is not None:
            packed.resolve(q.shape[0], k.shape[0])
        return packed

    # -- backward -------------------------------------------------------------------------
    def backward(self, q, k, v, out, dout, lse, dlse=None, *, softmax_scale=None, window=None, chunk_size=None,
                 packed: Packed | None = None):
        """(dq, dk, dv) of this package's attention, given dout and dlse, the gradients of out and of
        the LSE (None = zero). q, k, v, out, lse are the forward's, which checked them (AttentionFunction
        saves them); only the gradients are checked here. softmax_scale, window, chunk_size and, for
        varlen specs, the packed sequence arguments must be the forward call's."""
        self._check_devices(q.device, (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)))
        if packed is not None:
            (total_q, h, _), (s_k, h_kv) = q.shape, k.shape[:2]
            lse_shape, seqlens = (h, total_q), (total_q, s_k)
        else:
            (b, s_q, h, _), (s_k, h_kv) = q.shape, k.shape[1:3]
            lse_shape, seqlens = (b, h, s_q), (s_q, s_k)
        arch = self.arch_for(q.device)
        plan = self.backward_plan(arch, h, h_kv, *((0, 0) if packed is not None else (b, s_k)))
        if plan is None:
            _fail(
                f"{self.name}: no backward kernel for {arch} (this package has backward kernels for "
                f"{sorted(self.bwd_plans) or 'no arch'}); run the training step on a GPU of those archs",
                RuntimeError,
            )
        if packed is not None and (-(-s_k // plan["tile_n"]) + packed.batch) * h >= 2**31:
            # the packed main kernel numbers (key tile, head) in one int32 blockIdx.x
            _fail(f"k: a packed backward launches one CTA per (key tile of {plan['tile_n']} rows, head): "
                  f"{s_k} key rows in {packed.batch} sequences over {h} heads exceed 2**31 - 1 of them")
        dout = self._check_grad("dout", dout, tuple(out.shape), out.dtype, q.device)
        dlse = self._check_grad("dlse", dlse, lse_shape, torch.float32, q.device)
        scale = self._scale(softmax_scale, plan)
        args = self._backward_args(plan, scale, window, chunk_size, seqlens=seqlens)
        if (dout is None and dlse is None) or q.numel() == 0 or k.numel() == 0:
            # nothing flows back (or no query sees a key): zero gradients without a launch
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is None:  # a packed launch takes the batch-1 shape: made so once, not viewed per call
            dlse = self._zero_dlse((1, *lse_shape) if packed is not None else lse_shape, q.device)
        elif packed is not None:
            dlse = dlse[None]
        contiguous = dict(memory_format=torch.contiguous_format)
        # keys past seqused_k get a zero gradient: with MHA the kernel stores only the used rows. With
        # unchecked sequence values (max_seqlen_q given) rows may lie after the last sequence (e.g. the
        # padding of static shapes; the backward's kernels read the sequence values monotone from 0, see
        # `Packed.backward_tensors`, so no row lies before or between them): their gradient is zero, not
        # whatever the allocator held, and the postprocess's spare tiles write those zeros (a fill of the
        # three gradients took 62 us of a 660 us d128 backward on the H200)
        unused_keys = packed is not None and packed.seqused_k is not None and not plan["dkv_accum"]
        new = torch.zeros_like if unused_keys else torch.empty_like
        dq = torch.empty_like(q, **contiguous)
        dk, dv = (new(t, **contiguous) for t in (k, v))
        grads = dq, dk, dv  # returned as allocated (the packed launch takes batch-1 views of them)
        if packed is not None:
            # one batch of extent 1 whose rows the sequence tensors cut up
            q, k, v, out, dout, lse, dq, dk, dv = (t[None] for t in (q, k, v, out, dout, lse, dq, dk, dv))
            b, s_q = 1, total_q
        f32, i32 = dict(dtype=torch.float32, device=q.device), dict(dtype=torch.int32, device=q.device)
        # query tiles per (batch, head); varlen: per head, the tiles of every sequence numbered back to
        # back (at most ceil(total / tile) + sequences)
        q_tiles = -(-s_q // plan["tile_m"]) + (packed.batch if packed is not None else 0)
        check_dq_accumulator(q_tiles * plan["tile_m"], q.shape[-1])
        stats_shape = (b, h, q_tiles * plan["tile_m"])  # padded to whole tiles (the preprocess fills the padding)
        tensors = [q, k, v, out, dout, lse, dlse, dq, dk, dv,
                   torch.empty(stats_shape, **f32),  # lse_log2
                   torch.empty(stats_shape, **f32),  # dpsum
                   # dq_accum: every query tile as flat chunks in the kernel's fragment order (zeroed by
                   # the preprocess, or each chunk's first value stored by the main kernel; the postprocess
                   # puts the values in place)
                   torch.empty((b, h, q_tiles * plan["tile_m"] * q.shape[-1]), **f32)]
        if plan["dkv_accum"]:
            tensors += [torch.zeros(k.shape, **f32), torch.zeros(v.shape, **f32)]
        # the claim flags / turn counters: one per query tile, zeroed by the backward's preprocess kernel
        if plan.get("dq_claim", False):  # (lock files written before session 22 lack the field)
            # claim_dq: a flag per query tile (and, with dq_post_overlap, the pair's count of landed key blocks)
            tensors.append(torch.empty((b, h, q_tiles + int(plan.get("dq_post_overlap", False))), **i32))
        if plan["deterministic"]:
            k_tiles = -(-s_k // plan["tile_n"]) + (packed.batch if packed is not None else 0)
            tensors.append(torch.empty((b, h, q_tiles), **i32))  # sem_dq
            if plan["dkv_accum"]:
                tensors.append(torch.zeros((b, h_kv, k_tiles), **i32))  # sem_dkv
        if packed is not None:
            tensors += list(packed.backward_tensors())
            args.append(int(packed.seqused_k is not None))
        if plan["scheduler"] == "persistent":  # its CTA count last (never packed)
            args.append(self.persistent_ctas(plan, q.device))
        self._launch(self.function(plan), q.device, tensors + args)
        return grads

    @staticmethod
    def _check_grad(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device):
        """A gradient flowing into the backward: None, or a tensor like its output (made contiguous)."""
        if t is None:
            return None
        if not isinstance(t, torch.Tensor):
            _fail(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}", TypeError)
        if tuple(t.shape) != shape:
            _fail(f"{name}: expected shape {shape} (the forward's output), got {tuple(t.shape)}")
        if t.dtype != dtype:
            _fail(f"{name}: expected dtype {dtype} (the forward's output), got {t.dtype}", TypeError)
        if t.device != device:
            _fail(f"{name}: expected the device of q ({device}), got {t.device}")
        if not t.is_contiguous():  # e.g. the stride-0 gradient of out.sum()
            t = t.contiguous()
        return tma_ready(t) if t.dim() >= 3 else t

    @classmethod
    def _backward_args(cls, plan, scale: float, window, chunk_size, seqlens) -> list:
        """The backward's run-time arguments: the forward's, with grad_scale (the softmax scale)
        after the softcap ones."""
        args = cls._runtime_args(plan, scale, window, chunk_size, seqlens=seqlens)
        args.insert(2 if plan["softcap"] > 0 else 1, scale)
        return args

    # -- checks ---------------------------------------------------------------------------
    @staticmethod
    def _check_devices(device: torch.device, named) -> None:
        for name, t in named:
            if t.device.type != "cuda":
                _fail(f"{name}: expected a CUDA tensor, got device {t.device}")
            if t.device != device:
                _fail(f"{name}: expected the device of q ({device}), got {t.device}")

    def check_shapes(self, q, k, v, plan) -> None:
        """q, k, v agree with each other and the plan (packed for a varlen plan); device-independent."""
        if plan.get("varlen", False):
            self._check_packed_shapes(q, k, v, plan)
        else:
            self._check_shapes(q, k, v, plan)

    def _check_shapes(self, q, k, v, plan) -> None:
        if not (q.shape[0] == k.shape[0] == v.shape[0]):
            _fail(f"k, v: expected batch {q.shape[0]} like q, got {k.shape[0]} and {v.shape[0]}")
        if k.shape[1] != v.shape[1]:
            _fail(f"v: expected seqlen_k {k.shape[1]} like k, got {v.shape[1]}")
        for name, t in (("q", q), ("k", k)):
            if t.shape[1] >= 2**31:  # the kernels take sequence lengths as int32
                _fail(f"{name}: seqlen must be < 2**31, got {t.shape[1]}")
        self._check_heads(q.shape[2], k.shape[2], v.shape[2], plan)
        if q.shape[0] > GRID_LIMIT:
            _fail(f"q: batch must be <= {GRID_LIMIT}, got {q.shape[0]}")

    def _check_packed_shapes(self, q, k, v, plan) -> None:
        if k.shape[0] != v.shape[0]:
            _fail(f"v: expected total_k {k.shape[0]} rows like k, got {v.shape[0]}")
        self._check_heads(q.shape[1], k.shape[1], v.shape[1], plan)
        for name, t in (("q", q), ("k", k)):
            if t.shape[0] > 2**30:
                # the kernels address a sequence's rows in a bounded mode of 2^30 (device/varlen.SPAN)
                _fail(f"{name}: at most 2**30 packed rows, got {t.shape[0]}")

    def _check_heads(self, h: int, h_kv: int, h_v: int, plan) -> None:
        if h_kv != h_v:
            _fail(f"v: expected {h_kv} kv heads like k, got {h_v}")
        if h_kv == 0 or h % h_kv:
            _fail(f"k: kv heads ({h_kv}) must divide q heads ({h})")
        if h != h_kv and not plan["allow_gqa"]:
            _fail(f"k: spec {self.name} has allow_gqa: false, so k/v need {h} heads like q, got {h_kv}")
        if h > GRID_LIMIT:
            _fail(f"q: heads must be <= {GRID_LIMIT}, got {h}")

    @staticmethod
    def _check_out(out, shape, dtype, inputs=()) -> None:
        if not isinstance(out, torch.Tensor):
            _fail(f"out: expected a torch.Tensor, got {type(out).__name__}", TypeError)
        if tuple(out.shape) != shape or out.dtype != dtype:
            _fail(f"out: expected shape {shape} and dtype {dtype}; got {tuple(out.shape)}, {out.dtype}")
        if out.stride(-1) != 1 or out.data_ptr() % 16 or any(st % 8 for st in out.stride()[:-1]):
            _fail(f"out: expected a 16-byte aligned tensor with contiguous last dim, got strides {tuple(out.stride())}")
        if self_overlapping(out):
            # an expanded tensor, or strides that step back into earlier rows: tiles would store into the
            # same bytes
            _fail(f"out: expected a tensor whose elements do not share memory, got strides {tuple(out.stride())}")
        if out.requires_grad:
            refuse_out_requiring_grad()
        span = (out.data_ptr(), extent(out))
        for name, t in inputs:
            if overlaps(*span, t.data_ptr(), extent(t)):
                # tiles store O while others still load these inputs
                _fail(f"out: overlaps {name} in memory; pass a separate output tensor")

    @staticmethod
    def _scale(softmax_scale, plan) -> float:
        if softmax_scale is None:
            return 1.0 / math.sqrt(plan["head_dim"])
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            _fail(f"softmax_scale: expected a positive float, got {softmax_scale!r}", TypeError)
        try:
            scale = float(softmax_scale)
        except OverflowError:  # an int beyond float's range
            scale = math.inf
        # the kernels take scale * log2(e) (and scale / softcap) as fp32: beyond its range they would
        # compute with inf
        if not (math.isfinite(scale) and 0 < scale * LOG2_E <= FP32_MAX
                and (plan["softcap"] <= 0 or scale / plan["softcap"] <= FP32_MAX)):
            shown = repr(softmax_scale) if len(repr(softmax_scale)) <= 24 else f"{repr(softmax_scale)[:12]}... ({len(repr(softmax_scale))} digits)"
            _fail(f"softmax_scale: expected a positive float whose product with log2(e) fits fp32 (<= {FP32_MAX:.4g}), "
                  f"got {shown}")
        return scale

    @staticmethod
    def _runtime_args(plan, scale, window, chunk_size, seqlens=None) -> list:
        softcap = plan["softcap"]
        args: list = [softcap * LOG2_E if softcap > 0 else scale * LOG2_E]
        if softcap > 0:
            args.append(scale / softcap)
        if plan["local"]:
            left, right = (plan["window_left"], plan["window_right"]) if window is None else _window(window)
            if seqlens is not None:
                if seqlens[0] + seqlens[1] >= 2**31:
                    # key-space positions span [-seqlen_q, seqlen_k) and the kernels add window sides to
                    # them in Int32: past this a row's bound wraps and the row silently sees no key
                    _fail(f"k: a sliding window needs seqlen_q + seqlen_k < 2**31, got {seqlens[0]} + {seqlens[1]}")
                left, right = clamp_window(left, right, *seqlens)
            args += [left, right]
        elif window is not None:
            _fail(f"window: this spec's mask is {plan['mask_kind']!r}; window applies to sliding_window specs only")
        if plan["chunked"]:
            chunk = _chunk(plan, chunk_size)
            if seqlens is not None:
                # positions never reach seqlen_k, so a chunk at least that long is the same mask; clamped, the
                # kernels' chunk arithmetic (next chunk start = key + chunk) stays inside Int32
                chunk = min(chunk, max(seqlens[1], 1))
            args.append(chunk)
        elif chunk_size is not None:
            _fail(f"chunk_size: this spec's mask is {plan['mask_kind']!r}; chunk_size applies to chunked specs only")
        return args


def refuse_out_with_grad() -> None:
    _fail("out: out= does not support autograd (q, k or v requires grad), as for torch functions; "
          "drop out= or run under torch.no_grad()", RuntimeError)


def refuse_out_requiring_grad() -> None:
    _fail("out: must not require grad (the kernel writes it in place, behind autograd's back)", RuntimeError)


def spread_ctas(sms: int, seqlen_q: int, tile_m: int, pairs: int) -> int:
    """The CTA count of a persistent forward without a mask whose idle warpgroups skip a sequence's last, partial
    tile: CTA c runs tiles c, c + n, c + 2n, ... of the (head, batch) pairs' tiles in order (num_m per pair), so it
    meets query tile (c + k n) mod num_m in its k-th iteration. With n a multiple of num_m (132 SMs and seqlen 512 /
    1024 / 2048 in 192-row tiles: 3, 6, 11 tiles) a CTA meets the same query tile every time, and the CTAs that hold
    the cheap last tiles idle while the rest run only full ones. The largest n <= sms coprime to num_m walks every
    CTA through all num_m positions, so each holds its share of the cheap tiles (tools/sim_schedules.py idle). `sms`
    as it is when the last tile is full (nothing to spread), or when one wave holds every tile."""
    num_m = -(-seqlen_q // tile_m)
    if seqlen_q % tile_m == 0 or tile_m - seqlen_q % tile_m < 64 or num_m * pairs <= sms:
        return sms
    n = sms
    while n > 1 and math.gcd(n, num_m) != 1:
        n -= 1
    return n


def clamp_window(left: int, right: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """A window side wider than both sequences sees the same keys as one of exactly that width; the
    kernel adds window sides to positions in Int32, so they are clamped there before the launch."""
    widest = max(seqlen_q, seqlen_k)
    return tuple(w if w < 0 else min(w, widest) for w in (left, right))


def _chunk(plan: dict, chunk_size) -> int:
    """The call's chunk size (the spec's when None), checked."""
    chunk = plan["chunk_size"] if chunk_size is None else chunk_size
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk < 2**31:
        _fail(f"chunk_size: expected an int in [1, 2**31), got {chunk!r}")
    return chunk


def _window(window) -> tuple[int, int]:
    ok = isinstance(window, (tuple, list)) and len(window) == 2
    ok = ok and all(isinstance(w, int) and not isinstance(w, bool) and -1 <= w < 2**31 for w in window)
    if not ok:
        _fail(f"window: expected (left, right) ints >= 0, or -1 for unbounded, got {window!r}")
    if window[0] == -1 and window[1] == -1:
        _fail("window: at least one side must be bounded; (-1, -1) is no mask at all")
    return int(window[0]), int(window[1])


class AttentionFunction(torch.autograd.Function):
    """(out, lse) = attention(q, k, v) whose backward runs the package's backward kernels. The
    forward keeps q, k, v (as launched), out and the LSE, and the call's scale, window and chunk
    size, so the backward sees exactly what the forward computed."""

    @staticmethod
    def forward(ctx, op: ForwardOp, q, k, v, scale: float, window, chunk_size, packed: Packed | None):
        out, lse, launched = op._forward(q, k, v, scale, window, chunk_size, None, packed)
        # the varlen tensors too: saved, an in-place change before the backward (a refilled static
        # buffer) raises autograd's error instead of running the backward on other sequence boundaries
        ctx.save_for_backward(*launched, out, lse, *(t for _, t in (packed.tensors() if packed is not None else ())))
        ctx.op, ctx.scale, ctx.window, ctx.chunk_size, ctx.packed = op, scale, window, chunk_size, packed
        ctx.set_materialize_grads(False)  # an unused out or LSE gives None, not a zero tensor
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:
            return (None,) * 8
        with torch.no_grad():
            q, k, v, out, lse = ctx.saved_tensors[:5]  # (the rest: the varlen tensors, version-checked here)
            dq, dk, dv = ctx.op.backward(q, k, v, out, dout, lse, dlse, softmax_scale=ctx.scale, window=ctx.window,
                                         chunk_size=ctx.chunk_size, packed=ctx.packed)
        need = ctx.needs_input_grad
        grads = (dq if need[1] else None, dk if need[2] else None, dv if need[3] else None)
        if torch.is_grad_enabled():  # create_graph=True: the kernels' gradients are not differentiable
            grads = _not_differentiable(grads)
        return (None, *grads, None, None, None, None)


def _not_differentiable(grads: tuple) -> tuple:
    """The gradients, as tensors whose own backward raises. torch's once_differentiable does that only
    when the incoming gradients require grad, so with a loss linear in out (out.sum(), a frozen head) a
    create_graph=True gradient came back as a constant and a gradient penalty's term was silently lost."""
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    err = torch._C._functions.DelayedError(
        b"fa4gen attention: its backward is not differentiable (double backward, create_graph=True "
        b"gradient penalties); compute first-order gradients only", len(present))
    wrapped = iter(err(*[g.detach().requires_grad_() for g in present]))
    return tuple(next(wrapped) if g is not None else None for g in grads)


def precompile_ops(targets: list[tuple["ForwardOp", str]], *, jobs: int = 0,
                   directions: tuple[str, ...] = ("fwd", "bwd")) -> dict[str, dict[str, str]]:
    """Compile (or find in the disk cache) every kernel of several packages, each for its arch, in one pool of
    `jobs` compile processes (0: one per CPU as memory allows), so packages compile side by side and not one
    after another; the kernels of the current GPU's arch are then loaded. {package: {module: status}}.
    `directions`: only kernels of these (the GPU test suites' ahead-of-time compile of what they call)."""
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 0:
        _fail(f"precompile: jobs: expected 0 (one per CPU) or a positive count, got {jobs!r}")
    from fa4gen.builder import CompileJob, compile_jobs

    # the current GPU's arch, if any (an explicit arch compiles on any machine)
    here = CAPABILITY_TO_ARCH.get(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
    work = [(op, plan) for op, arch in targets for plan in op.kernel_plans(arch) if plan["direction"] in directions]
    reports = compile_jobs([CompileJob(op.dir, op.package, plan, op.name) for op, plan in work],
                           keep_sass=False, workers=jobs, log=log.info)
    failed = [f"{op.name}.{r.module}: {r.detail}" for (op, _), r in zip(work, reports) if r.status == "failed"]
    if failed:
        names = sorted({op.name for op, _ in targets})
        raise RuntimeError(f"{', '.join(names)}: precompile: {len(failed)} kernel(s) failed to compile: "
                           + "; ".join(failed))
    result: dict[str, dict[str, str]] = {op.name: {} for op, _ in targets}
    for (op, plan), r in zip(work, reports):
        if plan["arch"] == here:
            op.function(plan)  # from the disk cache (ms each)
        result[op.name][r.module] = r.status
    return result

"""Golden tests: the checks `fa4gen test` runs on one kernel of a generated variant.

  compile + SASS          (any machine) the kernel compiles for its arch through the cache; its
                          SASS has the arch's MMA (HGMMA / UTC*MMA) and TMA loads, and no spills;
                          a backward kernel ("bwd compile + SASS") also its bulk reduce-add
                          (UBLKRED: the dQ chunks are summed in global memory by the bulk copy
                          engine, or REDG with the plan's dq_atomic: from registers; dK/dV with
                          GQA by TMA reduce-add, UTMAREDG)
  emulator vs reference   (CPU) the plan's algorithm, emulated, is within the error budget
  kernel vs reference     (Hopper GPU) numerics of the real kernel, output poisoned before the call
  kernel vs emulator      (Hopper GPU) the same, against the emulator, per element in ulps

A backward kernel's numeric checks (Hopper GPU) are in fa4gen.golden.backward; its rows carry the
direction in front of the check's name ("bwd compile + SASS", "bwd grads vs reference").

Every numeric check runs the same cases: CASE_SHAPES (tile multiples and not, seqlen_q < and >
seqlen_k, seqlen 1, MHA/GQA/MQA) with the spec's own window/chunk and, for windowed or chunked
specs, a small run-time one that masks whole rows and tiles. A varlen variant runs each case as a
packed batch of mixed-length sequences (fa4gen.golden.packed).
"""

from __future__ import annotations

import contextlib

import math
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fa4gen.emulate import EMULATED_ARCHS, Algorithm
from fa4gen.golden import packed, tolerance
from fa4gen.golden.variants import Variant
from fa4gen.reference import mask_semantics

CASE_SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, kv_heads)
    (2, 128, 128, 4, 4),
    (2, 113, 203, 4, 2),
    (1, 300, 257, 6, 1),
    (3, 1, 1, 2, 2),
    (1, 250, 100, 2, 2),
    (1, 64, 700, 4, 4),
    (1, 1000, 1000, 2, 1),
]
RUNTIME_WINDOW = (37, 5)
RUNTIME_CHUNK = 64
MMA_OPCODE = {"sm90": "hgmma", "sm100": "utchmma"}
BULK_REDUCE_OPCODE = "ublkred"  # cp.reduce.async.bulk: the backward's dQ sums
VECTOR_REDUCE_OPCODE = "redg"  # red.global.add.v4.f32: the same sums from registers (plan dq_atomic)
TORCH_DTYPES = packed.TORCH_DTYPES


@dataclass(frozen=True)
class CheckResult:
    variant: str
    arch: str
    check: str
    status: str  # "pass" | "FAIL" | "skip"
    detail: str
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


@dataclass(frozen=True)
class Case:
    shape: tuple[int, int, int, int, int]
    window: tuple[int, int] | None
    chunk_size: int | None

    def label(self) -> str:
        extra = f" window={self.window}" if self.window else f" chunk_size={self.chunk_size}" if self.chunk_size else ""
        return f"shape={self.shape}{extra}"

    def kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if self.window is not None:
            kw["window"] = self.window
        if self.chunk_size is not None:
            kw["chunk_size"] = self.chunk_size
        return kw


def check_name(plan: dict, check: str) -> str:
    """A check's name in the table: as is for a forward kernel, after the direction otherwise, after
    the dispatch rule for a kernel that runs only from some seqlen_q on (KernelPlan.min_seqlen_q; with
    KernelPlan.min_window_keys, only for windows or chunks that wide), only for
    some seqlen_q ranges (KernelPlan.seqlen_q_ranges), only for MHA calls ("mha": KernelPlan.mha_only) or for GQA
    calls with enough CTAs ("gqa>=N CTAs": KernelPlan.gqa_head_loop, min_kv_ctas)."""
    words = [] if plan["direction"] == "fwd" else [plan["direction"]]
    if plan.get("mha_only"):
        words.append("mha")
    if plan.get("gqa_head_loop"):
        words.append(f"gqa>={plan['min_kv_ctas']}CTAs")
    if plan.get("min_seqlen_q"):
        words.append(f"seqlen_q>={plan['min_seqlen_q']}")
    if plan.get("min_window_keys"):
        words.append(f"{'chunk' if plan.get('chunked') else 'window'}>={plan['min_window_keys']}keys")
    if plan.get("seqlen_q_ranges"):
        words.append("seqlen_q in " + ",".join(f"{a}-{b}" for a, b in plan["seqlen_q_ranges"]))
    return " ".join([*words, check])


def cases(plan: dict, shapes=CASE_SHAPES) -> Iterator[Case]:
    for b, s_q, s_k, h, h_kv in shapes:
        shape = (b, s_q, s_k, h, h_kv if plan["allow_gqa"] else h)
        yield Case(shape, None, None)
        if plan["local"]:
            yield Case(shape, RUNTIME_WINDOW, None)
        if plan["chunked"]:
            yield Case(shape, None, RUNTIME_CHUNK)


def make_inputs(plan: dict, case: Case, *, seed: int, device="cpu"):
    """(q, k, v) of a case (packed for a varlen plan: use packed.case_inputs to get its sequences)."""
    return packed.case_inputs(plan, case.shape, seed=seed, device=device)[:3]


def case_seed(variant: Variant, case: Case) -> int:
    return zlib.crc32(f"{variant.name}/{case.label()}".encode())


class Worst:
    """Keeps the worst Comparison of a series of cases, and the case it came from."""

    def __init__(self, name: str):
        self.name, self.worst, self.detail, self.failed = name, -1.0, "", []

    def add(self, cmp: tolerance.Comparison, case: Case) -> None:
        if not cmp.ok:
            self.failed.append(f"{case.label()}: {cmp.detail}")
        if cmp.worst > self.worst:
            self.worst, self.detail = cmp.worst, f"{cmp.detail} at {case.label()}"

    def result(self, variant: Variant, arch: str, n: int, seconds: float) -> CheckResult:
        if self.failed:
            more = f" (+{len(self.failed) - 1} more)" if len(self.failed) > 1 else ""
            return CheckResult(variant.name, arch, self.name, "FAIL", self.failed[0] + more, seconds)
        return CheckResult(variant.name, arch, self.name, "pass", f"{n} cases; worst {self.detail}", seconds)


# --- CPU ----------------------------------------------------------------------------------------


def emulator_vs_reference(variant: Variant, plan: dict, *, shapes=CASE_SHAPES) -> CheckResult:
    """The plan's algorithm, emulated on the CPU, against the exact (fp64) reference."""
    start = time.perf_counter()
    if plan["arch"] not in EMULATED_ARCHS:
        return CheckResult(variant.name, plan["arch"], check_name(plan, "emulator vs reference"), "skip",
                           f"no emulator for {plan['arch']} yet")
    algo = Algorithm.from_plan(plan)
    worst = Worst(check_name(plan, "emulator vs reference"))
    n = 0
    for case in cases(plan, shapes):
        q, k, v, seq = packed.case_inputs(plan, case.shape, seed=case_seed(variant, case))
        emu, emu_lse = packed.emulate(q, k, v, algo, seq, **case.kwargs())
        sem = mask_semantics(plan, window=case.window, chunk_size=case.chunk_size)
        exact, exact_lse = packed.reference(q, k, v, seq, **sem)
        low, _ = packed.reference(q, k, v, seq, upcast=False, **sem)
        worst.add(tolerance.against_reference(emu, exact, low), case)
        worst.add(tolerance.lse_against_reference(emu_lse, exact_lse), case)
        n += 1
    return worst.result(variant, plan["arch"], n, time.perf_counter() - start)


def compile_and_sass(variant: Variant, plan: dict) -> CheckResult:
    """Compile (or load from the cache) one kernel and check its SASS; needs no GPU."""
    from fa4gen.compile.cache import DiskCache
    from fa4gen.compile.generated import compile_generated
    from fa4gen.compile.sass import find_nvdisasm

    arch, check = plan["arch"], check_name(plan, "compile + SASS")
    if find_nvdisasm() is None:
        return CheckResult(variant.name, arch, check, "FAIL",
                           "nvdisasm not found (pip install nvidia-cuda-nvdisasm); SASS cannot be checked")
    start = time.perf_counter()
    try:
        res = compile_generated(
            variant.path / f"{plan['module']}.py", f"{variant.import_name}.{plan['module']}", plan,
            cache=DiskCache(), keep_sass=True,
        )
    except Exception as err:  # noqa: BLE001 - one failing kernel is a table row, not a crash
        return CheckResult(variant.name, arch, check, "FAIL", f"{type(err).__name__}: {err}",
                           time.perf_counter() - start)
    sass = res.meta.get("sass") or {}
    mma = MMA_OPCODE.get(arch, "hgmma")
    dq_sum = VECTOR_REDUCE_OPCODE if plan.get("dq_atomic") else BULK_REDUCE_OPCODE
    required = [mma, "utmaldg"] + ([dq_sum] if plan["direction"] == "bwd" else [])
    counts = {op: _opcode_count(sass, op) for op in (*required, "ldl", "stl")}
    problems = [f"no {op.upper()}" for op in required if counts[op] <= 0]
    sass_text = getattr(res, "sass_text", None)
    if plan["direction"] == "bwd" and sass_text is not None:
        # the backward holds dK/dV accumulators next to S/dP: a few spills around its loops (state
        # kept across the masked / mask-free runs) are tolerated, none inside a loop that issues MMAs
        from fa4gen.compile.sass import spills_in_mma_loops

        per_block = (plan["head_dim"] + plan["head_dim_v"] + plan["tile_n"] + 2 * plan["tile_m"]) // 16
        in_loops = spills_in_mma_loops(sass_text, per_block, mma.upper())
        problems += [f"{in_loops} LDL/STL inside the MMA loops (spills)"] if in_loops else []
    else:
        problems += [f"{counts[op]} {op.upper()} (spills)" for op in ("ldl", "stl") if counts[op]]
    how = "cached" if res.cache_hit else f"compiled in {res.seconds:.1f}s"
    detail = (f"{how}; " + ", ".join(f"{op.upper()} {counts[op]}" for op in required)
              + f", LDL/STL {counts['ldl']}/{counts['stl']}, {res.meta.get('registers')} regs")
    return CheckResult(variant.name, arch, check, "FAIL" if problems else "pass",
                       "; ".join(problems) + f" ({detail})" if problems else detail, time.perf_counter() - start)


def _opcode_count(sass: dict, op: str) -> int:
    """A SASS summary's count of `op`: its own field, else the base-opcode histogram (UBLKRED)."""
    if op in sass:
        return sass[op]
    return (sass.get("opcodes") or {}).get(op.upper(), 0)


# --- GPU ----------------------------------------------------------------------------------------


def has_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def kernel_of(pkg, plan: dict):
    """A context in which the package's calls run `plan`'s kernel whatever their seqlen_q or head counts (a
    package may hold several forwards of one arch, picked per call: KernelPlan.min_seqlen_q / seqlen_q_ranges, and up to
    three backwards: the MHA one for calls with as many K/V heads as query heads (KernelPlan.mha_only), the head-loop
    GQA one for GQA calls with enough CTAs (KernelPlan.gqa_head_loop))."""
    op = getattr(pkg, "_forward", None)
    return op.pinned(plan["module"]) if hasattr(op, "pinned") else contextlib.nullcontext()


def kernel_numerics(variant: Variant, plan: dict, *, shapes=CASE_SHAPES, device="cuda") -> list[CheckResult]:
    """The real kernel on a Hopper GPU against the exact reference (fp32 on the GPU) and against the
    emulator (CPU), output poisoned with NaN before every call. `device` is "cuda" except in tests of
    this check's logic, which pass a CPU stand-in for the package."""
    start = time.perf_counter()
    arch = plan["arch"]
    pkg = variant.load()
    algo = Algorithm.from_plan(plan)
    dtype = TORCH_DTYPES[plan["dtype"]]
    ref_w, emu_w, ev_w = (Worst(check_name(plan, c)) for c in ("kernel vs reference", "kernel vs emulator",
                                                                  "emulator vs reference"))
    n = 0
    for case in cases(plan, shapes):
        q, k, v, seq = packed.case_inputs(plan, case.shape, seed=case_seed(variant, case), device=device)
        out = torch.full((*q.shape[:-1], plan["head_dim_v"]), float("nan"), device=device, dtype=dtype)
        if device == "cuda":
            _poison_allocator(packed.lse_shape(q, seq))
        with kernel_of(pkg, plan):
            res = pkg.attention(q, k, v, out=out, return_lse=plan["write_lse"], **seq, **case.kwargs())
        lse = res[1] if plan["write_lse"] else None
        if device == "cuda":
            torch.cuda.synchronize()
        sem = mask_semantics(plan, window=case.window, chunk_size=case.chunk_size)
        exact, exact_lse = packed.reference(q, k, v, seq, **sem)
        low, _ = packed.reference(q, k, v, seq, upcast=False, **sem)
        emu, emu_lse = packed.emulate(q, k, v, algo, seq, **case.kwargs())
        ref_w.add(tolerance.against_reference(out, exact, low), case)
        emu_w.add(tolerance.against_emulator(out, emu, dtype, tolerance.reference_budget(exact, low)), case)
        ev_w.add(tolerance.against_reference(emu.to(exact.device), exact, low), case)
        if lse is not None:
            ref_w.add(tolerance.lse_against_reference(lse, exact_lse), case)
            emu_w.add(tolerance.lse_against_emulator(lse, emu_lse, approx=_approx(plan)), case)
        n += 1
    took = time.perf_counter() - start
    # one run serves all three rows: its time goes on the first
    return [w.result(variant, arch, n, took if i == 0 else 0.0) for i, w in enumerate((ref_w, emu_w, ev_w))]


def _approx(plan: dict) -> bool:
    """Whether the kernel evaluates something the emulator only models (tanh.approx, the polynomial)."""
    return plan["softcap"] > 0 or plan["poly_every"] > 0


def _poison_allocator(shape) -> None:
    """Leave a NaN-filled block in the caching allocator for the kernel's LSE buffer to reuse."""
    junk = torch.full(shape, math.nan, device="cuda", dtype=torch.float32)
    del junk


__all__ = [
    "CASE_SHAPES", "Case", "CheckResult", "Worst", "case_seed", "cases", "check_name", "compile_and_sass",
    "emulator_vs_reference", "has_hopper", "kernel_numerics", "kernel_of", "make_inputs",
]

"""Compile stage on the CPU: every committed generated kernel compiles for its arch, and its SASS has
the shape its plan says (HGMMA count, TMA, no spills, MUFU.EX2 traded for FFMA by poly-exp).

Everything is compiled once per module into a tmp cache (FA4GEN_CACHE_DIR), then compiled again
to check that the second compile is a cache hit.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from fa4gen.builder import CompileJob, compile_jobs, plan_spec
from fa4gen.spec import load_spec

pytestmark = pytest.mark.compile

pytest.importorskip("cutlass")
from fa4gen.compile.sass import find_nvdisasm  # noqa: E402

if find_nvdisasm() is None:
    pytest.skip("nvdisasm not installed (needed for the SASS summary)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
SPEC_FILES = sorted((ROOT / "specs").glob("*.yaml"))
NAMES = [p.stem for p in SPEC_FILES]
REG_FILE = 64 * 1024


def _compile_all(names):
    """Every spec's sm90 kernels, compiled together in as many processes as the machine allows (what
    `fa4gen build --compile` does; the sm100 kernels: tests/test_sm100_compile.py)."""
    specs = {name: load_spec(ROOT / "specs" / f"{name}.yaml") for name in names}
    plans = {name: plan_spec(spec, archs=["sm90"])[0] for name, spec in specs.items()}
    jobs = [CompileJob(ROOT / "generated" / name, f"generated.{name}", p, name) for name in names for p in plans[name]]
    reports = iter(compile_jobs(jobs, keep_sass=True, workers=0))
    # (spec, plans, reports, unused: the per-spec time the serial loop kept)
    return {name: (specs[name], plans[name], [next(reports) for _ in plans[name]], None) for name in names}


@pytest.fixture(scope="module")
def compiled(cache_root):
    start = time.perf_counter()
    result = _compile_all(NAMES)
    total = time.perf_counter() - start
    print(f"\ncompiled {sum(len(r[2]) for r in result.values())} kernels in {total:.1f} s")
    return result


@pytest.fixture(scope="module")
def recompiled(compiled, cache_root):
    return _compile_all(NAMES)


def _sass(report):
    return report.meta["sass"]


def test_every_spec_has_an_sm90_kernel(compiled):
    for name, (spec, plans, reports, _) in compiled.items():
        # a second forward for long calls (min_seqlen_q > 0): the 192-row one of a masked d64 spec (llama32_1b),
        # the one-CTA-per-tile twin of a persistent forward (vit_encoder, llama3_8b, ...)
        long = [("sm90", "fwd")] if any(p.min_seqlen_q for p in plans) else []
        # and d <= 64 without a mask (vit_encoder) a 128-row twin for the lengths that pad 192-row tiles worst
        long += [("sm90", "fwd")] * sum(bool(p.seqlen_q_ranges) for p in plans)
        # with allow_gqa a backward's MHA-call twin (bwd_sm90_mha) comes before it, and neither deterministic nor
        # varlen (head dims <= 128) the head-loop GQA backward (bwd_sm90_gqa) before both
        gqa = spec.backward and spec.allow_gqa
        loop = gqa and not (spec.deterministic or spec.varlen) and max(spec.head_dim, spec.head_dim_v) <= 128
        bwd = [("sm90", "bwd")] * (spec.backward + gqa + loop)
        assert [(p.arch, p.direction) for p in plans] == [("sm90", "fwd")] + long + bwd
        assert [p.module for p in plans if p.mha_only] == (["bwd_sm90_mha"] if spec.backward and spec.allow_gqa else [])
        assert bool(long) == (name == "llama32_1b" or plans[0].scheduler == "persistent")
        assert [r.arch for r in reports] == [p.arch for p in plans]


@pytest.mark.parametrize("name", NAMES)
def test_kernel_compiles_with_expected_sass(compiled, name):
    spec, plans, reports, _ = compiled[name]
    for plan, r in zip(plans, reports):
        assert r.status == "compiled", r.detail
        assert r.meta["arch"] == plan.cute_arch
        assert r.meta["cubin_arch"].startswith("sm_90")
        s = _sass(r)
        if plan.direction == "bwd":
            _check_backward_sass(name, plan, r, s)
            continue
        copies = _copies(name, plan)
        # S = Q·Kᵀ: head_dim/16 WGMMAs of N = tile_n; O += P·V: tile_n/16 WGMMAs of N = head_dim_v,
        # once per copy of each step in the generated text (the overlapped loop peels the first S
        # and the last P·V)
        assert s["hgmma"] == copies["qk"] * (plan.head_dim // 16) + copies["pv"] * (plan.tile_n // 16)
        assert s["ldl"] == 0 and s["stl"] == 0
        assert r.meta.get("spill_stores") in (0, None) and r.meta.get("spill_loads") in (0, None)
        assert s["utmaldg"] > 0 and s["utmastg"] > 0
        assert s["mufu_ex2"] > 0
        assert s["utchmma"] == 0  # no tcgen05 MMA in an sm90 kernel
        # a CTA of `threads` threads must fit the register file at launch
        assert r.meta["registers"] * plan.threads <= REG_FILE
        # one MUFU.EX2 per score a thread holds (2 rows x tile_n/4 cols), minus the polynomial ones
        poly_cols = sum(1 for c in range(plan.tile_n // 4) if plan.poly_every and c % plan.poly_every == plan.poly_every - 1)
        assert s["mufu_ex2"] >= copies["softmax"] * 2 * (plan.tile_n // 4 - poly_cols)


def _copies(name, plan) -> dict[str, int]:
    """How many times the generated kernel text issues each step (checked against the plan)."""
    text = (ROOT / "generated" / name / f"{plan.module}.py").read_text()
    copies = {
        "qk": text.count("cute.gemm(tiled_mma_qk"),
        "pv": text.count("cute.gemm(tiled_mma_pv"),
        "softmax": text.count("softmax.online_softmax_step("),
    }
    # Key blocks run in descending runs with and without mask code (mask.mask_phases): one run
    # without a mask, two for causal (masked near the diagonal, unmasked), three when a window or
    # chunk also has a left edge. The overlapped loop peels the first S and the last P·V on top;
    # the plain loop peels only the first (ragged) block of an unmasked spec.
    runs = {"none": 1, "causal": 2, "sliding_window": 3, "chunked": 3}[plan.mask_kind]
    if plan.intra_wg_overlap:
        expected = 1 + runs
    else:
        expected = runs if plan.has_mask else 2
    assert copies == {"qk": expected, "pv": expected, "softmax": expected}
    return copies


def _poly_exp2_per_tile(plan) -> int:
    every = plan.poly_every
    return 2 * sum(1 for c in range(plan.tile_n // 4) if c % every == every - 1)


def test_poly_exp_trades_mufu_for_ffma(compiled):
    _, (base_plan, *_), (base, *_), _ = compiled["llama3_8b"]  # its forward (it has a backward too)
    _, (poly_plan, *_), (poly, *_), _ = compiled["fa4_pipeline"]  # (and its long-call twin)
    assert (base_plan.head_dim, base_plan.tile_n, base_plan.mask_kind) == (
        poly_plan.head_dim, poly_plan.tile_n, poly_plan.mask_kind
    )
    assert base_plan.poly_every == 0 and poly_plan.poly_every > 0
    per_copy = _poly_exp2_per_tile(poly_plan)
    assert per_copy == 8  # every 7th of 32 columns (c = 6, 13, 20, 27) on 2 rows
    copies = _copies("fa4_pipeline", poly_plan)["softmax"]
    assert _copies("llama3_8b", base_plan)["softmax"] == copies
    # Static counts: each copy of the softmax step trades `per_copy` MUFU.EX2 for FMA-pipe code. The
    # compiler may tail-duplicate part of a masked step, so this is a lower bound, not an equality
    # (the exact difference was 8 with one copy, and 18 with the overlapped loop's two copies).
    saved = _sass(base)["mufu_ex2"] - _sass(poly)["mufu_ex2"]
    assert copies * per_copy <= saved < copies * per_copy + per_copy * 2
    assert _sass(poly)["ffma"] > _sass(base)["ffma"]


@pytest.mark.parametrize("name", NAMES)
def test_second_compile_is_a_cache_hit(compiled, recompiled, cache_root, name):
    _, plans, first, _ = compiled[name]
    _, _, second, _ = recompiled[name]
    assert [r.status for r in second] == ["cached"] * len(plans)
    for a, b in zip(first, second):
        assert _sass(a)["hgmma"] == _sass(b)["hgmma"] and _sass(a)["mufu_ex2"] == _sass(b)["mufu_ex2"]
        assert b.meta["registers"] == a.meta["registers"]
    # the entries live under the tmp cache, one per kernel
    assert len([p for p in cache_root.iterdir() if p.is_dir()]) == sum(len(v[1]) for v in compiled.values())


def _block_loops(sass: str, hgmma_per_block: int) -> list[tuple[int, int]]:
    """(instructions, MUFU.EX2) of every loop in the SASS whose body issues one key block's WGMMAs."""
    from fa4gen.compile.sass import mma_loops

    return [(len(body), sum("MUFU.EX2" in b for b in body)) for body in mma_loops(sass, hgmma_per_block)]


def test_every_block_loop_has_one_exp2_per_score(compiled, cache_root):
    """Every block loop, the masked ones included, evaluates each score's exp2 exactly once: a thread
    holds 2 rows x tile_n/4 scores, minus the polynomial ones, plus one exp2 per row for the rescale
    factor. A mask or rescale branch left in the loop made ptxas recompute most of them (docs/PERF.md:
    the causal diagonal loop held 106 MUFU.EX2 instead of 66 until the mask compared compile-time
    columns)."""
    from fa4gen.compile.cache import DiskCache

    entries = {e.meta.get("name"): e for e in DiskCache(cache_root).ls()}
    for name, (spec, plans, reports, _) in compiled.items():
        for plan in plans:
            if plan.direction == "bwd":
                # the backward's loop over query blocks: one exp2 per score (64 x tile_n over 256 threads)
                sass = entries[f"{name}.{plan.module}"].file("kernel.sass").read_text()
                per_block = (plan.head_dim + plan.head_dim_v + plan.tile_n + 2 * plan.tile_m) // 16
                loops = _block_loops(sass, per_block)
                assert loops and all(ex2 == plan.tile_m * plan.tile_n // 256 for _, ex2 in loops), (name, loops)
                continue
            sass = entries[f"{name}.{plan.module}"].file("kernel.sass").read_text()
            loops = _block_loops(sass, plan.head_dim // 16 + plan.tile_n // 16)
            assert loops, f"{name}: no key-block loop found in the SASS"
            cols = plan.tile_n // 4
            poly = sum(1 for c in range(cols) if plan.poly_every and c % plan.poly_every == plan.poly_every - 1)
            expected = 2 * (cols - poly) + 2
            assert all(ex2 == expected for _, ex2 in loops), f"{name}: (instructions, MUFU.EX2) per loop {loops}, expected {expected} MUFU.EX2"


def test_forward_wgmma_groups_are_not_serialized(compiled, cache_root):
    """Each WGMMA group of a forward's key-block loop waits once, after its last WGMMA: ptxas serializes the groups
    (a WARPGROUP.DEPBAR after every HGMMA, each carrying the scoreboard gsb0) when it cannot prove a group's
    accumulators untouched while it is in flight. A group issued under one branch and waited for under another did
    that to every WGMMA of the persistent 192-row forward's guarded steps (session 57): each branch now holds whole
    groups. At most one HGMMA per group carries gsb0."""
    from fa4gen.compile.cache import DiskCache
    from fa4gen.compile.sass import mma_loops

    entries = {e.meta.get("name"): e for e in DiskCache(cache_root).ls()}
    for name, (spec, plans, reports, _) in compiled.items():
        for plan in plans:
            if plan.direction != "fwd":
                continue
            sass = entries[f"{name}.{plan.module}"].file("kernel.sass").read_text()
            for body in mma_loops(sass, plan.head_dim // 16 + plan.tile_n // 16):
                hgmma = [b for b in body if "HGMMA" in b]
                waited = [b for b in hgmma if "gsb0" in b]
                assert len(waited) <= 2, f"{name} {plan.module}: {len(waited)} of {len(hgmma)} HGMMA wait (serialized)"


def _function_sass(sass: str, name_part: str) -> str:
    """The SASS of the one kernel in a module's listing whose .text section name contains name_part."""
    sections = re.split(r"^//-+ \.text\.", sass, flags=re.M)
    found = [sec for sec in sections[1:] if name_part in sec.split("\n", 1)[0]]
    assert len(found) == 1, f"{len(found)} kernels named *{name_part}*"
    return found[0]


def test_dq_postprocess_moves_16_bytes_per_instruction(compiled, cache_root):
    """The dQ postprocess (sm90.ConvertChunks) reads the fp32 chunks and writes dQ with 128-bit accesses
    only, through a shared-memory tile: its element-wise 2-byte stores ran at 127 µs against flash-attn-4's
    49 µs at d128 s1k on the H200 (docs/PERF.md, session 9), 12% of the whole backward there."""
    from fa4gen.compile.cache import DiskCache
    from fa4gen.device.sm90 import ConvertChunks

    entries = {e.meta.get("name"): e for e in DiskCache(cache_root).ls()}
    checked = 0
    for name, (spec, plans, _, _) in compiled.items():
        for plan in (p for p in plans if p.direction == "bwd"):
            if not ConvertChunks(None, plan.head_dim, plan.tile_m, plan.varlen).staged:
                continue
            sass = _function_sass(entries[f"{name}.{plan.module}"].file("kernel.sass").read_text(), "ConvertChunks")
            ops = re.findall(r"\b((?:LDG|STG|LDS|STS)(?:\.[A-Z0-9]+)*)", sass)
            # (varlen also reads cu_seqlens, the hand-offs their chunk's claim flag or turn counter: 32-bit
            # index loads, not dQ data)
            index_loads = plan.varlen or plan.deterministic and not plan.dq_atomic or plan.dq_claim
            loads = [o for o in ops if o.startswith("LDG") and (o.endswith(".128") or not index_loads)]
            stores = [o for o in ops if o.startswith("STG")]
            assert loads and all(o.endswith(".128") for o in loads), (name, sorted(set(loads)))
            assert stores and all(o.endswith(".128") for o in stores), (name, sorted(set(stores)))
            # 2 * 128 threads: tile_m x head_dim fp32 in, as many bf16/fp16 out; varlen: plus the spare tiles'
            # zeros for the padding rows after the last sequence (`zero_rows_after`, a loop of 16-byte stores),
            # one for dQ and, for MHA, one each for dK and dV
            padding = (1 if plan.dkv_accum else 3) if plan.varlen else 0
            assert len(loads) == plan.tile_m * plan.head_dim // (2 * 128 * 4), (name, len(loads))
            assert len(stores) == plan.tile_m * plan.head_dim // (2 * 128 * 8) + padding, (name, len(stores))
            checked += 1
    assert checked >= 3


def test_bwd_preprocess_issues_its_loads_before_the_row_sum(compiled, cache_root):
    """The backward's preprocess (bwd.Preprocess / PreprocessVarlen) requests all of a lane's O and dO
    chunks (up to its group of four in the varlen one) with 128-bit loads before the first FFMA of the row
    sum, so a thread waits for DRAM once: with the loads inside the FMA loop, ptxas issued two chunks,
    waited, then the next (three round trips per thread at d128, four with LSE read after the row sum),
    and the preprocess took 85 µs against flash-attn-4's 68 µs at d128 s1k causal on the H200 (docs/PERF.md,
    session 19). The dQ accumulator is zeroed by 128-bit stores."""
    from fa4gen.compile.cache import DiskCache
    from fa4gen.device import bwd

    entries = {e.meta.get("name"): e for e in DiskCache(cache_root).ls()}
    checked = 0
    for name, (spec, plans, _, _) in compiled.items():
        for plan in (p for p in plans if p.direction == "bwd"):
            sass = _function_sass(entries[f"{name}.{plan.module}"].file("kernel.sass").read_text(), "Preprocess")
            ops = re.findall(r"\b((?:LDG|STG|FFMA)(?:\.[A-Z0-9]+)*)", sass)
            first_ffma = next(i for i, o in enumerate(ops) if o.startswith("FFMA"))
            chunks = (plan.head_dim_v // bwd.VEC + 3) // 4  # 16-byte chunks of O (and of dO) per lane
            group = min(chunks, 4) if plan.varlen else chunks
            wide = [o for o in ops[:first_ffma] if o.startswith("LDG") and o.endswith(".128")]
            assert len(wide) == 2 * group, (name, ops[:first_ffma])
            zeros = [o for o in ops if o.startswith("STG") and o.endswith(".128")]
            # the hand-offs with a flag (claim flags with a mask, or the deterministic turn 0) store each dQ
            # chunk's first value: no zeroing there; LSE2's store then sits between the loads and the row sum
            # in their place
            flagged = not plan.dq_atomic and (plan.deterministic or plan.dq_claim)
            assert bool(zeros) == (not flagged), (name, ops)
            assert not flagged or "STG.E" in ops[:first_ffma], (name, ops[:first_ffma])
            assert all(o.endswith(".128") or o == "STG.E" for o in ops if o.startswith("STG")), (name, ops)
            checked += 1
    assert checked >= 3


def test_handoffs_store_each_chunks_first_dq(compiled, cache_root):
    """With the dQ hand-off the dQ warp stores (bulk copy, UBLKCP.G.S) a chunk's first value and reduce-adds
    (UBLKRED) the others, one of each per warpgroup, so the preprocess does not zero the accumulator; the
    postprocess reads the tile's flag (the tiles no key block reaches give dQ = 0). Deterministic: the first
    key block of each query tile's order stores. Otherwise the first to reach a
    query tile claims it (an atomic add per tile at the block's start), stores both chunks, and releases it
    once the stores landed (a gpu-scope fence, then a reduction: at the next block's start or after the last
    block), while
    the others add at once if their claim saw the release, else poll for it first (acquire loads). Varlen
    without a mask only reduce-adds into the accumulator the preprocess zeroed. With the overlapped dQ conversion
    (plan dq_post_overlap, the MHA backward with the claim) the main kernel lets its dependents launch at its
    start (PREEXIT) and its dQ warp counts each tile once its adds have landed (one more fence and reduction);
    the conversion polls that count (acquire loads: a first load and the loop) before it reads a chunk, and its
    last CTA waits for the main kernel's end before it exits."""
    from fa4gen.compile.cache import DiskCache

    entries = {e.meta.get("name"): e for e in DiskCache(cache_root).ls()}
    seen = set()
    for name, (spec, plans, _, _) in compiled.items():
        for plan in (p for p in plans if p.direction == "bwd" and not p.dq_atomic):
            text = entries[f"{name}.{plan.module}"].file("kernel.sass").read_text()
            main = _function_sass(text, "FlashBwd")
            stores = re.findall(r"\bUBLKCP\.G\.S\b", main)
            flagged = plan.deterministic or plan.dq_claim
            overlap = int(plan.dq_post_overlap)
            assert len(stores) == (2 if flagged else 0), (name, len(stores))
            assert len(re.findall(r"\bUBLKRED\b", main)) == 2, name
            assert plan.dq_claim == (not plan.deterministic), name
            if plan.dq_claim:
                # a block's claim, and the poll for the release (first load + loop)
                assert len(re.findall(r"\bATOMG\.E\.ADD\.STRONG\.GPU\b", main)) == 3, name
                # the releases, each after a fence: the last block's at the next block's start and after the
                # last block
                # (and with the overlapped conversion the tile's count, after a fence of its own)
                assert len(re.findall(r"\bREDG\.E\.ADD\.S32\.STRONG\.GPU\b", main)) == 2 + overlap, name
                assert len(re.findall(r"\bMEMBAR\.ALL\.GPU\b", main)) == 2 + overlap, name
            post_sass = _function_sass(text, "ConvertChunks")
            post = re.findall(r"\bLDG(?:\.[A-Z0-9]+)*", post_sass)
            if not plan.varlen:  # (varlen also reads cu_seqlens)
                assert sum(not o.endswith(".128") for o in post) == int(flagged) + 2 * overlap, (name, post)
            assert post.count("LDG.E.STRONG.GPU") == 2 * overlap, (name, post)
            assert len(re.findall(r"\bPREEXIT\b", main)) == overlap, name
            # (and its last CTA waits for the main kernel's end before it exits: griddepcontrol.wait)
            assert len(re.findall(r"\bACQBULK\b", post_sass)) == overlap, name
            seen.add((plan.deterministic, plan.dq_claim, plan.dq_post_overlap))
    # (no spec has a maskless varlen non-deterministic backward)
    assert {(False, True, False), (False, True, True), (True, False, False)} <= seen, seen


def _check_backward_sass(name, plan, r, s):
    """The backward's main kernel: five WGMMA steps per query block (S, dP, dQ over the key block; dV,
    dK over the query block), once per generated copy of the block (one per masked / mask-free run),
    TMA loads and stores (dQ by bulk reduce-add of its fragment-order chunks, or by 128-bit reductions
    from registers with the plan's dq_atomic; GQA dK/dV by TMA reduce-add), one exp2 per score, no spills."""
    text = (ROOT / "generated" / name / f"{plan.module}.py").read_text()
    runs = {"none": 1, "causal": 2, "sliding_window": 3, "chunked": 3}[plan.mask_kind]
    assert text.count("cute.gemm(tiled_mma_sdp") == 2 * runs
    per_block = (plan.head_dim + plan.head_dim_v + plan.tile_n + 2 * plan.tile_m) // 16
    assert s["hgmma"] == runs * per_block
    assert s["ldl"] == 0 and s["stl"] == 0
    assert s["utmaldg"] > 0
    if plan.dq_atomic:  # dQ from registers: 128-bit reductions, (64 x DQ_N) / 512 per thread, per block and run
        from fa4gen.device.sm90 import dq_split  # the kernel's own split of dQ over the warpgroups

        assert s["opcodes"].get("UBLKRED", 0) == 0
        assert s["opcodes"].get("REDG", 0) == runs * 64 * dq_split(plan.head_dim, plan.tile_m)[1] // 512
    else:  # dQ: bulk reduce-add
        assert s["opcodes"].get("UBLKRED", 0) > 0
    assert (s["opcodes"].get("UTMAREDG", 0) > 0) == plan.dkv_accum  # GQA dK/dV: TMA reduce-add
    assert (s["utmastg"] > 0) == (not plan.dkv_accum)  # MHA dK/dV: TMA store
    # P = exp2(S * scale - LSE): (64 x tile_n) scores over 256 threads per query block and run
    assert s["mufu_ex2"] == runs * plan.tile_m * plan.tile_n // 256
    assert r.meta["registers"] * plan.threads <= REG_FILE


def test_spare_varlen_ctas_leave_before_any_set_up(compiled, cache_root):
    """A packed launch's grid is an upper bound (about one spare tile per sequence, 20% of the tiles at 32 x
    512 tokens): the CTAs of spare tiles exit (`varlen.leave_if_spare`) right after the tile scan, before the
    main kernels' TMA descriptor prefetch and mbarrier set-up and before the preprocess's O / dO loads. They
    used to run the whole prologue and epilogue on an empty range (docs/PERF.md, session 24: the d64 32 x 512
    backward's main kernel 461.7 -> 438.7 us on the H200)."""
    from fa4gen.compile.cache import DiskCache

    entries = {e.meta.get("name"): e for e in DiskCache(cache_root).ls()}
    set_up = ("SYNCS", "UTMACCTL", "UTMALDG", "BAR", "STS", "LDS", "STG", "LDG.E.128", "HGMMA")
    checked = 0
    for name, (spec, plans, _, _) in compiled.items():
        for plan in (p for p in plans if p.varlen):
            text = entries[f"{name}.{plan.module}"].file("kernel.sass").read_text()
            for part in ("FlashFwd",) if plan.direction == "fwd" else ("FlashBwd", "PreprocessVarlen"):
                ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9._]*)",
                                 _function_sass(text, part), flags=re.M)
                first_exit = ops.index("EXIT")
                first_set_up = next(i for i, o in enumerate(ops) if o.startswith(set_up))
                assert first_exit < first_set_up, (name, part, ops[: first_set_up + 1])
                checked += 1
    assert checked >= 3

"""Compile stage, sm100: every SM100 forward variant compiles for sm_100a on the CPU, and its SASS has the
shape the plan says. No Blackwell GPU runs these kernels anywhere: this is what can be verified.

Per variant: tcgen05 MMAs (UTCHMMA, one per K block of each MMA the generated text issues), TMEM loads
and stores (LDTM/STTM), TMA loads and stores (UTMALDG/UTMASTG), no spills (LDL/STL, stack frame), the
register file and the plan's shared-memory and TMEM budgets (the compiled SharedStorage is asserted equal
to the plan's byte count while tracing), and the poly-exp trade: every emulated exp2 is one FADD.RM
(the floor of fa4gen.device.polyexp; half an FADD2.RM where a pair of them goes through Blackwell's packed
fp32 ops) and one MUFU.EX2 fewer, none at share 0.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fa4gen.builder import CompileJob, compile_jobs, plan_spec, render_spec, write_package
from fa4gen.spec import load_spec, spec_from_dict

pytestmark = pytest.mark.compile

pytest.importorskip("cutlass")
from fa4gen.compile.sass import find_nvdisasm  # noqa: E402
from fa4gen.device import sm100  # noqa: E402

if find_nvdisasm() is None:
    pytest.skip("nvdisasm not installed (needed for the SASS summary)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
REG_FILE = 64 * 1024
SMEM_LIMIT = 227 * 1024

VARIANTS = {
    "d64": {"head_dim": 64},
    "d128": {"head_dim": 128},
    "d128_causal_lse": {"head_dim": 128, "mask": {"kind": "causal"}, "return_lse": True},
    "d128_poly15": {"head_dim": 128, "pipeline": {"poly_exp": {"share": 0.15, "degree": 3}}},
    "d128_poly50": {"head_dim": 128, "pipeline": {"poly_exp": {"share": 0.5, "degree": 3}}},
    "d128_poly50_deg5": {"head_dim": 128, "pipeline": {"poly_exp": {"share": 0.5, "degree": 5}}},  # tile_n 64
    "d128_window_softcap": {"head_dim": 128, "mask": {"kind": "sliding_window", "left": 511, "right": 0},
                            "softcap": 30.0},
    "d128_chunked_gqa": {"head_dim": 128, "mask": {"kind": "chunked", "chunk_size": 1024}, "allow_gqa": True},
    "d128_one_tile_fp16": {"head_dim": 128, "dtype": "fp16", "pipeline": {"ping_pong": False}},
    "d192_128": {"head_dim": 192, "head_dim_v": 128, "mask": {"kind": "causal"}},
    "d192": {"head_dim": 192, "return_lse": True},
    "d256": {"head_dim": 256, "mask": {"kind": "causal"}},
    # two_cta: a CTA pair (cluster (2, 1, 1)) sharing 256-row cta_group::2 MMAs; non-causal, head_dim 128/192
    "d128_two_cta": {"head_dim": 128, "mask": {"kind": "none"}, "pipeline": {"two_cta": True}},
    "d192_two_cta": {"head_dim": 192, "mask": {"kind": "none"}, "pipeline": {"two_cta": True}},  # tile_n 64
    "d192_128_two_cta_lse": {"head_dim": 192, "head_dim_v": 128, "return_lse": True, "pipeline": {"two_cta": True}},
    # variants that spilled before session 52 (spill census, docs/SM100.md): the LSE epilogue of (192, 128) with
    # two Q tiles, the 2-CTA (192, 128) MMA warp, chunked + softcap with every 3rd exp2 emulated (the chunk starts
    # now once per Q tile), d192 chunked with one Q tile
    "d192_128_causal_lse": {"head_dim": 192, "head_dim_v": 128, "mask": {"kind": "causal"}, "return_lse": True},
    "d192_128_two_cta": {"head_dim": 192, "head_dim_v": 128, "pipeline": {"two_cta": True}},
    "d128_chunked_softcap_poly34": {"head_dim": 128, "mask": {"kind": "chunked", "chunk_size": 96}, "softcap": 20.0,
                                    "return_lse": True, "pipeline": {"poly_exp": {"share": 0.34, "degree": 3}}},
    "d192_chunked_poly25": {"head_dim": 192, "mask": {"kind": "chunked", "chunk_size": 96},
                            "pipeline": {"poly_exp": {"share": 0.25, "degree": 3}}},
    # one Q tile where two would fit, chunked with every 3rd exp2 emulated: its softmax warps spilled 8 before session 53
    "d128_chunked_poly34_one_tile": {"head_dim": 128, "mask": {"kind": "chunked", "chunk_size": 96},
                                     "pipeline": {"ping_pong": False, "poly_exp": {"share": 0.34, "degree": 3}}},
    # fp16 d192 window + GQA + varlen: its softmax warps spilled 71 at 216 / 112 / 88 (session 53's GQA / fp16 census)
    "d192_window_gqa_varlen_fp16": {"head_dim": 192, "dtype": "fp16", "mask": {"kind": "sliding_window", "left": 100,
                                    "right": 20}, "allow_gqa": True, "varlen": True},
    # fp16 d192 chunked + varlen, a quarter of the exp2 emulated: its softmax warps spilled 2 at 200 / 128 / 88 (session 54)
    "d192_chunked_varlen_poly25_fp16": {"head_dim": 192, "dtype": "fp16", "mask": {"kind": "chunked", "chunk_size": 96},
                                        "varlen": True, "pipeline": {"poly_exp": {"share": 0.25, "degree": 3}}},
    # packed sequences: the SM90 family's bounded TMA views and tile numbering (fa4gen/device/varlen.py)
    "d128_varlen_causal_lse": {"head_dim": 128, "mask": {"kind": "causal"}, "return_lse": True, "varlen": True},
    "d64_varlen_window_fp16": {"head_dim": 64, "dtype": "fp16", "mask": {"kind": "sliding_window", "left": 100},
                               "varlen": True},
}
TWO_CTA = [name for name, d in VARIANTS.items() if d.get("pipeline", {}).get("two_cta")]


@pytest.fixture(scope="module")
def compiled(cache_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("generated")
    start = time.perf_counter()
    rendered = {}
    for name, d in VARIANTS.items():
        spec = spec_from_dict({"name": name, "targets": ["sm100"], "dtype": "bf16", **d})
        pkg, plans, _ = render_spec(spec, f"test:{name}")
        write_package(pkg, out)
        (plan,) = plans
        rendered[name] = (plan, pkg.files["fwd_sm100.py"])
    # every variant at once, in as many compile processes as the machine allows
    jobs = [CompileJob(out / name, f"sm100_test_{name}", plan, name) for name, (plan, _) in rendered.items()]
    reports = compile_jobs(jobs, keep_sass=True, workers=0)
    results = {name: (plan, report, text) for (name, (plan, text)), report in zip(rendered.items(), reports)}
    print(f"\ncompiled {len(results)} sm100 variants in {time.perf_counter() - start:.1f} s")
    return results


def _mma_count(plan) -> int:
    """UTCHMMA the generated text issues: S = Q·Kᵀ (head_dim/16 K blocks) for the first key block and in
    the loop; O += P·V (tile_n/16) in the loop and for the last block, each with both forms of its first
    K block (accumulate or not, decided at run time)."""
    return 2 * (plan.head_dim // 16) + 2 * (plan.tile_n // 16 + 1)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_compiles_with_expected_sass(compiled, name):
    plan, r, _ = compiled[name]
    assert r.status == "compiled", r.detail
    assert r.meta["arch"] == "sm_100a" and r.meta["cubin_arch"].startswith("sm_100")
    s = r.meta["sass"]
    assert s["utchmma"] == _mma_count(plan)
    assert s["hgmma"] == 0
    assert s["ldtm"] > 0 and s["sttm"] > 0
    assert s["utmaldg"] > 0 and s["utmastg"] > 0
    assert s["ldl"] == 0 and s["stl"] == 0, "spills"
    assert r.meta["spill_stores"] == 0 and r.meta["spill_loads"] == 0 and r.meta["stack_frame"] == 0
    assert r.meta["registers"] * plan.threads <= REG_FILE
    assert plan.smem_bytes <= SMEM_LIMIT and plan.tmem_cols <= 512
    assert s["mufu_ex2"] > 0


@pytest.mark.parametrize("name", list(VARIANTS))
def test_generated_text_has_no_dead_features(compiled, name):
    plan, _, text = compiled[name]
    assert ("mask." in text) == plan.has_mask
    assert ("apply_softcap" in text) == plan.has_softcap
    assert ("mLSE" in text) == plan.write_lse
    assert ("PERSISTENT_CTAS" in text) == (plan.scheduler == "persistent")
    assert ("varlen." in text) == plan.varlen
    # the peeled first key block, then the descending runs of mask.mask_phases: one mask-free run
    # without a mask; masked + mask-free for causal; a third, left-edge run for windows and chunks
    runs = {"none": 1, "causal": 2, "sliding_window": 3, "chunked": 3}[plan.mask_kind]
    assert text.count("softmax.online_softmax_step(") == 1 + runs
    assert "tile_needs_mask" not in text


def _two_cta_opcodes(sass) -> dict:
    return {op: n for op, n in sass["full_opcodes"].items() if ".2CTA" in op}


@pytest.mark.parametrize("name", TWO_CTA)
def test_two_cta_sass_has_the_pair_forms(compiled, name):
    """nvdisasm spells the cta_group::2 forms with a `.2CTA` modifier: every tcgen05 MMA is UTCHMMA.2CTA,
    every TMA load UTMALDG.*.2CTA (its bytes signal the even CTA's barrier), every tcgen05.commit
    UTCBAR.2CTA.MULTICAST (one arrival on each CTA's barrier), TMEM is allocated for the pair
    (UTCATOMSWS.2CTA); the cluster barrier (UCGABAR) orders barrier setup and exit across the pair, and
    remote mbarrier arrivals (the odd CTA's releases) appear as SYNCS.ARRIVE.*.RED."""
    plan, r, text = compiled[name]
    assert plan.two_cta and r.status == "compiled", r.detail
    s = r.meta["sass"]
    ops = s["full_opcodes"]
    assert ops.get("UTCHMMA.2CTA", 0) == s["utchmma"] == _mma_count(plan)
    assert sum(n for op, n in ops.items() if op.startswith("UTMALDG") and ".2CTA" in op) == s["utmaldg"] > 0
    assert sum(n for op, n in ops.items() if op.startswith("UTCBAR") and ".2CTA" in op and "MULTICAST" in op) > 0
    assert any(op.startswith("UTCATOMSWS.2CTA") for op in ops)
    assert ops.get("UCGABAR_ARV", 0) >= 2 and ops.get("UCGABAR_WAIT", 0) >= 2
    assert any(op.startswith("SYNCS.ARRIVE") and ".RED" in op for op in ops)
    assert s["ldl"] == 0 and s["stl"] == 0 and plan.smem_bytes <= SMEM_LIMIT
    assert "CtaGroup.TWO" in text and "cluster=CLUSTER" in text


def test_one_cta_variants_have_no_pair_forms(compiled):
    for plan, r, _ in compiled.values():
        if not plan.two_cta:
            assert _two_cta_opcodes(r.meta["sass"]) == {}, plan.name


def _emulated(sass) -> int:
    """Emulated exp2s: one floor (add.rm) each, a packed FADD2.RM serving two (PACKED_POLY)."""
    return sass["full_opcodes"].get("FADD.RM", 0) + 2 * sass["full_opcodes"].get("FADD2.RM", 0)


def test_poly_exp_share_moves_the_mufu_fma_mix(compiled):
    (base, b, _), (p15, r15, _), (p50, r50, _) = (compiled[n] for n in ("d128", "d128_poly15", "d128_poly50"))
    assert base.poly_every == 0 and _emulated(b.meta["sass"]) == 0
    for plan, r in ((p15, r15), (p50, r50)):
        # two copies of the softmax step, 4 rows a thread, the plan's emulated columns of each row
        per_row = sum(1 for c in range(plan.tile_n // 4) if c % plan.poly_every == plan.poly_every - 1)
        s = r.meta["sass"]
        assert _emulated(s) == 2 * 4 * per_row
        assert b.meta["sass"]["mufu_ex2"] - s["mufu_ex2"] == _emulated(s)
        # Blackwell's packed fp32 ops (fa4gen.device.sm100.packed_poly: from every 5th column emulated on, so share
        # 0.15 here, not 0.5): a row's emulated columns in pairs, each pair one FADD2.RM (the floor), two FADD2 (the
        # fraction) and one FFMA2 per Horner step; an odd one scalar
        pairs = 2 * 4 * (per_row // 2) if sm100.packed_poly(plan.poly_every, max(plan.head_dim, plan.head_dim_v)) else 0
        assert (pairs > 0) == (plan is p15)
        ops = s["full_opcodes"]
        assert ops.get("FADD2.RM", 0) == pairs and ops.get("FADD.RM", 0) == 2 * 4 * per_row - 2 * pairs
        assert s["ffma2"] == pairs * plan.poly_degree and ops.get("FADD2", 0) == 2 * pairs
        assert s["ffma"] + 2 * s["ffma2"] > b.meta["sass"]["ffma"]
    assert _emulated(r50.meta["sass"]) > _emulated(r15.meta["sass"])
    assert b.meta["sass"]["ffma2"] == 0  # (share 0: nothing packed; the scale-and-shift stays scalar FFMA)


def test_share_zero_has_no_emulated_exp2_in_any_variant(compiled):
    for plan, r, _ in compiled.values():
        assert (_emulated(r.meta["sass"]) > 0) == (plan.poly_every > 0)


SPEC_NAMES = [p.stem for p in sorted((ROOT / "specs").glob("*.yaml")) if "sm100" in load_spec(p).targets]


@pytest.fixture(scope="module")
def committed(cache_root):
    def build():  # every spec's sm100 kernels in as many processes as the machine allows
        plans = {name: plan_spec(load_spec(ROOT / "specs" / f"{name}.yaml"), archs=["sm100"])[0] for name in SPEC_NAMES}
        jobs = [CompileJob(ROOT / "generated" / name, f"generated.{name}", p, name)
                for name in SPEC_NAMES for p in plans[name]]
        reports = iter(compile_jobs(jobs, keep_sass=True, workers=0))
        return {name: (plans[name], [next(reports) for _ in plans[name]]) for name in SPEC_NAMES}

    return build(), build()


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_committed_sm100_kernels_compile_and_hit_the_cache(committed, name):
    first, second = committed
    (plan,), (r,) = first[name]
    assert r.status == "compiled", r.detail
    s = r.meta["sass"]
    assert s["utchmma"] == _mma_count(plan) and s["ldl"] == 0 and s["stl"] == 0
    (_,), (again,) = second[name]
    assert again.status == "cached" and again.meta["sass"]["utchmma"] == s["utchmma"]

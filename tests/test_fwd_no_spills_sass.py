"""Forward variants that held LDL/STL compile without register spills for sm_90a on the CPU (issue #3 asks
for no LDL/STL in any SM90 kernel; tools/spill_sweep.py sweeps the grid, these are the cases that spilled).

At head dims 208 and 240 each K/V row splits into TMA boxes with a 16- or 48-column remainder, and the
producer's key-block loop kept more coordinates than its 24 registers hold: 2-28 LDL/STL in 17 of 32
masked forwards, some inside the consumers' loops (session 13 sweep). Those plans give the producer 40
registers and the consumers 232 (the register file still fits: 128 x 40 + 256 x 232 = 64512)."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.compile

pytest.importorskip("cutlass")
from fa4gen.compile.sass import find_nvdisasm  # noqa: E402

if find_nvdisasm() is None:
    pytest.skip("nvdisasm not installed (needed for the SASS)", allow_module_level=True)

WINDOW = {"kind": "sliding_window", "left": 100, "right": 20}
CHUNKED = {"kind": "chunked", "chunk_size": 96}
CASES = {  # name: (head dim, mask, varlen, softcap[, tile_m]); LDL/STL before in the comment
    "d208_causal": (208, {"kind": "causal"}, False, 0.0),  # 13
    "d208_chunked_softcap": (208, CHUNKED, False, 20.0),  # 15
    "d240_window_varlen": (240, WINDOW, True, 0.0),  # 26, 2 inside an MMA loop
    "d240_chunked_softcap_varlen": (240, CHUNKED, True, 20.0),  # 28, 2 + 2 inside MMA loops
    # three consumer warpgroups at 160 registers (a masked d64 spec's long-call kernel): 12 inside an MMA loop while
    # every masked key block divided for its rows' chunk starts (4 with the LSE written); once per tile since s49
    "d64_chunked_softcap_192_rows": (64, CHUNKED, False, 20.0, 192),
}


def _forward_plan(d, mask, varlen=False, softcap=0.0, tile_m="auto", name="ns", tile_n="auto"):
    from fa4gen.plan import plan_kernels
    from fa4gen.spec import spec_from_dict

    spec = spec_from_dict(dict(name=name, targets=["sm90"], dtype="bf16", head_dim=d, mask=mask, varlen=varlen,
                               softcap=softcap, pipeline={"tile_m": tile_m, "tile_n": tile_n}))
    return spec, plan_kernels(spec, "sm90")[0]


@pytest.mark.parametrize("d", range(16, 257, 16))
def test_producer_registers_move_only_at_208_240_and_in_masked_persistent_forwards(d):
    """(masked persistent forwards: 32 / 232, measured 1-2% faster than 24 / 240 in session 16)"""
    _, plan = _forward_plan(d, {"kind": "causal"})
    if d in (208, 240) and plan.num_mma_warpgroups == 2:
        want = (40, 232)
    elif plan.scheduler == "persistent":
        want = (32, 232)
    else:
        want = (24, plan.regs_consumer)
    assert plan.scheduler == ("persistent" if d <= 128 else "grid_lpt"), d  # (PERSISTENT_MAX_HEAD_DIM_MASKED)
    assert (plan.regs_producer, plan.regs_consumer) == want, d
    assert 128 * plan.regs_producer + 128 * plan.num_mma_warpgroups * plan.regs_consumer <= 64512


LEAN = ["llama3_8b", "mistral_7b"]  # the committed specs of test_masked_persistent_key_block_loops_stay_lean


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The cases' forwards and the LEAN specs' two forwards each, compiled together (in as many processes as
    the machine allows): {name: [(plan, report, sass), ...]}."""
    from fa4gen.builder import compile_specs_for_sass
    from fa4gen.plan import plan_kernels
    from fa4gen.spec import load_spec

    pairs = []
    for case, (d, mask, varlen, softcap, *tile_m) in CASES.items():
        spec, plan = _forward_plan(d, mask, varlen, softcap, *tile_m, name=f"ns_{case}")
        pairs.append((spec, [plan]))
    for name in LEAN:
        spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml")
        pairs.append((spec, [p for p in plan_kernels(spec, "sm90") if p.direction == "fwd"]))
    rows = compile_specs_for_sass(pairs, tmp_path_factory.mktemp("ns"), "ns_gen")
    return dict(zip([*CASES, *LEAN], rows))


@pytest.mark.parametrize("case", list(CASES))
def test_forward_has_no_spills(case, compiled):
    ((plan, report, sass),) = compiled[case]
    if plan.head_dim > 192:
        assert (plan.regs_producer, plan.regs_consumer) == (40, 232)
    else:
        assert (plan.tile_m, plan.num_mma_warpgroups, plan.regs_consumer) == (192, 3, 160)
    assert report.status == "compiled", report.detail
    functions = {part.split("\n", 1)[0]: part for part in sass.split(".section\t.text.")[1:]}
    assert any("FlashFwd" in name for name in functions)
    spilled = {name[:80]: len(re.findall(r"\b(?:LDL|STL)\b", body)) for name, body in functions.items()}
    assert not any(spilled.values()), spilled


@pytest.mark.parametrize("name", LEAN)
def test_masked_persistent_key_block_loops_stay_lean(name, compiled):
    """The masked persistent forward's key-block loops stay within 110 instructions of the one-CTA-per-tile
    twin's, without LDL/STL (session 16: llama3_8b 686 / 568 against 596 / 500; mistral_7b 854 / 569 / 848
    against 754 / 504 / 761). The extra instructions are ptxas building the consumers' WGMMA descriptors in
    vector registers (48 R2UR + IMAD per loop). Session 15's flat loop with `make_warp_uniform` kept them
    uniform at d128 (627 / 511), but a same-run A/B on the H200 found that no faster at d128 causal s512-2k
    (session 16, docs/PERF.md), and which loop forms keep them uniform is not predictable: this guards the
    size, not the form. (The committed specs: d128 causal GQA with the LSE, d128 window GQA; a plain d128
    causal spec kept its descriptors uniform even without the shuffles.)"""
    from fa4gen.compile.sass import loops

    rows = compiled[name]
    assert [plan.scheduler for plan, _, _ in rows] == ["persistent", "grid_lpt"]
    sizes = {}
    for plan, report, sass in rows:
        assert report.status == "compiled", report.detail
        mma_loops = [body for body in loops(sass, wait_returns=False) if any("HGMMA" in line for line in body)]
        block_loops = [body for body in mma_loops if len(body) < 1000]  # the key-block loops (not their unrolled copies)
        sizes[plan.scheduler] = sorted(len(body) for body in block_loops)
        spills = sum(bool(re.search(r"\b(?:LDL|STL)\b", line)) for body in block_loops for line in body)
        assert spills == 0, (plan.scheduler, spills, sizes)
    persistent, grid = sizes["persistent"], sizes["grid_lpt"]
    assert len(persistent) == len(grid) >= 2, sizes
    assert all(p <= g + 110 for p, g in zip(persistent, grid)), sizes


def test_p_of_a_tile_n_80_block_converts_in_pairs_without_prmt(tmp_path):
    """At tile_n 80 (head dim 256's auto tile before session 47) a thread's P is 40 values: converted as one vector they lowered to single
    conversions that ptxas paired with a PRMT each (20 per key block, 504 instructions); `frag.convert` converts
    them in vectors of 8, packed two per F2FP (483)."""
    from fa4gen.builder import compile_for_sass
    from fa4gen.compile.sass import loops

    spec, plan = _forward_plan(256, {"kind": "none"}, name="pairs", tile_n=80)
    assert plan.tile_n == 80
    ((_, report, sass),) = compile_for_sass(spec, [plan], tmp_path, "pairs_gen")
    assert report.status == "compiled", report.detail
    (block,) = [body for body in loops(sass, wait_returns=False) if any("HGMMA" in line for line in body)]
    assert sum("F2FP" in line for line in block) == 20  # 40 values, two per conversion
    assert not any("PRMT" in line for line in block)


@pytest.mark.parametrize("d, dv, mask", [(128, 128, "none"), (192, 128, "causal")])
def test_p_conversions_run_inside_the_exp2_stream(d, dv, mask, tmp_path):
    """P is converted before the conditional O rescale, a branch, with conversions LLVM cannot sink below it, so
    ptxas spreads the key block's 32 F2FP through the MUFU.EX2 stream (flash-attn-4's loop shape). Sunk below the
    branch they ran as one burst at the block's end: on the H200, (192, 128) causal s4k, F2FP held 6.3% of the
    forward's stall samples against flash-attn-4's 1.8% (docs/PERF.md, session 34)."""
    from fa4gen.builder import compile_for_sass
    from fa4gen.compile.sass import loops
    from fa4gen.plan import plan_kernels
    from fa4gen.spec import spec_from_dict

    spec = spec_from_dict(dict(name=f"cvt_{d}_{mask}", targets=["sm90"], dtype="bf16", head_dim=d, head_dim_v=dv,
                               mask={"kind": mask}))
    plan = plan_kernels(spec, "sm90")[0]
    ((_, report, sass),) = compile_for_sass(spec, [plan], tmp_path, "cvt_gen")
    assert report.status == "compiled", report.detail
    mma_loops = [body for body in loops(sass, wait_returns=False) if any("HGMMA" in line for line in body)]
    block = min((body for body in mma_loops if len(body) < 1000), key=len)  # the unmasked key-block loop
    f2fp = [i for i, line in enumerate(block) if "F2FP" in line]
    ex2 = [i for i, line in enumerate(block) if "MUFU.EX2" in line]
    assert len(f2fp) == 32 and len(ex2) == 66
    # most conversions issue before the block's last exp2 (a burst after it was the old shape)
    assert sum(i < ex2[-1] for i in f2fp) >= 24, (f2fp, ex2[-1])

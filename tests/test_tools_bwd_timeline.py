"""tools/bwd_timeline.py on the CPU: its phase arithmetic on hand-made trace rows, the traced build's launch (the
API's arguments plus the trace tensor) against the traced kernel's compiled signature, the render's refusal of
kernels it cannot trace, and (compile) the traced kernel's SASS."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.launch_check import call, capture, check_signature, fake_arguments

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("bwd_timeline", ROOT / "tools" / "bwd_timeline.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bwd_timeline"] = mod
    spec.loader.exec_module(mod)
    return mod


tool = _tool()


def _row(sm, entry, consumers, kv, blocks, epilogue, entry_ns, end_ns, drained=-1, staged=-1, p_tile=-1, p_kv=-1,
         dq_issued=-1, dq_landed=-1):
    return [sm, entry, consumers, kv, blocks, epilogue, entry_ns, end_ns, drained, staged, p_tile, p_kv, dq_issued,
            dq_landed]


def test_the_sampled_block_intervals():
    """The sampled block's intervals at 2 cycles per ns (2000 per µs): each read only where the kernel wrote both of
    its points, the dQ warp's tile0 from the block's top where the kernel has no turn point (-1)."""
    det = [-1] * 27
    for col, v in ((tool.T_S_BLOCK, 10000), (tool.T_S_Q, 10200), (tool.T_S_DO, 10600), (tool.T_S_EMPTY, 13000),
                   (tool.T_S_EMPTIED, 15000), (tool.T_S_END, 16000), (tool.T_D_TOP, 9000), (tool.T_D_TURN, 11000),
                   (tool.T_D_FULL0, 15000), (tool.T_D_FULL1, 15400), (tool.T_D_READ, 16400), (tool.T_D_LAND, 18400),
                   (tool.T_D_PASS, 19400)):
        det[col] = v
    plain = [-1] * 27  # a default kernel's dQ warp: no turn, no landing or pass per block
    for col, v in ((tool.T_D_TOP, 1000), (tool.T_D_FULL0, 5000), (tool.T_D_FULL1, 7000)):
        plain[col] = v
    out = tool.sampled_block([det, plain], cycles_per_ns=2.0)
    us = {k: v["median_us"] for k, v in out.items()}
    assert us["q_wait"] == pytest.approx(0.1) and us["do_wait"] == pytest.approx(0.2)
    assert us["work"] == pytest.approx(1.2) and us["handoff"] == pytest.approx(1.0)
    assert us["after"] == pytest.approx(0.5)
    assert us["block"] == pytest.approx(3.0) and us["turn"] == pytest.approx(1.0)
    assert out["tile0"]["rows"] == 2 and sorted([out["tile0"]["median_us"], out["tile0"]["mean_us"]]) == \
        pytest.approx([2.0, 2.0])  # (15000 - 11000) / 2000 and (5000 - 1000) / 2000
    assert out["tile1"]["rows"] == 2 and out["tile1"]["mean_us"] == pytest.approx((0.2 + 1.0) / 2)
    assert out["land"]["rows"] == out["pass"]["rows"] == out["cycle"]["rows"] == 1
    assert us["land"] == pytest.approx(1.0) and us["pass"] == pytest.approx(0.5) and us["cycle"] == pytest.approx(5.2)
    assert tool.sampled_block([[-1] * 27], 2.0) == {}


def test_phases_and_the_gaps_between_ctas_on_one_sm():
    # SM 3 runs two CTAs (clock in cycles, 2 cycles per ns), SM 5 one; listed out of order
    rows = [
        _row(3, 1300, 1400, 1600, 2600, 2700, 650, 1350),
        _row(5, 100, 180, 300, 1100, 1200, 50, 600),
        _row(3, 100, 200, 400, 1000, 1200, 50, 600),
    ]
    p = tool.phases(rows)
    c = p["cycles"]
    assert c["prologue"] == [100, 80, 100]
    assert c["kv_wait"] == [200, 120, 200]
    assert c["blocks"] == [1000, 800, 600]
    assert c["epilogue"] == [100, 100, 200]
    assert c["gap"] == [100]  # SM 3: the second CTA entered 100 cycles after the first one's epilogue ended
    assert p["cycles_per_ns"] == pytest.approx((1400 + 1100 + 1100) / (700 + 550 + 550))
    assert (p["sms"], p["span_ns"], p["busy_ns"]) == (2, 1300, 1800)
    s = tool.summary(p, blocks_per_row=4)
    rate = p["cycles_per_ns"] * 1e3
    assert s["blocks"]["mean_us"] == pytest.approx(800 / rate)
    assert s["per_block_us"] == pytest.approx(800 / rate / 4)
    assert s["gap"]["median_us"] == pytest.approx(100 / rate)
    assert sum(v["share"] for k, v in s.items() if k in tool.PHASES) == pytest.approx(1.0)
    assert s["busy_share"] == pytest.approx(1800 / (1300 * 2))
    assert "stage" not in s and c["drain"] == c["stage"] == c["store"] == []  # no staged epilogue in these rows
    assert all(c[n] == [] for n in tool.PRODUCER_PARTS)  # nor producer / dQ-warp columns


@pytest.mark.parametrize("staged", [False, True])
def test_the_k_v_load_seen_from_the_producer(staged):
    # one SM, two persistent tiles (listed out of order): tile 2's producer starts its loads at 1150, holds the
    # K / V stage at 1260 and the consumers have K / V at 1400; tile 1 handed K / V back at 1000 (staged: its last
    # block done) or 1200 (its epilogue's end)
    rows = [
        _row(0, 1210, 1210, 1400, 2000, 2100, 605, 1050, p_tile=1150, p_kv=1260, dq_issued=1990, dq_landed=2150),
        _row(0, 100, 100, 300, 1000, 1200, 50, 600, p_tile=90, p_kv=95, dq_issued=980, dq_landed=1100),
    ]
    c = tool.phases(rows, kv_stages=1, staged=staged)["cycles"]
    assert sorted(c["kv_issue"]) == [140, 205]
    handback = 1000 if staged else 1200
    assert c["kv_late"] == [1260 - handback] and c["p_ahead"] == [handback - 1150]
    # the dQ warp: each tile's reduces landed 120 / 160 cycles after its last was issued; tile 2's K / V stage taken
    # 280 cycles after tile 1's last reduce was issued
    assert sorted(c["dq_land"]) == [120, 160] and c["kv_after_dq"] == [1260 - 980]
    # two K / V stages: the tile after another does not take the stage the other handed back, so no pairing
    c2 = tool.phases(rows, kv_stages=2, staged=staged)["cycles"]
    assert c2["kv_late"] == c2["p_ahead"] == c2["kv_after_dq"] == [] and sorted(c2["kv_issue"]) == [140, 205]
    # nor for two CTAs of a grid kernel (each takes its own K / V barrier's first phase)
    c3 = tool.phases(rows, kv_stages=1, staged=staged, persistent=False)["cycles"]
    assert c3["kv_late"] == c3["p_ahead"] == c3["kv_after_dq"] == [] and sorted(c3["kv_issue"]) == [140, 205]


def test_phases_by_round_are_each_sms_r_th_tile():
    # 1 cycle per ns; SM 0 runs tiles at entry 0 and 100, SM 1 at 10 and 120 (listed out of order); round 1 exists
    # on both, round 2 on none
    rows = [
        _row(1, 120, 120, 150, 170, 180, 120, 180, p_kv=110),
        _row(0, 0, 0, 40, 60, 70, 0, 70, p_kv=5),
        _row(1, 10, 10, 30, 50, 56, 10, 56, p_kv=8),
        _row(0, 100, 100, 104, 140, 150, 100, 150, p_kv=-1),
    ]
    r = tool.by_round(rows, [0, 1, 2], cycles_per_ns=1.0)
    assert sorted(r) == [0, 1] and r[0]["tiles"] == r[1]["tiles"] == 2
    assert r[0]["kv_wait_us"] == pytest.approx((40 + 20) / 2 / 1e3)
    assert r[0]["kv_issue_us"] == pytest.approx((35 + 22) / 2 / 1e3)
    assert r[0]["epilogue_us"] == pytest.approx((10 + 6) / 2 / 1e3)
    # round 1: SM 0's tile has no producer point, so kv_issue is SM 1's alone
    assert r[1]["kv_wait_us"] == pytest.approx((4 + 30) / 2 / 1e3) and r[1]["kv_issue_us"] == pytest.approx(40 / 1e3)


def test_the_staged_epilogue_splits_into_drain_stage_and_store():
    # row 1: drained at 1050 (dV in the dQ buffers), staged at 1120; row 2: no drained point (d64: both in dS)
    rows = [
        _row(0, 100, 100, 300, 1000, 1200, 50, 600, drained=1050, staged=1120),
        _row(1, 100, 100, 300, 1000, 1150, 50, 575, staged=1040),
    ]
    p = tool.phases(rows)
    c = p["cycles"]
    assert c["drain"] == [50, 0] and c["stage"] == [70, 40] and c["store"] == [80, 110]
    assert [d + s + t for d, s, t in zip(c["drain"], c["stage"], c["store"])] == c["epilogue"]
    s = tool.summary(p, blocks_per_row=2)
    # the parts are reported beside the phases, not added to a row's time a second time
    assert sum(v["share"] for k, v in s.items() if k in tool.PHASES) == pytest.approx(1.0)
    assert s["stage"]["mean_us"] == pytest.approx(55 / (p["cycles_per_ns"] * 1e3))


@pytest.mark.parametrize(("mask", "grid", "persistent"), [
    ("none", False, False), ("none", True, False), ("causal", False, False), ("causal", True, False),
    ("causal", False, True)])
def test_the_traced_launch_matches_the_traced_kernels_signature(mask, grid, persistent, tmp_path, monkeypatch):
    """The API's backward launch with the tool's trace tensor inserted is what the traced kernel compiles for
    (count, ranks, dtypes, extents); without it the count is one short."""
    pkg, plan = tool.traced_package(tool.spec_dict(128, mask), grid, tmp_path, persistent=persistent)
    op = pkg._forward
    # d128 causal: one CTA per tile unless --persistent forces the loop the planner declines there (session 68)
    assert (plan.scheduler == "persistent") == (not grid and (mask == "none" or persistent))
    assert op.bwd_plans["sm90"]["scheduler"] == plan.scheduler
    launched = capture(op, monkeypatch, "sm90")
    call(pkg, op.bwd_plans["sm90"], grad=True)
    (args,) = [a for m, a in launched if m == plan.module]
    fakes = fake_arguments(op.dir, plan.module)
    check_signature(tool.with_trace(args, torch.full((24, 27), -1, dtype=torch.int64)), fakes,
                    f"{plan.module} traced")
    with pytest.raises(AssertionError, match="arguments launched"):
        check_signature(args, fakes, plan.module)
    source = (op.dir / f"{plan.module}.py").read_text()
    assert "TRACE_EVENTS = 27" in source and source.count("trace.record(") >= 9
    # the producer's two points: the tile's loads started, the K / V stage held
    assert "T_P_TILE, trace.clock64()" in source and "T_P_KV, trace.clock64()" in source
    # the dQ warp's two points (every d128 MHA backward without determinism has one)
    assert "T_DQ_ISSUED, trace.clock64()" in source and "T_DQ_LANDED, trace.clock64()" in source
    # the masked persistent loop's rows are the consumers' tile index, in the producer too (its loop index is not)
    row = "tile = (batch * mQ.shape[2] + head) * num_n + n_block"
    assert source.count(row) == (3 if persistent else 0)
    # the staged epilogue's two points exist exactly where the plan stages dK / dV (the persistent kernel)
    assert ("T_STAGED, trace.clock64()" in source) == bool(plan.dkv_staging.phases)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_the_deterministic_192x128_backward_traces_too(mask, tmp_path, monkeypatch):
    """`--head-dim 192 --head-dim-v 128 --deterministic` (session 81: det / default read 0.66-0.83 there on an H100):
    the spec carries V's head dim and the deterministic backward, and its traced launch matches the traced kernel
    (the dQ warp's two points included: this backward hands dQ to it, in turns)."""
    spec = tool.spec_dict(192, mask, 128, True)
    assert (spec["head_dim"], spec["head_dim_v"], spec["deterministic"]) == (192, 128, True)
    assert spec["name"] == f"timeline_d192x128_{mask}_det"
    assert "head_dim_v" not in tool.spec_dict(128, mask, 128) and "deterministic" not in tool.spec_dict(128, mask)
    pkg, plan = tool.traced_package(spec, False, tmp_path)
    op = pkg._forward
    assert op.bwd_plans["sm90"]["deterministic"] and plan.scheduler == "grid"
    launched = capture(op, monkeypatch, "sm90")
    call(pkg, op.bwd_plans["sm90"], grad=True)
    (args,) = [a for m, a in launched if m == plan.module]
    check_signature(tool.with_trace(args, torch.full((24, 27), -1, dtype=torch.int64)),
                    fake_arguments(op.dir, plan.module), f"{plan.module} traced")
    source = (op.dir / f"{plan.module}.py").read_text()
    assert "T_DQ_ISSUED, trace.clock64()" in source and "bwd.pass_turn(sem)" in source


def test_render_traces_sm90_backward_kernels_only(tmp_path):
    from fa4gen.builder import plan_spec
    from fa4gen.render import render_package
    from fa4gen.spec import spec_from_dict

    spec = spec_from_dict(tool.spec_dict(64, "none"))
    plans, unavailable = plan_spec(spec, archs=["sm90"])
    with pytest.raises(ValueError, match=r"trace: \['fwd_sm90'\]: expected SM90 backward kernels of this package "
                                         r"\(bwd_sm90\)"):
        render_package(spec, plans, spec_label="x", unavailable=unavailable, trace={"fwd_sm90"})
    plain = render_package(spec, plans, spec_label="x", unavailable=unavailable)
    traced = render_package(spec, plans, spec_label="x", unavailable=unavailable, trace={"bwd_sm90"})
    assert "mTrace" not in plain.files["bwd_sm90.py"] and "mTrace" in traced.files["bwd_sm90.py"]
    assert plain.files["fwd_sm90.py"] == traced.files["fwd_sm90.py"]


def test_grid_and_persistent_exclude_each_other(tmp_path):
    with pytest.raises(SystemExit, match="exclude each other"):
        tool.traced_package(tool.spec_dict(128, "causal"), True, tmp_path, persistent=True)


@pytest.mark.compile
@pytest.mark.parametrize(("mask", "persistent"), [("none", False), ("causal", False), ("causal", True)])
def test_the_traced_backward_compiles_without_spills(mask, persistent, tmp_path):
    """sm_90a on the CPU: the timestamps are read (%globaltimer twice, %clock64 nine times, eleven with the staged
    epilogue, and the sampled block's points) and the traced kernel holds no LDL/STL, so the trace does not move what it measures by spilling (the
    producer's and the dQ warp's two points each included, in their 24 registers)."""
    pytest.importorskip("cutlass")
    from fa4gen.compile.generated import compile_generated
    from fa4gen.compile.sass import find_nvdisasm

    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed (needed for the SASS)")
    pkg, plan = tool.traced_package(tool.spec_dict(128, mask), False, tmp_path, persistent=persistent)
    op = pkg._forward
    result = compile_generated(op.dir / f"{plan.module}.py", f"{op.package}.{plan.module}", op.bwd_plans["sm90"],
                               cache=None, keep_sass=True)
    sass = result.sass_text
    assert not re.search(r"\b(LDL|STL)\b", sass)
    # nine points in every kernel (two by the producer, two by the dQ warp); the persistent d128 kernel's staged
    # epilogue adds the drained and staged ones
    assert sass.count("SR_GLOBALTIMER") == 2 and sass.count("SR_CLOCK") >= (11 if plan.dkv_staging.phases else 9)

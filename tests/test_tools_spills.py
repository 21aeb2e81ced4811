"""tools/spill_sweep.py: its grid of spec variants validates (names unique, every flag combination), and
its SASS reading splits a module's listing per CUDA function and finds the spills inside loops that
issue MMAs (hand-written SASS, no compile)."""

import itertools
import re

from conftest import load_tool
from fa4gen.compile.sass import loops
from fa4gen.spec import spec_from_dict


def _tool():
    return load_tool("spill_sweep")


def test_variants_cover_the_grid_with_valid_specs():
    tool = _tool()
    grid = list(tool.variants([(64, 64), (192, 128)], ["none", "window"], [0.0, 20.0], [False, True],
                              [False, True], [False, True], ["bf16", "fp16"]))
    assert len(grid) == 2 * 2 * 2 * 2 * 2 * 2 * 2
    assert len({g["name"] for g in grid}) == len(grid)
    for g in grid:
        spec = spec_from_dict(g)  # every variant is a valid spec
        assert spec.backward and (spec.head_dim, spec.head_dim_v) in ((64, 64), (192, 128))
        assert re.fullmatch(r"[a-z0-9_]+", g["name"])
    # forward-only specs without the LSE (no deterministic twin: a backward property)
    both = list(tool.variants([(64, 64)], ["chunked"], [20.0], [False], [False], [False, True], ["bf16"], [True, False]))
    assert [(g["name"], g["backward"], g["deterministic"]) for g in both] == [
        ("sw_bf16_d64_chunked_sc", True, False), ("sw_bf16_d64_chunked_sc_nolse", False, False),
        ("sw_bf16_d64_chunked_sc_det", True, True)]
    nolse = spec_from_dict(both[1])
    assert not nolse.backward and not nolse.return_lse


def test_sm100_and_poly_variants_are_valid_forward_specs():
    """--arch sm100: forward-only specs (the LSE as return_lse), 2-CTA only where the planner plans it, poly-exp
    shares in the names; the SM90 grid is the same with the new axes at their defaults."""
    tool = _tool()
    grid = list(tool.variants([(128, 128), (192, 128)], ["none", "causal"], [0.0, 20.0], [False], [False, True],
                              [False, True], ["bf16"], [False, True], [0.0, 0.15], [False, True], "sm100"))
    # deterministic and 2-CTA with a mask or varlen are skipped: 2 dims x (no mask: 2 varlen x (1 + 1 two-CTA if not
    # varlen) ... ) counted from the rules themselves
    expect = sum(1 for d, m, sc, vl, det, lse, p, two in itertools.product(
        range(2), ["none", "causal"], range(2), [False, True], [False, True], range(2), range(2), [False, True])
        if not det and not (two and (m != "none" or vl)))
    assert len(grid) == expect
    assert len({g["name"] for g in grid}) == len(grid)
    for g in grid:
        spec = spec_from_dict(g)
        assert spec.targets == ["sm100"] and not spec.backward and not spec.deterministic
        assert spec.return_lse == ("_nolse" not in g["name"])
        assert spec.pipeline.two_cta == g["name"].endswith("_2cta_sm100")
        assert (spec.pipeline.poly_exp.share > 0) == ("_p15" in g["name"])
    sm90 = list(tool.variants([(64, 64)], ["none"], [0.0], [False], [False], [False], ["bf16"], [True], [0.25]))
    assert [g["name"] for g in sm90] == ["sw_bf16_d64_none_p25"] and spec_from_dict(sm90[0]).backward


def test_ping_pong_variants_name_and_set_the_switch():
    """--ping-pong: "auto" leaves the spec's default (no name suffix), 0 / 1 set pipeline.ping_pong (one Q tile per
    CTA on sm100 with 0) and name it _pp0 / _pp1, so each variant keeps a unique name."""
    tool = _tool()
    grid = list(tool.variants([(128, 128)], ["none"], [0.0], [False], [False], [False], ["bf16"], [False], [0.0],
                              [False, True], "sm100", ["auto", False, True]))
    assert [g["name"] for g in grid] == [
        "sw_bf16_d128_none_nolse_sm100", "sw_bf16_d128_none_nolse_pp0_sm100", "sw_bf16_d128_none_nolse_pp1_sm100",
        "sw_bf16_d128_none_nolse_2cta_sm100", "sw_bf16_d128_none_nolse_2cta_pp0_sm100",
        "sw_bf16_d128_none_nolse_2cta_pp1_sm100"]
    for g in grid:
        spec = spec_from_dict(g)
        want = "auto" if "_pp" not in g["name"] else "_pp1" in g["name"]
        assert spec.pipeline.ping_pong == want


def test_sass_functions_and_spills_in_mma_loops():
    tool = _tool()

    def line(addr, text):
        return f"        /*{addr:04x}*/                   {text} ;"

    main = "\n".join([
        line(0x00, "STL [R1], R3"),  # before the loop: not in a loop
        ".L_x_1:",
        line(0x10, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ"),
        line(0x20, "LDL R5, [R1]"),  # inside the MMA loop
        line(0x30, "@P0 BRA `(.L_x_1)"),
        line(0x40, "EXIT"),
    ])
    pre = "\n".join([line(0x00, "STL [R1], R2"), line(0x10, "LDL R2, [R1]"), line(0x20, "EXIT")])
    sass = (f"\t.section\t.text.kernel_cutlass_kernel_x_FlashBwdSm90_object,\"ax\",@progbits\n{main}\n"
            f"\t.section\t.text.kernel_cutlass_kernel_fa4gendevicebwdPreprocess_object,\"ax\",@progbits\n{pre}\n")
    names = {tool._short(name): body for name, body in tool._functions(sass)}
    assert set(names) == {"FlashBwd", "Preprocess"}
    assert len(re.findall(r"\b(?:LDL|STL)\b", names["Preprocess"])) == 2
    assert tool._mma_loop_spills(sass, loops) == [(3, 1, 1)]
    assert tool._mma_loop_spills(sass.replace("LDL R5, [R1]", "IADD3 R5, R5, 1, RZ"), loops) == []


def test_spills_by_setmaxnreg_region():
    """Each LDL/STL counts for the last USETMAXREG before it ("launch" before any), named by the plan's roles; a
    TRY_ALLOC with its predicate and a DEALLOC both open a region; counts shared by two roles name both."""
    from types import SimpleNamespace

    tool = _tool()
    body = "\n".join([
        "STL [R1], R2 ;",
        "USETMAXREG.DEALLOC.CTAPOOL 0x58 ;",
        "LDL R2, [R1] ;",
        "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd8 ;",
        "LDL.64 R4, [R1+0x8] ;",
        "STL.128 [R1+0x10], R8 ;",
        "FFMA R3, R3, R4, R5 ;",  # no spill
        "USETMAXREG.DEALLOC.CTAPOOL 0x20 ;",
        "STL [R1+0x20], R6 ;",
    ])
    plan = SimpleNamespace(regs_softmax=216, regs_correction=112, regs_other=88)
    names = tool.role_names(plan)
    assert names == {216: "softmax", 112: "correction", 88: "other"}
    assert tool.spills_by_role(body, names) == {"launch": 1, "other 88": 1, "softmax 216": 2, "setmaxnreg 32": 1}
    assert tool.spills_by_role(body.replace("LDL", "MOV").replace("STL", "MOV")) == {}
    shared = tool.role_names(SimpleNamespace(regs_producer=24, regs_consumer=240, regs_softmax=0))
    assert shared == {24: "producer", 240: "consumers"}
    assert tool.role_names(SimpleNamespace(regs_softmax=200, regs_correction=88, regs_other=88))[88] == "correction/other"


def test_explicit_tile_and_stage_variants_name_and_set_the_fields():
    """--tile-m / --tile-n / --kv-stages: "auto" leaves the field alone (no suffix); integers set pipeline.tile_m /
    tile_n / kv_stages and name them _m / _n / _kv, so every variant keeps a unique name."""
    tool = _tool()
    grid = list(tool.variants([(128, 128)], ["none"], [0.0], [False], [False], [False], ["bf16"], [False], [0.0],
                              [False], "sm90", ["auto"], ["auto", 192], ["auto", 64, 160], ["auto", 3]))
    assert len(grid) == 2 * 3 * 2 and len({g["name"] for g in grid}) == len(grid)
    by_name = {g["name"]: g for g in grid}
    assert "pipeline" not in by_name["sw_bf16_d128_none_nolse"]
    assert by_name["sw_bf16_d128_none_nolse_m192_n160_kv3"]["pipeline"] == {"tile_m": 192, "tile_n": 160, "kv_stages": 3}
    for g in grid:
        spec = spec_from_dict(g)
        assert spec.pipeline.tile_n == (160 if "_n160" in g["name"] else 64 if "_n64" in g["name"] else "auto")
        assert spec.pipeline.kv_stages == (3 if "_kv3" in g["name"] else "auto")


def test_backward_switch_variants():
    """--bwd-swap-ab / --bwd-dq-atomic set the backward's switches on training specs (named _swap / _atomic) and
    skip forward-only specs, where they would change nothing."""
    tool = _tool()
    grid = list(tool.variants([(64, 64)], ["causal"], [20.0], [False], [False], [False], ["bf16"], [True, False], [0.0],
                              [False], "sm90", ["auto"], ["auto"], ["auto"], ["auto"], ["auto", True, False],
                              ["auto", True]))
    names = [g["name"] for g in grid]
    assert names == ["sw_bf16_d64_causal_sc", "sw_bf16_d64_causal_sc_atomic1", "sw_bf16_d64_causal_sc_swap1",
                     "sw_bf16_d64_causal_sc_swap1_atomic1", "sw_bf16_d64_causal_sc_swap0",
                     "sw_bf16_d64_causal_sc_swap0_atomic1", "sw_bf16_d64_causal_sc_nolse"]
    swap = spec_from_dict(grid[3])
    assert swap.pipeline.bwd_swap_ab is True and swap.pipeline.bwd_dq_atomic is True

"""Plan stage, sm100: every budget of the SM100 forward plan recomputed here from the plan's own numbers,
the TMEM map checked for overlaps, and the refusals checked for the field they name.

Budgets: TMEM 512 columns x 128 lanes per SM; shared memory 227 KB per CTA; 64K registers per SM under
setmaxnreg (four warpgroups of 128 threads).
"""

from __future__ import annotations

import itertools

import pytest

from fa4gen.plan import PlanError, plan_kernels
from fa4gen.plan.protocol import PIPELINE_CLASSES
from fa4gen.spec import spec_from_dict

SMEM_LIMIT = 227 * 1024
TMEM_COLUMNS = 512
REG_FILE = 64 * 1024
HEAD_DIMS = [(64, None), (96, None), (128, None), (192, 128), (192, None), (256, None)]
MASKS = [
    {"kind": "none"},
    {"kind": "causal"},
    {"kind": "sliding_window", "left": 511, "right": 0},
    {"kind": "chunked", "chunk_size": 1024},
]
PIPELINES = [
    {},
    {"ping_pong": False},
    {"tile_n": 64},
    {"poly_exp": {"share": 0.15, "degree": 3}, "rescale_threshold": 0.0},
    {"poly_exp": {"share": 1.0, "degree": 5}, "kv_stages": 2},
]


def _spec(i, hd, mask, pipeline, **extra):
    d = {"name": f"b_{i}", "targets": ["sm100"], "dtype": "bf16", "head_dim": hd[0], "mask": mask,
         "pipeline": pipeline, **extra}
    if hd[1] is not None:
        d["head_dim_v"] = hd[1]
    return spec_from_dict(d)


GRID = [_spec(i, hd, m, p, softcap=30.0 if i % 3 == 0 else 0.0, return_lse=bool(i % 2))
        for i, (hd, m, p) in enumerate(itertools.product(HEAD_DIMS, MASKS, PIPELINES))]


def _plan(spec):
    (plan,) = plan_kernels(spec, "sm100")
    return plan


def _error(spec) -> PlanError:
    with pytest.raises(PlanError) as info:
        _plan(spec)
    return info.value


def _plannable():
    out = []
    for spec in GRID:
        try:
            out.append(pytest.param(_plan(spec), id=spec.name))
        except PlanError:
            pass
    return out


PLANS = _plannable()


def test_grid_is_mostly_plannable():
    assert len(PLANS) >= 0.8 * len(GRID)


def test_default_head_dims_plan_as_designed():
    """The auto choices per head dim (two Q tiles where TMEM and shared memory allow)."""
    want = {64: (2, 128, 4), 128: (2, 128, 3), (192, 128): (2, 64, 2), 192: (1, 128, 2), 256: (1, 64, 3)}
    for key, (q_tiles, tile_n, stages) in want.items():
        d, dv = key if isinstance(key, tuple) else (key, None)
        plan = _plan(_spec(0, (d, dv), {"kind": "causal"}, {}))
        assert (plan.q_tiles, plan.tile_n, plan.kv_stages) == (q_tiles, tile_n, stages), key
        assert plan.ping_pong == (q_tiles == 2) and plan.tile_m == 128 * q_tiles


@pytest.mark.parametrize("plan", PLANS)
def test_budgets_hold(plan):
    d, dv, n, t = plan.head_dim, plan.head_dim_v, plan.tile_n, plan.q_tiles
    # TMEM: S_i (tile_n columns) and O_i (head_dim_v columns) per Q tile
    assert t * (n + dv) <= TMEM_COLUMNS
    assert plan.tmem_cols <= TMEM_COLUMNS and plan.tmem_cols & (plan.tmem_cols - 1) == 0
    # shared memory: barriers padded to 1 KB, O staging and Q per tile, K/V ring (stage = the larger block)
    smem = 1024 + t * 128 * (d + dv) * 2 + plan.kv_stages * n * max(d, dv) * 2
    assert plan.smem_bytes == smem <= SMEM_LIMIT
    assert plan.budgets[0].name.startswith("shared memory") and plan.budgets[0].used == smem
    # registers: softmax warpgroups raise, the others lower below the launch count (128 = 64K / 512)
    assert plan.threads == 512
    assert plan.regs_softmax >= 128 >= max(plan.regs_correction, plan.regs_other)
    assert all(r % 8 == 0 for r in (plan.regs_softmax, plan.regs_correction, plan.regs_other))
    assert 128 * (t * plan.regs_softmax + plan.regs_correction + (3 - t) * plan.regs_other) <= REG_FILE
    assert n + 48 <= plan.regs_softmax  # a softmax thread holds tile_n scores of its 4 rows
    assert plan.kv_stages >= 2


@pytest.mark.parametrize("plan", PLANS)
def test_tmem_map_does_not_overlap(plan):
    n, dv = plan.tile_n, plan.head_dim_v
    regions = []
    for i in range(plan.q_tiles):
        s, o, p, st = plan.tmem_s[i], plan.tmem_o[i], plan.tmem_p[i], plan.tmem_stats[i]
        regions += [(s, s + n), (o, o + dv)]
        # P_i (tile_n 16-bit values = tile_n / 2 columns) and the statistics live inside S_i, apart
        assert s <= st < st + plan.stats_cols <= p and p + n // 2 <= s + n
    regions.sort()
    assert all(a[1] <= b[0] for a, b in zip(regions, regions[1:]))
    assert regions[-1][1] <= plan.tmem_cols


@pytest.mark.parametrize("plan", PLANS)
def test_pipelines_match_the_plan(plan):
    pipes = {p.name: p for p in plan.pipelines}
    assert set(pipes) == {"q", "kv", "sp", "stats", "o"}
    assert all(p.cls in PIPELINE_CLASSES for p in pipes.values())
    assert pipes["kv"].stages == plan.kv_stages and pipes["q"].stages == plan.q_tiles
    assert pipes["q"].tx_bytes == plan.q_bytes == 128 * plan.head_dim * 2
    assert pipes["kv"].tx_bytes == plan.k_bytes == plan.tile_n * plan.head_dim * 2
    assert plan.v_bytes == plan.tile_n * plan.head_dim_v * 2
    # the MMA warp releases S_i once per step; softmax (128) and correction (128) threads release it
    assert pipes["sp"].consumer_arrivals == 256 and pipes["sp"].producer_start_phase == 0
    ids = [b.barrier_id for b in plan.named_barriers]
    assert len(set(ids)) == len(ids) and 0 not in ids


@pytest.mark.parametrize("plan", PLANS)
def test_poly_share_is_what_the_kernel_does(plan):
    cols = plan.tile_n // 4
    if plan.poly_every == 0:
        assert plan.poly_share == 0.0
    else:
        emulated = sum(1 for c in range(cols) if c % plan.poly_every == plan.poly_every - 1)
        assert emulated > 0 and plan.poly_share == emulated / cols


def test_scheduler_persistent_without_mask_longest_first_with():
    assert _plan(_spec(0, (128, None), {"kind": "none"}, {})).scheduler == "persistent"
    for mask in MASKS[1:]:
        assert _plan(_spec(0, (128, None), mask, {})).scheduler == "lpt"


@pytest.mark.parametrize("mask,hd", [({"kind": "causal"}, (128, None)), ({"kind": "none"}, (64, None)),
                                     ({"kind": "none"}, (256, None))])
def test_two_cta_refused_where_not_allowed(mask, hd):
    err = _error(_spec(0, hd, mask, {"two_cta": True}))
    assert [p.location for p in err.problems] == ["pipeline.two_cta"]
    assert "non-causal" in err.problems[0].message and "128 or 192" in err.problems[0].message


@pytest.mark.parametrize("hd", [(128, None), (192, 128), (192, None)])
def test_two_cta_plan_where_allowed(hd):
    """Non-causal, head_dim 128/192: a CTA pair (cluster of 2 along M) sharing 256-row cta_group::2 MMAs.
    Each CTA holds its 128 rows of Q/S/P/O (the TMEM map is the one-CTA map), and half of each K block
    (tile_n / 2 keys) and V block (head_dim_v / 2 columns); the even CTA's full barriers expect both halves."""
    one = _plan(_spec(0, hd, {"kind": "none"}, {}))
    plan = _plan(_spec(0, hd, {"kind": "none"}, {"two_cta": True}))
    assert plan.two_cta and plan.cluster_m == 2 and plan.mma_m == 256
    assert plan.tile_m == 2 * 128 * plan.q_tiles  # rows of a work tile: the pair's
    d, dv = plan.head_dim, plan.head_dim_v
    assert plan.q_bytes == 128 * d * 2
    assert plan.k_bytes == plan.tile_n // 2 * d * 2 and plan.v_bytes == plan.tile_n * dv // 2 * 2
    pipes = {p.name: p for p in plan.pipelines}
    assert pipes["q"].tx_bytes == 2 * plan.q_bytes and pipes["kv"].tx_bytes == 2 * plan.k_bytes
    assert pipes["sp"].consumer_arrivals == 512 and pipes["o"].consumer_arrivals == 256
    assert plan.tmem_cols <= 512 and plan.q_tiles * (plan.tile_n + dv) <= 512
    assert plan.smem_bytes <= 227 * 1024
    # half a K/V stage per CTA: at least the stages of the one-CTA plan with the same tiles
    if (plan.q_tiles, plan.tile_n) == (one.q_tiles, one.tile_n):
        assert plan.kv_stages >= one.kv_stages and plan.smem_bytes < one.smem_bytes
    assert any(n.startswith("two_cta:") for n in plan.notes)
    assert not one.two_cta and one.cluster_m == 1 and one.mma_m == 128


def test_ping_pong_over_the_tmem_budget_names_tmem():
    err = _error(_spec(0, (256, None), {"kind": "causal"}, {"ping_pong": True}))
    assert [p.location for p in err.problems] == ["pipeline.ping_pong"]
    assert "TMEM budget exceeded" in str(err) and "512" in str(err)


def test_shared_memory_over_budget_names_shared_memory():
    err = _error(_spec(0, (256, None), {"kind": "causal"}, {"tile_n": 128, "kv_stages": 2}))
    assert err.problems[0].location == "pipeline.kv_stages"
    assert "shared memory budget exceeded" in str(err)


def test_one_kv_stage_is_refused():
    err = _error(_spec(0, (128, None), {"kind": "causal"}, {"kv_stages": 1}))
    assert err.problems[0].location == "pipeline.kv_stages" and "at least 2 stages" in str(err)


def test_softmax_register_budget():
    err = _error(_spec(0, (64, None), {"kind": "none"}, {"tile_n": 256, "ping_pong": False}))
    assert "pipeline.tile_n" in [p.location for p in err.problems]
    assert "register" in str(err)


def test_too_small_poly_share_is_refused():
    err = _error(_spec(0, (128, None), {"kind": "none"}, {"poly_exp": {"share": 0.01, "degree": 3}}))
    assert [p.location for p in err.problems] == ["pipeline.poly_exp.share"]


@pytest.mark.parametrize("pipeline,field", [({"tile_m": 192}, "pipeline.tile_m"), ({"tile_n": 48}, "pipeline.tile_n"),
                                            ({"ping_pong": False, "tile_m": 256}, "pipeline.tile_m")])
def test_bad_tiles_name_the_field(pipeline, field):
    err = _error(_spec(0, (128, None), {"kind": "none"}, pipeline))
    assert field in [p.location for p in err.problems]


def test_plans_are_deterministic_and_round_trip():
    spec = _spec(0, (128, None), {"kind": "causal"}, {"poly_exp": {"share": 0.15, "degree": 3}})
    a, b = _plan(spec), _plan(spec)
    assert a == b and a.to_json() == b.to_json()
    assert "pipelines" in a.to_dict() and a.to_dict()["pipelines"][0]["name"] == "q"


@pytest.mark.parametrize("mask", [{"kind": "none"}, {"kind": "causal"}])
def test_varlen_tiles_without_keys_run_one_masked_block(mask):
    """A varlen sequence without keys (cu_seqlens_k empty for it, or seqused_k 0) and the grid's padding
    tiles past a sequence's end must run one fully masked key block, as every role takes one pipeline step
    per block: the no-mask SM100 forward took blocks [0, ceil(0 / tile_n)) and its loops started at block
    n_max - 1 = -1, the TILE_N rows before the sequence (another sequence's keys, or before the tensor),
    and padding tiles ran their sequence's whole key range (a review of the SM100 kernel against SM90's,
    session 13; there is no Blackwell GPU to run it, so the rendered kernel is checked)."""
    import re

    from fa4gen.builder import render_spec

    spec = spec_from_dict(dict(name="vl_nokeys", targets=["sm100"], dtype="bf16", head_dim=128, varlen=True,
                               mask=mask))
    pkg, _, _ = render_spec(spec, "t")
    code = pkg.files["fwd_sm100.py"]
    # padding tiles: no keys for them
    assert re.search(r"if m_block \* TILE_M >= seqlen_q:\n(\s*#.*\n)*\s*seqlen_k = Int32\(0\)", code)
    if mask["kind"] == "none":
        assert "n_min, n_max = Int32(0), cutlass.max(cute.ceil_div(seqlen_k, TILE_N), 1)" in code
    else:
        assert "bw.key_blocks(bounds, TILE_N)" in code  # never empty either
    assert "cute.ceil_div(seqlen_k, TILE_N)\n" not in code


def test_masked_sm100_groups_pairs_as_sm90_does():
    """The SM100 longest-first order uses the SM90 forward's groups (pow2_group of the L2 fit), which makes
    tile_coords walk the SM90 grid's launch order (tests/test_sm100_layouts.py); with the bare L2 fit the
    groups differed (e.g. 10 against 8 pairs for deepseek_mla at s8k, a session-13 review)."""
    from pathlib import Path

    from fa4gen.builder import render_spec
    from fa4gen.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parents[1] / "specs" / "deepseek_mla.yaml")
    pkg, _, _ = render_spec(spec, "t")
    code = pkg.files["fwd_sm100.py"]
    assert "lpt_group = schedule.pow2_group(" in code and "longest_first_order=LONGEST_FIRST" in code

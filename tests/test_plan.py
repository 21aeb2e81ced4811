"""Plan stage: invariants of every SM90 KernelPlan, for the committed specs and a grid of spec dicts.

Every budget is recomputed here from the plan's own numbers (not read back from the planner's
formula), the poly-exp fit is re-measured with `math` on a dense grid, and the error cases check
which field the PlanError names.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path

import pytest

from fa4gen.plan import ARCHS, Budget, KernelPlan, NotAvailableError, PlanError, plan_kernels
from fa4gen.spec import load_spec, spec_from_dict

ROOT = Path(__file__).resolve().parents[1]
SPEC_FILES = sorted((ROOT / "specs").glob("*.yaml"))

SMEM_LIMIT_SM90 = 227 * 1024  # opt-in shared memory per block on H100/H200
REG_FILE_SM90 = 64 * 1024  # 32-bit registers per SM
ELEM_BYTES = {"bf16": 2, "fp16": 2}


# --- the grid of valid spec dicts ------------------------------------------------------------

HEAD_DIMS = [(64, None), (96, None), (128, None), (192, 128), (256, None)]
DTYPES = ["bf16", "fp16"]
MASKS = [
    {"kind": "none"},
    {"kind": "causal"},
    {"kind": "sliding_window", "left": 511, "right": 0},
    {"kind": "sliding_window", "left": None, "right": 32},
    {"kind": "sliding_window", "left": 100, "right": None},
    {"kind": "chunked", "chunk_size": 1024},
]
PIPELINES = [
    {},
    {"tile_n": 64, "kv_stages": 3},
    {"ping_pong": False, "tile_m": 128},
    {"poly_exp": {"share": 0.15, "degree": 3}, "rescale_threshold": 0.0},
    {"poly_exp": {"share": 0.5, "degree": 5}, "tile_n": 48},
    {"poly_exp": {"share": 1.0, "degree": 4}, "kv_stages": 1},
    {"poly_exp": {"share": 0.3, "degree": 3}, "ping_pong": True, "kv_stages": "auto"},
    {"poly_exp": {"share": 0.0, "degree": 1}, "rescale_threshold": 14.0},
    {"intra_wg_overlap": False, "tile_n": 32, "kv_stages": 4},
]


def _spec_dict(i: int, hd, dtype, mask, pipeline, **extra) -> dict:
    head_dim, head_dim_v = hd
    d = {
        "name": f"grid_{i}",
        "targets": ["sm90"],
        "dtype": dtype,
        "head_dim": head_dim,
        "mask": mask,
        "pipeline": pipeline,
        **extra,
    }
    if head_dim_v is not None:
        d["head_dim_v"] = head_dim_v
    return d


GRID = [
    _spec_dict(i, hd, dt, m, p, softcap=(30.0 if i % 3 == 0 else 0.0), return_lse=bool(i % 2))
    for i, (hd, dt, m, p) in enumerate(itertools.product(HEAD_DIMS, DTYPES, MASKS, PIPELINES))
]


def _expected_smem(d: dict) -> int:
    """Shared memory the grid point needs by hand: Q tile + K/V stages (barriers excluded)."""
    head_dim = d["head_dim"]
    head_dim_v = d.get("head_dim_v") or head_dim
    auto_n = {64: 128, 96: 128, 128: 128, 192: 112, 256: 64}[head_dim]
    tile_n = d["pipeline"].get("tile_n", auto_n)
    stages = d["pipeline"].get("kv_stages", "auto")
    stages = 2 if stages == "auto" else stages
    tile_m = d["pipeline"].get("tile_m", "auto")
    tile_m = (192 if head_dim <= 64 else 128) if tile_m == "auto" else tile_m  # upper bound for auto
    e = ELEM_BYTES[d["dtype"]]
    return tile_m * head_dim * e + stages * tile_n * (head_dim + head_dim_v) * e


def _plan(d: dict) -> KernelPlan:
    return _fwd_plan(spec_from_dict(d))


def _fwd_plans(spec) -> list[KernelPlan]:
    """The forward plans: the default one, then any picked per call from some seqlen_q on or for some seqlen_q
    ranges (a spec with backward: true also gets a bwd plan, checked further below, with allow_gqa its MHA
    twin before it and, neither deterministic nor varlen, the head-loop GQA kernel before both)."""
    plans = plan_kernels(spec, "sm90")
    fwd = [p for p in plans if p.direction == "fwd"]
    gqa = spec.backward and spec.allow_gqa
    loop = gqa and not (spec.deterministic or spec.varlen) and max(spec.head_dim, spec.head_dim_v) <= 128
    bwd = ["bwd"] * (spec.backward + gqa + loop)
    assert [p.direction for p in plans] == ["fwd"] * len(fwd) + bwd
    assert [p.min_seqlen_q > 0 or bool(p.seqlen_q_ranges) for p in fwd] == [False] + [True] * (len(fwd) - 1)
    assert not any(p.min_seqlen_q and p.seqlen_q_ranges for p in fwd)
    return fwd


def _fwd_plan(spec) -> KernelPlan:
    return _fwd_plans(spec)[0]


def _all_plans():
    """(id, spec, plan) for every committed spec's sm90 plan and every plannable grid point."""
    out = []
    for path in SPEC_FILES:
        spec = load_spec(path)
        if "sm90" in spec.targets:
            out.append(pytest.param(spec, id=path.stem))
    for d in GRID:
        if _expected_smem(d) + 1024 <= SMEM_LIMIT_SM90:
            out.append(pytest.param(spec_from_dict(d), id=d["name"]))
    return out


ALL = _all_plans()


def _budget(plan: KernelPlan, word: str) -> Budget:
    (b,) = [b for b in plan.budgets if word in b.name]
    return b


# --- invariants --------------------------------------------------------------------------------


def test_grid_is_mostly_plannable():
    """The grid must exercise real plans (guards against a grid that silently filters itself out)."""
    plannable = [d for d in GRID if _expected_smem(d) + 1024 <= SMEM_LIMIT_SM90]
    assert len(plannable) >= 0.8 * len(GRID)
    assert len(SPEC_FILES) == 10


@pytest.mark.parametrize("spec", ALL)
def test_resource_invariants(spec):
    for plan in _fwd_plans(spec):
        # warp roles: one producer warpgroup + 64-row consumer warpgroups
        assert plan.tile_m == 64 * plan.num_mma_warpgroups
        assert plan.threads == 128 * (1 + plan.num_mma_warpgroups)
        assert plan.tile_n % 16 == 0 and 16 <= plan.tile_n <= 256
        assert plan.kv_stages >= 1
        # shared memory: recompute from the plan's own tile numbers
        smem = _budget(plan, "shared memory")
        assert smem.limit == SMEM_LIMIT_SM90 and smem.unit == "bytes"
        e = ELEM_BYTES[plan.dtype]
        tiles = plan.q_stages * plan.tile_m * plan.head_dim * e + plan.kv_stages * plan.tile_n * (plan.head_dim + plan.head_dim_v) * e
        if plan.scheduler == "persistent":
            tiles += plan.tile_m * plan.head_dim_v * e  # O's own buffer
        assert tiles <= smem.used <= tiles + 1024, "smem budget must count the Q and K/V tiles (+ barriers)"
        assert smem.used <= smem.limit
        # register file: producer + consumer warpgroups under setmaxnreg
        reg_file = 128 * plan.regs_producer + 128 * plan.num_mma_warpgroups * plan.regs_consumer
        assert reg_file <= REG_FILE_SM90
        assert _budget(plan, "register file").used == reg_file
        assert plan.regs_consumer % 8 == 0 and plan.regs_producer % 8 == 0  # setmaxnreg granularity
        regs = _budget(plan, "consumer registers")
        # fp32 O (dv/2) + fp32 S (tile_n/2) + 16-bit P (tile_n/4) per thread, at least
        assert regs.used >= plan.head_dim_v // 2 + plan.tile_n // 2 + plan.tile_n // 4
        assert regs.used <= regs.limit == plan.regs_consumer


@pytest.mark.parametrize("spec", ALL)
def test_spec_fields_carried_into_plan(spec):
    plan = _fwd_plan(spec)
    p = spec.pipeline
    assert (plan.arch, plan.cute_arch, plan.direction) == ("sm90", "sm_90a", "fwd")
    assert plan.name == spec.name and plan.dtype == spec.dtype
    assert (plan.cutlass_dtype, plan.torch_dtype) == {
        "bf16": ("BFloat16", "bfloat16"), "fp16": ("Float16", "float16")
    }[spec.dtype]
    assert (plan.head_dim, plan.head_dim_v) == (spec.head_dim, spec.head_dim_v)
    if p.tile_m != "auto":
        assert plan.tile_m == p.tile_m
    if p.tile_n != "auto":
        assert plan.tile_n == p.tile_n
    if p.kv_stages != "auto":
        assert plan.kv_stages == p.kv_stages
    if p.ping_pong != "auto":
        assert plan.ping_pong is p.ping_pong
    if p.intra_wg_overlap != "auto":
        assert plan.intra_wg_overlap is p.intra_wg_overlap
    assert plan.softcap == spec.softcap and plan.has_softcap == (spec.softcap > 0)
    assert plan.rescale_threshold == (8.0 if p.rescale_threshold == "auto" else p.rescale_threshold)
    assert plan.write_lse == (spec.return_lse or spec.backward)  # the backward needs the LSE
    assert plan.allow_gqa == spec.allow_gqa


@pytest.mark.parametrize("spec", ALL)
def test_mask_fields_match_spec(spec):
    plan = _fwd_plan(spec)
    m = spec.mask
    assert plan.mask_kind == m.kind
    assert plan.causal == (m.kind == "causal")
    assert plan.local == (m.kind == "sliding_window")
    assert plan.chunked == (m.kind == "chunked")
    assert plan.has_mask == (m.kind != "none")
    if m.kind == "sliding_window":
        assert plan.window_left == (-1 if m.left is None else m.left)
        assert plan.window_right == (-1 if m.right is None else m.right)
    else:
        assert (plan.window_left, plan.window_right) == (-1, -1)
    assert plan.chunk_size == (m.chunk_size if m.kind == "chunked" else 0)


def _walk(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _walk(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _walk(v)
    else:
        yield value


@pytest.mark.parametrize("spec", ALL)
def test_auto_is_resolved(spec):
    plan = _fwd_plan(spec)
    leaves = list(_walk(plan.to_dict()))
    assert "auto" not in leaves
    assert not any(isinstance(v, str) and "auto" == v.strip().lower() for v in leaves)
    assert isinstance(plan.ping_pong, bool) and isinstance(plan.intra_wg_overlap, bool)
    assert all(isinstance(getattr(plan, f), int) and not isinstance(getattr(plan, f), bool)
               for f in ("tile_m", "tile_n", "kv_stages", "threads"))


# --- poly-exp ----------------------------------------------------------------------------------


def _horner(coeffs, f):
    p = 0.0
    for c in reversed(coeffs):
        p = p * f + c
    return p


def _max_rel_error(coeffs, points=20000):
    return max(abs(_horner(coeffs, k / points) / 2.0 ** (k / points) - 1.0) for k in range(points))


@pytest.mark.parametrize("spec", ALL)
def test_poly_every_matches_share(spec):
    plan = _fwd_plan(spec)
    share = spec.pipeline.poly_exp.share
    if share == 0.0:
        assert plan.poly_every == 0 and plan.poly_share == 0.0
    else:
        assert plan.poly_every >= 1
        cols = plan.tile_n // 4  # elements of one row a thread holds
        taken = sum(1 for c in range(cols) if c % plan.poly_every == plan.poly_every - 1)
        assert plan.poly_share == pytest.approx(taken / cols)  # the share the kernel really runs
        assert abs(plan.poly_share - share) <= 0.5 / plan.poly_every + 1.0 / cols + 1e-12


@pytest.mark.parametrize("degree", [1, 2, 3, 4, 5])
def test_poly_coefficients_fit_exp2(degree):
    # degrees below 3 are refused once the polynomial is used, but their fit is still planned
    share = 0.25 if degree >= 3 else 0.0
    plan = _plan(_spec_dict(0, (128, None), "bf16", {"kind": "causal"},
                            {"poly_exp": {"share": share, "degree": degree}}))
    assert plan.poly_degree == degree
    assert len(plan.poly_coeffs) == degree + 1
    assert plan.poly_coeffs[0] == 1.0  # integral inputs stay exact
    err = _max_rel_error(plan.poly_coeffs)
    assert err == pytest.approx(plan.poly_max_rel_error, rel=0.10)
    if degree >= 3:
        assert err < 2.0**-10
    # a higher degree must fit strictly better (checks the fit, not just its self-report)
    if degree > 1:
        lower = _plan(_spec_dict(0, (128, None), "bf16", {"kind": "causal"},
                                 {"poly_exp": {"share": 0.0, "degree": degree - 1}}))
        assert err < _max_rel_error(lower.poly_coeffs)


@pytest.mark.parametrize("degree", [1, 2])
def test_low_poly_degree_is_refused_when_used(degree):
    with pytest.raises(PlanError) as info:
        _plan(_spec_dict(0, (128, None), "bf16", {"kind": "causal"}, {"poly_exp": {"share": 0.25, "degree": degree}}))
    assert any(p.location == "pipeline.poly_exp.degree" for p in info.value.problems)


@pytest.mark.parametrize("dtype,limit", [("fp16", 14.0), ("bf16", 64.0)])
def test_rescale_threshold_limit_by_dtype(dtype, limit):
    _plan(_spec_dict(0, (64, None), dtype, {"kind": "causal"}, {"rescale_threshold": limit}))
    with pytest.raises(PlanError) as info:
        _plan(_spec_dict(0, (64, None), dtype, {"kind": "causal"}, {"rescale_threshold": limit + 1}))
    assert any(p.location == "pipeline.rescale_threshold" for p in info.value.problems)


def _effective_share(plan: KernelPlan) -> float:
    """Share of a thread's exp2s the SM90 kernel evaluates with the polynomial.

    A consumer thread holds 2 rows x tile_n/4 columns of S; online_softmax_step uses the polynomial
    at local column c when c % poly_every == poly_every - 1.
    """
    cols = plan.tile_n // 4
    if plan.poly_every == 0:
        return 0.0
    return sum(1 for c in range(cols) if c % plan.poly_every == plan.poly_every - 1) / cols


@pytest.mark.parametrize("head_dim,share", [(128, 0.15), (128, 0.3), (128, 0.5), (128, 1.0), (256, 0.15),
                                            (128, 0.04)])
def test_poly_share_is_what_the_kernel_does(head_dim, share):
    plan = _plan(_spec_dict(0, (head_dim, None), "bf16", {"kind": "causal"}, {"poly_exp": {"share": share}}))
    assert abs(_effective_share(plan) - share) <= 0.5 / plan.poly_every


@pytest.mark.parametrize("head_dim,share", [(128, 0.01), (128, 0.02), (256, 0.04), (128, 1e-310), (128, 5e-324)])
def test_small_poly_share_is_not_silently_dropped(head_dim, share):
    # (subnormal shares: 1 / share is inf, whose round() raised OverflowError out of the planner, session 13 review)
    d = _spec_dict(0, (head_dim, None), "bf16", {"kind": "causal"}, {"poly_exp": {"share": share}})
    try:
        plan = _plan(d)
    except PlanError as err:  # refusing the share is acceptable too
        assert any("poly_exp" in p.location for p in err.problems)
        return
    assert _effective_share(plan) > 0.0
    assert abs(_effective_share(plan) - share) <= 0.5 / plan.poly_every


# --- errors ------------------------------------------------------------------------------------


def _plan_error(d: dict) -> PlanError:
    with pytest.raises(PlanError) as info:
        _plan(d)
    return info.value


def test_smem_budget_exceeded_names_shared_memory():
    d = _spec_dict(0, (256, None), "bf16", {"kind": "causal"}, {"tile_n": 256, "kv_stages": 4})
    err = _plan_error(d)
    assert not isinstance(err, NotAvailableError)
    assert "shared memory" in str(err)
    smem_problems = [p for p in err.problems if "shared memory" in p.message]
    assert len(smem_problems) == 1 and smem_problems[0].location.startswith("pipeline")
    message = smem_problems[0].message
    assert str(SMEM_LIMIT_SM90) in message
    need = int(re.search(r"need (\d+) bytes", message).group(1))
    assert _expected_smem(d) <= need <= _expected_smem(d) + 1024


@pytest.mark.parametrize("d", [d for d in GRID if _expected_smem(d) > SMEM_LIMIT_SM90], ids=lambda d: d["name"])
def test_grid_points_over_budget_are_refused(d):
    assert "shared memory" in str(_plan_error(d))


def test_smem_budget_boundary():
    """head_dim 256 with 2 stages of 80 keys fits in 227 KB; 3 stages do not."""
    ok = _plan(_spec_dict(0, (256, None), "bf16", {"kind": "none"}, {"tile_n": 80, "kv_stages": 2}))
    assert _budget(ok, "shared memory").used <= SMEM_LIMIT_SM90
    err = _plan_error(_spec_dict(0, (256, None), "bf16", {"kind": "none"}, {"tile_n": 80, "kv_stages": 3}))
    assert "shared memory" in str(err)


@pytest.mark.parametrize("tile_m", [64, 256])
def test_tile_m_outside_the_sm90_family_refused(tile_m):
    err = _plan_error(_spec_dict(0, (128, None), "bf16", {"kind": "causal"}, {"tile_m": tile_m}))
    assert [p.location for p in err.problems] == ["pipeline.tile_m"]
    assert str(tile_m) in err.problems[0].message


@pytest.mark.parametrize("head_dim,tile_m", [(128, 128), (64, 128), (64, 192), (64, "auto")])
def test_tile_m_two_or_three_warpgroups(head_dim, tile_m):
    plan = _plan(_spec_dict(0, (head_dim, None), "bf16", {"kind": "causal"}, {"tile_m": tile_m}))
    want = plan.tile_m if tile_m == "auto" else tile_m
    assert want in (128, 192)  # auto picks one of the two sm90 shapes
    assert plan.tile_m == want and plan.num_mma_warpgroups == want // 64
    assert plan.threads == 128 * (1 + want // 64)
    assert 128 * plan.regs_producer + 128 * plan.num_mma_warpgroups * plan.regs_consumer <= REG_FILE_SM90


def test_masked_head_dim_64_auto_gets_a_long_192_row_kernel():
    """tile_m auto on a masked d <= 64 spec: the default 128-row forward plus a 192-row one the API runs
    from LONG_SEQLEN_Q on; an explicit tile_m or a larger head dim get the persistent forward and its twin."""
    from fa4gen.plan.sm90 import LONG_SEQLEN_Q, PERSISTENT_MAX_SEQLEN_Q_MASKED

    spec = spec_from_dict(_spec_dict(0, (64, None), "bf16", {"kind": "causal"}, {}))
    fwd = [p for p in plan_kernels(spec, "sm90") if p.direction == "fwd"]
    assert [(p.module, p.tile_m, p.min_seqlen_q) for p in fwd] == [
        ("fwd_sm90", 128, 0), ("fwd_sm90_long", 192, LONG_SEQLEN_Q)]
    assert fwd[1].num_mma_warpgroups == 3 and fwd[1].threads == 512
    # the two differ in tiling only: same mask, softmax and interface
    same = {f.name for f in dataclasses.fields(KernelPlan)} - {
        "module", "tile_m", "num_mma_warpgroups", "threads", "regs_producer", "regs_consumer", "budgets", "notes",
        "min_seqlen_q", "scheduler", "persistent_ctas", "skip_idle_warpgroups", "q_stages"}
    assert all(getattr(fwd[0], f) == getattr(fwd[1], f) for f in same)
    # the persistent 128-row kernel takes auto's two Q buffers; the one-CTA-per-tile one loads its Q once
    assert (fwd[0].q_stages, fwd[1].q_stages) == (2, 1)
    # only the 192-row one-CTA-per-tile kernel lets a warpgroup without rows skip its work
    assert (fwd[0].skip_idle_warpgroups, fwd[1].skip_idle_warpgroups) == (False, True)
    # the 128-row one is persistent (its calls end below LONG_SEQLEN_Q), the 192-row one longest-first
    assert [(p.scheduler, p.persistent_ctas) for p in fwd] == [("persistent", 132), ("grid_lpt", 0)]
    assert any("fwd_sm90_long" in n for n in fwd[0].notes) and any("dispatch" in n for n in fwd[1].notes)
    spec = spec_from_dict(_spec_dict(0, (64, None), "bf16", {"kind": "causal"}, {"tile_m": 192}))
    assert [p.module for p in plan_kernels(spec, "sm90") if p.direction == "fwd"] == ["fwd_sm90"]  # 3 warpgroups
    for extra, head_dim in (({"tile_m": 128}, 64), ({}, 128)):
        spec = spec_from_dict(_spec_dict(0, (head_dim, None), "bf16", {"kind": "causal"}, extra))
        # no 192-row kernel: the persistent forward and its one-CTA-per-tile twin (same tiles)
        fwd = [p for p in plan_kernels(spec, "sm90") if p.direction == "fwd"]
        assert [(p.module, p.min_seqlen_q, p.tile_m) for p in fwd] == [
            ("fwd_sm90", 0, fwd[0].tile_m), ("fwd_sm90_long", PERSISTENT_MAX_SEQLEN_Q_MASKED, fwd[0].tile_m)]
    spec = spec_from_dict(_spec_dict(0, (64, None), "bf16", {"kind": "none"}, {}))
    assert [(p.module, p.tile_m, p.scheduler) for p in plan_kernels(spec, "sm90")] == [
        ("fwd_sm90", 192, "persistent"), ("fwd_sm90_long", 192, "grid"),
        ("fwd_sm90_rows128", 128, "persistent")]  # no mask: see the persistent and the rows128 tests


def test_tile_m_192_with_head_dim_128_is_over_the_register_budget():
    """Three consumer warpgroups leave 160 registers a thread; d128 with 128-key tiles needs more."""
    err = _plan_error(_spec_dict(0, (128, None), "bf16", {"kind": "causal"}, {"tile_m": 192}))
    assert all(p.location.startswith("pipeline.") for p in err.problems)
    assert "register" in str(err)
    # with smaller key tiles it fits
    plan = _plan(_spec_dict(0, (128, None), "bf16", {"kind": "causal"}, {"tile_m": 192, "tile_n": 64}))
    assert (plan.tile_m, plan.num_mma_warpgroups, plan.regs_consumer) == (192, 3, 160)


def test_varlen_plans_on_sm90_and_sm100_and_refuses_two_cta_by_name():
    spec = spec_from_dict(_spec_dict(0, (128, None), "bf16", {"kind": "causal"}, {}, varlen=True, backward=True,
                                     deterministic=True))
    fwd, mha, bwd = plan_kernels(spec, "sm90")  # (allow_gqa, the default: the MHA calls' backward too)
    assert fwd.varlen and bwd.varlen and bwd.deterministic
    assert mha.mha_only and mha.varlen and mha.deterministic
    (b_fwd,) = plan_kernels(spec_from_dict({**_spec_dict(0, (128, None), "bf16", {"kind": "causal"}, {}, varlen=True),
                                            "targets": ["sm100"]}), "sm100")
    assert b_fwd.varlen
    with pytest.raises(PlanError) as info:
        plan_kernels(spec_from_dict({**_spec_dict(0, (128, None), "bf16", {"kind": "none"}, {"two_cta": True},
                                                  varlen=True), "targets": ["sm100"]}), "sm100")
    assert [p.location for p in info.value.problems] == ["varlen"]
    assert "not available" in info.value.problems[0].message


@pytest.mark.parametrize("head_dim", [8, 40, 120])
def test_head_dim_not_multiple_of_16_refused(head_dim):
    err = _plan_error(_spec_dict(0, (head_dim, None), "bf16", {"kind": "none"}, {}))
    assert "head_dim" in [p.location for p in err.problems]


def test_unavailable_family_raises_not_available(monkeypatch):
    """A target registered as unavailable (as sm100 was before its family existed) gets NotAvailableError."""
    from fa4gen.plan import ArchFamily

    monkeypatch.setitem(ARCHS, "sm100", ArchFamily("sm100", "sm_100a", (), unavailable="not available yet (test)"))
    spec = spec_from_dict(_spec_dict(0, (128, None), "bf16", {"kind": "causal"}, {}) | {"targets": ["sm90", "sm100"]})
    with pytest.raises(NotAvailableError) as info:
        plan_kernels(spec, "sm100")
    assert "not available yet" in str(info.value)
    assert isinstance(info.value, PlanError)
    # the sm90 target of the same spec still plans
    assert plan_kernels(spec, "sm90")[0].arch == "sm90"


def test_sm100_is_available():
    spec = spec_from_dict(_spec_dict(0, (128, None), "bf16", {"kind": "causal"}, {}) | {"targets": ["sm90", "sm100"]})
    assert not ARCHS["sm100"].unavailable
    assert plan_kernels(spec, "sm100")[0].arch == "sm100"


def test_arch_not_in_targets_or_unknown():
    spec = spec_from_dict(_spec_dict(0, (128, None), "bf16", {"kind": "causal"}, {}))
    with pytest.raises(PlanError) as info:
        plan_kernels(spec, "sm100")
    assert not isinstance(info.value, NotAvailableError)
    assert info.value.problems[0].location == "targets"
    with pytest.raises(PlanError, match="unknown arch"):
        plan_kernels(spec, "sm80")


# --- printing, serialization, determinism ------------------------------------------------------

HEADER_FIELDS = ("name", "arch", "direction", "module")


@pytest.mark.parametrize("spec", ALL[:7])
def test_describe_lists_every_field(spec):
    plan = _fwd_plan(spec)
    text = plan.describe()
    lines = text.splitlines()
    # identity fields are in the header line, by value
    assert lines[0] == f"plan {plan.name} [{plan.arch} {plan.direction}] -> module {plan.module}"
    labels = {line.split()[0].rstrip(":") for line in lines[1:] if line.strip()}
    for f in dataclasses.fields(KernelPlan):
        if f.name in HEADER_FIELDS:
            continue
        if f.name == "notes" and not plan.notes:
            continue
        assert f.name in labels, f"describe() does not show {f.name}"
    for b in plan.budgets:
        assert f"{b.name}: {b.used} / {b.limit} {b.unit}" in text
    for n in plan.notes:
        assert n in text
    assert ["tile_n", str(plan.tile_n)] in [line.split() for line in lines]
    assert ["tile_m", str(plan.tile_m)] in [line.split() for line in lines]


@pytest.mark.parametrize("spec", ALL)
def test_to_json_round_trips(spec):
    plan = _fwd_plan(spec)
    data = json.loads(plan.to_json())
    data["budgets"] = tuple(Budget(**b) for b in data["budgets"])
    data["notes"] = tuple(data["notes"])
    data["poly_coeffs"] = tuple(data["poly_coeffs"])

    def tuples(v):  # JSON has no tuples: every other sequence field comes back as a list
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v

    data = {k: tuples(v) for k, v in data.items()}
    back = KernelPlan(**data)
    assert back == plan
    assert back.to_json() == plan.to_json()


@pytest.mark.parametrize("spec", ALL[:7])
def test_plans_are_deterministic(spec):
    a = plan_kernels(spec, "sm90")
    b = plan_kernels(spec_from_dict(spec.model_dump(mode="json")), "sm90")
    assert a == b
    assert [p.to_json() for p in a] == [p.to_json() for p in b]
    assert hash(a[0]) == hash(b[0])


@pytest.mark.parametrize("dims", [(64, None), (96, None), (128, None), (192, 128), (192, None), (256, None)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_plan_fits_the_budgets(dims, deterministic):
    """backward: true adds a bwd plan next to the fwd one; its tiles fit shared memory, the register
    estimate stays within setmaxnreg; Sᵀ (P in registers) by default for d <= 128."""
    spec = spec_from_dict(_spec_dict(0, dims, "bf16", {"kind": "causal"}, {}, backward=True, deterministic=deterministic))
    # (d64 with a mask: a 192-row forward for long calls first; GQA without determinism, d <= 128: the head-loop
    # backward before the MHA one)
    plans = [p for p in plan_kernels(spec, "sm90") if p.module != "bwd_sm90_gqa"]
    *_, fwd, mha, bwd = plans
    assert (fwd.direction, bwd.direction, bwd.module) == ("fwd", "bwd", "bwd_sm90")
    assert (mha.direction, mha.module, mha.mha_only) == ("bwd", "bwd_sm90_mha", True)  # allow_gqa's MHA twin
    for budget in mha.budgets:
        assert budget.used <= budget.limit, budget.line()
    assert fwd.write_lse  # the backward needs the forward's LSE
    assert bwd.deterministic == deterministic
    assert bwd.tile_n == (128 if max(spec.head_dim, spec.head_dim_v) <= 128 else 64)
    assert bwd.swap_sdp == (max(spec.head_dim, spec.head_dim_v) <= 128)
    wide = max(spec.head_dim, spec.head_dim_v) <= 64 or ((spec.head_dim, spec.head_dim_v) == (192, 128)
                                                          and deterministic)
    assert bwd.tile_m == (128 if wide else 64)  # causal: no 80-row tile
    for budget in bwd.budgets:
        assert budget.used <= budget.limit, budget.line()
    assert bwd.smem_bytes <= 227 * 1024 and min(bwd.q_stages, bwd.do_stages, bwd.pds_stages) >= 1


def test_no_backward_plan_without_backward():
    spec = spec_from_dict(_spec_dict(0, (128, None), "bf16", {"kind": "causal"}, {}))
    assert [p.direction for p in plan_kernels(spec, "sm90")] == ["fwd", "fwd"]  # persistent + its long-call twin


def test_backward_swap_ab_choices_and_limits():
    """Sᵀ: auto at d <= 128, varlen too (80 query rows at d128 without a mask, 128 at d64), except d64 with
    softcap (64 rows there: the default layout keeps 128); refused above 128."""
    def bwd(dims, mask, pipe, **kw):
        return plan_kernels(spec_from_dict(_spec_dict(0, dims, "bf16", mask, pipe, backward=True, **kw)), "sm90")[-1]

    none, causal = {"kind": "none"}, {"kind": "causal"}
    assert (bwd((128, None), none, {}).swap_sdp, bwd((128, None), none, {}).tile_m) == (True, 80)
    assert (bwd((128, None), causal, {}).swap_sdp, bwd((128, None), causal, {}).tile_m) == (True, 64)
    assert (bwd((128, None), none, {}, varlen=True).swap_sdp, bwd((128, None), none, {}, varlen=True).tile_m) == (True, 80)
    assert bwd((128, None), none, {}, softcap=30.0).tile_m == 64  # 80 rows spilled with softcap
    assert bwd((128, None), none, {"bwd_swap_ab": True}, varlen=True).tile_m == 80
    assert (bwd((96, None), none, {}).swap_sdp, bwd((96, None), none, {}).tile_m) == (True, 64)
    # without GQA above 128, dK/dV leave by 16-column stmatrix over each warpgroup's half of the head dim,
    # except at 144/176/208/240 (halves 72-120): there value by value (tests/test_dkv_store.py)
    for d in (144, 176, 208, 240):
        assert (bwd((d, None), none, {}, allow_gqa=False).tile_n, bwd((d, None), none, {}, allow_gqa=False).dkv_elementwise) == (64, True), d
        assert (bwd((d, None), none, {}, allow_gqa=True).tile_n, bwd((d, None), none, {}, allow_gqa=True).dkv_elementwise) == (64, False), d
    assert not bwd((160, None), none, {}, allow_gqa=False).dkv_elementwise
    # the 80-row tile computes dQᵀ with 64 head-dim rows per warpgroup: head dim 128 only
    assert (bwd((112, None), none, {}).swap_sdp, bwd((112, None), none, {}).tile_m) == (True, 64)
    assert not bwd((128, None), none, {"bwd_swap_ab": False}).swap_sdp
    assert (bwd((64, None), none, {}).swap_sdp, bwd((64, None), none, {}).tile_m) == (True, 128)
    assert (bwd((64, None), causal, {}, varlen=True).swap_sdp, bwd((64, None), causal, {}, varlen=True).tile_m) == (True, 128)
    assert (bwd((64, None), none, {}, softcap=20.0).swap_sdp, bwd((64, None), none, {}, softcap=20.0).tile_m) == (False, 128)
    assert not bwd((64, None), none, {"bwd_swap_ab": False}).swap_sdp
    # d64 Sᵀ: flash-attn-4's 128 x 128 tile, varlen too
    assert (bwd((64, None), none, {"bwd_swap_ab": True}).swap_sdp, bwd((64, None), none, {"bwd_swap_ab": True}).tile_m) == (True, 128)
    assert bwd((64, None), none, {"bwd_swap_ab": True}, varlen=True).tile_m == 128
    assert bwd((64, None), none, {"bwd_swap_ab": True}, softcap=20.0).tile_m == 64
    err = _plan_error(_spec_dict(0, (256, None), "bf16", none, {"bwd_swap_ab": True}, backward=True))
    assert [p.location for p in err.problems] == ["pipeline.bwd_swap_ab"]


def test_forward_192_128_takes_128_keys():
    """(192, 128) forward: 128 keys per block unless a sliding window (112), within shared memory."""
    def fwd(mask, **kw):
        return plan_kernels(spec_from_dict(_spec_dict(0, (192, 128), "bf16", mask, {}, **kw)), "sm90")[0]

    for mask in ({"kind": "none"}, {"kind": "causal"}, {"kind": "chunked", "chunk_size": 96}):
        p = fwd(mask)
        assert p.tile_n == 128 and p.smem_bytes <= 232448, mask
    assert fwd({"kind": "sliding_window", "left": 100, "right": 0}).tile_n == 96
    # head dims 129-192 otherwise: 96 keys (session 48)
    for d in (144, 160, 176, 192):
        assert plan_kernels(spec_from_dict(_spec_dict(0, (d, None), "bf16", {"kind": "none"}, {})), "sm90")[0].tile_n == 96


def test_forward_scheduler_persistent_where_o_fits_its_own_buffer():
    """Not packed, the forward is persistent when Q, the K/V stages and a separate O buffer fit shared
    memory (head dims 64-128 at the auto tiles), with a one-CTA-per-tile twin for long calls; d256 and
    (192, 128) stay one CTA per tile (their O must reuse Q's buffer), varlen the packed grid."""
    from fa4gen.plan.sm90 import PERSISTENT_MAX_SEQLEN_Q, PERSISTENT_MAX_SEQLEN_Q_192

    def fwd(hd, mask, pipeline=None, **kw):
        return plan_kernels(spec_from_dict(_spec_dict(0, hd, "bf16", mask, pipeline or {}, **kw)), "sm90")[0]

    none = {"kind": "none"}
    for hd in ((64, None), (96, None), (128, None), (144, None), (160, None)):
        p = fwd(hd, none)
        assert (p.scheduler, p.persistent_ctas) == ("persistent", 132), hd
        d, e = hd[0], 2
        buffers = (1 + p.q_stages) * p.tile_m * d * e + p.kv_stages * p.tile_n * 2 * d * e  # Q (1 or 2), O, K/V
        assert buffers <= _budget(p, "shared memory").used <= min(buffers + 1024, SMEM_LIMIT_SM90), hd
        assert p.q_stages == (2 if d <= 128 else 1), hd  # auto: two Q buffers up to d128
        # long calls: the same tiles, one CTA per tile, from PERSISTENT_MAX_SEQLEN_Q on (the 192-row kernel, which
        # skips idle warpgroups: from PERSISTENT_MAX_SEQLEN_Q_192, session 59's A/Bs)
        plans = plan_kernels(spec_from_dict(_spec_dict(0, hd, "bf16", none, {})), "sm90")
        if hd[0] <= 64:  # d64's 128-row twin for the lengths that pad 192-row tiles worst (the rows128 test)
            assert plans.pop().module == "fwd_sm90_rows128"
        bound = PERSISTENT_MAX_SEQLEN_Q_192 if hd[0] <= 64 else PERSISTENT_MAX_SEQLEN_Q
        assert (plans[0].tile_m, plans[0].skip_idle_warpgroups) == ((192, True) if hd[0] <= 64 else (128, False))
        assert [(q.module, q.scheduler, q.min_seqlen_q) for q in plans] == [
            ("fwd_sm90", "persistent", 0), ("fwd_sm90_long", "grid", bound)]
        assert any(f"seqlen_q >= {bound} run fwd_sm90_long" in n for n in plans[0].notes), plans[0].notes
        same = {f.name for f in dataclasses.fields(KernelPlan)} - {
            "module", "scheduler", "persistent_ctas", "budgets", "notes", "min_seqlen_q", "skip_idle_warpgroups",
            "q_stages", "rescale_threshold"}
        assert all(getattr(plans[0], f) == getattr(plans[1], f) for f in same)
        # rescale_threshold auto: 0 in d64's long kernel (the auto-threshold tests), 8 elsewhere
        assert (plans[0].rescale_threshold, plans[1].rescale_threshold) == ((8.0, 0.0) if hd[0] == 64 else (8.0, 8.0))
        assert any("dispatch" in n for n in plans[1].notes) and plans[1].q_stages == 1
    # d176 and up, (192, 128): O has no room of its own (or past PERSISTENT_MAX_HEAD_DIM)
    for hd in ((176, None), (256, None), (192, 128)):
        assert (fwd(hd, none).scheduler, fwd(hd, none).persistent_ctas) == ("grid", 0), hd
        assert len(plan_kernels(spec_from_dict(_spec_dict(0, hd, "bf16", none, {})), "sm90")) == 1
    # masked, 144 / 160 stay one CTA per tile (their persistent loops lost the uniform descriptors, CPU SASS)
    for hd in ((144, None), (160, None)):
        assert fwd(hd, {"kind": "causal"}).scheduler == "grid_lpt", hd
    # hand-set key blocks of 192: the tile loop's state spilled (CPU sweep), so one CTA per tile
    assert fwd((128, None), none, {"tile_n": 192, "kv_stages": 1}).scheduler == "grid"
    assert fwd((64, None), none, {"tile_n": 192, "tile_m": 128}).scheduler == "grid"
    assert fwd((64, None), none, {"tile_n": 160, "tile_m": 128}).scheduler == "persistent"
    assert fwd((128, None), none, {"kv_stages": 3}).scheduler == "grid"  # 3 stages + O: 224 KB + 32 KB
    # 192 rows without the intra-warpgroup overlap: persistent, but no idle-warpgroup skip, so the 4096-row bound
    plans = plan_kernels(spec_from_dict(_spec_dict(0, (64, None), "bf16", none, {"intra_wg_overlap": False})), "sm90")
    assert (plans[0].tile_m, plans[0].scheduler, plans[0].skip_idle_warpgroups) == (192, "persistent", False)
    assert (plans[1].module, plans[1].min_seqlen_q) == ("fwd_sm90_long", PERSISTENT_MAX_SEQLEN_Q)
    # masked: persistent too (units of two query tiles), twin longest-first; a masked d64 spec's twin is its
    # 192-row kernel for long calls
    for mask in ({"kind": "causal"}, {"kind": "sliding_window", "left": 100, "right": 0}, {"kind": "chunked", "chunk_size": 96}):
        plans = plan_kernels(spec_from_dict(_spec_dict(0, (128, None), "bf16", mask, {})), "sm90")
        assert [(q.module, q.scheduler) for q in plans] == [("fwd_sm90", "persistent"), ("fwd_sm90_long", "grid_lpt")]
        # producer / consumers 32 / 232 (measured faster than 24 / 240 with the flat tile loop, session 16)
        assert [(q.regs_producer, q.regs_consumer) for q in plans] == [(32, 232), (24, 240)]
    plans = plan_kernels(spec_from_dict(_spec_dict(0, (64, None), "bf16", {"kind": "causal"}, {})), "sm90")
    assert [(q.module, q.scheduler, q.tile_m) for q in plans] == [("fwd_sm90", "persistent", 128), ("fwd_sm90_long", "grid_lpt", 192)]
    assert fwd((128, None), none, varlen=True).scheduler == "grid"


@pytest.mark.parametrize("dims, softcap, expect", [
    ((64, None), 0.0, True),  # Sᵀ
    ((128, None), 0.0, True),  # Sᵀ
    ((64, None), 20.0, False),  # S at 128 rows: registers at the edge (global loads, the spill state measured)
    ((192, 128), 0.0, True),  # S, session 42
    ((256, None), 20.0, True),
])
def test_backward_statistics_in_shared_memory(dims, softcap, expect):
    """Where the backward bulk-copies LSE2 / D with each Q stage, its shared-memory sum carries them: 2 floats per
    query row and Q stage (a plan without them would size the Q pipeline's transaction count wrong)."""
    spec = spec_from_dict(_spec_dict(0, dims, "bf16", {"kind": "causal"}, {}, backward=True, softcap=softcap))
    bwd = next(p for p in plan_kernels(spec, "sm90") if p.direction == "bwd" and not p.mha_only)
    assert bwd.bwd_stats_in_smem == expect
    d, dv, m, n = spec.head_dim, spec.head_dim_v, bwd.tile_m, bwd.tile_n
    operands = (bwd.q_stages * m * d + bwd.do_stages * m * dv + n * (d + dv)
                + bwd.pds_stages * (1 if bwd.swap_sdp else 2) * m * n) * 2
    dq_cols = d if m == 128 else m if m % 64 else d // 2  # a warpgroup's fp32 dQ chunk: 64 rows x these
    mbarriers = (2 * bwd.q_stages + 2 * bwd.do_stages + 2) * 8
    stats = 2 * bwd.q_stages * m * 4 if expect else 0
    assert bwd.smem_bytes == operands + bwd.dq_buffers * 64 * dq_cols * 4 + stats + mbarriers


def test_backward_192_128_deterministic_takes_128_query_rows():
    """(192, 128) deterministic: 128 query rows x 64 keys per step, every mask and GQA included, within the
    shared memory budget (2 Q stages of 48 KB, dQ from registers); without determinism 64 rows (measured
    faster there); other head dims keep their tiles."""
    def bwd(dims, **kw):
        return plan_kernels(spec_from_dict(_spec_dict(0, dims, "bf16", {"kind": "causal"}, {}, backward=True, **kw)),
                            "sm90")[-1]

    for kw in ({}, {"allow_gqa": True}, {"softcap": 20.0}):
        p = bwd((192, 128), deterministic=True, **kw)
        assert (p.tile_m, p.tile_n, p.dq_atomic, p.dq_buffers) == (128, 64, True, 0), kw
        assert p.smem_bytes <= 232448 and p.q_stages == 2
        assert any("128 query rows" in n for n in p.notes)
        assert bwd((192, 128), **kw).tile_m == 64, kw
    assert (bwd((256, None), deterministic=True).tile_m, bwd((128, None)).tile_m,
            bwd((192, 192), deterministic=True).tile_m) == (64, 64, 64)


def test_backward_dq_atomic_choices():
    """dQ from registers (no hand-off buffer): auto above d 128, where the freed buffer buys a second dO
    stage (GQA too: its dK/dV epilogue stages in the Q buffers); deterministic too, each warpgroup taking
    the query block's turn; at d <= 128 only when asked."""
    def bwd(dims, pipe, **kw):
        return plan_kernels(spec_from_dict(_spec_dict(0, dims, "bf16", {"kind": "causal"}, pipe, backward=True, **kw)),
                            "sm90")[-1]

    d256 = bwd((256, None), {})
    assert (d256.dq_atomic, d256.dq_buffers, d256.q_stages, d256.do_stages) == (True, 0, 2, 2)
    assert d256.smem_bytes <= 232448
    assert any("red.global.add.v4.f32" in n for n in d256.notes)
    assert bwd((192, 128), {}).dq_atomic
    assert not bwd((128, None), {}).dq_atomic and bwd((128, None), {}).dq_buffers == 2
    det = bwd((256, None), {}, deterministic=True)
    assert (det.dq_atomic, det.dq_buffers, det.do_stages) == (True, 0, 2)
    assert any("turn" in n for n in det.notes)
    det128 = bwd((128, None), {}, deterministic=True)
    assert (det128.dq_atomic, det128.dq_buffers) == (False, 2)
    assert not bwd((256, None), {"bwd_dq_atomic": False}).dq_atomic
    forced = bwd((128, None), {"bwd_dq_atomic": True})
    assert (forced.dq_atomic, forced.dq_buffers) == (True, 0)
    # GQA's fp32 dK/dV epilogue stages a warpgroup's share (64 x 128 fp32 at d256) in the Q buffers instead
    gqa = bwd((256, None), {}, allow_gqa=True)
    assert (gqa.dq_atomic, gqa.dq_buffers, gqa.q_stages, gqa.do_stages) == (True, 0, 2, 2)
    gqa128 = bwd((128, None), {"bwd_dq_atomic": True}, allow_gqa=True)  # 64 x 128 fp32 needs both Q stages
    assert (gqa128.dq_buffers, gqa128.q_stages * gqa128.tile_m * 128 * 2 >= 64 * 128 * 4) == (0, True)
    # deterministic at d128: only when asked
    ordered = bwd((128, None), {"bwd_dq_atomic": True}, deterministic=True)
    assert (ordered.dq_atomic, ordered.dq_buffers) == (True, 0)
    assert any("turn" in n for n in ordered.notes)


def test_backward_192_128_mha_computes_dkv_transposed():
    """(192, 128) without GQA: flash-attn-4's 64 x 96 tile with dKᵀ/dVᵀ (head dims on WGMMA's M), every
    mask, varlen and determinism, within the shared-memory budget; GQA (fp32 dK/dV staging by key rows)
    keeps its tiles (128 x 64 when deterministic), and no other head dim changes."""
    def bwd(dims, mask="causal", **kw):
        return plan_kernels(spec_from_dict(_spec_dict(0, dims, "bf16", {"kind": mask}, {}, backward=True, **kw)),
                            "sm90")[-1]

    for mask in ("none", "causal"):
        for kw in ({}, {"varlen": True}, {"softcap": 20.0}, {"deterministic": True},
                   {"deterministic": True, "varlen": True}):
            p = bwd((192, 128), mask, allow_gqa=False, **kw)
            assert (p.tile_m, p.tile_n, p.dkv_transposed, p.swap_sdp, p.dq_atomic) == (64, 96, True, False, False), kw
            assert (p.q_stages, p.do_stages, p.pds_stages, p.dq_buffers) == (2, 2, 1, 2), kw
            assert p.deterministic == kw.get("deterministic", False)
            assert p.smem_bytes <= 232448
            assert any("dKᵀ = Qᵀ·dS" in n for n in p.notes)
    gqa = bwd((192, 128), allow_gqa=True)
    assert (gqa.tile_n, gqa.dkv_transposed) == (64, False)
    # dQ handed to the dQ warp by default, as pipeline.bwd_dq_atomic: false asks: flash-attn-4's stages there
    for det in (False, True):
        h = plan_kernels(spec_from_dict(_spec_dict(0, (192, 128), "bf16", {"kind": "causal"}, {"bwd_dq_atomic": False},
                                                   backward=True, allow_gqa=False, deterministic=det)), "sm90")[-1]
        assert (h.dkv_transposed, h.dq_atomic, h.q_stages, h.do_stages, h.pds_stages, h.dq_buffers) == (
            True, False, 2, 2, 1, 2)
        assert h.smem_bytes <= 232448
    det_gqa = bwd((192, 128), allow_gqa=True, deterministic=True)
    assert (det_gqa.tile_m, det_gqa.tile_n, det_gqa.dkv_transposed) == (128, 64, False)
    for dims in ((256, None), (128, None), (64, None), (192, 192)):
        assert not bwd(dims, allow_gqa=False).dkv_transposed


@pytest.mark.parametrize("mask", [{"kind": "none"}, {"kind": "causal"}, {"kind": "sliding_window", "left": 256, "right": 0},
                                  {"kind": "chunked", "chunk_size": 512}])
def test_backward_dq_claim_choices(mask):
    """The dQ claim (no zeroing preprocess) where key blocks reach a query tile one after another: with a
    mask (its diagonal staggers them) and without one (the kernel starts key block n at its diagonal's
    query tile, m_rot; varlen too); not deterministic (turns), not with dQ from registers."""
    def bwd(dims=(128, None), pipe=None, **kw):
        spec = spec_from_dict(_spec_dict(0, dims, "bf16", mask, pipe or {}, backward=True, **kw))
        return plan_kernels(spec, "sm90")[-1]

    assert bwd().dq_claim and any("dQ claim" in n for n in bwd().notes)
    assert bwd((64, None), allow_gqa=False).dq_claim
    assert bwd(varlen=True).dq_claim
    assert not bwd(deterministic=True).dq_claim
    d256 = bwd((256, None))
    assert d256.dq_atomic and not d256.dq_claim
    assert not bwd(pipe={"bwd_dq_atomic": True}).dq_claim


@pytest.mark.parametrize("dims, mask, expect", [
    ((64, None), {"kind": "causal"}, "measured 0.952-0.992x of the non-deterministic backward with a causal mask"),
    ((128, None), {"kind": "none"}, "measured 0.965-0.997x of the non-deterministic backward without a mask"),
    ((96, None), {"kind": "causal"}, "measured at d128 0.933-0.967x"),
    ((192, 128), {"kind": "causal"}, "measured 0.828-0.972x"),
    ((256, None), {"kind": "sliding_window", "left": 64, "right": 0},
     "measured 0.912-1.001x of the non-deterministic backward with a causal mask (sliding_window not measured)"),
])
def test_deterministic_backward_states_its_measured_cost(dims, mask, expect):
    """#4: "the plan states the cost" of determinism: the ratio measured for the spec's head-dim class and mask
    (docs/PERF.md; the session is named), and no such note without determinism."""
    def notes(det):
        spec = spec_from_dict(_spec_dict(0, dims, "bf16", mask, {}, backward=True, deterministic=det))
        return [n for n in plan_kernels(spec, "sm90")[-1].notes if n.startswith("deterministic")]
    (note,) = notes(True)
    assert expect in note and re.search(r"session \d+, docs/PERF\.md", note), note
    assert notes(False) == []


@pytest.mark.parametrize("dims, softcap, swap, expect_note", [
    ((64, None), 20.0, "auto", True), ((64, None), 20.0, False, False), ((64, None), 20.0, True, False),
    ((64, None), 0.0, "auto", False), ((128, None), 20.0, "auto", False),
])
def test_d64_softcap_backward_states_its_spilling_layout(dims, softcap, swap, expect_note):
    """#3's SASS target is missed on purpose in one place: the d <= 64 softcap backward's auto layout, whose 128-row
    S loop spills registers but measured faster than the spill-free Sᵀ form; the plan says so (and names the
    switch) only where auto chose it."""
    spec = spec_from_dict(_spec_dict(0, dims, "bf16", {"kind": "causal"}, {"bwd_swap_ab": swap}, backward=True,
                                     softcap=softcap))
    bwd = plan_kernels(spec, "sm90")[-1]
    notes = [n for n in bwd.notes if n.startswith("bwd_swap_ab auto -> S")]
    assert len(notes) == expect_note, bwd.notes
    if expect_note:
        assert "bwd_swap_ab: true" in notes[0] and re.search(r"session \d+, docs/PERF\.md", notes[0])


@pytest.mark.parametrize("allow_gqa", [True, False])
def test_gqa_backward_has_an_mha_twin_for_mha_calls(allow_gqa):
    """allow_gqa (the spec default) sends dK/dV through fp32 workspaces: the spec then gets a second backward,
    bwd_sm90_mha (the allow_gqa: false kernel, planned before it), which the API runs for MHA calls; both plans
    say which calls they take. A spec without allow_gqa has one backward and no such note."""
    spec = spec_from_dict(_spec_dict(0, (128, None), "bf16", {"kind": "causal"}, {}, backward=True,
                                     allow_gqa=allow_gqa))
    bwd_plans = [p for p in plan_kernels(spec, "sm90") if p.direction == "bwd"]
    bwd = bwd_plans[-1]
    notes = [n for n in bwd.notes if n.startswith("GQA (allow_gqa)")]
    assert (bwd.module, bwd.dkv_accum, bwd.mha_only) == ("bwd_sm90", allow_gqa, False)
    if not allow_gqa:
        assert len(bwd_plans) == 1 and notes == []
        return
    assert len(notes) == 1 and "bwd_sm90_mha" in notes[0]
    mha = bwd_plans[-2]  # (the head-loop GQA backward first: test_gqa_head_loop_backward_is_the_mha_plan_once_per_q_head)
    alone = plan_kernels(spec_from_dict(_spec_dict(0, (128, None), "bf16", {"kind": "causal"}, {}, backward=True,
                                                   allow_gqa=False)), "sm90")[-1]
    assert (mha.module, mha.mha_only, mha.dkv_accum, mha.allow_gqa) == ("bwd_sm90_mha", True, False, False)
    # the allow_gqa: false spec's kernel, plan for plan, but for its module name, dispatch flag and note
    assert dataclasses.replace(mha, module=alone.module, mha_only=False, notes=alone.notes) == alone
    assert mha.notes[-1].startswith("dispatch: the API runs this kernel for calls with as many K/V heads")


def test_forward_q_stages_two_buffers_in_the_persistent_forward_only():
    """pipeline.q_stages 2 gives the persistent forward a second Q buffer (one more Q tile of shared memory); auto
    takes it where it fits up to head dim 128 (measured at 64 and 128, session 49); kernels that run one CTA per
    tile keep one; a hand-set second buffer that does not fit is refused by name, auto falls back to 1."""
    from fa4gen.plan.sm90 import AUTO_Q_STAGES_MAX_HEAD_DIM

    def fwds(hd, mask, pipeline, **kw):
        return [p for p in plan_kernels(spec_from_dict(_spec_dict(0, hd, "bf16", mask, pipeline, **kw)), "sm90")
                if p.direction == "fwd"]

    none, causal, window = {"kind": "none"}, {"kind": "causal"}, {"kind": "sliding_window", "left": 64, "right": 0}
    for hd, mask in (((64, None), none), ((128, None), none), ((64, None), causal), ((128, None), causal),
                     ((96, None), window)):
        (one, *rest1), (two, *rest2), (auto, *rest_auto) = (fwds(hd, mask, {"q_stages": 1}),
                                                            fwds(hd, mask, {"q_stages": 2}), fwds(hd, mask, {}))
        assert one.scheduler == two.scheduler == "persistent" and (one.q_stages, two.q_stages) == (1, 2)
        assert auto == dataclasses.replace(two, notes=auto.notes)  # auto: the hand-set 2, its note says auto
        smem = [next(b.used for b in p.budgets if b.name == "shared memory per CTA") for p in (one, two)]
        assert smem[1] == smem[0] + two.tile_m * hd[0] * 2 + 16 <= 232448
        assert all(p.q_stages == 1 for p in rest1 + rest2 + rest_auto if p.min_seqlen_q)  # the long-call twins
        assert any("q_stages 2" in n for n in two.notes) and not any("q_stages 2" in n for n in one.notes)
        assert any("q_stages auto -> 2" in n for n in auto.notes)
    # above AUTO_Q_STAGES_MAX_HEAD_DIM auto keeps 1 (d144 has room for the second buffer but was not measured)
    assert AUTO_Q_STAGES_MAX_HEAD_DIM == 128
    assert (fwds((144, None), none, {})[0].q_stages, fwds((144, None), none, {"q_stages": 2})[0].q_stages) == (1, 2)
    # one CTA per tile: d256, varlen
    (d256,) = fwds((256, None), none, {"q_stages": 2})
    assert d256.q_stages == 1 and any("q_stages 2 asked for, 1 here" in n for n in d256.notes)
    assert all(p.q_stages == 1 for p in fwds((128, None), none, {"q_stages": 2}, varlen=True))
    assert all(p.q_stages == 1 for p in fwds((128, None), none, {}, varlen=True))
    # d128 with 160-key blocks fills shared memory with one Q buffer: refused when asked for, auto's 1 otherwise
    err = _plan_error(_spec_dict(0, (128, None), "bf16", none, {"q_stages": 2, "tile_n": 160}))
    assert [p.location for p in err.problems] == ["pipeline.q_stages"]
    assert "second Q buffer (32768 bytes)" in str(err)
    for q in (1, "auto"):
        (p, *_) = fwds((128, None), none, {"q_stages": q, "tile_n": 160})
        assert (p.scheduler, p.q_stages) == ("persistent", 1)


def test_forward_rows128_twin_for_the_lengths_that_pad_192_row_tiles_worst():
    """d <= 64 without a mask (tile_m auto: 192 rows, persistent) gets a 128-row persistent twin for the seqlen_q
    whose 192-row tiles compute more than ROWS128_RATE times the rows 128-row tiles do (session 49, H200: 128 rows
    +36% at s197, +8% at s577; session 47: -2.5% at s512), up to ROWS128_MAX_SEQLEN_Q (session 59, H100: with the
    192-row kernel's idle-warpgroup skip, 577-640 run faster in 192-row tiles); masked, hand-set tile_m, varlen and
    larger head dims have none. The twin is the hand-set tile_m 128 plan but for its module, dispatch ranges and
    note."""
    from fa4gen.plan.sm90 import PERSISTENT_MAX_SEQLEN_Q, ROWS128_MAX_SEQLEN_Q, ROWS128_RATE, rows128_ranges

    ranges = rows128_ranges()
    assert ranges == ((1, 128), (193, 256))
    inside = {s for a, b in ranges for s in range(a, b + 1)}
    for s in range(1, PERSISTENT_MAX_SEQLEN_Q):
        pad128, pad192 = -(-s // 128) * 128, -(-s // 192) * 192
        assert (s in inside) == (pad128 * ROWS128_RATE < pad192 and s <= ROWS128_MAX_SEQLEN_Q), s
    assert 197 in inside and not {512, 577, 640, 1024, 257, 1025} & inside  # ViT-B's 197 in, ViT-L's 577 out
    # the rate and the limit decide: at 1.0 every length with fewer 128-row padded rows joins (385-512 among them);
    # below 4096 rows the rate alone would add 577-640
    assert (385, 512) in rows128_ranges(limit=PERSISTENT_MAX_SEQLEN_Q, rate=1.0)
    assert rows128_ranges(limit=PERSISTENT_MAX_SEQLEN_Q) == ((1, 128), (193, 256), (577, 640))
    assert rows128_ranges(limit=200) == ((1, 128), (193, 199))

    def fwds(hd, mask, pipeline, **kw):
        return [p for p in plan_kernels(spec_from_dict(_spec_dict(0, hd, "bf16", mask, pipeline, **kw)), "sm90")
                if p.direction == "fwd"]

    none = {"kind": "none"}
    for hd in ((64, None), (32, None)):
        default, long, twin = fwds(hd, none, {})
        hand = fwds(hd, none, {"tile_m": 128})[0]
        assert (default.tile_m, default.scheduler, twin.tile_m, twin.scheduler) == (192, "persistent", 128, "persistent")
        assert (twin.module, twin.seqlen_q_ranges, twin.min_seqlen_q, long.seqlen_q_ranges) == (
            "fwd_sm90_rows128", ranges, 0, ())
        assert twin == dataclasses.replace(hand, module=twin.module, seqlen_q_ranges=ranges, notes=twin.notes)
        assert twin.notes[-1].startswith("dispatch: the API runs this 128-row kernel for calls with seqlen_q in "
                                         "1-128, 193-256 (")
    # no twin: masked (128 rows already), hand-set tile_m (either), varlen, head dims above 64
    assert [p.module for p in fwds((64, None), {"kind": "causal"}, {})] == ["fwd_sm90", "fwd_sm90_long"]
    for pipeline in ({"tile_m": 192}, {"tile_m": 128}):
        assert "fwd_sm90_rows128" not in [p.module for p in fwds((64, None), none, pipeline)]
    assert [p.module for p in fwds((64, None), none, {}, varlen=True)] == ["fwd_sm90"]
    assert "fwd_sm90_rows128" not in [p.module for p in fwds((96, None), none, {})]


def test_gqa_head_loop_backward_is_the_mha_plan_once_per_q_head():
    """A GQA spec (allow_gqa, neither deterministic nor varlen, dQ through buffers) gets bwd_sm90_gqa: the MHA
    backward's plan (same tiles, stages, dK/dV stored from registers) with gqa_head_loop and a CTA-count dispatch
    bound; deterministic, varlen, dq_atomic (head dims above 128) and allow_gqa: false specs get none."""
    from fa4gen.plan.sm90 import GQA_HEAD_LOOP_MIN_CTAS

    def bwd(hd, mask, extra=None, **kw):
        spec = spec_from_dict(_spec_dict(0, hd, "bf16", mask, extra or {}, **kw) | {"backward": True})
        return {p.module: p for p in plan_kernels(spec, "sm90") if p.direction == "bwd"}

    for hd in ((64, None), (96, None), (128, None)):
        for mask in ({"kind": "none"}, {"kind": "causal"}, {"kind": "sliding_window", "left": 64, "right": 0}):
            plans = bwd(hd, mask)
            assert list(plans) == ["bwd_sm90_gqa", "bwd_sm90_mha", "bwd_sm90"], (hd, mask)
            mha, loop = plans["bwd_sm90_mha"], plans["bwd_sm90_gqa"]
            assert (loop.gqa_head_loop, loop.dkv_accum, loop.allow_gqa, loop.mha_only) == (True, False, True, False)
            assert loop.min_kv_ctas == GQA_HEAD_LOOP_MIN_CTAS and not plans["bwd_sm90"].gqa_head_loop
            same = {f.name for f in dataclasses.fields(KernelPlan)} - {
                "module", "allow_gqa", "gqa_head_loop", "min_kv_ctas", "mha_only", "notes", "scheduler",
                "persistent_ctas", "kv_stages", "smem_bytes", "budgets", "dq_post_overlap"}
            assert all(getattr(loop, f) == getattr(mha, f) for f in same), (hd, mask)
            # the overlapped dQ conversion: the MHA twin's with the claim, never the head loop's
            assert not loop.dq_post_overlap and mha.dq_post_overlap == mha.dq_claim, (hd, mask)
            # the persistent MHA twin's second K / V stage (where it fits: d <= 96) is its only extra shared memory
            kv_bytes = loop.tile_n * (loop.head_dim + loop.head_dim_v) * 2
            assert loop.kv_stages == 1 and mha.kv_stages in (1, 2)
            assert mha.smem_bytes == loop.smem_bytes + (mha.kv_stages - 1) * (kv_bytes + 16), (hd, mask)
            # one CTA per (key block, kv head, batch): never the MHA twin's persistent loop (no mask)
            assert (loop.scheduler, loop.persistent_ctas) == ("grid", 0)
            # causal: only where dK / dV stage without barriers (dS stage 1: head dims <= 64; session 68)
            persistent = mask["kind"] == "none" or (mask["kind"] == "causal" and max(d for d in hd if d) <= 64)
            assert mha.scheduler == ("persistent" if persistent else "grid"), (hd, mask)
            assert any(f"at least {GQA_HEAD_LOOP_MIN_CTAS} CTAs" in n for n in loop.notes)
    causal = {"kind": "causal"}
    assert "bwd_sm90_gqa" not in bwd((128, None), causal, deterministic=True)
    assert "bwd_sm90_gqa" not in bwd((128, None), causal, varlen=True)
    assert "bwd_sm90_gqa" not in bwd((256, None), causal)  # dQ added from registers (bwd_dq_atomic auto)
    assert "bwd_sm90_gqa" not in bwd((128, None), causal, {"bwd_dq_atomic": True})
    assert list(bwd((128, None), causal, allow_gqa=False)) == ["bwd_sm90"]


@pytest.mark.parametrize("dims", [(64, None), (96, None), (128, None)])
def test_backward_is_persistent_for_mha_without_a_mask(dims):
    """The persistent backward (one CTA per SM over the key-block tiles, round-robin) is planned for the Sᵀ MHA
    kernels without a mask (every tile the same work) or causal at head dims <= 64 (the paired order), neither deterministic nor varlen,
    dQ through the hand-off.
    allow_gqa specs get it in their MHA twin (bwd_sm90_mha) only; every other backward keeps one CTA per tile."""
    def bwd(mask=None, pipe=None, module="bwd_sm90", **kw):
        spec = spec_from_dict(_spec_dict(0, dims, "bf16", mask or {"kind": "none"}, pipe or {}, backward=True, **kw))
        return {p.module: p for p in plan_kernels(spec, "sm90") if p.direction == "bwd"}[module]

    mha = bwd(allow_gqa=False)
    assert (mha.scheduler, mha.persistent_ctas, mha.swap_sdp, mha.dq_claim) == ("persistent", 132, True, True)
    assert any(n.startswith("persistent: 132 CTAs") for n in mha.notes)
    twin, gqa, loop = bwd(module="bwd_sm90_mha"), bwd(), bwd(module="bwd_sm90_gqa")
    assert (twin.scheduler, gqa.scheduler, loop.scheduler) == ("persistent", "grid", "grid")
    # causal too (session 67's patch, GPU-run in session 68) where dK / dV stage in dS stage 1, without barriers (d64):
    # the d96 / d128 form (dV behind the dQ warp's drained barrier) measured 0.92-0.98x one CTA per tile, so the
    # planner keeps those on the grid; masked_persistent=True (tools/bwd_timeline.py --persistent) still plans it
    causal = bwd({"kind": "causal"}, allow_gqa=False)
    from fa4gen.plan.sm90 import plan_backward

    forced = plan_backward(spec_from_dict(_spec_dict(0, dims, "bf16", {"kind": "causal"}, {}, backward=True,
                                                     allow_gqa=False)), masked_persistent=True)
    assert (forced.scheduler, forced.persistent_ctas) == ("persistent", 132) and forced.dkv_staging.phases
    if dims[0] <= 64:
        assert (causal.scheduler, causal.persistent_ctas) == ("persistent", 132) and causal.dkv_staging.stage0 == 1
    else:
        assert (causal.scheduler, causal.persistent_ctas) == ("grid", 0) and forced.dkv_staging.dv_in_dq
        # (the forced form's second K / V stage where it fits, d96, is all else that differs)
        assert causal.kv_stages == 1
        assert causal == dataclasses.replace(forced, scheduler="grid", persistent_ctas=0, notes=causal.notes,
                                             kv_stages=1, smem_bytes=causal.smem_bytes, budgets=causal.budgets)
    others = [bwd(deterministic=True, allow_gqa=False),
              bwd(varlen=True, allow_gqa=False), bwd(pipe={"bwd_dq_atomic": True}, allow_gqa=False),
              bwd(pipe={"bwd_swap_ab": False}, allow_gqa=False),
              bwd({"kind": "sliding_window", "left": 64, "right": 0}, allow_gqa=False)]
    assert [(p.scheduler, p.persistent_ctas) for p in others] == [("grid", 0)] * len(others)
    assert bwd(softcap=20.0, allow_gqa=False).scheduler == ("grid" if dims[0] <= 64 else "persistent")  # d64: S layout


def test_persistent_backward_gets_a_second_kv_stage_where_it_fits():
    """The persistent backward with dK / dV staged outside K's and V's buffers loads the next tile's K / V into a
    second stage where the shared memory allows it (d <= 96; d128's 230,736 bytes leave no room for 64 KB more):
    session 68's timeline read ~2-2.5 us a tile of K / V wait behind the one stage's hand-back. One CTA per tile, GQA
    and the K / V-buffer epilogue keep one stage."""
    from fa4gen.plan.sm90 import SMEM_BUDGET, plan_backward

    def bwd(d, mask="none", **kw):
        return plan_backward(spec_from_dict(_spec_dict(0, (d, None), "bf16", {"kind": mask}, {}, backward=True,
                                                       allow_gqa=False, **kw)))

    for d, mask, stages in [(16, "none", 2), (64, "none", 2), (64, "causal", 2), (96, "none", 2), (128, "none", 1),
                            (128, "causal", 1)]:
        plan = bwd(d, mask)
        assert plan.kv_stages == stages, (d, mask)
        assert plan.smem_bytes <= SMEM_BUDGET
        assert (stages == 2) == any(n.startswith("K / V in two stages") for n in plan.notes), (d, mask)
        if stages == 2:
            assert plan.scheduler == "persistent" and plan.dkv_staging.phases
            # the one-CTA-per-tile plan of the same spec: one stage, and exactly one K / V stage (+ 2 mbarriers) less
            grid = plan_backward(spec_from_dict(_spec_dict(0, (d, None), "bf16", {"kind": mask}, {}, backward=True,
                                                           allow_gqa=False)), allow_persistent=False)
            assert grid.kv_stages == 1 and plan.smem_bytes == grid.smem_bytes + plan.tile_n * 2 * d * 2 + 16
            assert next(b.used for b in plan.budgets if b.name == "shared memory per CTA") == plan.smem_bytes
    assert bwd(64, deterministic=True).kv_stages == 1 and bwd(64, varlen=True).kv_stages == 1
    assert bwd(96, softcap=20.0).kv_stages == 2


# --- rescale_threshold "auto" (plan.sm90._always_rescale_long) ---------------------------------------


def _thresholds(d: dict) -> dict[str, float]:
    return {p.module: p.rescale_threshold for p in _fwd_plans(spec_from_dict(d))}


def test_auto_threshold_is_zero_only_in_the_d64_long_kernel_without_a_mask():
    none64 = _spec_dict(0, (64, None), "bf16", {"kind": "none"}, {})
    assert _thresholds(none64) == {"fwd_sm90": 8.0, "fwd_sm90_long": 0.0, "fwd_sm90_rows128": 8.0}
    long_plan = [p for p in _fwd_plans(spec_from_dict(none64)) if p.module == "fwd_sm90_long"][0]
    assert any("rescale_threshold auto: 0" in n for n in long_plan.notes)


@pytest.mark.parametrize("change", [
    {"pipeline": {"rescale_threshold": 8.0}},  # set by the user: kept everywhere
    {"softcap": 30.0},
    {"mask": {"kind": "causal"}},
    {"head_dim": 128},
    {"head_dim": 48},
])
def test_auto_threshold_is_eight_elsewhere(change):
    d = {**_spec_dict(0, (64, None), "bf16", {"kind": "none"}, {}), **change}
    assert set(_thresholds(d).values()) == {8.0}


def test_a_set_threshold_of_zero_stays_zero():
    d = _spec_dict(0, (64, None), "fp16", {"kind": "none"}, {"rescale_threshold": 0.0})
    assert set(_thresholds(d).values()) == {0.0}

"""Pipeline protocol: model-check every generated forward kernel's inter-role pipelines (SM90 and SM100).

fa4gen.plan.protocol runs the roles' programs under random interleavings, with mbarriers modelled by
their parity rule, an in-order tensor core, TMA copies landing in any order and named barriers, and
reports deadlocks, waits that pass on the wrong phase, buffers rewritten before every consumer
released them, and reads of the wrong data. Here: every committed spec's forward and a grid of plans
pass; deliberately broken protocols are caught; and the model is tied to the generated code (the
barrier setup is generated from the plan's pipelines, and each role's text uses the pipelines the
model says).

Forward plans only. The SM90 backward (direction "bwd", templates/sm90/bwd.py.j2) is not modelled:
its plan carries no pipelines or named barriers as data (its K/V, Q and dO TMA pipelines, the P/dS
and dQ hand-off barriers between the consumer warpgroups and the dQ warp, and, when deterministic,
the per-tile semaphores that order CTAs through global memory are written in the template), so a
model would be a second hand-written copy of the template rather than a check of what the plan
decides. Its protocol is exercised by running it: tests/test_gpu_backward.py and `fa4gen test` on a
Hopper GPU (gradients against the reference with the buffers poisoned, bitwise repeats when
deterministic).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
from pathlib import Path

import pytest

from fa4gen.builder import render_spec
from fa4gen.plan import plan_kernels, protocol
from fa4gen.plan.protocol import ProtocolError
from fa4gen.plan.sm90 import plan_backward as plan_sm90_backward
from fa4gen.device import sm90
from fa4gen.spec import load_spec, spec_from_dict

ROOT = Path(__file__).resolve().parents[1]
SPEC_FILES = sorted((ROOT / "specs").glob("*.yaml"))


def _spec(hd, mask, pipeline, targets=("sm100",)):
    d = {"name": "p", "targets": list(targets), "dtype": "bf16", "head_dim": hd[0], "mask": mask, "pipeline": pipeline}
    if hd[1] is not None:
        d["head_dim_v"] = hd[1]
    return spec_from_dict(d)


SM100_PLANS = [
    plan_kernels(_spec(hd, {"kind": "causal"}, p), "sm100")[0]
    for hd, p in itertools.product(
        [(64, None), (128, None), (192, 128), (256, None)],
        [{}, {"ping_pong": False}, {"kv_stages": 2}],
    )
]
SM90_PLANS = [  # (without a mask: the persistent forward where it fits; one Q buffer, auto's 2 below)
    plan_kernels(_spec((hd, None), {"kind": kind}, dict(p, **{"tile_m": tm}), ("sm90",)), "sm90")[0]
    for kind, hd, tm, p in itertools.product(
        ["causal", "none"],
        [64, 128],
        [128, 192],
        [{"ping_pong": pp, "intra_wg_overlap": ov, "kv_stages": st, "q_stages": 1}
         for pp, ov, st in itertools.product([True, False], [True, False], [1, 2, 3])],
    )
    if not (tm == 192 and hd == 128)
] + [  # two Q buffers (pipeline.q_stages 2): the persistent forwards that fit them
    plan_kernels(_spec((hd, None), {"kind": kind}, {"q_stages": 2, "ping_pong": pp, "intra_wg_overlap": ov}, ("sm90",)),
                 "sm90")[0]
    for kind, hd, pp, ov in itertools.product(["causal", "none"], [64, 128], [True, False], [True, False])
]


def _committed(arch):
    """Every forward plan of every committed spec with this target (a masked d64 spec has two, picked per
    call by seqlen_q; see the module docstring for the backward)."""
    out = []
    for path in SPEC_FILES:
        spec = load_spec(path)
        if arch in spec.targets:
            out += [pytest.param(p, id=f"{path.stem}.{p.module}") for p in plan_kernels(spec, arch) if p.direction == "fwd"]
    return out


# --- every kernel passes -------------------------------------------------------------------------


@pytest.mark.parametrize("plan", _committed("sm100") + [pytest.param(p, id=f"grid{i}") for i, p in enumerate(SM100_PLANS)])
def test_sm100_protocol_holds(plan):
    runs = protocol.check_sm100(plan, runs=40, max_tiles=4, max_blocks=5, seed=1)
    assert len(runs) == 40
    # every run drove real traffic through every pipeline
    assert all(r.tc_ops > 0 and r.tma_copies > 0 for r in runs)


@pytest.mark.parametrize("plan", _committed("sm90") + [pytest.param(p, id=f"grid{i}") for i, p in enumerate(SM90_PLANS)])
def test_sm90_protocol_holds(plan):
    runs = protocol.check_sm90(plan, runs=40, max_blocks=6, seed=2)
    assert len(runs) == 40
    # every run drove its key blocks through the K and V pipelines (check_sm90 draws each run's block counts
    # from random.Random(seed); a model that ran no block passed before, session 13 review): Q once per tile,
    # then one K and one V load per block, each completing its stage's full barrier once. A persistent plan's
    # runs hold 1-4 tiles (the tile count drawn after the first tile's blocks)
    rng = random.Random(2)
    draws = []
    for _ in range(40):
        tiles = [rng.randint(0, 6)]
        if plan.scheduler == "persistent":
            tiles += [rng.randint(0, 6) for _ in range(rng.randint(1, 4) - 1)]
        if plan.skip_idle_warpgroups:  # each tile's busy warpgroups, drawn after its key blocks (counted below)
            for _ in tiles:
                rng.randint(1, plan.num_mma_warpgroups)
        draws.append(tiles)
    assert max(max(t) for t in draws) == 6
    assert (max(len(t) for t in draws) > 1) == (plan.scheduler == "persistent")
    for run, tiles in zip(runs, draws):
        assert run.tma_copies == len(tiles) + 2 * sum(tiles)
        assert sum(v for key, v in run.completions.items() if key.startswith("q.full")) == len(tiles)
        assert run.completions["q.full[0]"] == -(-len(tiles) // plan.q_stages)  # the buffers take turns
        for pipe in ("k", "v"):
            assert sum(v for key, v in run.completions.items() if key.startswith(f"{pipe}.full")) == sum(tiles)


def test_backward_plans_are_refused_not_passed():
    """The model mirrors the forward templates: a committed spec's backward plan must not pass it for nothing."""
    (bwd,) = [p for p in plan_kernels(load_spec(ROOT / "specs" / "llama3_8b.yaml"), "sm90") if p.module == "bwd_sm90"]
    with pytest.raises(ValueError, match=r"llama3_8b \[sm90 bwd\]: the protocol model covers forward kernels only"):
        protocol.check_sm90(bwd)
    with pytest.raises(ValueError, match="forward kernels only"):
        protocol.sm90_programs(bwd, 2)


# --- broken protocols are caught -------------------------------------------------------------------


def _with(plan, **changes):
    pipes = tuple(dataclasses.replace(p, **changes[p.name]) if p.name in changes else p for p in plan.pipelines)
    return dataclasses.replace(plan, pipelines=pipes)


@pytest.mark.parametrize("changes,message", [
    ({"kv": {"stages": 1}}, "deadlock"),  # K_{j+1} needs the stage V_j holds
    ({"sp": {"producer_start_phase": 1}}, r"expecting \('P'"),  # P·V issued before P was written
    # softmax alone completes the phase: P·V may run before the correction rescaled O, or the
    # parity of a later phase is mistaken for this one
    ({"sp": {"consumer_arrivals": 128}}, r"phase bit aliases|expecting \('(P|Os)'|more than"),
    ({"o": {"producer_start_phase": 0}}, "deadlock"),
    ({"stats": {"producer_arrivals": 256}}, "deadlock"),
])
def test_sm100_mutations_are_caught(changes, message):
    plan = _with(SM100_PLANS[1], **changes)
    with pytest.raises(ProtocolError, match=message):
        protocol.check_sm100(plan, runs=30, seed=3)


def _drop(programs, role, predicate):
    """Remove from `role`'s program the first op matching `predicate`."""
    inner = programs[role]

    def gen():
        dropped = False
        for op in inner:
            if not dropped and predicate(op):
                dropped = True
                continue
            yield op

    programs[role] = gen()
    return programs


def test_sm90_missing_initial_pingpong_arrive_deadlocks():
    (plan,) = [p for p in SM90_PLANS if p.ping_pong and p.num_mma_warpgroups == 2][:1]
    model = protocol.ProtocolModel(protocol.sm90_pipelines(plan), protocol.sm90_named_barriers(plan))
    last = f"consumer{plan.num_mma_warpgroups - 1}"
    programs = _drop(protocol.sm90_programs(plan, 3), last, lambda op: op.kind == "bar_arrive")
    with pytest.raises(ProtocolError, match="deadlock"):
        model.run(programs, seed=0)


def test_sm90_missing_epilogue_barrier_overwrites_q():
    """Without the first epilogue barrier a warpgroup writes O over Q while another still reads Q (with
    ping-pong the final hand-over already orders them, and with one K/V stage the V ring does)."""
    plan = next(p for p in SM90_PLANS if not p.ping_pong and p.kv_stages == 3 and p.scheduler != "persistent")
    model = protocol.ProtocolModel(protocol.sm90_pipelines(plan), protocol.sm90_named_barriers(plan))
    caught = 0
    for seed in range(40):
        programs = protocol.sm90_programs(plan, 4)
        for c in range(plan.num_mma_warpgroups):
            programs = _drop(programs, f"consumer{c}", lambda op: op.kind == "bar_sync" and op.stage == 1)
        try:
            model.run(programs, seed=seed)
        except ProtocolError as err:
            assert "reads sQ" in str(err) or "named barrier" in str(err)
            caught += 1
    assert caught > 0


def test_sm100_early_release_of_k_is_caught():
    """The MMA warp releasing K before the S MMAs that read it were issued: the TMA overwrites it."""
    plan = SM100_PLANS[1]
    model = protocol.ProtocolModel(plan.pipelines, plan.named_barriers)
    caught = 0
    for seed in range(60):
        programs = protocol.sm100_programs(plan, [3, 3])
        inner = programs["mma"]

        def premature(inner=inner):
            ops = list(inner)
            first_wait = next(i for i, op in enumerate(ops) if op.kind == "wait" and op.pipe == "kv")
            release = next(i for i, op in enumerate(ops) if op.kind == "release" and op.pipe == "kv")
            ops.insert(first_wait + 1, ops.pop(release))
            yield from ops

        programs["mma"] = premature()
        try:
            model.run(programs, seed=seed)
        except ProtocolError:
            caught += 1
    assert caught > 0


# --- the model is the generated code's protocol ----------------------------------------------------

_CREATE = re.compile(
    r"pipe_(?P<name>\w+) = pipeline\.(?P<cls>\w+)\.create\(\s*barrier_storage=storage\.mbar_(?P=name)\.data_ptr\(\), "
    r"num_stages=(?P<stages>\d+),\s*producer_group=pipeline\.CooperativeGroup\(pipeline\.Agent\.Thread, (?P<prod>\d+)\),"
    r"\s*consumer_group=pipeline\.CooperativeGroup\(pipeline\.Agent\.Thread, (?P<cons>\d+)\),"
    r"(?:\s*tx_count=(?P<tx>\d+),)?"
)
METHODS = {"acquire": "producer_acquire", "commit": "producer_commit", "wait": "consumer_wait", "release": "consumer_release"}


def _sm100_source(spec):
    pkg, plans, _ = render_spec(spec, "test")
    (plan,) = [p for p in plans if p.arch == "sm100"]
    return plan, pkg.files["fwd_sm100.py"]


@pytest.mark.parametrize("hd,pipeline", [((128, None), {}), ((192, 128), {}), ((256, None), {}),
                                         ((128, None), {"ping_pong": False})])
def test_sm100_barrier_setup_is_generated_from_the_plan(hd, pipeline):
    plan, text = _sm100_source(_spec(hd, {"kind": "causal"}, pipeline))
    created = {m["name"]: m for m in _CREATE.finditer(text)}
    assert set(created) == {p.name for p in plan.pipelines}
    for p in plan.pipelines:
        m = created[p.name]
        assert (m["cls"], int(m["stages"]), int(m["prod"]), int(m["cons"])) == (
            p.cls, p.stages, p.producer_arrivals, p.consumer_arrivals)
        assert int(m["tx"] or 0) == p.tx_bytes
        assert f"mbar_{p.name}: cute.struct.MemRange[cutlass.Int64, {p.stages} * 2]" in text
    for b in plan.named_barriers:
        assert f"barrier_id={b.name.upper()}_BARRIER, num_threads={b.threads})" in text


def _sections(text, markers):
    """The generated text of each role: from its marker comment to the next role's."""
    starts = sorted((text.index(marker), role) for role, marker in markers.items())
    out = {}
    for (start, role), (end, _) in zip(starts, starts[1:] + [(len(text), None)]):
        out[role] = text[start:end]
    return out


def _model_calls(programs):
    calls = {}
    for role, program in programs.items():
        role = re.sub(r"\d+$", "", role)
        for op in program:
            if op.kind in METHODS and op.pipe:
                method = "producer_tail" if op.kind == "acquire" and op.count == 0 else METHODS[op.kind]
                calls.setdefault(role, set()).add((op.pipe, method))
    return calls


def _text_calls(section):
    calls = set(re.findall(r"pipe_(\w+)\.(producer_acquire|producer_commit|consumer_wait|consumer_release|producer_tail)", section))
    calls |= {(name, "producer_acquire") for name in re.findall(r"bw\.load_stage\(pipe_(\w+)", section)}
    # the guarded steps' pipeline calls as module functions (fa4gen.device.sm90.consumer_wait / consumer_release)
    calls |= {(name, method) for method, name in re.findall(r"hopper\.(consumer_wait|consumer_release)\(pipe_(\w+)", section)}
    return calls


def test_sm100_roles_use_the_pipelines_the_model_checks():
    plan, text = _sm100_source(_spec((128, None), {"kind": "causal"}, {}))
    sections = _sections(text, {"load": "# Load role", "mma": "# MMA role", "softmax": "# Softmax role",
                                "correction": "# Correction role"})
    model = _model_calls(protocol.sm100_programs(plan, [2, 3]))
    for role in ("load", "mma", "softmax", "correction"):
        assert _text_calls(sections[role]) == model[role], role


@pytest.mark.parametrize("name", ["llama3_8b", "vit_encoder"])
def test_sm90_roles_use_the_pipelines_the_model_checks(name):
    """Each forward module of the spec (the persistent forward and its one-CTA-per-tile twin, vit_encoder's 128-row
    twin; llama3_8b with a causal mask) calls the pipeline methods, and names the barriers, that the model runs."""
    spec = load_spec(ROOT / "specs" / f"{name}.yaml")  # backward: true; its backward is not modelled
    pkg, plans, _ = render_spec(spec, "test")
    fwds = [p for p in plans if p.direction == "fwd"]
    # persistent + its long-call twin (+ vit_encoder's 128-row twin)
    assert [p.scheduler == "persistent" for p in fwds] == [True, False] + [True] * (name == "vit_encoder")
    for plan in fwds:
        text = pkg.files[f"{plan.module}.py"]
        sections = _sections(text, {"producer": "# Load role", "consumer": "# MMA role"})
        model = _model_calls(protocol.sm90_programs(plan, [3, 2] if plan.scheduler == "persistent" else 3))
        assert _text_calls(sections["producer"]) == model["producer"]
        # one CTA per tile, the consumer never releases Q: the model does not either; persistent, both do
        assert (("q", "consumer_release") in model["consumer"]) == (plan.scheduler == "persistent")
        assert _text_calls(sections["consumer"]) == model["consumer"]
        for b in protocol.sm90_named_barriers(plan):
            if b.name.startswith("pingpong"):
                assert "PINGPONG_BARRIER" in text
            if b.name == "o_stored":
                assert f"O_STORED_BARRIER = {b.barrier_id}" in text and "barrier_id=O_STORED_BARRIER" in text


# --- two_cta: the CTA pair's cross-CTA arrivals ------------------------------------------------------

TWO_CTA_PLANS = [
    plan_kernels(_spec(hd, {"kind": "none"}, dict(p, two_cta=True)), "sm100")[0]
    for hd, p in itertools.product([(128, None), (192, None)], [{}, {"ping_pong": False}, {"kv_stages": 2}])
]


@pytest.mark.parametrize("plan", [pytest.param(p, id=f"d{p.head_dim}-q{p.q_tiles}-s{p.kv_stages}") for p in TWO_CTA_PLANS])
def test_sm100_two_cta_protocol_holds(plan):
    """Both CTAs of the pair are modelled: the even CTA's MMAs read both CTAs' Q/K/V halves and write both
    CTAs' S/O, its commits multicast to both CTAs' barriers, the odd CTA's TMA bytes land on the even CTA's
    full barriers and its softmax/correction releases on the even CTA's empty barriers."""
    assert plan.two_cta and plan.cluster_m == 2 and plan.mma_m == 256
    runs = protocol.check_sm100(plan, runs=40, max_tiles=4, max_blocks=5, seed=4)
    assert all(r.tc_ops > 0 and r.tma_copies > 0 for r in runs)
    for r in runs:
        # the odd CTA's TMA full barriers and its sp/o empty barriers are never used; its sp/o full barriers
        # and q/kv empty barriers complete as often as the even CTA's
        assert r.completions["kv@1.full[0]"] == r.completions["sp@1.empty[0]"] == 0
        assert r.completions["sp@1.full[0]"] == r.completions["sp.full[0]"] > 0
        assert r.completions["kv@1.empty[0]"] == r.completions["kv.empty[0]"] > 0


@pytest.mark.parametrize("changes,message", [
    # the even CTA's sp/o barriers must count the odd CTA's releases too
    ({"sp": {"consumer_arrivals": 256}}, r"phase bit aliases|expecting \('(P|Os)'|more than"),
    ({"o": {"consumer_arrivals": 128}}, r"phase bit aliases|expecting|more than|ends mid-phase"),
])
def test_sm100_two_cta_mutations_are_caught(changes, message):
    plan = _with(TWO_CTA_PLANS[0], **changes)
    with pytest.raises(ProtocolError, match=message):
        protocol.check_sm100(plan, runs=30, seed=5)


def test_sm100_two_cta_barrier_setup_is_generated_from_the_plan():
    plan, text = _sm100_source(_spec((128, None), {"kind": "none"}, {"two_cta": True}))
    created = {m["name"]: m for m in _CREATE.finditer(text)}
    assert set(created) == {p.name for p in plan.pipelines}
    for p in plan.pipelines:
        m = created[p.name]
        assert (m["cls"], int(m["stages"]), int(m["prod"]), int(m["cons"])) == (
            p.cls, p.stages, p.producer_arrivals, p.consumer_arrivals)
        assert int(m["tx"] or 0) == p.tx_bytes
        # every pipeline with a tcgen05 side gets the pair's cluster layout (multicast commits, remote releases)
        body = text[m.start():text.index(")\n", text.index("defer_sync", m.start()))]
        assert ("cta_layout_vmnk=cta_layout_vmnk" in body) == p.cluster_aware
    # the pair's TMA bytes: both CTAs' halves land on the even CTA's full barrier
    assert {p.name: p.tx_bytes for p in plan.pipelines if p.has_tx} == {"q": 2 * plan.q_bytes, "kv": 2 * plan.k_bytes}
    assert plan.k_bytes == plan.tile_n // 2 * plan.head_dim * 2 and plan.v_bytes == plan.tile_n * plan.head_dim_v
    sections = _sections(text, {"load": "# Load role", "mma": "# MMA role", "softmax": "# Softmax role",
                                "correction": "# Correction role"})
    # the even CTA's roles; one multicast commit / release in the text is an arrival per CTA in the model
    model = _model_calls({k: v for k, v in protocol.sm100_programs(plan, [2, 3]).items() if protocol.PEER not in k})
    for role in ("load", "mma", "softmax", "correction"):
        assert _text_calls(sections[role]) == {(pipe.replace(protocol.PEER, ""), m) for pipe, m in model[role]}, role


# --- the persistent SM90 forward (one CTA over several tiles) --------------------------------------

PERSISTENT_SM90 = [p for p in SM90_PLANS if p.scheduler == "persistent"]


def _edited_fails(model, make_programs, edit, seeds):
    """The error messages of the runs of `model` over `seeds` once `edit(role, op)` rewrites the ops of
    `make_programs()` (an op, or None to drop it)."""
    errors = []
    for seed in seeds:
        def rewrite(role, inner):
            for op in inner:
                op = edit(role, op)
                if op is not None:
                    yield op

        programs = {role: rewrite(role, inner) for role, inner in make_programs().items()}
        try:
            model.run(programs, seed=seed)
        except ProtocolError as err:
            errors.append(str(err))
    return errors


def _persistent_fails(plan, edit, tiles=(3, 2, 3), seeds=range(30)):
    """How many of `seeds` runs of `plan` over `tiles` raise once `edit(role, op)` rewrites its ops (an op,
    or None to drop it); the error messages."""
    model = protocol.ProtocolModel(protocol.sm90_pipelines(plan), protocol.sm90_named_barriers(plan))
    return _edited_fails(model, lambda: protocol.sm90_programs(plan, list(tiles)), edit, seeds)


def test_persistent_sm90_plans_are_modelled_over_several_tiles():
    assert len(PERSISTENT_SM90) >= 16  # every switch combination without a mask
    assert {(p.ping_pong, p.intra_wg_overlap) for p in PERSISTENT_SM90} == {(a, b) for a in (True, False) for b in (True, False)}
    assert any(p.num_mma_warpgroups == 3 for p in PERSISTENT_SM90)
    for plan in PERSISTENT_SM90:
        assert not _persistent_fails(plan, lambda role, op: op, seeds=range(5))
    with pytest.raises(ValueError, match="one tile per CTA"):
        protocol.sm90_programs(next(p for p in SM90_PLANS if p.scheduler != "persistent"), [2, 2])


def test_persistent_sm90_o_store_read_must_be_waited_for():
    """Without the storing warp's wait for its previous TMA store, the next tile's O overwrites sO while the
    store still reads it."""
    plan = PERSISTENT_SM90[0]
    # (tiles without key blocks: the next tile's epilogue follows the store within a few steps)
    errors = _persistent_fails(plan, lambda role, op: None if op.kind == "store_wait" else op, tiles=(0,) * 6,
                               seeds=range(200))
    assert errors and all("while a TMA store still reads it" in e for e in errors)


def test_persistent_sm90_q_must_be_released_per_tile():
    """A consumer that keeps Q's buffer (as the one-CTA-per-tile kernel may) deadlocks the next tile's Q load."""
    plan = PERSISTENT_SM90[0]
    errors = _persistent_fails(plan, lambda role, op: None if op.kind == "release" and op.pipe == "q" else op, seeds=range(3))
    assert len(errors) == 3 and all("deadlock" in e for e in errors)


def test_persistent_sm90_o_stored_barrier_needs_its_own_id():
    """With "O is in smem" on the epilogue barrier's id, a warpgroup that only arrives there runs into the next
    tile and its arrival counts towards the wrong use of the barrier: some interleaving breaks (without
    ping-pong, which would otherwise hold that warpgroup back in the next tile)."""
    caught = 0
    for plan in [p for p in PERSISTENT_SM90 if not p.ping_pong][:4]:
        errors = _persistent_fails(plan, lambda role, op: dataclasses.replace(op, stage=protocol.SM90_EPILOGUE_BARRIER)
                                   if op.kind in ("bar_sync", "bar_arrive") and op.stage == protocol.SM90_O_STORED_BARRIER
                                   else op, tiles=(0,) * 6, seeds=range(100))
        assert all("reads sO" in e or "named barrier" in e for e in errors)
        caught += len(errors)
    assert caught


# --- a sequence's last tile: warpgroups with no row skip their work (plan.skip_idle_warpgroups) ----------------

IDLE_SM90 = [p for p in SM90_PLANS if p.skip_idle_warpgroups]


def test_idle_warpgroups_are_planned_for_three_warpgroups():
    assert IDLE_SM90 and all(p.num_mma_warpgroups == 3 for p in IDLE_SM90)
    grid = [p for p in IDLE_SM90 if p.scheduler != "persistent"]
    assert {(p.ping_pong, p.intra_wg_overlap) for p in grid} == {(a, b) for a in (True, False) for b in (True, False)}
    # the persistent loop skips through guarded steps, which exist for the intra-warpgroup overlap's block only
    persistent = [p for p in SM90_PLANS if p.scheduler == "persistent" and p.num_mma_warpgroups == 3]
    assert persistent and all(p.skip_idle_warpgroups == p.intra_wg_overlap for p in persistent)
    assert any(p.skip_idle_warpgroups for p in persistent)


def test_sm90_persistent_idle_warpgroups_keep_the_protocol_across_tiles():
    """The persistent kernel's idle warpgroups (guarded steps) over several tiles, busy and idle mixed, with the
    pipeline states running on across them."""
    plans = [p for p in IDLE_SM90 if p.scheduler == "persistent"]
    assert plans
    tiles = [(5, 3), (2, 1), (4, 2), (0, 1), (3, 1), (1, 3)]
    for plan in plans:
        model = protocol.ProtocolModel(protocol.sm90_pipelines(plan), protocol.sm90_named_barriers(plan))
        for seed in range(6):
            run = model.run(protocol.sm90_programs(plan, tiles), seed=seed)
            assert run.tma_copies == len(tiles) + 2 * sum(n for n, _ in tiles)


@pytest.mark.parametrize("busy", [1, 2])
def test_sm90_idle_warpgroups_keep_the_protocol(busy):
    for plan in IDLE_SM90:
        model = protocol.ProtocolModel(protocol.sm90_pipelines(plan), protocol.sm90_named_barriers(plan))
        for seed, blocks in itertools.product(range(4), (0, 1, 2, 5)):
            run = model.run(protocol.sm90_programs(plan, (blocks, busy)), seed=seed)
            assert run.tma_copies == 1 + 2 * blocks


def _idle_mutant_errors(plan, make_keep, seeds=range(30)):
    """Errors of runs where the idle warpgroup 2 (one busy warpgroup, 4 key blocks) skips every op that
    `make_keep()` (a fresh filter per run) refuses."""
    model = protocol.ProtocolModel(protocol.sm90_pipelines(plan), protocol.sm90_named_barriers(plan))
    errors = []
    for seed in seeds:
        programs = protocol.sm90_programs(plan, (4, 1))
        keep = make_keep()
        programs["consumer2"] = (op for op in programs["consumer2"] if keep(op))
        try:
            model.run(programs, seed=seed)
        except ProtocolError as err:
            errors.append(str(err))
    return errors


def test_sm90_idle_warpgroup_that_keeps_its_turn_deadlocks():
    """Warpgroup 2 (the last) arrives once to start the ring, then passes each turn on; without its first pass
    warpgroup 0 never gets the tensor core back."""
    plan = next(p for p in IDLE_SM90 if p.ping_pong)

    def make_keep():
        arrives = 0

        def keep(op):
            nonlocal arrives
            if op.kind == "bar_arrive" and op.stage == protocol.SM90_PINGPONG_BARRIER:
                arrives += 1
                return arrives != 2  # the start arrive kept, the first pass dropped
            return True
        return keep

    errors = _idle_mutant_errors(plan, make_keep, seeds=range(3))
    assert len(errors) == 3 and all("deadlock" in e for e in errors)


def test_sm90_idle_warpgroup_that_never_waits_for_the_loads_is_caught():
    """Releasing K/V stages without waiting for their loads lets the idle warpgroup's arrivals run a round ahead
    and count towards a stage's previous use: the producer refills a stage the busy warpgroup still reads."""
    plan = next(p for p in IDLE_SM90 if not p.ping_pong and p.kv_stages == 1)
    errors = _idle_mutant_errors(plan, lambda: lambda op: not (op.kind == "wait" and op.pipe in ("k", "v")), seeds=range(100))
    assert errors


# --- pipeline.q_stages 2: the persistent forward's two Q buffers ------------------------------------

Q2_SM90 = [p for p in SM90_PLANS if p.q_stages == 2]


def test_q_stages_2_plans_are_the_persistent_ones_modelled():
    assert len(Q2_SM90) == 16 and all(p.scheduler == "persistent" for p in Q2_SM90)
    assert {p.mask_kind for p in Q2_SM90} == {"none", "causal"}
    for plan in Q2_SM90:
        assert not _persistent_fails(plan, lambda role, op: op, tiles=(3, 0, 2, 4, 1), seeds=range(5))


def test_q_stages_2_next_q_into_the_buffer_in_use_is_caught():
    """A producer that loads every tile's Q into buffer 0 (a template indexing sQ by 0 with two stages)
    overwrites Q while the previous tile's S GEMMs may still read it."""
    plan = next(p for p in Q2_SM90 if p.mask_kind == "none" and p.ping_pong and p.intra_wg_overlap)

    def to_stage0(role, op):
        if op.kind == "tma" and op.pipe == "q":
            return dataclasses.replace(op, writes=(("sQ[0]", op.writes[0][1]),))
        return op

    errors = _persistent_fails(plan, to_stage0, tiles=(1, 1, 1, 1), seeds=range(50))
    # (a consumer then finds the wrong tile's Q in buffer 0, or nothing in buffer 1)
    assert len(errors) == 50 and all(re.search(r"reads sQ\[[01]\] expecting \('Q', \d\)", e) for e in errors)


def test_q_stages_2_consumer_reading_the_other_buffer_is_caught():
    """Consumers that read buffer 0 whatever the tile (the S GEMM's Q operand not sliced by the pipeline
    state) read the wrong tile's Q on every second tile."""
    plan = next(p for p in Q2_SM90 if p.mask_kind == "causal" and p.ping_pong and p.intra_wg_overlap)

    def from_stage0(role, op):
        if op.kind == "read" and op.reads and op.reads[0][0].startswith("sQ["):
            return dataclasses.replace(op, reads=(("sQ[0]", op.reads[0][1]), *op.reads[1:]))
        return op

    errors = _persistent_fails(plan, from_stage0, tiles=(2, 2), seeds=range(5))
    assert len(errors) == 5


def test_q_stages_2_template_indexes_q_by_the_pipeline_state_and_one_buffer_text_uses_index_0():
    """With two Q buffers (auto's choice here) the producer copies into the state's buffer and the S GEMMs read the
    consumer state's; q_stages 1 renders the one-buffer text, constant index 0 (the kernel measured before session 49)."""
    base = {"name": "p", "targets": ["sm90"], "dtype": "bf16", "head_dim": 64, "mask": {"kind": "none"}}
    pkg2, plans2, _ = render_spec(spec_from_dict(base), "test")
    pkg1, plans1, _ = render_spec(spec_from_dict(dict(base, pipeline={"q_stages": 1})), "test")
    fwd2, fwd1 = pkg2.files["fwd_sm90.py"], pkg1.files["fwd_sm90.py"]
    assert plans2[0].q_stages == 2 and plans1[0].q_stages == 1
    assert "Q_STAGES = 2" in fwd2 and "tQsQ[None, q_state.index]" in fwd2
    assert "tSrQ[None, None, None, q_cstate.index]" in fwd2
    assert "Q_STAGES" not in fwd1 and "tQsQ[None, 0]" in fwd1 and "tSrQ[None, None, None, 0]" in fwd1
    # the one-CTA-per-tile twin of the q_stages 2 spec keeps one buffer
    assert plans2[1].module == "fwd_sm90_long" and plans2[1].q_stages == 1
    assert "Q_STAGES" not in pkg2.files["fwd_sm90_long.py"]


def test_persistent_sm90_producer_loads_the_first_k_before_q():
    """The persistent producer issues a tile's first K before acquiring Q's buffer (the K stage frees a block
    earlier than Q's buffer); a one-CTA-per-tile producer loads Q first. Model and template text agree."""
    for plan in (PERSISTENT_SM90[0], next(p for p in SM90_PLANS if p.scheduler != "persistent")):
        persistent = plan.scheduler == "persistent"
        ops = [op for op in protocol.sm90_programs(plan, [2, 0, 3] if persistent else 2)["producer"] if op.kind == "tma"]
        order = [(op.pipe, op.writes[0][1]) for op in ops]
        if persistent:
            assert order[:3] == [("k", ("K", 0, 0)), ("q", ("Q", 0)), ("k", ("K", 0, 1))]
            assert ("q", ("Q", 1)) in order and ("q", ("Q", 2)) in order  # a tile without key blocks still loads Q
            assert order[order.index(("q", ("Q", 2))) - 1] == ("k", ("K", 2, 0))
        else:
            assert order[:2] == [("q", ("Q", 0)), ("k", ("K", 0, 0))]
    spec = load_spec(ROOT / "specs" / "vit_encoder.yaml")
    pkg, plans, _ = render_spec(spec, "test")
    for plan in (p for p in plans if p.direction == "fwd"):
        producer = _sections(pkg.files[f"{plan.module}.py"], {"producer": "# Load role", "consumer": "# MMA role"})["producer"]
        k_first = producer.index("pipe_k.producer_acquire") < producer.index("pipe_q.producer_acquire")
        assert k_first == (plan.scheduler == "persistent"), plan.module


# --- the SM90 backward (dQ warp path): one tile per CTA, and persistent (since session 66) ---------------------

def _bwd(d, mask=None, **kw):
    """The spec's bwd_sm90 plan (with allow_gqa: the fp32-workspace GQA one, not its MHA twin nor docs/patches
    0001's head-loop kernel)."""
    spec = spec_from_dict(dict(name="pb", targets=["sm90"], dtype="bf16", head_dim=d, mask=mask or {"kind": "none"},
                               backward=True, **kw))
    return next(p for p in plan_kernels(spec, "sm90") if p.direction == "bwd" and p.module == "bwd_sm90")


# the modelled plans (Sᵀ MHA without determinism): no mask at d64 / d96 / d128 (80-row steps), causal, softcap
BWD_PLANS = [_bwd(d, mask, allow_gqa=False, softcap=sc)
             for d, mask, sc in [(64, None, 0.0), (96, None, 0.0), (128, None, 0.0), (128, None, 20.0),
                                 (128, {"kind": "causal"}, 0.0), (64, {"kind": "causal"}, 0.0)]]
# the d128 causal kernel persistent as plan_backward(masked_persistent=True) builds it (tools/bwd_timeline.py
# --persistent): the planner keeps it one CTA per tile since session 68, but the form stays modelled and measurable
assert BWD_PLANS[4].scheduler == "grid"
BWD_PLANS[4] = plan_sm90_backward(spec_from_dict(dict(name="pb", targets=["sm90"], dtype="bf16", head_dim=128,
                                                       mask={"kind": "causal"}, backward=True, allow_gqa=False)),
                                  masked_persistent=True)


def _bwd_fails(plan, edit, tiles=(3, 3, 3), seeds=range(30)):
    """The error messages of the backward model's runs of `plan` over `tiles` once `edit(role, op)` rewrites its ops."""
    model = protocol.ProtocolModel(protocol.sm90_bwd_pipelines(plan), protocol.sm90_bwd_named_barriers(plan))
    return _edited_fails(model, lambda: protocol.sm90_bwd_programs(plan, list(tiles)), edit, seeds)


def _persistent(plan, **stages):
    """`plan` persistent with other stage counts; one K / V stage where dK / dV then go through K's and V's buffers
    (plan_backward's second K / V stage needs the staging: `_second_kv_stage`)."""
    p = dataclasses.replace(plan, scheduler="persistent", persistent_ctas=132, **stages)
    return p if p.dkv_staging.phases or "kv_stages" in stages else dataclasses.replace(p, kv_stages=1)


@pytest.mark.parametrize("plan", [pytest.param(p, id=f"d{p.head_dim}-{p.mask_kind}-m{p.tile_m}-sc{int(p.softcap)}")
                                  for p in BWD_PLANS])
def test_sm90_backward_protocol_holds(plan):
    """One tile per CTA as planned; and the same plan persistent over several tiles, with every stage count the
    planner may choose (Q / dO 1-2, P/dS 1-2, dQ buffers 1-2)."""
    assert plan.swap_sdp and not plan.deterministic and plan.dq_claim
    protocol.check_sm90_bwd(plan, runs=20)
    for q, do, pds, bufs in itertools.product((1, 2), (1, 2), (1, 2), (1, 2)):
        p = _persistent(plan, q_stages=q, do_stages=do, pds_stages=pds, dq_buffers=bufs)
        if p.has_mask and not p.dkv_staging.phases:  # never planned (plan_backward keeps one CTA per tile)
            with pytest.raises(ValueError, match="stages dK / dV in the dS buffers"):
                protocol.check_sm90_bwd(p)
            continue
        protocol.check_sm90_bwd(p, runs=6, max_tiles=4, seed=q + 2 * do + 4 * pds + 8 * bufs)


def test_sm90_backward_model_refuses_what_it_does_not_model():
    for kw in (dict(allow_gqa=True), dict(allow_gqa=False, deterministic=True), dict(allow_gqa=False, varlen=True),
               dict(allow_gqa=False, pipeline={"bwd_dq_atomic": True}), dict(allow_gqa=False, pipeline={"bwd_swap_ab": False})):
        with pytest.raises(ValueError, match="the backward model covers"):
            protocol.check_sm90_bwd(_bwd(128, **kw))
    grid = dataclasses.replace(next(p for p in BWD_PLANS if p.mask_kind == "causal"), scheduler="grid", persistent_ctas=0)
    with pytest.raises(ValueError, match="one tile per CTA"):
        protocol.sm90_bwd_programs(grid, [2, 2])
    fwd = next(p for p in plan_kernels(_spec((128, None), {"kind": "none"}, {}, ("sm90",)), "sm90"))
    with pytest.raises(ValueError, match="sm90 backward plans"):
        protocol.check_sm90_bwd(fwd)


def test_persistent_backward_kv_released_before_the_dkv_stores_read_it_is_caught():
    """Where the dS buffers cannot stage dK / dV (d128 with one dS stage: plan.dkv_staging.phases 0), the epilogue
    goes through K's and V's buffers: consumers releasing K / V before warpgroup 0's stores have read those buffers
    let the next tile's K / V load overwrite them under the stores."""
    plan = _persistent(BWD_PLANS[2], pds_stages=1)
    assert plan.dkv_staging.phases == 0

    def early(role, op):
        return None if op.kind == "store_wait_le" and role == "consumer0" else op

    errors = _bwd_fails(plan, early, seeds=range(200))
    assert errors and all("while a TMA store still reads it" in e for e in errors)


def test_persistent_backward_stages_dkv_in_the_ds_buffers():
    """The planned persistent backwards stage dK / dV in the dS buffers (session 67): d64 both at once in dS stage 1
    (the next tile's first block writes stage 0 only); d96 / d128 dK in the dS buffers and dV in the dQ buffers.
    With one dQ buffer, d128 falls back to two phases (dK, then dV) in the dS buffers."""
    staging = {(p.head_dim, p.mask_kind, int(p.softcap)): p.dkv_staging for p in BWD_PLANS if p.scheduler == "persistent"}
    assert {k: (v.phases, v.stage0, v.dv_in_dq) for k, v in staging.items()} == {
        (64, "none", 0): (1, 1, False), (96, "none", 0): (1, 0, True), (128, "none", 0): (1, 0, True),
        (128, "none", 20): (1, 0, True), (128, "causal", 0): (1, 0, True), (64, "causal", 0): (1, 1, False)}
    # the staged bytes fit the dS (and dQ) buffers from their first stage on; the stores' swizzle needs 1024-byte
    # offsets; the dQ buffers' size is the kernel's (sm90.dq_split)
    for key, st in staging.items():
        plan = next(p for p in BWD_PLANS if (p.head_dim, p.mask_kind, int(p.softcap)) == key)
        assert st.stage_bytes == plan.tile_n * plan.tile_m * 2 and st.stage_bytes % 1024 == 0
        in_ds = st.dk_bytes if st.dv_in_dq else st.dk_bytes + st.dv_bytes if st.phases == 1 else max(st.dk_bytes, st.dv_bytes)
        assert st.stage0 * st.stage_bytes + in_ds <= plan.pds_stages * st.stage_bytes
        if st.dv_in_dq:
            assert st.dq_buffer_bytes == 64 * sm90.dq_split(plan.head_dim, plan.tile_m)[1] * 4
            assert st.dv_bytes <= plan.dq_buffers * st.dq_buffer_bytes
    d128 = next(p for p in BWD_PLANS if (p.head_dim, p.softcap) == (128, 0.0) and p.scheduler == "persistent")
    assert (dataclasses.replace(d128, dq_buffers=1).dkv_staging.phases, dataclasses.replace(d128, dq_buffers=1).dkv_staging.dv_in_dq) == (2, False)
    # not staged: one CTA per tile, GQA accumulators
    assert all(p.scheduler == "persistent" for p in BWD_PLANS)  # (session 67: the causal ones too)
    assert dataclasses.replace(BWD_PLANS[0], scheduler="grid", persistent_ctas=0).dkv_staging.phases == 0
    assert _persistent(_bwd(128, allow_gqa=True)).dkv_staging.phases == 0


@pytest.mark.parametrize("d", [96, 128])
def test_persistent_backward_staged_store_read_must_be_waited_for(d):
    """Staged in the dS buffers in two phases, warpgroup 0's first warp not waiting for its stores' reads lets dV's
    writes or the next tile's dS writes land under the stores. (d64's one phase in dS stage 1 is next written a whole
    query block later, which the model's stores, retiring at random steps, almost never outlast.)"""
    plan = next(p for p in BWD_PLANS if p.head_dim == d and p.scheduler == "persistent" and not p.softcap)
    assert plan.dkv_staging.phases
    errors = _bwd_fails(plan, lambda role, op: None if op.kind == "store_wait_le" and role == "consumer0" else op,
                        seeds=range(200))
    assert errors and all(re.search(r"writes sd(S\[\d\]\.\d|Q\[\d\]) while a TMA store still reads it", e)
                          for e in errors), errors[:3]


@pytest.mark.parametrize("dq_buffers", [2, 1])
def test_persistent_backward_staged_epilogue_needs_its_last_barrier(dq_buffers):
    """Staged from dS stage 0 (d128: dK there, dV in the dQ buffers; and, with one dQ buffer, two phases in the dS
    buffers): without the epilogue's last barrier the next tile's first dS or dQ writes can land before warpgroup
    0's first warp has waited for the last store's read."""
    plan = next(p for p in BWD_PLANS if p.head_dim == 128 and p.scheduler == "persistent" and not p.softcap)
    plan = plan if dq_buffers == 2 else dataclasses.replace(plan, dq_buffers=dq_buffers)
    assert plan.dkv_staging.stage0 == 0 and plan.dkv_staging.phases == 3 - dq_buffers
    seen = {}

    per_tile = 2 * plan.dkv_staging.phases + 1

    def no_last_barrier(role, op):  # epilogue barriers a tile: first, one per phase written, one between, last
        if op.kind == "bar_sync" and op.stage == protocol.SM90_BWD_EPILOGUE_BARRIER:
            seen[role] = seen.get(role, 0) + 1
            if seen[role] % per_tile == 0:
                return None
        return op

    errors = []
    for seed in range(200):
        seen.clear()
        errors += _bwd_fails(plan, no_last_barrier, seeds=[seed])
    assert errors and all(re.search(r"writes sd(S\[\d\]\.\d|Q\[\d\]) while a TMA store still reads it|reads sd[SQ]", e)
                          for e in errors), errors[:3]


def test_persistent_backward_dv_in_dq_waits_for_the_dq_warp():
    """dV staged in the dQ buffers (d128): without the dQ warp's per-tile arrival the consumers never pass the
    drained barrier (deadlock); without the consumers' wait on it, dV lands under the dQ warp's last reduce."""
    plan = next(p for p in BWD_PLANS if p.head_dim == 128 and p.scheduler == "persistent" and not p.softcap)
    assert plan.dkv_staging.dv_in_dq
    drained = protocol.SM90_BWD_DQ_DRAINED_BARRIER
    errors = _bwd_fails(plan, lambda role, op: None if role == "dq" and op.stage == drained else op, seeds=range(3))
    assert len(errors) == 3 and all("deadlock" in e for e in errors)
    errors = _bwd_fails(plan, lambda role, op: op if role == "dq" or op.kind != "bar_sync" or op.stage != drained
                        else None, seeds=range(300))
    assert errors and all(re.search(r"writes sdQ\[\d\] while a TMA store still reads it|reads sdQ\[\d\] expecting|deadlock|arrivals", e)
                          for e in errors), errors[:3]
    assert any("writes sdQ" in e for e in errors)


def test_persistent_backward_kv_never_released_deadlocks():
    plan = _persistent(BWD_PLANS[0])
    errors = _bwd_fails(plan, lambda role, op: None if op.kind == "release" and op.pipe == "kv" else op, seeds=range(3))
    assert len(errors) == 3 and all("deadlock" in e for e in errors)


@pytest.mark.parametrize("which", [2, 4, -4], ids=["d128-persistent-staged", "d128-causal-persistent-staged",
                                                  "d128-causal-grid"])
def test_sm90_backward_missing_epilogue_barriers_are_caught(which):
    """Without the epilogue's barriers one warpgroup writes dK over K (one CTA per tile) or over dS / dQ (persistent,
    staged in the dS / dQ buffers) while the other still reads it for its last query block, or stores a buffer the
    other has not written yet and then writes it under the store."""
    plan = BWD_PLANS[abs(which)]
    if which < 0:  # one CTA per tile: the epilogue through K's and V's buffers
        plan = dataclasses.replace(plan, scheduler="grid", persistent_ctas=0)
    buf = "sd(S\\[\\d\\]\\.\\d|Q\\[\\d\\])" if plan.dkv_staging.phases else "s[KV]\\[0\\]"
    errors = _bwd_fails(plan, lambda role, op: None if op.kind == "bar_sync" and op.stage == 1 else op, tiles=(4,),
                        seeds=range(100))
    assert errors and all(re.search(rf"reads {buf} expecting|writes {buf} while a TMA store still reads it", e)
                          for e in errors), errors[:3]


def test_sm90_backward_dq_handoff_needs_the_empty_arrivals():
    plan = BWD_PLANS[0]
    errors = _bwd_fails(plan, lambda role, op: None if role == "dq" and op.kind == "bar_arrive" else op, tiles=(3,),
                        seeds=range(3))
    assert len(errors) == 3 and all("deadlock" in e for e in errors)


@pytest.mark.parametrize("d", [64, 128])
def test_sm90_backward_roles_use_the_pipelines_the_model_checks(d):
    """The rendered MHA backward without a mask (the model's plans) calls, role by role, the pipeline methods the
    model runs: the load role acquires K / V, Q and dO; the dQ warp touches no pipeline (named barriers only);
    the consumers wait for all three and release Q and dO (and, persistent, K / V)."""
    spec = spec_from_dict(dict(name="pb", targets=["sm90"], dtype="bf16", head_dim=d, backward=True, allow_gqa=False))
    pkg, plans, _ = render_spec(spec, "test")
    plan = next(p for p in plans if p.direction == "bwd")
    text = pkg.files[f"{plan.module}.py"]
    sections = _sections(text, {"producer": "# Load role", "dq": "# dQ role",
                                "consumer": "warpgroup_reg_alloc(REGS_CONSUMER)"})
    model = _model_calls(protocol.sm90_bwd_programs(plan, [3, 2] if plan.scheduler == "persistent" else 3))
    for role in ("producer", "consumer"):
        assert _text_calls(sections[role]) == model[role], role
    assert _text_calls(sections["dq"]) == set() and "dq" not in model
    for name, value in (("EPILOGUE_BARRIER", protocol.SM90_BWD_EPILOGUE_BARRIER), ("PDS_BARRIER", protocol.SM90_BWD_PDS_BARRIER),
                        ("DQ_FULL_BARRIER", protocol.SM90_BWD_DQ_FULL_BARRIER),
                        ("DQ_EMPTY_BARRIER", protocol.SM90_BWD_DQ_EMPTY_BARRIER)):
        assert re.search(rf"^{name} = {value}\b", text, re.M), name
    assert f"DQ_HANDOFF = 128 + 32" in text and protocol.SM90_BWD_DQ_HANDOFF == 160

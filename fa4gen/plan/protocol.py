"""Plan stage: the inter-role pipelines of a kernel as data, and a model checker for their protocol.

A kernel's roles (load warp, MMA warp, softmax and correction warpgroups, ...) hand buffers to each
other through mbarrier pipelines. Each pipeline is a `PipelineSpec`: producer and consumer roles,
stages, how many arrivals complete a "full" and an "empty" phase, the TMA transaction bytes, and
which phase the producer's first acquire waits for. The SM100 plan carries its pipelines and the
SM100 template generates its barrier storage and pipeline objects from them; the SM90 pipelines are
derived here from the SM90 plan's fields (its template builds them by hand).

The model checker runs the roles' programs (per-tile sequences of acquire / commit / wait / release,
data reads and writes, tensor-core ops) under random interleavings, with mbarriers modelled by their
hardware rule (a wait on parity P passes when the barrier's phase parity differs from P), a
tensor core that executes tcgen05 ops in issue order with `tcgen05.commit` arrivals queued behind
them, TMA copies that land in any order, and named barriers. It reports a deadlock, a wait that
passes on the wrong phase (parity aliasing), a buffer written before every consumer released it,
and a read that sees data other than what the program meant to read (tokens).

The forward models (`sm90_programs`, `sm100_programs`) refuse a backward plan (`forward_only`) rather than pass
it; the SM90 backward has its own (`sm90_bwd_programs`), for the dQ-warp path its default plans without
determinism or dK/dV workspaces take: the K / V, Q and dO pipelines, the dQ hand-off's named barriers, the
P / dS barrier, the epilogue that stages dK / dV in K's and V's buffers, and (persistent, since session 66)
several tiles per CTA, whose epilogue stages them in the dS (and dQ) buffers instead (`plan.dkv_staging`).
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

# cutlass.pipeline classes, by who arrives: a TMA/async producer arrives from threads, a UMMA side
# arrives through tcgen05.commit (queued behind the MMAs it tracks).
PIPELINE_CLASSES = {
    "PipelineTmaUmma": ("tma", "umma"),
    "PipelineUmmaAsync": ("umma", "async"),
    "PipelineAsyncUmma": ("async", "umma"),
    "PipelineAsync": ("async", "async"),
    "PipelineTmaAsync": ("tma", "async"),
}


@dataclass(frozen=True)
class PipelineSpec:
    """One mbarrier pipeline between roles.

    `producer_arrivals` / `consumer_arrivals` complete one "full" / "empty" phase of one stage.
    `stage_by` is "ring" (both sides walk the stages in order) or "q_tile" (stage = Q tile index; each
    side flips its phase once per use). `producer_start_phase` 1 is the usual "buffers start empty"
    (the first acquire passes at once); 0 means the producer commits once before its first acquire,
    so every acquire waits for the release of the commit before it.
    """

    name: str
    cls: str
    producer: str
    consumers: tuple[str, ...]
    stages: int
    producer_arrivals: int
    consumer_arrivals: int
    tx_bytes: int = 0
    stage_by: str = "ring"
    producer_start_phase: int = 1
    purpose: str = ""

    def __post_init__(self):
        if self.cls not in PIPELINE_CLASSES:
            raise ValueError(f"unknown pipeline class {self.cls!r}")
        if self.stage_by not in ("ring", "q_tile"):
            raise ValueError(f"stage_by must be 'ring' or 'q_tile' (got {self.stage_by!r})")

    @property
    def producer_kind(self) -> str:
        return PIPELINE_CLASSES[self.cls][0]

    @property
    def consumer_kind(self) -> str:
        return PIPELINE_CLASSES[self.cls][1]

    @property
    def has_tx(self) -> bool:
        """A TMA producer: the stage completes when its transaction bytes land."""
        return self.producer_kind == "tma"

    @property
    def cluster_aware(self) -> bool:
        """The cutlass class takes a cluster layout (every class with a tcgen05 side does)."""
        return "umma" in (self.producer_kind, self.consumer_kind)


@dataclass(frozen=True)
class NamedBarrierSpec:
    name: str
    barrier_id: int
    threads: int
    purpose: str = ""


class ProtocolError(AssertionError):
    """The protocol deadlocks, reuses a buffer before its release, or passes a wait on the wrong phase."""


# --- ops a role program yields ------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    kind: str
    pipe: str = ""
    stage: int = 0
    phase: int = 0
    count: int = 1
    reads: tuple[tuple[str, object], ...] = ()
    writes: tuple[tuple[str, object], ...] = ()
    bytes: int = 0
    note: str = ""
    target: str = ""  # a TMA copy whose bytes land on another pipeline's full barrier (the peer CTA's)


def acquire(pipe, stage, phase, count=1, tx=0):
    return Op("acquire", pipe, stage, phase, count, bytes=tx)


def commit(pipe, stage, count=1):
    return Op("commit", pipe, stage, count=count)


def wait(pipe, stage, phase):
    return Op("wait", pipe, stage, phase)


def release(pipe, stage, count=1):
    return Op("release", pipe, stage, count=count)


def tma_load(pipe, stage, resource, token, nbytes, target=""):
    """A TMA copy into `resource` (stage `stage` of `pipe`); its bytes land on the full barrier of `target`
    (default: `pipe`). With two_cta, the odd CTA's copies land on the even CTA's barrier."""
    return Op("tma", pipe, stage, writes=((resource, token),), bytes=nbytes, target=target)


def read(*pairs, note=""):
    return Op("read", reads=tuple(pairs), note=note)


def write(*pairs, pipe="", stage=0, note=""):
    return Op("write", pipe, stage, writes=tuple(pairs), note=note)


def mma(reads, writes, note="", pipe="", stage=0):
    return Op("mma", pipe, stage, reads=tuple(reads), writes=tuple(writes), note=note)


def bar_sync(barrier_id, threads, count):
    return Op("bar_sync", stage=barrier_id, phase=threads, count=count)


def bar_arrive(barrier_id, threads, count):
    return Op("bar_arrive", stage=barrier_id, phase=threads, count=count)


def tma_store(resource, token):
    return Op("store", reads=((resource, token),))


def store_wait():
    return Op("store_wait")


def store_wait_le(pending: int):
    """Wait until at most `pending` of this role's TMA stores / bulk reduces still read their source
    (`cp.async.bulk.wait_group.read N`)."""
    return Op("store_wait_le", count=pending)


class PhaseTracker:
    """The (index, phase) walk of one side of a pipeline, as the generated code keeps it."""

    def __init__(self, spec: PipelineSpec, side: str, stage: int = 0):
        self.spec = spec
        self.index = stage
        start = spec.producer_start_phase if side == "producer" else 0
        self.phase = start

    def next(self) -> tuple[int, int]:
        here = (self.index, self.phase)
        if self.spec.stage_by == "ring":
            self.index += 1
            if self.index == self.spec.stages:
                self.index = 0
                self.phase ^= 1
        else:
            self.phase ^= 1
        return here


# --- the checker --------------------------------------------------------------------------------


class _Barrier:
    def __init__(self, name: str, expected: int):
        self.name = name
        self.expected = expected
        self.pending = expected
        self.tx = 0
        self.completions = 0

    def arrive(self, count: int):
        self.pending -= count
        if self.pending < 0:
            raise ProtocolError(f"{self.name}: {-self.pending} arrivals more than the {self.expected} of a phase")
        self._maybe_complete()

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.completions += 1
            self.pending = self.expected

    def passes(self, parity: int) -> bool:
        return self.completions % 2 != parity


@dataclass
class _Agent:
    name: str
    program: Iterator[Op]
    op: Op | None = None
    done: bool = False
    waits: dict = field(default_factory=dict)


@dataclass
class ModelRun:
    steps: int
    completions: dict[str, int]
    tc_ops: int
    tma_copies: int


class ProtocolModel:
    """Executes role programs against mbarrier pipelines under one random interleaving."""

    def __init__(self, pipelines: tuple[PipelineSpec, ...], named_barriers: tuple[NamedBarrierSpec, ...] = ()):
        self.pipes = {p.name: p for p in pipelines}
        self.named = {b.barrier_id: b for b in named_barriers}

    def run(self, programs: dict[str, Iterator[Op]], seed: int, max_steps: int = 2_000_000) -> ModelRun:
        rng = random.Random(seed)
        bars: dict[tuple[str, str, int], _Barrier] = {}
        owed: dict[tuple[str, int], int] = {}  # (pipe, stage) -> consumer arrivals still owed before reuse
        for p in self.pipes.values():
            for s in range(p.stages):
                bars[(p.name, "full", s)] = _Barrier(f"{p.name}.full[{s}]", p.producer_arrivals)
                bars[(p.name, "empty", s)] = _Barrier(f"{p.name}.empty[{s}]", p.consumer_arrivals)
                owed[(p.name, s)] = 0
        data: dict[str, object] = {}
        tc_queue: deque = deque()
        tma_flight: list[Op] = []
        stores: dict[str, list] = {}
        named_count: dict[int, int] = {}
        named_gen: dict[int, int] = {}
        agents = [_Agent(name, prog) for name, prog in programs.items()]
        stats = {"tc": 0, "tma": 0}

        def fail(msg: str):
            raise ProtocolError(f"seed {seed}: {msg}")

        def check_reads(who: str, reads):
            for res, token in reads:
                if data.get(res) != token:
                    fail(f"{who} reads {res} expecting {token} but it holds {data.get(res)}")

        def do_writes(who: str, op: Op):
            if op.pipe:
                if owed[(op.pipe, op.stage)] > 0:
                    fail(f"{who} writes {op.pipe} stage {op.stage} ({op.writes}) before its consumers released it "
                         f"({owed[(op.pipe, op.stage)]} arrivals owed)")
                owed[(op.pipe, op.stage)] = self.pipes[op.pipe].consumer_arrivals
            for res, token in op.writes:
                for pending in stores.values():
                    if any(r == res for r, _ in pending):
                        fail(f"{who} writes {res} while a TMA store still reads it")
                data[res] = token

        def arrive(pipe: str, side: str, stage: int, count: int):
            bars[(pipe, side, stage)].arrive(count)
            if side == "empty":
                owed[(pipe, stage)] -= count

        def try_wait(agent: _Agent, key, parity: int) -> bool:
            bar = bars[key]
            n = agent.waits.get(key, 0)
            spec = self.pipes[key[0]]
            offset = 1 if key[1] == "full" or spec.producer_start_phase == 0 else 0
            target = n + offset
            if not bar.passes(parity):
                if bar.completions > target:
                    fail(f"{agent.name} waits on {bar.name} for completion {target} but it is already at "
                         f"{bar.completions}: the phase bit aliases")
                return False
            if bar.completions != target:
                fail(f"{agent.name} passes {bar.name} (parity {parity}) at completion {bar.completions}, "
                     f"but its program needs completion {target}")
            agent.waits[key] = n + 1
            return True

        def execute(agent: _Agent) -> bool:
            op = agent.op
            k = op.kind
            if k in ("acquire", "wait"):
                side = "empty" if k == "acquire" else "full"
                if not try_wait(agent, (op.pipe, side, op.stage), op.phase):
                    return False
                if k == "acquire" and self.pipes[op.pipe].producer_kind == "tma":
                    bar = bars[(op.pipe, "full", op.stage)]
                    bar.tx += op.bytes
                    bar.arrive(op.count)
                return True
            if k == "commit":
                spec = self.pipes[op.pipe]
                if spec.producer_kind == "umma":
                    tc_queue.append(("arrive", op.pipe, "full", op.stage, op.count, agent.name))
                elif spec.producer_kind == "async":
                    arrive(op.pipe, "full", op.stage, op.count)
                return True
            if k == "release":
                if self.pipes[op.pipe].consumer_kind == "umma":
                    tc_queue.append(("arrive", op.pipe, "empty", op.stage, op.count, agent.name))
                else:
                    arrive(op.pipe, "empty", op.stage, op.count)
                return True
            if k == "tma":
                tma_flight.append(op)
                return True
            if k == "read":
                check_reads(agent.name, op.reads)
                return True
            if k == "write":
                do_writes(agent.name, op)
                return True
            if k == "mma":
                tc_queue.append(("mma", op, agent.name))
                return True
            if k in ("bar_sync", "bar_arrive"):
                bid, threads = op.stage, op.phase
                if (agent.name, "gen") not in agent.waits:
                    gen = named_gen.get(bid, 0)
                    named_count[bid] = named_count.get(bid, 0) + op.count
                    if named_count[bid] > threads:
                        fail(f"named barrier {bid}: {named_count[bid]} arrivals for {threads} threads")
                    if named_count[bid] == threads:
                        named_count[bid] = 0
                        named_gen[bid] = gen + 1
                    if k == "bar_arrive":
                        return True
                    agent.waits[(agent.name, "gen")] = gen
                gen = agent.waits[(agent.name, "gen")]
                if named_gen.get(bid, 0) > gen:
                    del agent.waits[(agent.name, "gen")]
                    return True
                return False
            if k == "store":
                stores.setdefault(agent.name, []).append(op.reads[0])
                check_reads(agent.name, op.reads)
                return True
            if k == "store_wait":
                if stores.get(agent.name):
                    return False
                return True
            if k == "store_wait_le":
                return len(stores.get(agent.name, ())) <= op.count
            fail(f"unknown op {k}")
            return False

        def advance(agent: _Agent):
            try:
                agent.op = next(agent.program)
            except StopIteration:
                agent.op, agent.done = None, True

        for a in agents:
            advance(a)
        steps = 0
        while True:
            steps += 1
            if steps > max_steps:
                fail("step limit reached (livelock?)")
            choices = []
            for a in agents:
                if not a.done:
                    choices.append(("agent", a))
            if tc_queue:
                choices.append(("tc", None))
            if tma_flight:
                choices.append(("tma", None))
            for who, pending in stores.items():
                if pending:
                    choices.append(("store", who))
            if not choices:
                break
            rng.shuffle(choices)
            progressed = False
            for kind, who in choices:
                if kind == "agent":
                    if execute(who):
                        advance(who)
                        progressed = True
                        break
                elif kind == "tc":
                    item = tc_queue.popleft()
                    stats["tc"] += 1
                    if item[0] == "mma":
                        _, op, name = item
                        check_reads(f"tensor core ({op.note})", op.reads)
                        do_writes(f"tensor core ({op.note})", op)
                    else:
                        _, pipe, side, stage, count, name = item
                        arrive(pipe, side, stage, count)
                    progressed = True
                    break
                elif kind == "tma":
                    op = tma_flight.pop(rng.randrange(len(tma_flight)))
                    stats["tma"] += 1
                    do_writes("TMA", op)
                    bar = bars[(op.target or op.pipe, "full", op.stage)]
                    bar.tx -= op.bytes
                    # a peer CTA's bytes may land before the barrier's own producer announced the phase's
                    # bytes (the hardware's tx-count goes negative within the phase); never after it arrived
                    if bar.tx < 0 and (not op.target or bar.pending != bar.expected):
                        fail(f"{bar.name}: more TMA bytes landed than expected")
                    bar._maybe_complete()
                    progressed = True
                    break
                else:
                    stores[who].pop(0)
                    progressed = True
                    break
            if not progressed:
                blocked = ", ".join(f"{a.name} at {a.op.kind} {a.op.pipe}[{a.op.stage}] phase {a.op.phase}"
                                    for a in agents if not a.done)
                fail(f"deadlock: {blocked}")
        for key, bar in bars.items():
            if bar.pending != bar.expected or bar.tx:
                fail(f"{bar.name} ends mid-phase ({bar.expected - bar.pending} of {bar.expected} arrivals, "
                     f"{bar.tx} bytes pending)")
        return ModelRun(
            steps=steps,
            completions={b.name: b.completions for b in bars.values()},
            tc_ops=stats["tc"],
            tma_copies=stats["tma"],
        )


def model_check(
    pipelines: tuple[PipelineSpec, ...],
    named_barriers: tuple[NamedBarrierSpec, ...],
    make_programs: Callable[[list[int]], dict[str, Iterator[Op]]],
    *,
    runs: int = 50,
    max_tiles: int = 4,
    max_blocks: int = 5,
    seed: int = 0,
) -> list[ModelRun]:
    """Run `runs` random interleavings, each over a random list of tiles with 0..max_blocks key blocks."""
    rng = random.Random(seed)
    model = ProtocolModel(pipelines, named_barriers)
    out = []
    for r in range(runs):
        tiles = [rng.randint(1, max_blocks) for _ in range(rng.randint(1, max_tiles))]
        out.append(model.run(make_programs(tiles), seed=seed * 100_003 + r))
    return out


# --- SM100 forward: pipelines and role programs --------------------------------------------------

TMEM_BARRIER = 1
EPILOGUE_BARRIER = 2


def sm100_pipelines(*, q_tiles: int, kv_stages: int, q_bytes: int, k_bytes: int, two_cta: bool = False):
    """The SM100 forward's pipelines (one CTA's view; `two_cta` counts the peer CTA's arrivals)."""
    peers = 2 if two_cta else 1
    return (
        PipelineSpec("q", "PipelineTmaUmma", "load", ("mma",), q_tiles, 1, 1, tx_bytes=q_bytes * peers,
                     purpose="the CTA's Q tiles, loaded once per work tile, released after its last S MMA"),
        PipelineSpec("kv", "PipelineTmaUmma", "load", ("mma",), kv_stages, 1, 1, tx_bytes=k_bytes * peers,
                     purpose="K and V blocks alternating in one ring: K0 V0 K1 V1 ..."),
        PipelineSpec("sp", "PipelineUmmaAsync", "mma", ("softmax", "correction"), q_tiles, 1, 256 * peers,
                     stage_by="q_tile", producer_start_phase=0,
                     purpose="S_i in TMEM (full) / P_i written and O_i rescaled (empty): gates P_i·V and the next S_i"),
        PipelineSpec("stats", "PipelineAsync", "softmax", ("correction",), q_tiles, 128, 128, stage_by="q_tile",
                     purpose="row scale (and the final row max and sum) of step j, through TMEM"),
        PipelineSpec("o", "PipelineUmmaAsync", "mma", ("correction",), q_tiles, 1, 128 * peers, stage_by="q_tile",
                     purpose="O_i complete after the tile's last P_i·V (full) / read by the epilogue (empty)"),
    )


def sm100_named_barriers(*, q_tiles: int):
    return (
        NamedBarrierSpec("tmem", TMEM_BARRIER, 32 * (1 + 4 * q_tiles + 4),
                         "MMA, softmax and correction warps: TMEM allocated (start) / no longer used (end)"),
        NamedBarrierSpec("epilogue", EPILOGUE_BARRIER, 128, "correction warps: O tile in shared memory"),
    )


PEER = "@1"  # suffix of the odd CTA's barriers, buffers and roles in a two_cta model
PEER_BARRIER_OFFSET = 16  # named barriers are per CTA: the odd CTA's get distinct ids in the model


def sm100_model_pipelines(plan) -> tuple[PipelineSpec, ...]:
    """The barriers the model runs: the plan's pipelines, and with two_cta a copy per pipeline for the odd CTA
    (`name@1`). Each CTA initializes every pipeline's barriers with the same counts; which of them are used
    follows cutlass's 2-CTA classes: the TMA full barriers and the UMMA-side empty barriers of the even CTA
    (the odd CTA's TMA bytes and its softmax/correction releases go there), the odd CTA's own empty barriers
    of q/kv and full barriers of sp/o (tcgen05.commit multicasts to both)."""
    if not plan.two_cta:
        return plan.pipelines
    return plan.pipelines + tuple(dataclasses.replace(p, name=p.name + PEER) for p in plan.pipelines)


def sm100_model_named_barriers(plan) -> tuple[NamedBarrierSpec, ...]:
    if not plan.two_cta:
        return plan.named_barriers
    return plan.named_barriers + tuple(
        dataclasses.replace(b, name=b.name + PEER, barrier_id=b.barrier_id + PEER_BARRIER_OFFSET)
        for b in plan.named_barriers
    )


def sm100_programs(plan, tiles: list[int]) -> dict[str, Iterator[Op]]:
    """What each SM100 role does, op by op, over the CTA's work `tiles` (key blocks per tile).

    Mirrors templates/sm100 (load, mma, softmax, correction partials) step for step. With two_cta, both
    CTAs of the pair are modelled (the odd CTA's roles, barriers and buffers carry the suffix `@1`): the
    even CTA's MMA warp issues every MMA (reading both CTAs' Q and K/V halves, writing both CTAs' S and O)
    and its commits arrive on both CTAs' barriers; the odd CTA's TMA bytes land on the even CTA's full
    barriers and its softmax/correction releases arrive on the even CTA's empty barriers.
    """
    forward_only(plan)
    P = {p.name: p for p in plan.pipelines}
    T = plan.q_tiles
    tmem_threads = 32 * (1 + 4 * T + 4)
    pair = 2 if plan.two_cta else 1
    ctas = ["", PEER][:pair]

    def load(c=""):
        q, kv = PhaseTracker(P["q"], "producer"), PhaseTracker(P["kv"], "producer")
        leader = c == ""

        def kv_load(what, t, j, nbytes):
            s, ph = kv.next()
            if leader:
                yield acquire("kv", s, ph, tx=nbytes * pair)
                yield tma_load("kv", s, f"sKV[{s}]", (what, t, j), nbytes)
            else:
                yield acquire("kv" + c, s, ph, count=0)
                yield tma_load("kv" + c, s, f"sKV{c}[{s}]", (what, t, j), nbytes, target="kv")

        for t, n in enumerate(tiles):
            yield from kv_load("K", t, 0, plan.k_bytes)
            for i in range(T):
                s, ph = q.next()
                if leader:
                    yield acquire("q", s, ph, tx=plan.q_bytes * pair)
                    yield tma_load("q", s, f"sQ[{s}]", ("Q", t, i), plan.q_bytes)
                else:
                    yield acquire("q" + c, s, ph, count=0)
                    yield tma_load("q" + c, s, f"sQ{c}[{s}]", ("Q", t, i), plan.q_bytes, target="q")
            yield from kv_load("V", t, 0, plan.v_bytes)
            for j in range(1, n):
                yield from kv_load("K", t, j, plan.k_bytes)
                yield from kv_load("V", t, j, plan.v_bytes)
        for tracker, name in ((kv, "kv"), (q, "q")):
            for _ in range(P[name].stages):
                s, ph = tracker.next()
                yield acquire(name + c, s, ph, count=0)

    def both(res):
        """A resource in each CTA of the pair (the 2-CTA MMA's operands and accumulators)."""
        return [(f"{r}", tok) for r, tok in res] + [(f"{_peer(r)}", tok) for r, tok in res if pair == 2]

    def _peer(r):
        return r.replace("[", PEER + "[") if "[" in r else r + PEER

    def commit_all(pipe, i):
        """tcgen05.commit: with two_cta it multicasts one arrival to the barrier of each CTA."""
        for c in ctas:
            yield commit(pipe + c, i)

    def release_all(pipe, s):
        for c in ctas:
            yield release(pipe + c, s)

    def mma_role():
        q, kv = PhaseTracker(P["q"], "consumer"), PhaseTracker(P["kv"], "consumer")
        sp = [PhaseTracker(P["sp"], "producer", i) for i in range(T)]
        o = [PhaseTracker(P["o"], "producer", i) for i in range(T)]
        clobber = lambda i: tuple(both(((f"P{i}", None), (f"St{i}", None))))  # noqa: E731 - S_i's columns hold P_i, stats_i
        yield bar_sync(TMEM_BARRIER, tmem_threads, 32)
        for t, n in enumerate(tiles):
            for i in range(T):
                s, ph = o[i].next()
                yield acquire("o", s, ph)
            qs = []
            for i in range(T):
                s, ph = q.next()
                yield wait("q", s, ph)
                qs.append(s)
            ks, ph = kv.next()
            yield wait("kv", ks, ph)
            for i in range(T):
                yield mma(both([(f"sQ[{qs[i]}]", ("Q", t, i)), (f"sKV[{ks}]", ("K", t, 0))]),
                          [*both([(f"S{i}", ("S", t, 0))]), *clobber(i)], f"S{i} = Q{i}·K0", pipe="sp", stage=i)
                yield from commit_all("sp", i)
            yield from release_all("kv", ks)
            for j in range(1, n + 1):
                vs, ph = kv.next()
                yield wait("kv", vs, ph)
                for i in range(T):
                    s, ph = sp[i].next()
                    yield acquire("sp", s, ph)
                    o_in = both([(f"O{i}", ("Os", t, j - 2))]) if j >= 2 else []
                    first = dict(pipe="o", stage=i) if j == 1 else {}
                    yield mma([*both([(f"P{i}", ("P", t, j - 1)), (f"sKV[{vs}]", ("V", t, j - 1))]), *o_in],
                              both([(f"O{i}", ("O", t, j - 1))]), f"O{i} += P{i}·V{j - 1}", **first)
                    if j == n:
                        yield from commit_all("o", i)
                        continue
                    if i == 0:
                        ks, ph = kv.next()
                        yield wait("kv", ks, ph)
                    yield mma(both([(f"sQ[{qs[i]}]", ("Q", t, i)), (f"sKV[{ks}]", ("K", t, j))]),
                              [*both([(f"S{i}", ("S", t, j))]), *clobber(i)], f"S{i} = Q{i}·K{j}", pipe="sp", stage=i)
                    yield from commit_all("sp", i)
                yield from release_all("kv", vs)
                if j < n:
                    yield from release_all("kv", ks)
            for i in range(T):
                yield from release_all("q", qs[i])
        yield bar_sync(TMEM_BARRIER, tmem_threads, 32)

    def idle_mma(c):
        """The odd CTA's MMA warp: allocates TMEM with the pair, issues nothing, frees it at the end."""
        yield bar_sync(TMEM_BARRIER + (PEER_BARRIER_OFFSET if c else 0), tmem_threads, 32)
        yield bar_sync(TMEM_BARRIER + (PEER_BARRIER_OFFSET if c else 0), tmem_threads, 32)

    def softmax(i, c=""):
        # c: this CTA's suffix. Waits on its own full barriers; releases go to the even CTA's sp barrier.
        tb = TMEM_BARRIER + (PEER_BARRIER_OFFSET if c else 0)
        sp, st = PhaseTracker(P["sp"], "consumer", i), PhaseTracker(P["stats"], "producer", i)
        yield bar_sync(tb, tmem_threads, 128)
        for t, n in enumerate(tiles):
            for j in range(n):
                s, ph = sp.next()
                yield wait("sp" + c, s, ph)
                yield read((f"S{i}{c}", ("S", t, j)), note="S from TMEM")
                s, ph = st.next()
                yield acquire("stats" + c, s, ph)
                yield write((f"St{i}{c}", ("St", t, j)), pipe="stats" + c, stage=i)
                yield commit("stats" + c, i, 128)
                yield write((f"P{i}{c}", ("P", t, j)))
                yield release("sp", i, 128)
        yield bar_arrive(tb, tmem_threads, 128)

    def correction(c=""):
        tb = TMEM_BARRIER + (PEER_BARRIER_OFFSET if c else 0)
        eb = EPILOGUE_BARRIER + (PEER_BARRIER_OFFSET if c else 0)
        st = [PhaseTracker(P["stats"], "consumer", i) for i in range(T)]
        o = [PhaseTracker(P["o"], "consumer", i) for i in range(T)]
        yield bar_sync(tb, tmem_threads, 128)
        for t, n in enumerate(tiles):
            for j in range(n):
                for i in range(T):
                    s, ph = st[i].next()
                    yield wait("stats" + c, s, ph)
                    yield read((f"St{i}{c}", ("St", t, j)))
                    yield release("stats" + c, i, 128)
                    if j >= 1:
                        yield read((f"O{i}{c}", ("O", t, j - 1)), note="rescale O")
                        yield write((f"O{i}{c}", ("Os", t, j - 1)))
                    yield release("sp", i, 128)
            yield store_wait()
            yield bar_sync(eb, 128, 128)
            for i in range(T):
                s, ph = o[i].next()
                yield wait("o" + c, s, ph)
                yield read((f"O{i}{c}", ("O", t, n - 1)), note="epilogue")
                yield write((f"sO{i}{c}", ("Ofin", t, i)))
                yield release("o", i, 128)
                yield bar_sync(eb, 128, 128)
                yield tma_store(f"sO{i}{c}", ("Ofin", t, i))
        yield store_wait()
        yield bar_arrive(tb, tmem_threads, 128)

    programs = {"load": load(), "mma": mma_role(), "correction": correction()}
    for i in range(T):
        programs[f"softmax{i}"] = softmax(i)
    if pair == 2:
        programs.update({"load" + PEER: load(PEER), "mma" + PEER: idle_mma(PEER), "correction" + PEER: correction(PEER)})
        for i in range(T):
            programs[f"softmax{i}{PEER}"] = softmax(i, PEER)
    return programs


# --- SM90 forward (templates/sm90): pipelines derived from the plan, role programs -----------------

SM90_EPILOGUE_BARRIER = 1
SM90_PINGPONG_BARRIER = 2
SM90_O_STORED_BARRIER = 5  # persistent forward: "O is in shared memory" (the storing warp waits, the rest arrive)


def sm90_pipelines(plan):
    """The SM90 forward's pipelines: Q (q_stages: 1, or 2 in a persistent forward that asks for it), K and V
    (kv_stages each), TMA producer thread, one release arrival per consumer warp."""
    warps = 4 * plan.num_mma_warpgroups
    q_bytes = plan.tile_m * plan.head_dim * 2
    k_bytes = plan.tile_n * plan.head_dim * 2
    v_bytes = plan.tile_n * plan.head_dim_v * 2
    return (
        PipelineSpec("q", "PipelineTmaAsync", "producer", ("consumer",), plan.q_stages, 1, warps, tx_bytes=q_bytes,
                     purpose="the Q tile, loaded once per tile"),
        PipelineSpec("k", "PipelineTmaAsync", "producer", ("consumer",), plan.kv_stages, 1, warps, tx_bytes=k_bytes,
                     purpose="K blocks, released right after the S GEMM"),
        PipelineSpec("v", "PipelineTmaAsync", "producer", ("consumer",), plan.kv_stages, 1, warps, tx_bytes=v_bytes,
                     purpose="V blocks, released after the P·V GEMM"),
    )


def sm90_named_barriers(plan):
    wgs = plan.num_mma_warpgroups
    out = [NamedBarrierSpec("epilogue", SM90_EPILOGUE_BARRIER, 128 * wgs, "consumer warpgroups: O over Q's smem")]
    if plan.ping_pong:
        out += [NamedBarrierSpec(f"pingpong{c}", SM90_PINGPONG_BARRIER + c, 256, f"warpgroup {c}'s turn")
                for c in range(wgs)]
    if plan.scheduler == "persistent":
        out.append(NamedBarrierSpec("o_stored", SM90_O_STORED_BARRIER, 128 * wgs, "O in its own smem buffer"))
    return tuple(out)


def forward_only(plan) -> None:
    """The role programs here mirror the forward templates; a backward plan would be checked against a
    protocol its kernel does not run, and pass for nothing."""
    direction = getattr(plan, "direction", "fwd")
    if direction != "fwd":
        raise ValueError(f"{plan.name} [{plan.arch} {direction}]: the protocol model covers forward kernels only")


def sm90_programs(plan, tiles) -> dict[str, Iterator[Op]]:
    """One SM90 CTA over its work `tiles` (key blocks per tile, or (key blocks, busy warpgroups) where
    `plan.skip_idle_warpgroups` lets the warpgroups from `busy` on skip a tile's work; an int or one such pair:
    one tile); mirrors templates/sm90
    (_roles, _consumer, _epilogue). One CTA per tile: O goes over Q's shared memory. Persistent
    (`plan.scheduler`): the pipeline states run on across tiles, the consumers release Q's buffer once a
    tile's S GEMMs are done, O has a buffer of its own (per warpgroup's rows: `sO{c}`) that warpgroup 0's
    storing warp reads out with TMA stores, waited for before the next tile writes it."""
    forward_only(plan)
    tiles = [tiles] if isinstance(tiles, (int, tuple)) else list(tiles)
    persistent = plan.scheduler == "persistent"
    if not persistent and len(tiles) != 1:
        raise ValueError(f"{plan.name}: one tile per CTA (scheduler {plan.scheduler}), got {len(tiles)}")
    P = {p.name: p for p in sm90_pipelines(plan)}
    W = plan.num_mma_warpgroups
    PP = SM90_PINGPONG_BARRIER

    def producer():
        q, k, v = (PhaseTracker(P[x], "producer") for x in "qkv")

        def load(name, tr, t, j):
            s, ph = tr.next()
            yield acquire(name, s, ph, tx=P[name].tx_bytes)
            yield tma_load(name, s, f"s{name.upper()}[{s}]", (name.upper(), t, j), P[name].tx_bytes)

        for t, tile in enumerate(tiles):
            n_blocks = tile[0] if isinstance(tile, tuple) else tile
            # persistent: the tile's first K before its Q (its stage frees before Q's buffer does)
            k_first = persistent and n_blocks > 0
            if k_first:
                yield from load("k", k, t, 0)
            s, ph = q.next()
            yield acquire("q", s, ph, tx=P["q"].tx_bytes)
            yield tma_load("q", s, f"sQ[{s}]", ("Q", t), P["q"].tx_bytes)
            # K of a block before V of the block before it (the consumers' order)
            for j in range(1 if k_first else 0, n_blocks):
                yield from load("k", k, t, j)
                if j > 0:
                    yield from load("v", v, t, j - 1)
            if n_blocks:
                yield from load("v", v, t, n_blocks - 1)

    def consumer(c):
        q, k, v = (PhaseTracker(P[x], "consumer") for x in "qkv")
        for t, tile in enumerate(tiles):
            n_blocks, busy = tile if isinstance(tile, tuple) else (tile, W)
            if c >= busy:
                yield from idle_tile(c, t, n_blocks, q, k, v)
            else:
                yield from consumer_tile(c, t, n_blocks, q, k, v)
        if persistent and c == 0:
            yield store_wait()

    def idle_tile(c, t, n_blocks, q, k, v):
        # plan.skip_idle_warpgroups: no row of warpgroup c inside the sequence; templates/sm90/_consumer.j2 idle_tile
        # (one CTA per tile) or the persistent kernel's guarded steps: every stage waited for, then released, turns
        # passed on, no read
        kslots = [k.next() for _ in range(n_blocks)]
        vslots = [v.next() for _ in range(n_blocks)]
        qs, ph = q.next()
        yield wait("q", qs, ph)
        if plan.ping_pong and c == W - 1:
            yield bar_arrive(PP, 256, 128)
        if plan.intra_wg_overlap:
            if n_blocks:
                yield wait("k", *kslots[0])
                yield release("k", kslots[0][0], 4)
            for j in range(1, n_blocks):
                yield wait("k", *kslots[j])
                if persistent:
                    # the persistent kernel's guarded steps (templates/sm90/_steps.j2 overlapped_block): the busy
                    # block's handshakes in its order, without its reads
                    if plan.ping_pong:
                        yield bar_sync(PP + c, 256, 128)
                    yield wait("v", *vslots[j - 1])
                    if plan.ping_pong:
                        yield bar_arrive(PP + (c + 1) % W, 256, 128)
                    yield release("k", kslots[j][0], 4)
                    yield release("v", vslots[j - 1][0], 4)
                    continue
                if plan.ping_pong:
                    yield bar_sync(PP + c, 256, 128)
                    yield bar_arrive(PP + (c + 1) % W, 256, 128)
                yield release("k", kslots[j][0], 4)
                yield wait("v", *vslots[j - 1])
                yield release("v", vslots[j - 1][0], 4)
            if persistent:
                yield release("q", qs, 4)
            if n_blocks:
                yield wait("v", *vslots[n_blocks - 1])
                yield release("v", vslots[n_blocks - 1][0], 4)
        else:
            for j in range(n_blocks):
                yield wait("k", *kslots[j])
                if plan.ping_pong:
                    yield bar_sync(PP + c, 256, 128)
                    yield bar_arrive(PP + (c + 1) % W, 256, 128)
                yield release("k", kslots[j][0], 4)
                yield wait("v", *vslots[j])
                yield release("v", vslots[j][0], 4)
            if persistent:
                yield release("q", qs, 4)
        yield from epilogue(c, t)

    def consumer_tile(c, t, n_blocks, q, k, v):
        kslots = [k.next() for _ in range(n_blocks)]
        vslots = [v.next() for _ in range(n_blocks)]
        qs, ph = q.next()
        yield wait("q", qs, ph)

        def s_gemm(j):
            yield wait("k", *kslots[j])
            yield read((f"sQ[{qs}]", ("Q", t)), (f"sK[{kslots[j][0]}]", ("K", t, j)), note=f"S = Q·K{j} (wg {c})")

        def pv_gemm(j):
            yield wait("v", *vslots[j])
            yield read((f"sV[{vslots[j][0]}]", ("V", t, j)), note=f"O += P·V{j} (wg {c})")

        if plan.ping_pong and c == W - 1:
            yield bar_arrive(PP, 256, 128)
        if plan.intra_wg_overlap:
            if n_blocks:
                yield from s_gemm(0)
                yield release("k", kslots[0][0], 4)
            for j in range(1, n_blocks):
                if plan.ping_pong:
                    yield wait("k", *kslots[j])
                    yield bar_sync(PP + c, 256, 128)
                    yield read((f"sQ[{qs}]", ("Q", t)), (f"sK[{kslots[j][0]}]", ("K", t, j)))
                else:
                    yield from s_gemm(j)
                yield from pv_gemm(j - 1)
                if plan.ping_pong:
                    yield bar_arrive(PP + (c + 1) % W, 256, 128)
                yield release("k", kslots[j][0], 4)
                yield release("v", vslots[j - 1][0], 4)
            if persistent:
                yield release("q", qs, 4)
            if n_blocks:
                yield from pv_gemm(n_blocks - 1)
                yield release("v", vslots[n_blocks - 1][0], 4)
        else:
            for j in range(n_blocks):
                yield wait("k", *kslots[j])
                if plan.ping_pong:
                    yield bar_sync(PP + c, 256, 128)
                yield read((f"sQ[{qs}]", ("Q", t)), (f"sK[{kslots[j][0]}]", ("K", t, j)))
                if plan.ping_pong:
                    yield bar_arrive(PP + (c + 1) % W, 256, 128)
                yield release("k", kslots[j][0], 4)
                yield from pv_gemm(j)
                yield release("v", vslots[j][0], 4)
            if persistent:
                yield release("q", qs, 4)
        yield from epilogue(c, t)

    def epilogue(c, t):
        if plan.ping_pong and c == 0:
            yield bar_sync(PP, 256, 128)
        if not persistent:
            # epilogue: O rows go over Q's shared memory (any row may overlay any warpgroup's Q rows)
            yield bar_sync(SM90_EPILOGUE_BARRIER, 128 * W, 128)
            yield write(("sQ[0]", ("O", c)))  # (one CTA per tile: one Q buffer)
            yield bar_sync(SM90_EPILOGUE_BARRIER, 128 * W, 128)
            return
        # persistent epilogue: the storing warp (in warpgroup 0) waits for its last store's read of sO, all
        # meet, each writes its rows, the storing warp waits for them and stores every warpgroup's rows
        if c == 0:
            yield store_wait()
        yield bar_sync(SM90_EPILOGUE_BARRIER, 128 * W, 128)
        yield write((f"sO{c}", ("O", t, c)))
        if c == 0:
            yield bar_sync(SM90_O_STORED_BARRIER, 128 * W, 128)
            for c2 in range(W):
                yield tma_store(f"sO{c2}", ("O", t, c2))
        else:
            yield bar_arrive(SM90_O_STORED_BARRIER, 128 * W, 128)

    programs = {"producer": producer()}
    for c in range(W):
        programs[f"consumer{c}"] = consumer(c)
    return programs


def check_sm90(plan, *, runs: int = 40, max_blocks: int = 6, max_tiles: int = 4, seed: int = 0) -> list[ModelRun]:
    """Random interleavings of one CTA: one tile of 0..max_blocks key blocks, or (persistent) 1..max_tiles
    such tiles per run (drawn after the first tile's blocks, so one-tile runs keep their draws)."""
    forward_only(plan)
    rng = random.Random(seed)
    model = ProtocolModel(sm90_pipelines(plan), sm90_named_barriers(plan))
    out = []
    for r in range(runs):
        tiles = [rng.randint(0, max_blocks)]
        if plan.scheduler == "persistent":
            tiles += [rng.randint(0, max_blocks) for _ in range(rng.randint(1, max_tiles) - 1)]
        if getattr(plan, "skip_idle_warpgroups", False):
            # a sequence's last tile: warpgroups from `busy` on have no row (warpgroup 0 always has one)
            tiles = [(n, rng.randint(1, plan.num_mma_warpgroups)) for n in tiles]
        out.append(model.run(sm90_programs(plan, tiles), seed=seed * 7919 + r))
    return out


def check_sm100(plan, *, runs: int = 40, max_tiles: int = 4, max_blocks: int = 5, seed: int = 0) -> list[ModelRun]:
    forward_only(plan)
    return model_check(sm100_model_pipelines(plan), sm100_model_named_barriers(plan),
                       lambda tiles: sm100_programs(plan, tiles),
                       runs=runs, max_tiles=max_tiles, max_blocks=max_blocks, seed=seed)


__all__ = [
    "NamedBarrierSpec",
    "check_sm100",
    "check_sm90",
    "forward_only",
    "sm100_model_named_barriers",
    "sm100_model_pipelines",
    "sm100_named_barriers",
    "sm100_pipelines",
    "sm90_named_barriers",
    "sm90_pipelines",
    "Op",
    "PhaseTracker",
    "PipelineSpec",
    "ProtocolError",
    "ProtocolModel",
    "model_check",
]


# --- the SM90 backward (templates/sm90/bwd.py.j2), the dQ warp's path ----------------------------------

SM90_BWD_EPILOGUE_BARRIER = 1
SM90_BWD_PDS_BARRIER = 2
SM90_BWD_DQ_FULL_BARRIER = 3  # + w
SM90_BWD_DQ_EMPTY_BARRIER = 5  # + w
SM90_BWD_DQ_HANDOFF = 128 + 32  # a consumer warpgroup and the dQ warp
SM90_BWD_DQ_DRAINED_BARRIER = 7  # plan.dkv_staging.dv_in_dq: the dQ warp -> the consumers, a tile's dQ tiles read out


def sm90_bwd_modelled(plan) -> None:
    """The backward model covers the dQ warp's hand-off (plans without dq_atomic) for MHA, without determinism
    and without the fp32 dK / dV workspaces, in the Sᵀ layout: it refuses the others rather than pass them."""
    if getattr(plan, "direction", "fwd") != "bwd" or plan.arch != "sm90":
        raise ValueError(f"{plan.name} [{plan.arch} {plan.direction}]: the backward model covers sm90 backward plans")
    if plan.dq_atomic or plan.deterministic or plan.dkv_accum or not plan.swap_sdp or plan.varlen:
        raise ValueError(f"{plan.name} [sm90 bwd]: the backward model covers the Sᵀ MHA dQ-warp path without "
                         "determinism or varlen (this plan has dq_atomic / deterministic / dkv_accum / S layout / varlen)")


def sm90_bwd_pipelines(plan):
    """The backward's TMA pipelines: K and V together in one stage (`pipe_kv`), Q (with its LSE2 / D rows) and dO
    rings; one producer thread, one release per consumer warp (8)."""
    q_bytes = plan.tile_m * plan.head_dim * 2
    do_bytes = plan.tile_m * plan.head_dim_v * 2
    kv_bytes = plan.tile_n * (plan.head_dim + plan.head_dim_v) * 2
    return (
        PipelineSpec("kv", "PipelineTmaAsync", "producer", ("consumer",), plan.kv_stages, 1, 8, tx_bytes=kv_bytes,
                     purpose="the key block's K and V: once per tile (persistent: in plan.kv_stages stages)"),
        PipelineSpec("q", "PipelineTmaAsync", "producer", ("consumer",), plan.q_stages, 1, 8, tx_bytes=q_bytes,
                     purpose="Q (and its LSE2 / D rows) per query block"),
        PipelineSpec("do", "PipelineTmaAsync", "producer", ("consumer",), plan.do_stages, 1, 8, tx_bytes=do_bytes,
                     purpose="dO per query block"),
    )


def sm90_bwd_named_barriers(plan):
    out = [NamedBarrierSpec("epilogue", SM90_BWD_EPILOGUE_BARRIER, 256, "consumers: dK / dV over K's and V's smem"),
           NamedBarrierSpec("pds", SM90_BWD_PDS_BARRIER, 256, "consumers: dS of a query block in smem")]
    for w in range(2):
        out += [NamedBarrierSpec(f"dq_full{w}", SM90_BWD_DQ_FULL_BARRIER + w, SM90_BWD_DQ_HANDOFF,
                                 f"warpgroup {w} -> dQ warp: its dQ tile is in smem"),
                NamedBarrierSpec(f"dq_empty{w}", SM90_BWD_DQ_EMPTY_BARRIER + w, SM90_BWD_DQ_HANDOFF,
                                 f"dQ warp -> warpgroup {w}: its buffer was read out")]
    if plan.dkv_staging.dv_in_dq:
        out.append(NamedBarrierSpec("dq_drained", SM90_BWD_DQ_DRAINED_BARRIER, 256 + 32,
                                    "dQ warp -> consumers: the tile's last dQ tiles were read out (dV staged there)"))
    return tuple(out)


def sm90_bwd_programs(plan, tiles) -> dict[str, Iterator[Op]]:
    """One SM90 backward CTA over its (key block) tiles, each `tiles[t]` query blocks; mirrors
    templates/sm90/bwd.py.j2 (the load role, the dQ role, swapped_block, dq_handoff, dkv_epilogue). One CTA per
    tile: K and V load first and are never released. Persistent (`plan.scheduler`, since session 66): the
    pipeline states run on across tiles, the producer loads a tile's first Q and dO before its K and V, and the
    consumers release K / V as soon as the tile's last GEMMs are done, its dK / dV going out through the dS
    buffers (`plan.dkv_staging`: TMA stores by warpgroup 0's first warp, in one or two phases), or, where those
    are too small, after the tile's epilogue through K's and V's buffers (their reads waited for before that
    release)."""
    sm90_bwd_modelled(plan)
    tiles = [tiles] if isinstance(tiles, int) else list(tiles)
    persistent = plan.scheduler == "persistent"
    if not persistent and len(tiles) != 1:
        raise ValueError(f"{plan.name}: one tile per CTA (scheduler {plan.scheduler}), got {len(tiles)}")
    if persistent and plan.has_mask and not plan.dkv_staging.phases:
        # a tile without query blocks loads no K / V, so its epilogue may not go through K's and V's buffers while
        # the next tile's load lands there (fa4gen.plan.sm90.plan_backward plans no such kernel)
        raise ValueError(f"{plan.name}: a masked persistent backward stages dK / dV in the dS buffers (dkv_staging)")
    if plan.kv_stages > 1 and not (persistent and plan.dkv_staging.phases):
        # the epilogue through K's and V's buffers (stage 0) assumes one stage (plan_backward plans two only with
        # dK / dV staged elsewhere, persistent)
        raise ValueError(f"{plan.name}: two K / V stages need the persistent loop with dK / dV staged (dkv_staging)")
    P = {p.name: p for p in sm90_bwd_pipelines(plan)}
    BUFS, PDS = plan.dq_buffers, plan.pds_stages
    EMPTY, FULL, HAND = SM90_BWD_DQ_EMPTY_BARRIER, SM90_BWD_DQ_FULL_BARRIER, SM90_BWD_DQ_HANDOFF
    # persistent with plan.dkv_staging: per epilogue phase, the tensors laid out back to back in the dS buffers
    # (dV in the dQ buffers instead with dv_in_dq) and the dS stages they overlap
    staging = plan.dkv_staging
    nbytes = {"dK": staging.dk_bytes, "dV": staging.dv_bytes}
    staged_parts = ([["dK"]] if staging.dv_in_dq else [["dK", "dV"]] if staging.phases == 1 else [["dK"], ["dV"]])

    def ds_stages(part):
        first, out = 0, set()
        for name in part:
            out.update(staging.stages_of(first, nbytes[name]))
            first += nbytes[name]
        return sorted(out)

    def producer():
        kv, q, do = (PhaseTracker(P[x], "producer") for x in ("kv", "q", "do"))

        def load_kv(t):
            s, ph = kv.next()
            yield acquire("kv", s, ph, tx=P["kv"].tx_bytes)
            # K's and V's copies, one stage: modelled as one copy landing both
            yield Op("tma", "kv", s, writes=((f"sK[{s}]", ("K", t)), (f"sV[{s}]", ("V", t))), bytes=P["kv"].tx_bytes)

        for t, m in enumerate(tiles):
            if not persistent and m:
                yield from load_kv(t)
            for i in range(m):
                s, ph = q.next()
                yield acquire("q", s, ph, tx=P["q"].tx_bytes)
                yield tma_load("q", s, f"sQ[{s}]", ("Q", t, i), P["q"].tx_bytes)
                s, ph = do.next()
                yield acquire("do", s, ph, tx=P["do"].tx_bytes)
                yield tma_load("do", s, f"sdO[{s}]", ("dO", t, i), P["do"].tx_bytes)
                if persistent and i == 0:
                    yield from load_kv(t)

    def dq_warp():
        for t, m in enumerate(tiles):
            for i in range(m):
                if BUFS == 2:  # both buffers freed before waiting for either tile
                    for w in range(2):
                        yield store_wait_le(1 - w)
                        yield bar_arrive(EMPTY + w, HAND, 32)
                for w in range(2):
                    if BUFS == 1:  # one buffer in turns
                        yield store_wait_le(0)
                        yield bar_arrive(EMPTY + w, HAND, 32)
                    yield bar_sync(FULL + w, HAND, 32)
                    yield tma_store(f"sdQ[{w % BUFS}]", ("dQ", t, i, w))  # the bulk reduce-add reads the buffer
            yield store_wait_le(0)  # (the tile's last adds landed: its claim released)
            if persistent and staging.dv_in_dq and m:  # the consumers stage the tile's dV in the dQ buffers
                yield bar_arrive(SM90_BWD_DQ_DRAINED_BARRIER, 256 + 32, 32)

    def consumer(c):
        kv, q, do = (PhaseTracker(P[x], "consumer") for x in ("kv", "q", "do"))
        for t, m in enumerate(tiles):
            kvs = kv.next() if m else None
            if m:
                yield wait("kv", *kvs)
            for i in range(m):
                pds = i % PDS
                qs, qph = q.next()
                yield wait("q", qs, qph)
                yield read((f"sK[{kvs[0]}]", ("K", t)), (f"sQ[{qs}]", ("Q", t, i)), note=f"Sᵀ = K·Qᵀ (wg {c})")
                ds, dph = do.next()
                yield wait("do", ds, dph)
                yield read((f"sV[{kvs[0]}]", ("V", t)), (f"sdO[{ds}]", ("dO", t, i)), note=f"dPᵀ = V·dOᵀ (wg {c})")
                if PDS == 1:  # the previous block's dQ GEMMs (both warpgroups) are done reading sdS
                    yield bar_sync(SM90_BWD_PDS_BARRIER, 256, 128)
                yield write((f"sdS[{pds}].{c}", ("dS", t, i, c)))
                yield bar_sync(SM90_BWD_PDS_BARRIER, 256, 128)
                yield read((f"sdS[{pds}].0", ("dS", t, i, 0)), (f"sdS[{pds}].1", ("dS", t, i, 1)), (f"sK[{kvs[0]}]", ("K", t)),
                           note=f"dQ = dS·K (wg {c})")
                yield read((f"sQ[{qs}]", ("Q", t, i)), (f"sdO[{ds}]", ("dO", t, i)), note=f"dK, dV (wg {c})")
                # dq_handoff: the warpgroup's dQ tile into its buffer once the dQ warp has read it out
                yield bar_sync(EMPTY + c, HAND, 128)
                yield write((f"sdQ[{c % BUFS}]", ("dQ", t, i, c)))
                yield bar_arrive(FULL + c, HAND, 128)
                yield release("q", qs, 4)
                yield release("do", ds, 4)
            if persistent and staging.phases:
                # K / V back to the producer once the tile's last GEMMs are done (each block ends waiting for them);
                # staged_dkv_epilogue: dK / dV through the dS buffers, stored by warpgroup 0's first warp
                if m:
                    yield release("kv", kvs[0], 4)
                yield bar_sync(SM90_BWD_EPILOGUE_BARRIER, 256, 128)
                if staging.dv_in_dq and m:  # (a tile without blocks handed no dQ tile over since the last)
                    yield bar_sync(SM90_BWD_DQ_DRAINED_BARRIER, 256 + 32, 128)
                for p, part in enumerate(staged_parts):
                    if p:
                        yield bar_sync(SM90_BWD_EPILOGUE_BARRIER, 256, 128)
                    # a stage's two warpgroup halves are not contiguous bytes: a write anywhere in a stage takes both
                    held = {f"sdS[{s}].{h}": ("/".join(part), t) for s in ds_stages(part) for h in (0, 1)}
                    if staging.dv_in_dq:  # dV from the dQ buffers' start
                        held.update({f"sdQ[{b}]": ("dV", t)
                                     for b in range(-(-staging.dv_bytes // staging.dq_buffer_bytes))})
                    yield write(*held.items())
                    yield bar_sync(SM90_BWD_EPILOGUE_BARRIER, 256, 128)
                    if c == 0:
                        for res, token in held.items():
                            yield tma_store(res, token)
                        yield store_wait_le(0)
                if staging.stage0 == 0:
                    yield bar_sync(SM90_BWD_EPILOGUE_BARRIER, 256, 128)
                continue
            # dkv_epilogue: dK / dV over K's and V's buffers, stored by warpgroup 0's first warp
            yield bar_sync(SM90_BWD_EPILOGUE_BARRIER, 256, 128)
            yield write(("sK[0]", ("dK", t)), ("sV[0]", ("dV", t)))
            yield bar_sync(SM90_BWD_EPILOGUE_BARRIER, 256, 128)
            if c == 0:
                yield tma_store("sK[0]", ("dK", t))
                yield tma_store("sV[0]", ("dV", t))
                yield store_wait_le(0)
            if persistent and m:
                yield release("kv", kvs[0], 4)

    return {"producer": producer(), "dq": dq_warp(), "consumer0": consumer(0), "consumer1": consumer(1)}


def check_sm90_bwd(plan, *, runs: int = 40, max_blocks: int = 5, max_tiles: int = 4, seed: int = 0) -> list[ModelRun]:
    """Random interleavings of one backward CTA: one tile of 1..max_blocks query blocks, or (persistent) 1..max_tiles
    tiles of the same block count (no mask: every tile of a call visits every query block) or, causal, of
    0..max_blocks each (a key block sees the query blocks at and below its diagonal; none where seqlen_k > seqlen_q
    puts it past every query)."""
    sm90_bwd_modelled(plan)
    rng = random.Random(seed)
    model = ProtocolModel(sm90_bwd_pipelines(plan), sm90_bwd_named_barriers(plan))
    out = []
    for r in range(runs):
        m = rng.randint(1, max_blocks)
        n = rng.randint(1, max_tiles) if plan.scheduler == "persistent" else 1
        tiles = [rng.randint(0, max_blocks) for _ in range(n)] if n > 1 and plan.has_mask else [m] * n
        out.append(model.run(sm90_bwd_programs(plan, tiles), seed=seed * 7919 + r))
    return out


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
"""

from __future__ import annotations

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


def acquire(pipe, stage, phase, count=1, tx=0):
    return Op("acquire", pipe, stage, phase, count, bytes=tx)


def commit(pipe, stage, count=1):
    return Op("commit", pipe, stage, count=count)


def wait(pipe, stage, phase):
    return Op("wait", pipe, stage, phase)


def release(pipe, stage, count=1):
    return Op("release", pipe, stage, count=count)


def tma_load(pipe, stage, resource, token, nbytes):
    return Op("tma", pipe, stage, writes=((resource, token),), bytes=nbytes)


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
                    bar = bars[(op.pipe, "full", op.stage)]
                    bar.tx -= op.bytes
                    if bar.tx < 0:
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


__all__ = [
    "NamedBarrierSpec",
    "Op",
    "PhaseTracker",
    "PipelineSpec",
    "ProtocolError",
    "ProtocolModel",
    "model_check",
]

"""Where an SM90 backward CTA's time goes: a traced build of the main kernel writes timestamps per CTA (per tile
when persistent) and this prints the phases, so the per-CTA cost that tools/cta_cost.py fits from whole-kernel
times can be split into its parts.

Phases, from %clock64 (the SM's own cycle counter, so a CTA's phases and the gap to the next CTA on the same SM
are exact), converted to µs with the clock rate %globaltimer gives over the same CTAs:
  prologue   entry -> the consumers start (barrier set-up, setmaxnreg; one-tile-per-CTA kernels only)
  kv_wait    the consumers start -> K / V landed
  blocks     K / V landed -> the last query block done (per query block: blocks / count)
  epilogue   the last query block done -> dK / dV out (their stores' reads waited for)
  gap        one CTA's (tile's) epilogue end -> the next CTA's entry (tile's start) on the same SM: the teardown and
             launch that a persistent kernel removes (persistent: the loop's own turnaround)
The staged epilogue (plan.dkv_staging, persistent kernels) is also split into its parts:
  drain      the last query block done -> past the dQ warp's drained barrier (dV staged in the dQ buffers only)
  stage      -> dK / dV (the first phase) in shared memory, both warpgroups past the barrier after their stmatrix
  store      -> the epilogue's end (warp 4's TMA stores have read the buffers; a second phase where there is one)
and the kernel's span against the SMs' busy time (the tail: SMs idle while the last CTAs finish). The producer's
view of the K / V load (its first thread's %clock64 as it starts a tile's loads and once it holds the K / V stage):
  kv_issue   the producer holds the K / V stage (their TMA issued next) -> the consumers have K / V (the load's
             latency only where the consumers waited for it; otherwise an upper bound)
  kv_late    the previous tile's hand-back of K / V -> the producer holding the stage (persistent, one stage)
  p_ahead    the producer starting the tile's loads -> that hand-back (positive: it was waiting for the hand-back)
and the dQ warp's (its %clock64 once it issued the tile's last dQ bulk reduce and once they all landed):
  dq_land      that last reduce issued -> the tile's reduces landed
  kv_after_dq  that last reduce issued -> the producer holding the next tile's K / V stage (persistent, one stage)
and one sampled query block per CTA (the middle of its walk; one-CTA-per-tile kernels, the head loop's last head):
the consumers' waits in it and the dQ warp's steps (SAMPLED below), and, for persistent kernels, the phases by round
(`--rounds`: the r-th tile each SM ran), since the first rounds run with every CTA loading and storing at once.

The traced build is rendered with `fa4gen.render.render_package(..., trace={module})` into a scratch package:
the kernel takes one more tensor (fa4gen/device/trace.py), nothing else changes; the packages users build are
never traced. Shapes follow tools/bench_fwd.py's grid (batch x seqlen = 16384 tokens, 2048 / d heads).

Run on the GPU machine: `python3 tools/bwd_timeline.py --head-dim 128 --mask none --seqlens 512,2048 [--grid |
--persistent] [--out DIR]` (`--grid`: one CTA per tile even where the plan is persistent, to compare the two;
`--persistent`: the causal kernel persistent even where the planner keeps it one CTA per tile, d80-d128, whose
staged epilogue has barriers: plan_backward(masked_persistent=True)); `--head-dim-v 128` with `--head-dim 192` for
(192, 128), `--deterministic` for the spec's deterministic backward (its dQ warp lets each block's adds land before
it passes the turn, so dq_land reads about 0 there, and the turns waited for fall in `blocks`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from cta_cost import HIDDEN, TOKENS, work  # noqa: E402  (the grid cell: its shape, CTAs and query blocks)

# the trace columns (templates/sm90/bwd.py.j2's T_* constants)
(T_SM, T_ENTRY, T_CONSUMERS, T_KV, T_BLOCKS, T_EPILOGUE, T_ENTRY_NS, T_END_NS, T_DRAINED, T_STAGED, T_P_TILE,
 T_P_KV, T_DQ_ISSUED, T_DQ_LANDED, T_S_BLOCK, T_S_Q, T_S_DO, T_S_EMPTY, T_S_EMPTIED, T_S_END, T_D_TOP, T_D_TURN,
 T_D_FULL0, T_D_FULL1, T_D_READ, T_D_LAND, T_D_PASS) = range(27)
REQUIRED = 8  # columns every traced kernel writes; T_DRAINED / T_STAGED only where the epilogue has those points
PHASES = ("prologue", "kv_wait", "blocks", "epilogue", "gap")
EPILOGUE_PARTS = ("drain", "stage", "store")  # the staged epilogue's parts (their sum is its epilogue)
# the K / V load seen from the producer (its first thread's %clock64, same SM as the consumers' columns):
#   kv_issue  when the producer holds the tile's K / V stage (and issues its TMA) -> the consumers have K / V:
#             the load's latency only where the consumers waited for it (kv_wait above its ~0.1 µs floor); where
#             they arrived after it landed (a persistent tile's K / V issued before the previous epilogue), a bound
#   kv_late   the previous tile's consumers handing K / V back (their last query block done: T_BLOCKS where the
#             epilogue is staged, else its end) -> the producer holding the stage (persistent, one K / V stage,
#             the tile after another on the same SM only): how long the hand-back takes to reach the producer
#   p_ahead   the producer starting the tile's loads -> the previous tile's hand-back (positive: the producer
#             was waiting for it, not for the previous tile's Q / dO stages)
# and the dQ warp's (its first thread; kernels with a dQ warp):
#   dq_land      the tile's last dQ bulk reduce issued -> all of the tile's reduces landed in global memory
#   kv_after_dq  the tile's last dQ reduce issued -> the producer holding the next tile's K / V stage (persistent,
#                one stage; positive: the next K / V load queues behind that reduce)
PRODUCER_PARTS = ("kv_issue", "kv_late", "p_ahead", "dq_land", "kv_after_dq")


def spec_dict(d: int, mask: str, dv: int | None = None, deterministic: bool = False) -> dict:
    """tools/bench_fwd.py's backward spec of a grid row (MHA, bf16, the plan's own pipeline choices); `dv`: V's own
    head dim ((192, 128)), `deterministic`: the spec's deterministic backward."""
    tag = f"d{d}" + (f"x{dv}" if dv and dv != d else "") + f"_{mask}" + ("_det" if deterministic else "")
    spec = dict(name=f"timeline_{tag}", targets=["sm90"], dtype="bf16", head_dim=d,
                mask={"kind": "causal"} if mask == "causal" else {"kind": "none"},
                backward=True, allow_gqa=False)
    if dv and dv != d:
        spec["head_dim_v"] = dv
    if deterministic:
        spec["deterministic"] = True
    return spec


def traced_package(spec: dict, grid: bool, out_dir: Path, persistent: bool = False):
    """Render `spec` with its SM90 backward traced (with `grid`, one CTA per tile; with `persistent`, the masked
    persistent loop where the planner would not choose it) and import it."""
    from fa4gen.builder import plan_spec, write_package
    from fa4gen.compile.generated import import_from_path
    from fa4gen.render import RenderedPackage, render_package
    from fa4gen.spec import spec_from_dict

    s = spec_from_dict(spec)
    plans, unavailable = plan_spec(s, archs=["sm90"])
    if grid and persistent:
        raise SystemExit("bwd_timeline: --grid and --persistent exclude each other")
    if persistent:
        from fa4gen.plan.sm90 import plan_backward

        forced = plan_backward(s, masked_persistent=True)
        if forced.scheduler != "persistent":
            raise SystemExit(f"{s.name}: no persistent backward for this spec (plan_backward: {forced.scheduler})")
        plans = [forced if p.direction == "bwd" and p.module == forced.module else p for p in plans]
    if grid:
        plans = [dataclasses.replace(p, scheduler="grid", persistent_ctas=0)
                 if p.direction == "bwd" and p.scheduler == "persistent" else p for p in plans]
    bwd = [p for p in plans if p.direction == "bwd"]
    if not bwd or any(p.varlen or p.dkv_accum for p in bwd):
        raise SystemExit(f"{s.name}: expected an MHA SM90 backward without varlen (the trace rows are per key block)")
    pkg = render_package(s, plans, spec_label="<bwd_timeline>", unavailable=unavailable, trace={p.module for p in bwd})
    name = f"fa4gen_timeline_{s.name}{'_grid' if grid else '_persistent' if persistent else ''}"
    write_package(RenderedPackage(name=name, files=pkg.files), out_dir)
    return import_from_path(name, out_dir / name / "__init__.py", package=True), bwd[0]


def rows_by_sm(rows: list[list[int]]) -> dict[int, list[list[int]]]:
    """The rows of each SM, in the order they entered it (a one-tile-per-CTA kernel's CTAs, a persistent CTA's tiles)."""
    by_sm: dict[int, list[list[int]]] = {}
    for r in rows:
        by_sm.setdefault(r[T_SM], []).append(r)
    return {sm: sorted(sm_rows, key=lambda r: r[T_ENTRY]) for sm, sm_rows in by_sm.items()}


def phases(rows: list[list[int]], kv_stages: int = 1, staged: bool = False, persistent: bool = True) -> dict:
    """Per-row phase lengths in cycles, the gaps between consecutive rows on one SM, and the clock rate (cycles
    per ns) from the rows' own entry -> end spans. `kv_stages` / `staged` (the plan's K / V stages, whether K / V
    go back before the epilogue: plan.dkv_staging) place the hand-back for PRODUCER_PARTS; `persistent`: the rows
    are one CTA's tiles (kv_late / p_ahead pair a tile with the one before it on its SM; a grid CTA has its own
    K / V barrier, so there they are not computed)."""
    out = {name: [] for name in PHASES + EPILOGUE_PARTS + PRODUCER_PARTS}
    cycles = ns = 0
    for r in rows:
        if r[T_P_KV] >= 0:
            out["kv_issue"].append(r[T_KV] - r[T_P_KV])
        if r[T_DQ_ISSUED] >= 0 and r[T_DQ_LANDED] >= 0:
            out["dq_land"].append(r[T_DQ_LANDED] - r[T_DQ_ISSUED])
        out["prologue"].append(r[T_CONSUMERS] - r[T_ENTRY])
        out["kv_wait"].append(r[T_KV] - r[T_CONSUMERS])
        out["blocks"].append(r[T_BLOCKS] - r[T_KV])
        out["epilogue"].append(r[T_EPILOGUE] - r[T_BLOCKS])
        if r[T_STAGED] >= 0:
            drained = r[T_DRAINED] if r[T_DRAINED] >= 0 else r[T_BLOCKS]
            out["drain"].append(drained - r[T_BLOCKS])
            out["stage"].append(r[T_STAGED] - drained)
            out["store"].append(r[T_EPILOGUE] - r[T_STAGED])
        cycles += r[T_EPILOGUE] - r[T_ENTRY]
        ns += r[T_END_NS] - r[T_ENTRY_NS]
    by_sm = rows_by_sm(rows)
    for sm_rows in by_sm.values():
        out["gap"] += [b[T_ENTRY] - a[T_EPILOGUE] for a, b in zip(sm_rows, sm_rows[1:])]
        if persistent and kv_stages == 1:  # the hand-back of one tile's K / V stage is the next tile's (same SM) to take
            for a, b in zip(sm_rows, sm_rows[1:]):
                if b[T_P_KV] >= 0 and b[T_P_TILE] >= 0:
                    handback = a[T_BLOCKS] if staged else a[T_EPILOGUE]
                    out["kv_late"].append(b[T_P_KV] - handback)
                    out["p_ahead"].append(handback - b[T_P_TILE])
                if b[T_P_KV] >= 0 and a[T_DQ_ISSUED] >= 0:
                    out["kv_after_dq"].append(b[T_P_KV] - a[T_DQ_ISSUED])
    return {"cycles": out, "cycles_per_ns": cycles / ns if ns > 0 else float("nan"), "sms": len(by_sm),
            "span_ns": max(r[T_END_NS] for r in rows) - min(r[T_ENTRY_NS] for r in rows),
            "busy_ns": sum(r[T_END_NS] - r[T_ENTRY_NS] for r in rows)}


# one sampled query block per CTA (the middle of its walk; the template's sample_at points): intervals between two
# columns, each read where the kernel wrote both. The consumers' first thread (warpgroup 0):
#   q_wait / do_wait   its Q / dO stage waits; work: from there to its dQ hand-off; handoff: the wait for the dQ
#   buffer (or, deterministic with dQ from registers, the turn warp's go); after: the hand-off to the block's end
# the dQ warp's first thread:
#   turn       the block's top -> past its turn (deterministic: a poll, or none when the peek saw it)
#   tile0      past the turn (else the top) -> warpgroup 0's tile in its buffer; tile1: -> warpgroup 1's
#   read       -> the adds issued and the buffers released (read out); land: -> the adds landed; pass: -> turn passed
#   cycle      the block's top -> past its pass (deterministic: the dQ warp's serial path for the block)
SAMPLED = (("q_wait", T_S_BLOCK, T_S_Q), ("do_wait", T_S_Q, T_S_DO), ("work", T_S_DO, T_S_EMPTY),
           ("handoff", T_S_EMPTY, T_S_EMPTIED), ("after", T_S_EMPTIED, T_S_END), ("block", T_S_BLOCK, T_S_END),
           ("turn", T_D_TOP, T_D_TURN), ("tile0", T_D_TURN, T_D_FULL0), ("tile1", T_D_FULL0, T_D_FULL1),
           ("read", T_D_FULL1, T_D_READ), ("land", T_D_READ, T_D_LAND), ("pass", T_D_LAND, T_D_PASS),
           ("cycle", T_D_TOP, T_D_PASS))


def sampled_block(rows: list[list[int]], cycles_per_ns: float) -> dict:
    """Median / mean µs of each SAMPLED interval over the rows that wrote both of its points (tile0 from the
    block's top where a kernel has no turn point)."""
    rate = cycles_per_ns * 1e3
    out = {}
    for name, a, b in SAMPLED:
        values = []
        for r in rows:
            start = r[a] if r[a] >= 0 or a != T_D_TURN else r[T_D_TOP]
            if start >= 0 and r[b] >= 0:
                values.append((r[b] - start) / rate)
        if values:
            out[name] = {"median_us": statistics.median(values), "mean_us": statistics.fmean(values),
                         "rows": len(values)}
    return out


def by_round(rows: list[list[int]], rounds: list[int], cycles_per_ns: float) -> dict:
    """Medians in µs of kv_wait, kv_issue and the epilogue over the r-th tile of every SM (rows ordered by their
    entry on each SM), for each r of `rounds` that some SM reached."""
    ordered = list(rows_by_sm(rows).values())
    rate = cycles_per_ns * 1e3
    out = {}
    for k in rounds:
        tiles = [sm_rows[k] for sm_rows in ordered if k < len(sm_rows)]
        if not tiles:
            continue
        issue = [r[T_KV] - r[T_P_KV] for r in tiles if r[T_P_KV] >= 0]
        out[k] = {"tiles": len(tiles),
                  "kv_wait_us": statistics.median(r[T_KV] - r[T_CONSUMERS] for r in tiles) / rate,
                  "kv_issue_us": statistics.median(issue) / rate if issue else float("nan"),
                  "epilogue_us": statistics.median(r[T_EPILOGUE] - r[T_BLOCKS] for r in tiles) / rate}
    return out


def summary(p: dict, blocks_per_row: float) -> dict:
    """Medians / means of each phase in µs, each phase's share of a row's mean time, the SMs' busy share."""
    rate = p["cycles_per_ns"] * 1e3  # cycles per µs
    out = {}
    for name, values in p["cycles"].items():
        if values:
            out[name] = {"median_us": statistics.median(values) / rate, "mean_us": statistics.fmean(values) / rate}
    per_row = sum(v["mean_us"] for k, v in out.items() if k in PHASES)
    for v in out.values():
        v["share"] = v["mean_us"] / per_row if per_row else float("nan")
    out["per_block_us"] = out["blocks"]["mean_us"] / blocks_per_row if blocks_per_row else float("nan")
    out["clock_ghz"] = p["cycles_per_ns"]
    out["busy_share"] = p["busy_ns"] / (p["span_ns"] * p["sms"]) if p["span_ns"] else float("nan")
    out["span_us"] = p["span_ns"] / 1e3
    return out


def with_trace(args: list, trace) -> list:
    """The API's launch arguments of the backward with the trace tensor after its last tensor argument: where the
    traced kernel takes it (its last tensor parameter, before the run-time scalars)."""
    import torch

    last = max(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    return [*args[:last + 1], trace, *args[last + 1:]]


def run_cell(pkg, plan, d: int, s: int, causal: bool, repeats: int,
             dv: int | None = None) -> tuple[list[list[int]], float]:
    """The traced backward of one grid cell, `repeats` times (the last one's rows); mean query blocks per row
    (`dv`: V's head dim where it differs from Q / K's)."""
    import torch

    from fa4gen.api.runtime import ForwardOp

    b, h = TOKENS // s, HIDDEN // d
    op = pkg._forward
    bwd_fn = op.function(op.bwd_plans["sm90"])
    n_rows = -(-s // plan.tile_n) * h * b
    from fa4gen.render import TRACE_EVENTS

    trace = torch.full((n_rows, TRACE_EVENTS), -1, dtype=torch.int64, device="cuda")
    launch = ForwardOp._launch

    def traced_launch(fn, device, args):
        launch(fn, device, with_trace(args, trace) if fn is bwd_fn else args)

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, width, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for width in (d, d, dv or d))
    ForwardOp._launch = staticmethod(traced_launch)
    try:
        for _ in range(repeats):
            out = pkg.attention(q, k, v)
            out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
    finally:
        ForwardOp._launch = staticmethod(launch)
    rows = trace.cpu().tolist()
    missing = sum(1 for r in rows if min(r[:REQUIRED]) < 0)
    if missing:
        raise SystemExit(f"d{d} s{s}: {missing} of {len(rows)} trace rows not written")
    # query blocks per CTA as tools/cta_cost.py counts them (the kernel's own causal range, mirrored)
    ctas, visits = work(s, d, causal, plan.tile_m, plan.tile_n)
    blocks = visits / ctas
    return rows, blocks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--head-dim-v", type=int, default=None, help="V's head dim where it differs (e.g. 128 with 192)")
    ap.add_argument("--deterministic", action="store_true", help="the spec's deterministic backward")
    ap.add_argument("--mask", choices=("none", "causal"), default="none")
    ap.add_argument("--seqlens", default="512,1024,2048")
    ap.add_argument("--grid", action="store_true", help="one CTA per tile even where the plan is persistent")
    ap.add_argument("--persistent", action="store_true",
                    help="the causal kernel persistent even where the planner keeps it one CTA per tile (d80-d128)")
    ap.add_argument("--repeats", type=int, default=3, help="backward calls per cell (the last one is read)")
    ap.add_argument("--out", default=None, help="folder for timeline.json (the rows and the summaries)")
    ap.add_argument("--rounds", default="0,1,2,3,5,10",
                    help="persistent kernels: print the phases of these rounds (the r-th tile of each SM); '' for none")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bwd_timeline: needs a CUDA GPU (the traced kernel runs)")
    spec = spec_dict(args.head_dim, args.mask, args.head_dim_v, args.deterministic)
    label = spec["name"].removeprefix("timeline_")  # e.g. d192x128_causal_det
    scratch = Path(tempfile.mkdtemp(prefix="fa4gen_timeline_"))
    pkg, plan = traced_package(spec, args.grid, scratch, persistent=args.persistent)
    kind = "one CTA per tile" if plan.scheduler != "persistent" else "persistent"
    print(f"{label} backward ({plan.module}, {kind}, {plan.tile_m} x {plan.tile_n} tiles); "
          f"µs per CTA / tile (median, mean, share of the mean row)")
    print("| seqlen | rows | blocks / row | " + " | ".join(PHASES) + " | per block | SMs busy | span µs | GHz |")
    print("|---" * (len(PHASES) + 7) + "|")
    report = {"spec": spec, "kind": kind, "plan": {"tile_m": plan.tile_m, "tile_n": plan.tile_n}, "cells": {}}
    for s in (int(x) for x in args.seqlens.split(",")):
        rows, blocks = run_cell(pkg, plan, args.head_dim, s, args.mask == "causal", args.repeats, args.head_dim_v)
        p = phases(rows, plan.kv_stages, bool(plan.dkv_staging.phases), plan.scheduler == "persistent")
        summ = summary(p, blocks)
        rounds = by_round(rows, [int(x) for x in args.rounds.split(",") if x], p["cycles_per_ns"]) \
            if plan.scheduler == "persistent" else {}
        sampled = sampled_block(rows, p["cycles_per_ns"])
        report["cells"][s] = {"summary": summ, "rounds": rounds, "sampled": sampled, "rows": rows}
        cells = " | ".join(f"{summ[n]['median_us']:.2f} / {summ[n]['mean_us']:.2f} ({summ[n]['share']:.0%})"
                           if n in summ else "-" for n in PHASES)
        print(f"| {s} | {len(rows)} | {blocks:.1f} | {cells} | {summ['per_block_us']:.2f} | {summ['busy_share']:.1%} "
              f"| {summ['span_us']:.0f} | {summ['clock_ghz']:.2f} |")
        if "stage" in summ:
            print(f"  s{s} staged epilogue (median / mean µs): " + ", ".join(
                f"{n} {summ[n]['median_us']:.2f} / {summ[n]['mean_us']:.2f}" for n in EPILOGUE_PARTS))
        if "kv_issue" in summ:
            print(f"  s{s} K / V from the producer (median / mean µs): " + ", ".join(
                f"{n} {summ[n]['median_us']:.2f} / {summ[n]['mean_us']:.2f}" for n in PRODUCER_PARTS if n in summ))
        if sampled:
            print(f"  s{s} sampled block (median / mean µs): " + ", ".join(
                f"{n} {v['median_us']:.2f} / {v['mean_us']:.2f}" for n, v in sampled.items()))
        if rounds:
            print(f"  s{s} by round (medians, µs; kv_wait / kv_issue / epilogue): " + ", ".join(
                f"{k}: {v['kv_wait_us']:.2f} / {v['kv_issue_us']:.2f} / {v['epilogue_us']:.2f}" for k, v in rounds.items()))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        tag = f"{label}{'_grid' if args.grid else '_persistent' if args.persistent else ''}"
        (Path(args.out) / f"timeline_{tag}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

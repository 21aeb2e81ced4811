"""Per-loop SASS of a spec's kernels, compiled on the CPU (no GPU needed): for every loop of every
kernel, its instruction count, MMAs (HGMMA / UTCHMMA...), MUFU.EX2 and spills. The quickest check that
a template change kept a hot loop lean (e.g. a masked loop recomputing exponentials shows more
MUFU.EX2 than the mask-free one).

Run: `PYTHONPATH=. python tools/sass_loops.py specs/llama3_8b.yaml` (or a JSON spec dict in place of
the path: '{"name": "x", "targets": ["sm90"], "dtype": "bf16", "head_dim": 64, "mask": {"kind": "causal"}}').
Loops are listed outermost-last as they appear in the listing; nested loops appear inside their
parents' counts too. `--cycles` adds each loop's static issue cycles (the stall counts ptxas encoded, summed:
one warp's issue time for an iteration without any barrier or scoreboard wait) and the span of its MUFU.EX2
stream in cycles and instructions: a stream of N MUFU.EX2 takes ~8N cycles on sm_90, and what runs in its issue
gaps is free (session 60: the d128 causal backward's mask-free loop 1,068 cycles on main, flash-attn-4's 844).
"""

import argparse
import json
import os
import re
import tempfile
from collections import Counter
from pathlib import Path

MMA_OPS = ("HGMMA", "UTCHMMA", "UTCQMMA", "UTCOMMA")


def _spec(text: str):
    from fa4gen.spec import load_spec, spec_from_dict

    if text.lstrip().startswith("{"):  # a JSON dict (may be longer than a file name can be)
        return spec_from_dict(json.loads(text))
    return load_spec(Path(text))


def _mma_loops(sass_text: str, min_mma: int) -> list[tuple[list[str], int]]:
    """(body, MMA count) of every loop with at least `min_mma` MMA instructions."""
    from fa4gen.compile.sass import loops

    # (an out-of-line wait's jump back into a loop body closes a region that is no loop: left out)
    bodies = loops(sass_text, wait_returns=False)
    counted = ((body, sum(any(op in b for op in MMA_OPS) for b in body)) for body in bodies)
    return [(body, mma) for body, mma in counted if mma >= min_mma]


def loop_rows(sass_text: str, min_mma: int = 1) -> list[tuple[int, int, int, int]]:
    """(instructions, MMAs, MUFU.EX2, LDL/STL) per loop with at least `min_mma` MMA instructions."""
    return [(len(body), mma, sum("MUFU.EX2" in b for b in body), sum(bool(re.search(r"\b(LDL|STL)\b", b)) for b in body))
            for body, mma in _mma_loops(sass_text, min_mma)]


def loop_lines(sass_text: str, min_mma: int = 1, ops: int = 0) -> list[str]:
    """The listing's lines for each loop `loop_rows` finds, with its `ops` most frequent opcodes under it."""
    lines = []
    for (n, mma, ex2, spill), counts in zip(loop_rows(sass_text, min_mma), loop_ops(sass_text, min_mma)):
        lines.append(f"    loop: {n:5d} instructions  {mma:3d} MMA  {ex2:3d} MUFU.EX2  {spill:2d} LDL/STL")
        if ops:
            lines.append("          " + ", ".join(f"{op} {c}" for op, c in counts.most_common(ops)))
    return lines


def loop_cycle_rows(control_text: str, min_mma: int = 1) -> list[tuple[int, int, int, int, int]]:
    """(instructions, static issue cycles, MUFU.EX2, their stream's cycles, its instructions) per loop with at least
    `min_mma` MMAs of a `fa4gen.compile.sass.disassemble_with_control` listing (the stream: first to last MUFU.EX2)."""
    from fa4gen.compile.sass import issue_cycles

    rows = []
    for body, _ in _mma_loops(control_text, min_mma):
        ex2 = [i for i, b in enumerate(body) if "MUFU.EX2" in b]
        stream = body[ex2[0]:ex2[-1] + 1] if ex2 else []
        rows.append((len(body), issue_cycles(body), len(ex2), issue_cycles(stream), len(stream)))
    return rows


def loop_op_cycles(control_text: str, min_mma: int = 1) -> list[Counter]:
    """Static issue cycles per opcode (without modifiers or predicate) of each loop `loop_cycle_rows` lists: where a
    loop's cycles go (session 74: the d128 causal backward's mask-free loop against flash-attn-4's)."""
    from fa4gen.compile.sass import issue_cycles, summarize_sass

    per_loop = []
    for body, _ in _mma_loops(control_text, min_mma):
        cycles = Counter()
        for line in body:
            for op in summarize_sass(line).opcodes:  # one, or none on a line that holds no instruction
                cycles[op] += issue_cycles([line])
        per_loop.append(cycles)
    return per_loop


def loop_cycles(control_text: str, min_mma: int = 1, ops: int = 0) -> list[str]:
    """`loop_cycle_rows` as listing lines, with `ops` the loop's `ops` opcodes of the most issue cycles under each."""
    lines = []
    by_op = loop_op_cycles(control_text, min_mma) if ops else None
    for i, (n, cycles, ex2, stream, stream_n) in enumerate(loop_cycle_rows(control_text, min_mma)):
        lines.append(f"    loop: {n:5d} instructions  {cycles:5d} issue cycles  "
                     + (f"{ex2} MUFU.EX2 over {stream} cycles / {stream_n} instructions" if ex2 else "no MUFU.EX2"))
        if by_op:
            lines.append("          cycles: " + ", ".join(f"{op} {c}" for op, c in by_op[i].most_common(ops)))
    return lines


def loop_ops(sass_text: str, min_mma: int = 1) -> list[Counter]:
    """Opcode (without modifiers or predicate) counts per loop, for the loops `loop_rows` lists."""
    from fa4gen.compile.sass import summarize_sass

    return [Counter(summarize_sass("\n".join(body)).opcodes) for body, _ in _mma_loops(sass_text, min_mma)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", help="a spec file, or a JSON spec dict")
    ap.add_argument("--arch", action="append", help="only these targets (default: all of the spec's)")
    ap.add_argument("--min-mma", type=int, default=1, help="list loops with at least this many MMAs (default 1)")
    ap.add_argument("--ops", type=int, default=0, metavar="N",
                    help="also print each loop's N most frequent opcodes (e.g. the uniform-datapath address math)")
    ap.add_argument("--dump", type=Path, default=None, help="also write each kernel's SASS listing into this folder")
    ap.add_argument("--cycles", action="store_true",
                    help="also print each loop's static issue cycles and MUFU.EX2 stream (from the control codes); "
                         "with --ops N, also its N opcodes of the most issue cycles")
    args = ap.parse_args(argv)
    os.environ.setdefault("FA4GEN_QUIET", "1")
    from fa4gen.builder import compile_for_sass, plan_spec
    from fa4gen.compile.cache import DiskCache
    from fa4gen.compile.sass import control_listing

    spec = _spec(args.spec)
    plans, _ = plan_spec(spec, archs=args.arch)
    with tempfile.TemporaryDirectory(prefix="fa4gen-sass-") as tmp:  # a fresh cache: every kernel compiled here
        for plan, report, sass in compile_for_sass(spec, plans, Path(tmp), "sassloops_gen"):
            print(f"{spec.name} {plan.arch} {plan.module}: {report.status} {report.detail}".rstrip()
                  + (f", {report.meta['registers']} registers" if report.meta.get("registers") else "")
                  + ("; GQA dK/dV accumulators (allow_gqa's GQA/MQA calls; its MHA calls run bwd_sm90_mha, the "
                     "benchmarks' MHA kernel)" if plan.dkv_accum else ""))
            if sass is None:
                continue
            if args.dump is not None:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"{spec.name}.{plan.module}.sass").write_text(sass)
            for line in loop_lines(sass, args.min_mma, args.ops):
                print(line)
            if args.cycles:
                entry = next(e for e in DiskCache(Path(tmp) / "cache").ls()
                             if e.meta.get("name") == f"{spec.name}.{plan.module}")
                control = control_listing(entry.artifact_path.read_bytes())
                if args.dump is not None:
                    (args.dump / f"{spec.name}.{plan.module}.control.sass").write_text(control)
                for line in loop_cycles(control, args.min_mma, args.ops):
                    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

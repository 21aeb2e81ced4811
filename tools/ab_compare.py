"""Table of an A/B run of tools/ab_bench.sh: per grid cell, fa4gen's TFLOP/s of the new tree and of the
reference in every round, new/ref and each side's ratio to flash-attn-4, forward and, when the runs had
--bwd, backward (and with --deterministic the deterministic backward, against flash-attn-4's only
backward); then the geometric mean of new/ref, its spread over rounds, and the raw ratios' geometric mean.
Each side's runs are separate processes whose clocks drift (the matmul rate moved 9% in 7 minutes in session
13), so new/ref divides each run's fa4gen cell by the same run's flash-attn-4 cell first — the same-run ratio —
and falls back
to raw TFLOP/s only where flash-attn-4 did not run. The last column is the raw ratio of the means, marked
when it differs from new/ref by more than 3%: then one run's flash-attn-4 cell was an outlier (session 16:
520.6 TFLOP/s against 464-483 in the other runs) or the clocks drifted, and the cell needs a second look: a line
under the table lists that cell's flash-attn-4 reading in every run and names one more than 4% from their median.
Reads DIR/{new,ref}_N/bench_{fwd,bwd}.json, or a run's bench_*.partial.jsonl where a timeout stopped it before
its JSON (a cell some run did not finish is compared over the runs that have it, its row says how many, and the
per-round spread counts only the cells every run has); writes DIR/ab.md. Runs anywhere: `python3 tools/ab_compare.py DIR`.
"""

import argparse
import json
import math
from pathlib import Path
from statistics import mean, median


def load(path: Path) -> dict[tuple, dict]:
    """Rows of one bench run (its JSON, or the cells of a .partial.jsonl) keyed by (d, dv, seqlen, causal)."""
    if path.name.endswith(".partial.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        rows = json.loads(path.read_text())["rows"]
    return {(_dims(r), r["seqlen"], "y" if r["causal"] else "n"): r for r in rows}


def _dims(r: dict) -> str:
    dv = r.get("dv", r["d"])
    return str(r["d"]) if dv == r["d"] else f"{r['d']}x{dv}"


def runs(ab_dir: Path, side: str) -> list[dict[tuple, dict]]:
    found = []
    for run_dir in sorted(ab_dir.glob(f"{side}_*"), key=lambda p: p.name):
        if run_dir.is_dir():
            finished = sorted(run_dir.glob("bench_*.json"))
            # a run cut short by the call's timeout left only its finished cells
            cut = [f for f in sorted(run_dir.glob("bench_*.partial.jsonl"))
                   if f.with_name(f.name.replace(".partial.jsonl", ".json")) not in finished]
            found += [r for r in (load(f) for f in finished + cut) if r]
    return found


# new/ref through flash-attn-4 and the raw ratio differing by more than this marks a cell "(!)"
RAW_DISAGREES = 0.03
# one side's own runs of a cell further apart than this (max / min - 1) mark its new/ref "(~)": a cell resting on
# one outlying run (session 47: a ref run 753.7 against 707.1, the cell's new/ref 0.958). 4% is about the 90th
# percentile of a side's spread over the stored A/B archives (tools/ab_spread.py, session 46: 3.8-4.4%)
SIDE_SPREAD = 0.04


def _relative(run: dict, cell: tuple, col: str, fa4_col: str) -> float:
    """fa4gen's cell in one run, relative to the same run's flash-attn-4 cell when it has one."""
    row = run[cell]
    return row[col] / row[fa4_col] if row.get(fa4_col) else row[col]


def fa4_note(cell: tuple, nr: list[dict], fr: list[dict], fa4_col: str) -> str:
    """For a "(!)" cell: every run's flash-attn-4 TFLOP/s, and the one furthest from their median when it is more
    than SIDE_SPREAD away (session 48: one ref run's 193.1 against 246.8-252.2 made a cell read 0.911 through
    flash-attn-4 while the raw ratio read 1.040; finding that run took unpacking the archive)."""
    readings = [(f"new run {i + 1}", r[cell][fa4_col]) for i, r in enumerate(nr)]
    readings += [(f"ref run {i + 1}", r[cell][fa4_col]) for i, r in enumerate(fr)]
    mid = median(v for _, v in readings)
    name, worst = max(readings, key=lambda nv: abs(nv[1] / mid - 1))
    text = (f"(!) {cell[0]} s{cell[1]} {'causal' if cell[2] == 'y' else 'no mask'}: flash-attn-4 "
            f"{' / '.join(f'{v:.1f}' for _, v in readings[:len(nr)])} (new runs), "
            f"{' / '.join(f'{v:.1f}' for _, v in readings[len(nr):])} (ref runs)")
    if abs(worst / mid - 1) > SIDE_SPREAD:
        text += f"; {name} ({worst:.1f}) is {worst / mid - 1:+.0%} from their median: read the raw ratio"
    return text


def table(new: list[dict], ref: list[dict], col: str, fa4_col: str
          ) -> tuple[list[str], list[float], list[list[float]], list[float], list[str]]:
    """(markdown lines, new/ref per cell, new/ref per round pair for the cells every run has, raw new/ref per
    cell: the means of the sides' own numbers, not through flash-attn-4; a note per "(!)" cell naming each run's
    flash-attn-4 reading).

    A cell that some run did not finish (a call cut short) is compared over the runs that have it, and
    its row says how many; it stays out of the per-round spread."""
    def has(r, c):
        return c in r and r[c].get(col) is not None
    order = list(dict.fromkeys(c for r in new + ref for c in r))
    cells = [c for c in order if any(has(r, c) for r in new) and any(has(r, c) for r in ref)]
    lines = [f"| d | seqlen | causal | new ({col}) | ref ({col}) | new/ref | new/FA4 | ref/FA4 | raw new/ref |",
             "|---" * 9 + "|"]
    ratios, per_round, raws, notes = [], [], [], []
    for c in cells:
        nr, fr = [r for r in new if has(r, c)], [r for r in ref if has(r, c)]
        n = [r[c][col] for r in nr]
        f = [r[c][col] for r in fr]
        rn = [_relative(r, c, col, fa4_col) for r in nr]
        rf = [_relative(r, c, col, fa4_col) for r in fr]
        ratio = mean(rn) / mean(rf)
        ratios.append(ratio)
        complete = len(nr) == len(new) and len(fr) == len(ref)
        if complete:
            per_round.append([a / b for a, b in zip(rn, rf)])
        same_run = all(r[c].get(fa4_col) for r in nr + fr)
        vs = (lambda x: f"{mean(x):.3f}") if same_run else (lambda x: "-")
        raw = mean(n) / mean(f)
        raws.append(raw)
        mark = " (!)" if same_run and abs(ratio / raw - 1) > RAW_DISAGREES else ""
        if mark:
            notes.append(fa4_note(c, nr, fr, fa4_col))
        runs_note = "" if complete else f" ({len(nr)} new / {len(fr)} ref runs)"
        wide = " (~)" if any(len(x) > 1 and max(x) / min(x) - 1 > SIDE_SPREAD for x in (n, f)) else ""
        lines.append(f"| {c[0]} | {c[1]} | {c[2]} | {' / '.join(f'{x:.1f}' for x in n)} | "
                     f"{' / '.join(f'{x:.1f}' for x in f)} | {ratio:.3f}{runs_note}{wide} | {vs(rn)} | {vs(rf)} | {raw:.3f}{mark} |")
    return lines, ratios, per_round, raws, notes


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    args = ap.parse_args(argv)
    new, ref = runs(args.dir, "new"), runs(args.dir, "ref")
    if not new or not ref:
        raise SystemExit(f"{args.dir}: need new_N/ and ref_N/ folders with bench_*.json (found {len(new)} new, {len(ref)} ref)")
    if len(new) != len(ref):  # a run that failed: the rounds no longer pair up
        print(f"warning: {len(new)} new runs but {len(ref)} ref runs (a failed run? see the logs)")
    out = []
    # (the deterministic backward, with --deterministic, against flash-attn-4's non-deterministic one)
    for col, fa4_col in (("fa4gen", "fa4"), ("fa4gen_bwd", "fa4_bwd"), ("fa4gen_det_bwd", "fa4_bwd")):
        if all(r and any(row.get(col) is not None for row in r.values()) for r in new + ref):
            lines, ratios, per_round, raws, fa4_notes = table(new, ref, col, fa4_col)
            gm = math.exp(mean(math.log(x) for x in ratios))
            gm_raw = math.exp(mean(math.log(x) for x in raws))
            pairs = min(len(new), len(ref)) if per_round else 0
            rounds = ", ".join(f"{math.exp(mean(math.log(cell[i]) for cell in per_round)):.3f}" for i in range(pairs))
            over = "" if len(per_round) == len(ratios) else f", over the {len(per_round)} cells every run finished:"
            spread = f" (per round{over} {rounds})" if pairs > 1 else ""
            count = f"{len(new)} runs each" if len(new) == len(ref) else f"{len(new)} new / {len(ref)} ref runs"
            out += lines + ["", f"{col}: geometric mean new/ref {gm:.3f} over {len(ratios)} cells, {count}"
                            f"{spread}; ratios to the same run's flash-attn-4; raw (the sides' own numbers) "
                            f"{gm_raw:.3f}", ""]
            notes = [f"(~): one side's runs of the cell more than {SIDE_SPREAD:.0%} apart (an outlying run moves "
                     "its new/ref)" if any("(~)" in ln for ln in lines) else "",
                     f"(!): new/ref through flash-attn-4 and the raw ratio more than {RAW_DISAGREES:.0%} apart"
                     if any("(!)" in ln for ln in lines) else ""]
            notes += fa4_notes
            out += [n for n in notes if n] + ([""] if any(notes) else [])
    text = "\n".join(out)
    (args.dir / "ab.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

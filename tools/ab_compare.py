"""Table of an A/B run of tools/ab_bench.sh: per grid cell, fa4gen's TFLOP/s of the new tree and of the
reference in every round, new/ref of their means and each side's ratio to flash-attn-4 (whose column is
averaged over all rounds of both sides), forward and, when the runs had --bwd, backward (and with
--deterministic the deterministic backward, against flash-attn-4's only backward); then the
geometric mean of new/ref. Reads DIR/{new,ref}_N/bench_{fwd,bwd}.json; writes DIR/ab.md. Runs anywhere:
`python3 tools/ab_compare.py DIR`.
"""

import argparse
import json
import math
from pathlib import Path
from statistics import mean


def load(path: Path) -> dict[tuple, dict]:
    """Rows of one bench run keyed by (d, seqlen, causal)."""
    rows = json.loads(path.read_text())["rows"]
    return {(r["d"], r["seqlen"], "y" if r["causal"] else "n"): r for r in rows}


def runs(ab_dir: Path, side: str) -> list[dict[tuple, dict]]:
    found = []
    for run_dir in sorted(ab_dir.glob(f"{side}_*"), key=lambda p: p.name):
        if run_dir.is_dir():
            found += [load(f) for f in sorted(run_dir.glob("bench_*.json"))]
    return found


def table(new: list[dict], ref: list[dict], col: str, fa4_col: str) -> tuple[list[str], list[float]]:
    cells = [c for c in new[0] if all(c in r and r[c].get(col) is not None for r in new + ref)]
    lines = [f"| d | seqlen | causal | new ({col}) | ref ({col}) | new/ref | new/FA4 | ref/FA4 |", "|---" * 8 + "|"]
    ratios = []
    for c in cells:
        n = [r[c][col] for r in new]
        f = [r[c][col] for r in ref]
        fa4 = [r[c][fa4_col] for r in new + ref if r[c].get(fa4_col) is not None]
        ratio = mean(n) / mean(f)
        ratios.append(ratio)
        vs = (lambda x: f"{mean(x) / mean(fa4):.3f}") if fa4 else (lambda x: "-")
        lines.append(f"| {c[0]} | {c[1]} | {c[2]} | {' / '.join(f'{x:.1f}' for x in n)} | "
                     f"{' / '.join(f'{x:.1f}' for x in f)} | {ratio:.3f} | {vs(n)} | {vs(f)} |")
    return lines, ratios


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    args = ap.parse_args(argv)
    new, ref = runs(args.dir, "new"), runs(args.dir, "ref")
    if not new or not ref:
        raise SystemExit(f"{args.dir}: need new_N/ and ref_N/ folders with bench_*.json (found {len(new)} new, {len(ref)} ref)")
    out = []
    # (the deterministic backward, with --deterministic, against flash-attn-4's non-deterministic one)
    for col, fa4_col in (("fa4gen", "fa4"), ("fa4gen_bwd", "fa4_bwd"), ("fa4gen_det_bwd", "fa4_bwd")):
        if all(r and next(iter(r.values())).get(col) is not None for r in new + ref):
            lines, ratios = table(new, ref, col, fa4_col)
            gm = math.exp(mean(math.log(x) for x in ratios))
            out += lines + ["", f"{col}: geometric mean new/ref {gm:.3f} over {len(ratios)} cells, {len(new)} runs each", ""]
    text = "\n".join(out)
    (args.dir / "ab.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

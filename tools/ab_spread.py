"""Process-to-process spread of each implementation's TFLOP/s in the A/B archives under docs/perf
(tools/ab_bench.sh's ab.tgz files, renamed per call): within one archive and one side (new or ref: the same
kernels in every run of that side), each cell's max / min - 1 over the side's processes, for fa4gen and for
flash-attn-4 timed in the same processes. Says whether a one-process reading of a cell is fa4gen's or
flash-attn-4's noise (docs/PERF.md, session 46).

Run: `python3 tools/ab_spread.py [--root docs/perf] [--min-runs 2]` (CPU; reads the archives only).
"""

import argparse
import collections
import json
import statistics
import tarfile
from pathlib import Path

PAIRS = (("fa4gen", "fa4", "forward"), ("fa4gen_bwd", "fa4_bwd", "backward"))


def side_cells(archive: Path) -> dict[tuple, dict[str, list[float]]]:
    """(side, d, dv, seqlen, causal) -> column -> the TFLOP/s of each of that side's runs in one archive."""
    cells: dict[tuple, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    with tarfile.open(archive) as tf:
        for member in tf.getmembers():
            if not member.name.endswith(("bench_fwd.json", "bench_bwd.json")):
                continue
            side = Path(member.name).parent.name.split("_")[0]  # ab/new_3/bench_bwd.json -> new
            try:
                rows = json.load(tf.extractfile(member)).get("rows", [])
            except (json.JSONDecodeError, AttributeError):
                continue
            for r in rows:
                key = (side, r["d"], r.get("dv", r["d"]), r["seqlen"], r["causal"])
                for ours, fa4, _ in PAIRS:
                    for col in (ours, fa4):
                        if r.get(col):
                            cells[key][col].append(r[col])
    return cells


def spreads(archives: list[Path], min_runs: int) -> dict[str, list[tuple[float, float]]]:
    """Per direction, (fa4gen spread, flash-attn-4 spread) of every side-cell with at least min_runs runs of both."""
    out: dict[str, list[tuple[float, float]]] = {name: [] for _, _, name in PAIRS}
    for archive in archives:
        try:
            cells = side_cells(archive)
        except tarfile.TarError:
            continue
        for cols in cells.values():
            for ours, fa4, name in PAIRS:
                a, b = cols.get(ours, []), cols.get(fa4, [])
                if len(a) >= min_runs and len(a) == len(b):
                    out[name].append((max(a) / min(a) - 1, max(b) / min(b) - 1))
    return out


def _pct(values: list[float], q: float) -> str:
    values = sorted(values)
    return f"{100 * values[min(len(values) - 1, int(q * len(values)))]:.2f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent / "docs" / "perf"))
    ap.add_argument("--min-runs", type=int, default=2)
    args = ap.parse_args()
    archives = sorted(p for p in Path(args.root).glob("*/*.tgz") if "ab" in p.name)
    print(f"{len(archives)} archives under {args.root}")
    print("| direction | side-cells | fa4gen median | fa4gen p90 | flash-attn-4 median | flash-attn-4 p90 | "
          "flash-attn-4 the wider |")
    print("|---|---|---|---|---|---|---|")
    for name, pairs in spreads(archives, args.min_runs).items():
        if not pairs:
            continue
        ours, fa4 = [p[0] for p in pairs], [p[1] for p in pairs]
        wider = sum(f > o for o, f in pairs)
        print(f"| {name} | {len(pairs)} | {100 * statistics.median(ours):.2f}% | {_pct(ours, 0.9)} | "
              f"{100 * statistics.median(fa4):.2f}% | {_pct(fa4, 0.9)} | {wider} of {len(pairs)} |")


if __name__ == "__main__":
    main()

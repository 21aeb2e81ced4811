"""The README's speed table from bench_fwd.py runs: one row per (head dims, mask), each ratio column the range
(min–max) over the row's sequence lengths, so the table is read off the run files instead of copied by hand.

    python3 tools/grid_summary.py RUN.json [RUN.json ...] [--label s76]

Each RUN.json is what `tools/bench_fwd.py --out DIR` writes (one process, or the merge of `--processes N`: its
ratios are then the medians of each process's own ratios). Runs are read in order and a later run's cell replaces
an earlier one's (e.g. a short and a long pass, or a re-read of one head dim). Columns: forward / flash-attn-4,
forward / the better of flash-attn-4 and cuDNN, the same for the backward, the deterministic backward over the
default one, and the sequence lengths the row covers; a column no run filled reads "—". Under the table, issue #3 /
#4's cell counts: forward and backward cells at >= 1.05x the better peer and at >= 1.0x flash-attn-4, and
deterministic cells at >= 0.85x the default backward. No GPU needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLUMNS = (("vs_fa4", "forward / flash-attn-4"), ("vs_best", "forward / best"),
           ("bwd_vs_fa4", "backward / flash-attn-4"), ("bwd_vs_best", "backward / best"),
           ("det_vs_nondet", "deterministic / default backward"))


def _mask(row: dict) -> str:
    if row.get("chunk"):
        return f"chunked {row['chunk']}"
    if row.get("window") is not None:
        return f"window {row['window']}"
    return "causal" if row["causal"] else "none"


def load_cells(paths: list[Path]) -> dict[tuple, dict]:
    """(d, dv, mask, seqlen) -> row, later files replacing earlier ones."""
    cells: dict[tuple, dict] = {}
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise SystemExit(f"{path}: not a bench_fwd.py JSON file ({err})") from None
        rows = data.get("rows") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            raise SystemExit(f"{path}: expected a bench_fwd.py JSON object with 'rows'")
        for row in rows:
            cells[(row["d"], row.get("dv", row["d"]), _mask(row), row["seqlen"])] = row
    return cells


def _range(values: list[float]) -> str:
    if not values:
        return "—"
    lo, hi = min(values), max(values)
    return f"{lo:.3f}" if lo == hi else f"{lo:.3f}–{hi:.3f}"


def summary_rows(cells: dict[tuple, dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for (d, dv, mask, _), row in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "none",
                                                                          kv[0][2], kv[0][3])):
        groups.setdefault((d, dv, mask), []).append(row)
    out = []
    for (d, dv, mask), rows in groups.items():
        entry = {"head dim": str(d) if d == dv else f"({d}, {dv})", "mask": mask,
                 "seqlens": ", ".join(str(r["seqlen"]) for r in rows)}
        for key, title in COLUMNS:
            entry[title] = _range([r[key] for r in rows if isinstance(r.get(key), (int, float))])
        out.append(entry)
    return out


def markdown(rows: list[dict], label: str | None) -> str:
    titles = ["head dim", "mask", *(t for _, t in COLUMNS), "seqlens"] + (["run"] if label else [])
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    for r in rows:
        lines.append("| " + " | ".join([*(r[t] for t in titles if t != "run"), *([label] if label else [])]) + " |")
    return "\n".join(lines)


# issue #3 / #4's per-cell bars: (ratio key, bar, what it is)
TARGETS = (("vs_best", 1.05, "forward >= 1.05x best"), ("vs_fa4", 1.0, "forward >= 1.0x flash-attn-4"),
           ("bwd_vs_best", 1.05, "backward >= 1.05x best"), ("bwd_vs_fa4", 1.0, "backward >= 1.0x flash-attn-4"),
           ("det_vs_nondet", 0.85, "deterministic >= 0.85x default"))


def target_counts(cells: dict[tuple, dict]) -> list[str]:
    """'<what>: met in M of N cells (below: cell ratio, ...)' for each bar some cell has a ratio for."""
    out = []
    for key, bar, what in TARGETS:
        have = [(c, row[key]) for c, row in sorted(cells.items()) if isinstance(row.get(key), (int, float))]
        if not have:
            continue
        below = [f"d{d if d == dv else f'{d}x{dv}'} {mask} s{s} {v:.3f}" for (d, dv, mask, s), v in have if v < bar]
        line = f"{what}: met in {len(have) - len(below)} of {len(have)} cells"
        out.append(line + (f" (below: {', '.join(below)})" if below else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench_fwd.py JSON files, later ones replacing earlier cells")
    ap.add_argument("--label", default=None, help="a run column with this text (e.g. the session)")
    args = ap.parse_args(argv)
    cells = load_cells(args.runs)
    print(markdown(summary_rows(cells), args.label))
    print()
    print("\n".join(f"- {line}" for line in target_counts(cells)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

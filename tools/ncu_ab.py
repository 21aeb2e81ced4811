"""The summary of tools/ncu_ab.sh: every tree's main-kernel cycles per cell, side by side with the working tree's.

Reads the details pages tools/ncu_cell.sh wrote (TREE__CELL__rROUND_details.txt, through ncu_compare.details) in a
folder and prints, for each cell and kernel (fa4gen's rows, flash-attn-4's as the control: its code is the same in
every tree, so its spread is the reading's), each tree's SM-active and elapsed cycles by round, their means and the
means over the working tree's ("work"). Kernel names carry fa4gen's cache key, which differs between trees, so rows
are matched by kind and order (fa4gen, fa4gen#2 for --swap / --det, flash-attn-4, other#N).

Run: `python tools/ncu_ab.py DIR [--markdown FILE]`.
"""

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path
from statistics import mean

from ncu_compare import details

NAME = re.compile(r"^(?P<tree>[A-Za-z0-9_-]+?)__(?P<cell>[A-Za-z0-9_]+)__r(?P<round>\d+)_details\.txt$")


def read_cycles(path: Path) -> list[tuple[str, float | None, float | None]]:
    """(kernel label, elapsed cycles, SM-active cycles) for each kernel of one details page, in launch order."""
    rows, seen = [], defaultdict(int)
    for kernel, fields in details(path.read_text(errors="replace")):
        name = kernel.removeprefix("kernel_cutlass_kernel_")
        kind = "fa4gen" if name.startswith("fa4gen") else "flash-attn-4" if name.startswith("flash") else "other"
        seen[kind] += 1
        label = kind if seen[kind] == 1 and kind != "other" else f"{kind}#{seen[kind]}"
        rows.append((label, fields.get("cycles"), fields.get("active_cycles")))
    return rows


def collect(folder: Path):
    """{cell: {kernel: {tree: {round: (elapsed, active)}}}} and the rounds seen."""
    data: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    rounds = set()
    for path in sorted(folder.glob("*_details.txt")):
        m = NAME.match(path.name)
        if not m:
            continue
        rnd = int(m["round"])
        rounds.add(rnd)
        for label, elapsed, active in read_cycles(path):
            data[m["cell"]][label][m["tree"]][rnd] = (elapsed, active)
    return data, sorted(rounds)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def summary(folder: Path) -> str:
    data, rounds = collect(folder)
    if not data:
        return f"ncu_ab: no TREE__CELL__rN_details.txt pages in {folder}\n"
    out = ["| cell | kernel | tree | SM-active cycles by round | mean | / work | elapsed mean | / work |",
           "|---|---|---|---|---|---|---|---|"]
    for cell in sorted(data):
        for kernel in sorted(data[cell], key=lambda k: (k.startswith("other"), k.startswith("flash"), k)):
            by_tree = data[cell][kernel]
            trees = sorted(by_tree, key=lambda t: (t != "work", t))

            def means(tree):
                vals = [by_tree[tree].get(r) for r in rounds]
                el = [v[0] for v in vals if v and v[0] is not None]
                ac = [v[1] for v in vals if v and v[1] is not None]
                return vals, (mean(el) if el else None), (mean(ac) if ac else None)

            _, base_el, base_ac = means("work") if "work" in by_tree else (None, None, None)
            for tree in trees:
                vals, el, ac = means(tree)
                by_round = " / ".join(_fmt(v[1] if v else None) for v in vals)
                r_ac = f"{ac / base_ac:.4f}" if ac and base_ac else "-"
                r_el = f"{el / base_el:.4f}" if el and base_el else "-"
                out.append(f"| {cell} | {kernel} | {tree} | {by_round} | {_fmt(ac)} | {r_ac} | {_fmt(el)} | {r_el} |")
    out.append("")
    out.append(f"{len(rounds)} round(s); '/ work': the tree's mean cycles over the working tree's (below 1: that "
               "tree's kernel takes fewer cycles than the working tree's); flash-attn-4's rows are the same code in "
               "every tree: their spread is the reading's")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="where tools/ncu_ab.sh's ncu_cell.sh runs wrote their pages")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    if not args.folder.is_dir():
        print(f"ncu_ab: {args.folder} is not a folder", file=sys.stderr)
        return 2
    text = summary(args.folder)
    sys.stdout.write(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

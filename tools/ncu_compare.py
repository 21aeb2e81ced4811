"""Side-by-side reading of an Nsight Compute source-page export (`ncu ... --section SourceCounters
--page source --csv --print-source sass > ncu.csv`, one block per profiled kernel, e.g. from
tools/bwd_ncu.py): per kernel, instructions executed by opcode with their shared-memory wavefronts
(and the ideal count) and share of stall samples, the stall reasons, the instructions of one hot-loop
iteration (those executed at least half as often as the most frequent HGMMA), the stall samples of each
group of instructions executed equally often (`by_count`: per key block, per tile, ...), and the top stall
sites. Runs anywhere (no GPU): `python3 tools/ncu_compare.py ncu.csv [--top 25]`.

`--details FILE` reads a details-page text export instead (`ncu -i report.ncu-rep --page details > FILE`, or the
report ncu prints without `--page`): per kernel its duration, SM clock, elapsed cycles, DRAM / L2 / compute
throughput and registers, with each kernel's cycles over the first kernel's. Profiled with `--clock-control none`
the kernels may run at different clocks (session 59: a backward 0.4% shorter in µs than flash-attn-4's took 2.8% more
cycles), so compare cycles. Its SM-active cycles tell a loop's speed from a grid's tail: the share of the elapsed
cycles an SM sat idle (session 59's d128 causal s2k backward: flash-attn-4's SMs idle 8.3%, ours 2.8%, so per
active cycle its loop was ~9% faster though the kernels took 2.8% apart). Both files may be given
(`ncu.csv --details details.txt`); either may be xz-compressed (`.xz`, as docs/perf keeps them).

With two or more kernels in the CSV, a last table puts each opcode's stall samples side by side, as shares of the
first kernel's samples (so a row's difference is the share of the first kernel's time it explains), largest
difference first: session 80's d64 no-mask s16k forward read +2.3% F2FP and +1.3% FMNMX against flash-attn-4 there.

`--stall-ops REASON` adds, per kernel, that stall reason's samples summed by opcode (share of all the kernel's
samples): e.g. `--stall-ops wait` put 3.7% of our d128 causal backward's samples on MUFU against flash-attn-4's
0.3% (session 60).
"""

import argparse
import csv
import io
import lzma
import re
from collections import Counter
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(text: str) -> list[tuple[str, list[dict]]]:
    """(kernel name, rows as dicts) per kernel block of the export."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith('"Address"')]
    out = []
    for n, start in enumerate(starts):
        name_line = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].startswith('"Kernel Name"')), "")
        name = next(csv.reader([name_line]))[1] if name_line else f"kernel {n}"
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        block = [line for line in lines[start:end] if line.startswith('"')]
        rows = list(csv.DictReader(io.StringIO("\n".join(block))))
        out.append((name, [r for r in rows if r.get("Address", "").startswith("0x")]))
    return out


def read_text(path: Path) -> str:
    """A text export, xz-decompressed when its name ends in .xz."""
    return lzma.decompress(path.read_bytes()).decode("utf-8") if path.suffix == ".xz" else path.read_text()


def stall_ops(rows: list[dict], reason: str, top: int = 12) -> str:
    """One line: the samples of stall reason `reason` by opcode, as shares of all the kernel's stall samples."""
    key = f"stall_{reason}"
    if rows and key not in rows[0]:
        known = sorted(k[6:] for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k)
        raise SystemExit(f"--stall-ops: no stall reason {reason!r} in the export (it has: {', '.join(known)})")
    sampled = sum(_num(r, SAMPLES) for r in rows) or 1
    per_op = by_opcode(rows, key)
    total = sum(per_op.values())
    return (f"  {reason} stalls {100 * total / sampled:.1f}% of samples, by opcode: "
            + ", ".join(f"{op} {100 * v / sampled:.2f}%" for op, v in per_op.most_common(top) if v))


def by_opcode(rows: list[dict], key: str) -> Counter:
    """Column `key` of the rows summed by opcode."""
    out = Counter()
    for r in rows:
        out[opcode(r["Source"])] += _num(r, key)
    return out


def _num(row: dict, key: str) -> float:
    try:
        return float(row.get(key) or 0)
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers."""
    tokens = source.split()
    if tokens and tokens[0].startswith("@"):
        tokens = tokens[1:]
    return tokens[0].split(".")[0] if tokens else ""


def by_count(rows: list[dict]) -> list[tuple[float, tuple[int, float, float]]]:
    """(execution count, (instructions, stall samples, instructions executed)) per group of instructions that
    ran equally often, most stall samples first: a persistent kernel's per-key-block loop, its per-tile code
    (first block, last P·V, epilogue) and its producer separate by their counts."""
    groups: dict[float, list[float]] = {}
    for r in rows:
        n = _num(r, "Instructions Executed")
        if n:
            g = groups.setdefault(n, [0, 0.0, 0.0])
            g[0] += 1
            g[1] += _num(r, SAMPLES)
            g[2] += n
    return sorted(((n, tuple(g)) for n, g in groups.items()), key=lambda item: -item[1][1])


def report(name: str, rows: list[dict], top: int) -> str:
    executed, wavefronts, ideal, samples, stalls = Counter(), Counter(), Counter(), Counter(), Counter()
    for r in rows:
        op = opcode(r["Source"])
        executed[op] += _num(r, "Instructions Executed")
        wavefronts[op] += _num(r, "L1 Wavefronts Shared")
        ideal[op] += _num(r, "L1 Wavefronts Shared Ideal")
        samples[op] += _num(r, SAMPLES)
        for key in r:
            if key.startswith("stall_") and "Not Issued" not in key:
                stalls[key[6:]] += _num(r, key)
    total, sampled = sum(executed.values()) or 1, sum(samples.values()) or 1
    out = [f"== {name[:100]}", f"instructions executed {total:.4g}, stall samples {sampled:.0f}"]
    for op, n in executed.most_common(top):
        smem = f"  smem wavefronts {wavefronts[op]:.3g} (ideal {ideal[op]:.3g})" if wavefronts[op] else ""
        out.append(f"  {op:12s} {n:11.4g} {100 * n / total:5.1f}%  stalls {100 * samples[op] / sampled:5.1f}%{smem}")
    out.append("  stall reasons: " + ", ".join(f"{k} {100 * v / sampled:.1f}%" for k, v in stalls.most_common(8)))
    hmma = max((_num(r, "Instructions Executed") for r in rows if "MMA" in opcode(r["Source"])), default=0)
    if hmma:
        per_iter = Counter()
        for r in rows:
            n = _num(r, "Instructions Executed")
            if n >= 0.45 * hmma:  # both sides of a per-warpgroup branch run half as often
                per_iter[opcode(r["Source"])] += n / hmma
        out.append(f"  one hot-loop iteration per warp: {sum(per_iter.values()):.0f} instructions: "
                   + ", ".join(f"{k} {v:.0f}" for k, v in per_iter.most_common(top)))
    out.append("  stall samples by execution count (code run equally often: a hot loop's body, a tile's "
               "prologue and epilogue, ...):")
    for count, (n_instr, share, issued) in by_count(rows)[:6]:
        out.append(f"    x{count:<9.4g} {n_instr:5d} instructions  {100 * share / sampled:5.1f}% of stall samples, "
                   f"{100 * issued / total:5.1f}% of instructions executed")
    out.append("  top stall sites:")
    for r in sorted(rows, key=lambda r: -_num(r, SAMPLES))[:12]:
        reason = max(((_num(r, k), k[6:]) for k in r if k.startswith("stall_") and "Not Issued" not in k),
                     default=(0, ""))[1]
        out.append(f"    {r['Address'][-5:]} {100 * _num(r, SAMPLES) / sampled:5.1f}% {reason:14s} "
                   f"x{_num(r, 'Instructions Executed'):9.3g}  {r['Source'].strip()[:70]}")
    return "\n".join(out)


def opcode_deltas(found: list[tuple[str, list[dict]]], top: int) -> str:
    """Markdown: each opcode's stall samples per kernel, as shares of the first kernel's samples, and each later
    kernel's difference to the first (first minus it: positive where the first kernel stalls more), the `top`
    largest absolute differences (against the second kernel) first; the first row sums every opcode."""
    per_kernel = [by_opcode(rows, SAMPLES) for _, rows in found]
    base = sum(per_kernel[0].values()) or 1
    ops = set().union(*per_kernel)
    ranked = sorted(ops, key=lambda op: (-abs(per_kernel[0][op] - per_kernel[1][op]), op))[:top]
    labels = [f"k{i + 1}" for i in range(len(found))]
    out = [f"{label} = {name.removeprefix('kernel_cutlass_kernel_')[:90]}" for label, (name, _) in zip(labels, found)]
    out += ["", "| opcode | " + " | ".join(labels) + " | " + " | ".join(f"k1 - {k}" for k in labels[1:]) + " |",
            "|---" * (2 * len(found)) + "|"]

    def row(label, values):
        shares = [100 * v / base for v in values]
        return (f"| {label} | " + " | ".join(f"{v:.1f}%" for v in shares) + " | "
                + " | ".join(f"{shares[0] - v:+.1f}%" for v in shares[1:]) + " |")

    out.append(row("(all)", [sum(k.values()) for k in per_kernel]))
    for op in ranked:
        out.append(row(op, [k[op] for k in per_kernel]))
    return "\n".join(out)


# a details-page kernel header: "  <name> (grid)x(block), Context 1, Stream 7, Device 0, CC 9.0"
_KERNEL_LINE = re.compile(r"^  (\S+) \([\d, ]+\)x\([\d, ]+\), Context")
# a metric row: name, unit (absent for counts such as Block Size), value
# (one space only between unit and value when the value is wide: "SM Active Cycles   cycle 1,046,385.94")
_METRIC_LINE = re.compile(r"^ {4}(\S.*?) {2,}(?:(\S+) +)?([\d,]+(?:\.\d+)?)\s*$")
DETAILS = (("Duration", "duration"), ("SM Frequency", "sm_ghz"), ("Elapsed Cycles", "cycles"),
           ("SM Active Cycles", "active_cycles"),
           ("DRAM Throughput", "dram_pct"), ("L2 Cache Throughput", "l2_pct"),
           ("Compute (SM) Throughput", "compute_pct"), ("Registers Per Thread", "registers"))


def details(text: str) -> list[tuple[str, dict[str, float]]]:
    """(kernel name, {field: value}) per kernel of a details-page export, the fields of DETAILS that it holds
    (duration in µs whatever unit ncu printed)."""
    names = dict(DETAILS)
    out: list[tuple[str, dict[str, float]]] = []
    for line in text.splitlines():
        head = _KERNEL_LINE.match(line)
        if head:
            out.append((head.group(1), {}))
            continue
        row = _METRIC_LINE.match(line)
        if not out or not row or row.group(1) not in names or names[row.group(1)] in out[-1][1]:
            continue
        value = float(row.group(3).replace(",", ""))
        if row.group(1) == "Duration":
            value *= {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}.get(row.group(2) or "us", 1.0)
        out[-1][1][names[row.group(1)]] = value
    return out


def details_table(found: list[tuple[str, dict[str, float]]]) -> str:
    """A markdown table of `details`, each kernel's elapsed cycles over the first kernel's."""
    def cell(d: dict[str, float], key: str, fmt: str) -> str:
        return format(d[key], fmt) if key in d else "-"

    lines = ["| kernel | duration (µs) | SM clock (GHz) | elapsed cycles | cycles / first | SM-active cycles | SMs idle | "
             "DRAM % | L2 % | compute % | registers |", "|---" * 11 + "|"]
    first = found[0][1].get("cycles") if found else None
    for name, d in found:
        ratio = f"{d['cycles'] / first:.3f}" if first and "cycles" in d else "-"
        idle = f"{100 * (1 - d['active_cycles'] / d['cycles']):.1f}%" if d.get("cycles") and "active_cycles" in d else "-"
        short = name.removeprefix("kernel_cutlass_kernel_")[:50]
        lines.append(f"| {short} | {cell(d, 'duration', ',.2f')} | {cell(d, 'sm_ghz', '.2f')} | "
                     f"{cell(d, 'cycles', ',.0f')} | {ratio} | {cell(d, 'active_cycles', ',.0f')} | {idle} | "
                     f"{cell(d, 'dram_pct', '.1f')} | {cell(d, 'l2_pct', '.1f')} | "
                     f"{cell(d, 'compute_pct', '.1f')} | {cell(d, 'registers', '.0f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", type=Path, nargs="?", help="a source-page CSV export")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--details", type=Path, default=None, help="a details-page text export (see the module doc)")
    ap.add_argument("--stall-ops", metavar="REASON", default=None,
                    help="also sum this stall reason's samples by opcode (e.g. wait, barrier, long_sb, mio)")
    args = ap.parse_args(argv)
    if args.csv is None and args.details is None:
        ap.error("give a source-page CSV export, --details FILE, or both")
    if args.details is not None:
        found = details(read_text(args.details))
        if not found:
            ap.error(f"--details {args.details}: no kernel found (expected `ncu -i ... --page details` output)")
        print(details_table(found))
        print()
    if args.csv is not None:
        found = kernels(read_text(args.csv))
        for name, rows in found:
            print(report(name, rows, args.top))
            if args.stall_ops:
                print(stall_ops(rows, args.stall_ops))
            print()
        if len(found) > 1:
            print("stall samples by opcode, as shares of the first kernel's samples:")
            print(opcode_deltas(found, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A/B table of tools/bwd_profile.py runs: the backward's main kernel (and the whole backward) of this tree
against a reference, per case, from runs made in separate processes on the GPU machine.

Each process profiles fa4gen's backward and flash-attn-4's side by side. flash-attn-4's main kernel is the same
code in every process, so its time across the processes is the noise floor of the comparison (0.1-0.5% in
sessions 28-29), and each side's main kernel is also given divided by that process's flash-attn-4 kernel,
which cancels a clock that drifted between processes. A side run more than once (ABBA rounds) shows the mean
of its runs and each run's value.

Run anywhere: `python3 tools/profile_compare.py NEW_DIR[,NEW_DIR...] REF_DIR[,REF_DIR...]` (folders holding
bwd_profile.json, e.g. a device call's `--out $OUT/prof_new` and `--out $OUT/prof_ref`); `--markdown FILE`
also writes the table there.
"""

import argparse
import json
from pathlib import Path
from statistics import mean


def main_kernel(times: dict[str, float]) -> float | None:
    """The main backward kernel's µs among one backward's kernels (names as torch.profiler gives them, cut
    to 90 characters by bwd_profile.py): fa4gen's is its generated `bwd_sm90` module's kernel, flash-attn-4's
    `FlashAttentionBackwardSm90`; the preprocess, postprocess and conversion kernels are not it."""
    found = [us for name, us in times.items()
             if ("bwd_sm90" in name or "FlashAttentionBackwardSm90" in name)
             and not any(part in name.lower() for part in ("preprocess", "postprocess", "convert"))]
    if len(found) > 1:
        raise ValueError(f"more than one main backward kernel among {sorted(times)}")
    return found[0] if found else None


def load(folder: Path) -> dict[tuple, dict]:
    """One process's cases keyed by (d, seqlen, causal): fa4gen's and flash-attn-4's main kernel and total µs."""
    rows = json.loads((folder / "bwd_profile.json").read_text())
    out = {}
    for r in rows:
        d = r["d"] if r.get("dv", r["d"]) == r["d"] else f"{r['d']}x{r['dv']}"
        key = (d, str(r["seqlen"]), "y" if r["causal"] else "n")
        case = {}
        for side in ("fa4gen", "fa4"):
            if r.get(side):
                case[side] = (main_kernel(r[side]), sum(r[side].values()))
        out[key] = case
    return out


def compare(new_runs: list[dict], ref_runs: list[dict]) -> list[dict]:
    """Per case present in every run: the mean main kernel and backward total of each side, new / ref raw and
    divided by each process's flash-attn-4 main kernel, and flash-attn-4's spread over all the processes."""
    keys = [k for k in new_runs[0] if all(k in run for run in new_runs + ref_runs)]
    table = []
    for key in keys:
        def side(runs):
            ours = [run[key]["fa4gen"] for run in runs]
            fa4 = [run[key].get("fa4", (None, None))[0] for run in runs]
            rel = [o[0] / f for o, f in zip(ours, fa4) if f]
            return [o[0] for o in ours], mean(o[1] for o in ours), fa4, (mean(rel) if len(rel) == len(ours) else None)
        n_main, n_total, n_fa4, n_rel = side(new_runs)
        r_main, r_total, r_fa4, r_rel = side(ref_runs)
        fa4_all = [f for f in n_fa4 + r_fa4 if f]
        table.append(dict(
            case=key, new_main=n_main, ref_main=r_main, new_total=n_total, ref_total=r_total,
            main_ratio=mean(n_main) / mean(r_main), total_ratio=n_total / r_total,
            rel_ratio=(n_rel / r_rel) if n_rel and r_rel else None,
            fa4_spread=(max(fa4_all) / min(fa4_all) - 1) if fa4_all else None,
        ))
    return table


def markdown(table: list[dict]) -> str:
    def us(values):
        return " / ".join(f"{v:.1f}" for v in values)

    lines = ["| case (d, seqlen, causal) | main kernel new µs | ref µs | new / ref | same, per flash-attn-4 kernel "
             "| whole backward new / ref | flash-attn-4 kernel spread |",
             "|---|---|---|---|---|---|---|"]
    for row in table:
        d, s, c = row["case"]
        rel = f"{row['rel_ratio']:.4f}" if row["rel_ratio"] else "-"
        spread = f"{100 * row['fa4_spread']:.2f}%" if row["fa4_spread"] is not None else "-"
        lines.append(f"| {d}, {s}, {c} | {us(row['new_main'])} | {us(row['ref_main'])} | {row['main_ratio']:.4f} "
                     f"| {rel} | {row['total_ratio']:.4f} | {spread} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("new", help="comma-separated folders with the new tree's bwd_profile.json")
    ap.add_argument("ref", help="comma-separated folders with the reference's bwd_profile.json")
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args(argv)
    new_runs = [load(Path(p)) for p in args.new.split(",")]
    ref_runs = [load(Path(p)) for p in args.ref.split(",")]
    text = markdown(compare(new_runs, ref_runs))
    print(text, end="")
    if args.markdown is not None:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

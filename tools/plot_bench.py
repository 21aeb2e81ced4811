"""Plot a tools/bench_fwd.py JSON as TFLOP/s per seqlen: one column per head dim (DxDV when head_dim_v
differs), a row per (direction, causal) — forward rows always, backward rows (fa4gen, its
deterministic backward when measured, flash-attn-4, cuDNN, SDPA flash) when the run had --bwd.

Run anywhere with matplotlib: `python tools/plot_bench.py docs/perf/X.json [docs/perf/Y.json ...] docs/perf/X.png`.
Several JSON files (e.g. a grid's short and long cells, timed in separate device calls) are drawn as one grid; a
cell in two of them is refused, since two runs' numbers of one cell are not comparable.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FWD = (("fa4gen", "fa4gen"), ("fa4", "flash-attn-4"), ("cudnn", "cuDNN (SDPA)"), ("sdpa_flash", "SDPA flash"))
BWD = (("fa4gen_bwd", "fa4gen"), ("fa4gen_det_bwd", "fa4gen deterministic"), ("fa4_bwd", "flash-attn-4"),
       ("cudnn_bwd", "cuDNN (SDPA)"), ("sdpa_flash_bwd", "SDPA flash"))
# one colour per implementation in every panel
COLORS = {"fa4gen": "C0", "flash-attn-4": "C1", "cuDNN (SDPA)": "C2", "SDPA flash": "C3", "fa4gen deterministic": "C4"}


def dim_label(row: dict) -> str:
    dv = row.get("dv", row["d"])
    return f"d{row['d']}" if dv in (None, row["d"]) else f"d{row['d']}x{dv}"


def panels(rows: list[dict]) -> list[tuple[str, bool, tuple]]:
    """(direction, causal, series) of each plotted row of panels: forward, then backward if measured."""
    out = [("forward", causal, FWD) for causal in (False, True)]
    if any(r.get("fa4gen_bwd") is not None for r in rows):
        out += [("backward", causal, BWD) for causal in (False, True)]
    return out


def merged(srcs: list[str]) -> tuple[list[dict], dict]:
    """The rows of every bench JSON in `srcs` (a run's dict, or a bare list of rows) and the first run's dict (its
    GPU for the title; each run's matmul rate, when measured, under "matmul_runs")."""
    rows, first, seen, matmul = [], None, {}, []
    for src in srcs:
        data = json.loads(open(src).read())
        if isinstance(data, dict):
            first = first or data
            if "matmul_tflops" in data:
                matmul.append(data["matmul_tflops"])
        for r in data["rows"] if isinstance(data, dict) else data:
            cell = (r["d"], r.get("dv") or r["d"], r["causal"], r["seqlen"])
            if cell in seen:
                raise SystemExit(f"plot_bench: the cell d{cell[0]}x{cell[1]} {'causal' if cell[2] else 'no mask'} "
                                 f"s{cell[3]} is in both {seen[cell]} and {src}: plot one run's reading of a cell")
            seen[cell] = src
            rows.append(r)
    meta = dict(first or {})
    meta.pop("matmul_tflops", None)
    if matmul:
        meta["matmul_runs"] = matmul
    return rows, meta


def main(*paths: str) -> None:
    """main(SRC.json [, SRC2.json ...], DST.png)."""
    if len(paths) < 2:
        raise SystemExit("usage: python tools/plot_bench.py BENCH.json [BENCH2.json ...] OUT.png")
    *srcs, dst = paths
    rows, data = merged(srcs)
    dims = sorted({(r["d"], r.get("dv") or r["d"]) for r in rows})
    grid = panels(rows)
    fig, axes = plt.subplots(len(grid), len(dims), figsize=(4.4 * len(dims) + 1, 3.5 * len(grid)),
                             squeeze=False)
    for j, dim in enumerate(dims):
        for i, (direction, causal, series) in enumerate(grid):
            ax = axes[i][j]
            sel = sorted((r for r in rows if (r["d"], r.get("dv") or r["d"]) == dim and r["causal"] == causal),
                         key=lambda r: r["seqlen"])
            seqlens = [r["seqlen"] for r in sel]
            for key, label in series:
                ys = [r.get(key) for r in sel]
                if any(isinstance(y, (int, float)) for y in ys):
                    ax.plot(seqlens, [y if isinstance(y, (int, float)) else None for y in ys], marker="o", label=label,
                            color=COLORS[label])
            ax.set_xscale("log", base=2)
            ax.set_title(f"{direction} {dim_label(sel[0]) if sel else dim}: {'causal' if causal else 'no mask'}")
            ax.set_xlabel("seqlen (batch x seqlen = 16k)")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
            if j == 0:
                ax.legend(fontsize=7)
    title = f"bf16, {data.get('gpu', 'GPU')}"
    if data.get("matmul_runs"):
        # a run of several processes (--processes) lists each process's rate
        runs = [" / ".join(str(x) for x in m) if isinstance(m, list) else str(m) for m in data["matmul_runs"]]
        title += (f"\nbf16 8192^3 matmul {runs[0]} TFLOP/s in the same run" if len(runs) == 1 else
                  f"\nbf16 8192^3 matmul {'; '.join(runs)} TFLOP/s in the {len(runs)} runs drawn")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=100)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Plot a tools/bench_fwd.py JSON as TFLOP/s per seqlen, one panel per (head dim, causal).

Run anywhere with matplotlib: `python tools/plot_bench.py docs/perf/X.json docs/perf/X.png`.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

IMPLS = (("fa4gen", "fa4gen"), ("fa4", "flash-attn-4"), ("cudnn", "cuDNN (SDPA)"), ("sdpa_flash", "SDPA flash"))


def main(src: str, dst: str) -> None:
    data = json.loads(open(src).read())
    rows = data["rows"] if isinstance(data, dict) else data
    dims = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(2, len(dims), figsize=(4.2 * len(dims), 7), sharey=True, squeeze=False)
    for j, d in enumerate(dims):
        for i, causal in enumerate((False, True)):
            ax = axes[i][j]
            sel = [r for r in rows if r["d"] == d and r["causal"] == causal]
            seqlens = [r["seqlen"] for r in sel]
            for key, label in IMPLS:
                ys = [r.get(key) for r in sel]
                if any(y is not None for y in ys):
                    ax.plot(seqlens, ys, marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(f"d{d} {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("seqlen (batch x seqlen = 16k)")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("TFLOP/s")
        axes[1][0].set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=8)
    title = f"forward, bf16, {data.get('gpu', 'GPU')}" if isinstance(data, dict) else "forward, bf16"
    fig.suptitle(title + (f"; bf16 matmul {data['matmul_tflops']} TFLOP/s" if isinstance(data, dict) else ""))
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Per-CTA and per-query-block cost of a backward main kernel, fitted from `tools/bwd_profile.py` rows.

A one-CTA-per-key-block backward runs ceil(s_k / tile_n) x heads x batch CTAs; each visits its query blocks (all
ceil(s_q / tile_m) of them without a mask; causal: the ones at or below its diagonal). With one CTA per SM, the
main kernel takes about (CTAs x P + query blocks x B) / SMs: P is what a CTA costs besides its blocks (launch,
barrier set-up, the first loads, the dK / dV epilogue, the last dQ adds) and B one query block. Rows of one head
dim at several lengths (the FA grid's 16384 tokens, hidden 2048) fit P and B by least squares, for each
implementation the file holds (fa4gen, and flash-attn-4 with the same tiles: its d64 / d128 backward tiles are
fa4gen's). Docs: docs/STATUS.md "Where to start" item 2 (a persistent backward hides P).

    python3 tools/cta_cost.py bwd_profile.json --head-dim 128 [--causal] [--sms 132] [--tile-m 80 --tile-n 128]

Without --tile-m / --tile-n the tiles are fa4gen's plan for the grid's spec (MHA, bf16).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# run as `python3 tools/cta_cost.py` from anywhere: the project root (fa4gen, for the plan's tiles) on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKENS, HIDDEN = 16384, 2048
# the main kernel's name in torch.profiler's rows (tools/bwd_profile.py), per implementation
MAIN_KERNEL = {"fa4gen": "bwd_sm90", "fa4": "FlashAttentionBackwardSm90"}


def work(seqlen: int, head_dim: int, causal: bool, tile_m: int, tile_n: int) -> tuple[int, int]:
    """(CTAs, query blocks over all CTAs) of one grid cell: 16384 / seqlen sequences, 2048 / head_dim heads."""
    pairs = (TOKENS // seqlen) * (HIDDEN // head_dim)
    n_blocks = math.ceil(seqlen / tile_n)
    m_blocks = math.ceil(seqlen / tile_m)
    if not causal:
        return n_blocks * pairs, n_blocks * m_blocks * pairs
    # key block n's query blocks as the kernel ranges them (fa4gen.emulate.tiling mirrors mask.m_block_range)
    from fa4gen.emulate.tiling import m_block_range

    visits = 0
    for n in range(n_blocks):
        lo, hi = m_block_range(n, tile_n, tile_m, seqlen, seqlen, -1, -1, 0, causal=True, local=False, chunked=False)
        visits += max(hi - lo, 0)
    return n_blocks * pairs, visits * pairs


def fit(points: list[tuple[int, int, float]], sms: int) -> tuple[float, float]:
    """P and B (µs) of time = (ctas x P + blocks x B) / sms, least squares over (ctas, blocks, µs) points."""
    if len(points) < 2:
        raise ValueError(f"fitting P and B needs rows at two or more lengths, got {len(points)}")
    a = [(c / sms, b / sms) for c, b, _ in points]
    y = [t for _, _, t in points]
    s11 = sum(x1 * x1 for x1, _ in a)
    s12 = sum(x1 * x2 for x1, x2 in a)
    s22 = sum(x2 * x2 for _, x2 in a)
    t1 = sum(x1 * t for (x1, _), t in zip(a, y))
    t2 = sum(x2 * t for (_, x2), t in zip(a, y))
    det = s11 * s22 - s12 * s12
    if abs(det) < 1e-12 * max(s11 * s22, 1e-30):
        raise ValueError("the rows do not separate P from B (the same blocks per CTA at every length)")
    return (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det


def main_kernel_us(times: dict[str, float], impl: str) -> float:
    names = [k for k in times if MAIN_KERNEL[impl] in k]
    if len(names) != 1:
        raise ValueError(f"{impl}: expected one main kernel named like {MAIN_KERNEL[impl]!r}, found {names}")
    return times[names[0]]


def plan_tiles(head_dim: int, causal: bool) -> tuple[int, int]:
    """fa4gen's backward tiles for the grid's spec (MHA, bf16, this mask)."""
    from fa4gen.plan import plan_kernels
    from fa4gen.spec import spec_from_dict

    spec = spec_from_dict(dict(name="cta_cost", targets=["sm90"], dtype="bf16", head_dim=head_dim, backward=True,
                               allow_gqa=False, mask={"kind": "causal" if causal else "none"}))
    bwd = next(p for p in plan_kernels(spec, "sm90") if p.direction == "bwd")
    return bwd.tile_m, bwd.tile_n


def run(rows: list[dict], head_dim: int, causal: bool, sms: int, tile_m: int, tile_n: int) -> dict[str, dict]:
    """{implementation: {"P_us", "B_us", "points": [(seqlen, ctas, blocks, µs, P share of a CTA)]}}."""
    rows = [r for r in rows if r["d"] == head_dim and r["dv"] == head_dim and r["causal"] == causal
            and not str(r["seqlen"]).startswith("v")]
    out = {}
    for impl in MAIN_KERNEL:
        have = [r for r in rows if impl in r]
        if not have:
            continue
        points = []
        for r in have:
            s = int(r["seqlen"])
            ctas, blocks = work(s, head_dim, causal, tile_m, tile_n)
            points.append((s, ctas, blocks, main_kernel_us(r[impl], impl)))
        p, b = fit([(c, k, t) for _, c, k, t in points], sms)
        out[impl] = {"P_us": p, "B_us": b,
                     "points": [(s, c, k, t, p / (p + b * k / c)) for s, c, k, t in points]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", type=Path, help="bwd_profile.json from tools/bwd_profile.py")
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU that ran the profile (H100 / H200 SXM: 132)")
    ap.add_argument("--tile-m", type=int, default=0)
    ap.add_argument("--tile-n", type=int, default=0)
    args = ap.parse_args(argv)
    if bool(args.tile_m) != bool(args.tile_n):
        ap.error("--tile-m and --tile-n go together")
    tile_m, tile_n = (args.tile_m, args.tile_n) if args.tile_m else plan_tiles(args.head_dim, args.causal)
    try:
        rows = json.loads(args.profile.read_text())
        result = run(rows, args.head_dim, args.causal, args.sms, tile_m, tile_n)
    except (OSError, ValueError, KeyError) as err:
        print(f"cta_cost: {args.profile}: {err}", file=sys.stderr)
        return 2
    if not result:
        print(f"cta_cost: {args.profile}: no rows at head dim {args.head_dim}, causal={args.causal}", file=sys.stderr)
        return 2
    print(f"d{args.head_dim} {'causal' if args.causal else 'no mask'}, tiles {tile_m} x {tile_n}, {args.sms} SMs")
    for impl, r in result.items():
        print(f"  {impl}: P = {r['P_us']:.2f} us per CTA, B = {r['B_us']:.2f} us per query block")
        for s, c, k, t, share in r["points"]:
            print(f"    s{s}: {c} CTAs, {k / c:.1f} blocks each, main kernel {t:.1f} us, P {100 * share:.0f}% of a CTA")
    return 0


if __name__ == "__main__":
    sys.exit(main())

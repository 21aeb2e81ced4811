"""Two forward kernels of one spec pinned in turn in one process (GPU): TFLOP/s of each, alternated over
rounds, so a dispatch rule can be read without a patch. The spec, the pair count (chunked and windowed calls
exactly) and the timing are bench_fwd.py's (its grid spec of the row, do_bench medians with L2 flushed).

Run (GPU): `python3 tools/pin_ab.py --head-dim 128 (--chunk KEYS | --window LEFT | --mask causal|none) --seqlens
4096,8192 [--rounds 3]`; prints one row per (cell, kernel): TFLOP/s per round and the median, and the first kernel's
median over the second's; the two kernels' outputs of each cell are compared (max |diff| <= 2^-6, else it
stops). E.g. `--mask causal --seqlens 4096,8192,16384` reads the masked d128 persistent forward's
bound (PERSISTENT_MAX_SEQLEN_Q_MASKED: session 64 moved it from 4096 to 8192 on these pins) where causal calls
cross it. Run on the GPU machine after `source tools/device_env.sh` (fa4gen needs its pydantic).
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=None, help="chunked mask of this many keys")
    ap.add_argument("--window", type=int, default=None, metavar="LEFT", help="sliding window (LEFT, 0)")
    ap.add_argument("--mask", choices=("causal", "none"), default=None, help="a causal mask or none instead")
    ap.add_argument("--seqlens", default="4096,8192")
    ap.add_argument("--kernels", default="fwd_sm90,fwd_sm90_long")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if sum(x is not None for x in (args.chunk, args.window, args.mask)) != 1:
        ap.error("give exactly one of --chunk KEYS / --window LEFT / --mask causal|none")
    if args.rounds < 1:
        ap.error("--rounds: expected a positive count")
    kernels = args.kernels.split(",")
    if len(kernels) != 2:
        ap.error(f"--kernels: expected two forward kernels joined by a comma, got {args.kernels!r}")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("pin_ab: needs a CUDA GPU (it times kernels); none is visible here")
    import fa4gen
    from bench_fwd import _causal_keys, _fwd_spec, bench_ms, pass_order

    causal = args.mask != "none"
    tag = args.mask or (f"c{args.chunk}" if args.chunk else f"w{args.window}")
    pkg = fa4gen.build(_fwd_spec(args.head_dim, causal, window=args.window, chunk=args.chunk))
    op = pkg._forward
    d = args.head_dim
    for s in (int(x) for x in args.seqlens.split(",")):
        b, h = max(1, 16384 // s), 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        pairs = _causal_keys(s, args.window, args.chunk) if causal else s * s
        flops = 4 * b * h * pairs * d
        got = {name: [] for name in kernels}
        for r in range(args.rounds):
            for name in pass_order(kernels, r):
                with op.pinned(name):
                    got[name].append(flops / (bench_ms(lambda: pkg.attention(q, k, v)) * 1e-3) / 1e12)
        outs = []
        for name in kernels:  # the two kernels must agree on this call (a pinned kernel off its usual lengths)
            with op.pinned(name):
                outs.append(pkg.attention(q, k, v).float())
        diff = (outs[0] - outs[1]).abs().max().item()
        if not diff <= 2.0**-6:  # (NaN fails too) bf16 outputs of |o| <= 1: the kernels' rounding differs by ulps
            raise SystemExit(f"pin_ab: {kernels[0]} and {kernels[1]} disagree at s{s}: max |diff| {diff:.3g}")
        meds = {name: statistics.median(vals) for name, vals in got.items()}
        for name in kernels:
            print(f"d{d} {tag} s{s} {name:16s} " + " ".join(f"{x:6.1f}" for x in got[name]) + f"  median {meds[name]:6.1f}")
        print(f"d{d} {tag} s{s} {kernels[0]} / {kernels[1]}: {meds[kernels[0]] / meds[kernels[1]]:.3f} "
              f"(outputs agree within {diff:.2g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

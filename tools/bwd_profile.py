"""Where a backward's GPU time goes: every kernel of one autograd backward (fa4gen and, when importable,
flash-attn-4), from torch.profiler, per call. Splits the main kernel from the preprocess, postprocess,
memsets and copies, so a gap to flash-attn-4 can be placed before tuning the main loop.

Run on the GPU machine: `source tools/device_env.sh; python3 tools/bwd_profile.py --cases 128:8192:n,128:2048:n
--out $OUT/profile` (case = d:seqlen:causal y/n; batch 16384/seqlen, heads 2048/d as in bench_fwd.py).
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import fa4gen
from bench_fwd import _bwd_spec, _fa4, _first, _warm_backward

ITERS = 10


def kernel_times(run, q, k, v) -> dict[str, float]:
    """µs per backward of each GPU kernel (by name) that the backward of run(q, k, v) launches."""
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    out = run(qg, kg, vg)
    dout = torch.randn_like(out)
    for _ in range(3):
        out.backward(dout, retain_graph=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            out.backward(dout, retain_graph=True)
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times[ev.name[:90]] += ev.device_time / ITERS
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="128:8192:n,128:2048:n,256:8192:n")
    ap.add_argument("--out", default="bwd_profile_out")
    ap.add_argument("--prebuild", type=int, default=0, metavar="N",
                    help="first compile the cases' fa4gen kernels in N processes (tools/prebuild.py)")
    args = ap.parse_args()
    cases = [(int(d), int(s), c == "y") for d, s, c in (case.split(":") for case in args.cases.split(","))]
    if args.prebuild:
        from prebuild import prebuild

        prebuild([_bwd_spec(d, causal, False) for d, _, causal in cases], args.prebuild)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    fa4 = _fa4()
    result = []
    for d, s, causal in cases:
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        pkg = fa4gen.build(_bwd_spec(d, causal, False))
        _warm_backward(pkg, d)
        impls = {"fa4gen": pkg.attention}
        if fa4 is not None:
            impls["fa4"] = lambda q, k, v: _first(fa4(q, k, v, causal=causal))
        row = {"d": d, "seqlen": s, "causal": causal}
        for name, run in impls.items():
            row[name] = kernel_times(run, q, k, v)
            total = sum(row[name].values())
            print(f"d{d} s{s} causal={causal} {name}: {total:.0f} us per backward")
            for kname, us in row[name].items():
                print(f"    {us:9.1f} us  {100 * us / total:5.1f}%  {kname}")
        result.append(row)
        # after every case, so a device call stopped by its time limit still returns the finished ones
        (out_dir / "bwd_profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Where a backward's GPU time goes: every kernel of one autograd backward (fa4gen and, when importable,
flash-attn-4), from torch.profiler, per call. Splits the main kernel from the preprocess, postprocess,
memsets and copies, so a gap to flash-attn-4 can be placed before tuning the main loop.

Run on the GPU machine: `source tools/device_env.sh; python3 tools/bwd_profile.py --cases 128:8192:n,128:2048:n
--out $OUT/profile` (case = d:seqlen:causal y/n, d as D or DxDV (head_dim x head_dim_v, e.g. 192x128:16384:y);
batch 16384/seqlen, heads 2048/d as in bench_fwd.py).
A seqlen written vLO-HI (e.g. 128:v128-1024:y) profiles a varlen backward instead: 16384 tokens packed from
the sequence lengths tools/bench_varlen.py draws for that range, MHA, flash-attn-4's varlen function beside it.
"""

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import fa4gen
from bench_fwd import _bwd_spec, _fa4, _first, _warm_backward
from bench_varlen import TOKENS, lengths, packed_kwargs

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


def _spec(d: int, dv: int, s: str, causal: bool) -> dict:
    """The fa4gen backward spec of a case: bench_fwd.py's, or with a varlen seqlen (vLO-HI) bench_varlen.py's."""
    if not s.startswith("v"):
        return _bwd_spec(d, causal, False, dv=dv)
    return dict(name=f"bench_varlen_bwd_d{d}_{'causal' if causal else 'full'}", targets=["sm90"], dtype="bf16",
                head_dim=d, varlen=True, backward=True, allow_gqa=False, mask={"kind": "causal" if causal else "none"})


def _cases(text: str) -> list[tuple[int, int, str, bool]]:
    """--cases: comma list of d:seqlen:causal (d as D or DxDV, seqlen N or vLO-HI, causal y/n) as
    (d, dv, seqlen, causal); a bad case exits naming it."""
    cases = []
    for case in (c.strip() for c in text.split(",") if c.strip()):
        m = re.fullmatch(r"(\d+)(?:x(\d+))?:(\d+|v\d+-\d+):([yn])", case)
        if m is None:
            raise SystemExit(f"--cases: expected d:seqlen:causal (e.g. 128:8192:n, 192x128:16384:y, 64:v128-1024:y), "
                             f"got {case!r}")
        d, dv, s, causal = int(m[1]), int(m[2] or m[1]), m[3], m[4] == "y"
        if s.startswith("v") and dv != d:
            raise SystemExit(f"--cases: {case!r}: varlen cases take one head dim (D), not DxDV")
        cases.append((d, dv, s, causal))
    return cases


def _fa4_varlen():
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except Exception as err:  # noqa: BLE001
        print(f"flash-attn-4 not importable: {err}")
        return None
    return flash_attn_varlen_func


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="128:8192:n,128:2048:n,256:8192:n")
    ap.add_argument("--out", default="bwd_profile_out")
    ap.add_argument("--prebuild", type=int, default=0, metavar="N",
                    help="first compile the cases' fa4gen kernels in N processes (tools/prebuild.py)")
    args = ap.parse_args()
    cases = _cases(args.cases)
    if args.prebuild:
        from prebuild import prebuild

        prebuild([_spec(d, dv, s, causal) for d, dv, s, causal in cases], args.prebuild)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    fa4 = _fa4()
    result = []
    for d, dv, s, causal in cases:
        pkg = fa4gen.build(_spec(d, dv, s, causal))
        h = 2048 // d
        if s.startswith("v"):
            lo, hi = (int(x) for x in s[1:].split("-"))
            lens = lengths(d + int(causal), lo, hi)  # the draw bench_varlen.py makes for this row
            q, k, v = (torch.randn(TOKENS, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            kw = packed_kwargs(lens)
            impls = {"fa4gen": lambda q, k, v: pkg.attention(q, k, v, **kw)}
            fa4v = _fa4_varlen()
            if fa4v is not None:
                impls["fa4"] = lambda q, k, v: _first(fa4v(q, k, v, causal=causal, **kw))
        else:
            q, k, v = (torch.randn(16384 // int(s), int(s), h, w, device="cuda", dtype=torch.bfloat16) for w in (d, d, dv))
            impls = {"fa4gen": pkg.attention}
            if fa4 is not None:
                impls["fa4"] = lambda q, k, v: _first(fa4(q, k, v, causal=causal))
            _warm_backward(pkg, d, dv)  # (varlen: kernel_times' first, unprofiled backwards load the kernels)
        row = {"d": d, "dv": dv, "seqlen": s, "causal": causal}
        label = f"d{d}" if dv == d else f"d{d}x{dv}"
        for name, run in impls.items():
            row[name] = kernel_times(run, q, k, v)
            total = sum(row[name].values())
            print(f"{label} s{s} causal={causal} {name}: {total:.0f} us per backward")
            for kname, us in row[name].items():
                print(f"    {us:9.1f} us  {100 * us / total:5.1f}%  {kname}")
        result.append(row)
        # after every case, so a device call stopped by its time limit still returns the finished ones
        (out_dir / "bwd_profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

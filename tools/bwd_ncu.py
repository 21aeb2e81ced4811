"""One autograd backward of fa4gen and of flash-attn-4 on the same inputs, for Nsight Compute to read
(the hardware counters of both main kernels side by side). Run on the GPU machine:

    source tools/device_env.sh
    ncu --clock-control none -k regex:'FlashBwdSm90|FlashAttentionBackwardSm90' -c 2 \
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \
        --section ComputeWorkloadAnalysis --section LaunchStats python3 tools/bwd_ncu.py 128 8192 n

Arguments: head dim, seqlen, causal y/n (batch 16384/seqlen, heads 2048/d as in bench_fwd.py). Each
implementation runs one backward (compiled on its first call, before its kernels launch), so `-c 2`
profiles fa4gen's main kernel, then flash-attn-4's.
"""

import sys

import torch

import fa4gen
from bench_fwd import _bwd_spec, _fa4, _first


def main():
    d, s, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "y"
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    pkg = fa4gen.build(_bwd_spec(d, causal, False))
    fa4 = _fa4()
    runs = [pkg.attention] + ([lambda q, k, v: _first(fa4(q, k, v, causal=causal))] if fa4 is not None else [])
    for run in runs:
        out = run(q, k, v)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()

"""One autograd backward of fa4gen and of flash-attn-4 on the same inputs, for Nsight Compute to read
(the hardware counters of both main kernels side by side). Run on the GPU machine:

    source tools/device_env.sh
    ncu --clock-control none -k regex:'FlashBwdSm90|FlashAttentionBackwardSm90' -c 2 \
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \
        --section ComputeWorkloadAnalysis --section LaunchStats python3 tools/bwd_ncu.py 128 8192 n

Arguments: head dim, seqlen, causal y/n [--swap] [--fwd] (batch 16384/seqlen, heads 2048/d as in
bench_fwd.py). Each implementation runs one backward (compiled on its first call, before its kernels
launch), so `-c 2` profiles fa4gen's main kernel, then flash-attn-4's (`--swap -c 3`: fa4gen's, its Sᵀ
variant's, flash-attn-4's). For the per-instruction view add `--section SourceCounters --page source
--csv --print-source sass > ncu.csv` and read it with `python3 tools/ncu_compare.py ncu.csv`.
`--fwd` runs one forward of each instead (profile with -k regex:'FlashFwdSm90|FlashAttentionForwardSm90').
"""

import sys

import torch

import fa4gen
from bench_fwd import _bwd_spec, _fa4, _first, _fwd_spec


def main():
    d, s, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "y"
    fwd = "--fwd" in sys.argv[4:]  # forwards only: fa4gen's forward kernel, then flash-attn-4's
    swap = "--swap" in sys.argv[4:]  # also fa4gen's Sᵀ backward (pipeline.bwd_swap_ab), profiled second
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=not fwd) for _ in range(3))
    if fwd:
        pkg = fa4gen.build(_fwd_spec(d, causal))
        pkg.attention(q, k, v)
        fa4 = _fa4()
        if fa4 is not None:
            fa4(q, k, v, causal=causal)
        torch.cuda.synchronize()
        return
    runs = [fa4gen.build(_bwd_spec(d, causal, False)).attention]
    if swap:
        runs.append(fa4gen.build(_bwd_spec(d, causal, False, swap_ab=True)).attention)
    fa4 = _fa4()
    if fa4 is not None:
        runs.append(lambda q, k, v: _first(fa4(q, k, v, causal=causal)))
    for run in runs:
        out = run(q, k, v)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()

"""One autograd backward of fa4gen and of flash-attn-4 on the same inputs, for Nsight Compute to read
(the hardware counters of both main kernels side by side). Run on the GPU machine:

    source tools/device_env.sh
    ncu --clock-control none -k regex:'FlashBwdSm90|FlashAttentionBackwardSm90' -c 2 \
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \
        --section ComputeWorkloadAnalysis --section LaunchStats python3 tools/bwd_ncu.py 128 8192 n

Arguments: head dim (D or DxDV, e.g. 192x128), seqlen, causal y/n [--swap] [--det] [--fwd] [--cudnn] [--gqa] (batch
16384/seqlen, heads 2048/D as in bench_fwd.py; `--gqa`: a quarter as many key/value heads, Llama's ratio, and fa4gen's
backward compiled with allow_gqa, so its GQA kernel runs). Each implementation runs one backward (compiled on its first call, before its kernels
launch), so `-c 2` profiles fa4gen's main kernel, then flash-attn-4's (`--swap -c 3`: fa4gen's, its Sᵀ
variant's, flash-attn-4's). For the per-instruction view add `--section SourceCounters --page source
--csv --print-source sass > ncu.csv` and read it with `python3 tools/ncu_compare.py ncu.csv`.
`--det` adds fa4gen's deterministic backward after the default one (`-c 3`: fa4gen's, its deterministic
one's, flash-attn-4's; with --swap too, `-c 4`). `--cudnn` adds torch SDPA's cuDNN attention last (forward or
backward; its kernels are named by cuDNN, e.g. `-k regex:'FlashFwdSm90|FlashAttentionForwardSm90|cudnn|sdpa|fmha'`
with one more in `-c`; the kernel names to match are in ncu's own listing without -k). `--fwd` runs one forward of each instead (profile with -k regex:'FlashFwdSm90|FlashAttentionForwardSm90').
A seqlen written vLO-HI (e.g. `64 v512-512 n`) runs the varlen backward instead, on the packing
tools/bwd_profile.py and tools/bench_varlen.py use (16384 tokens, MHA), with flash-attn-4's varlen function;
`--dense` adds fa4gen's dense backward on the same tokens as batch 16384 / HI sequences of HI (meaningful
when LO = HI), profiled second (`-c 3`: fa4gen varlen, fa4gen dense, flash-attn-4 varlen).
"""

import os
import sys

import torch

import fa4gen
from bench_fwd import _bwd_spec, _fa4, _first, _fwd_spec, _sdpa, _sdpa_bshd


def main():
    if "CUDA_INJECTION64_PATH" not in os.environ:  # how the Nsight tools load their collector into a process
        # session 36 spent a device call running this alone: it launches each kernel once and reports nothing
        print("bwd_ncu.py: CUDA_INJECTION64_PATH is not set, so no Nsight profiler seems attached and this run only "
              "launches the kernels; profile it with the ncu command line in this file's docstring", file=sys.stderr)
    d, _, dv = sys.argv[1].partition("x")
    if sys.argv[2].startswith("v"):
        return varlen(int(d), sys.argv[2], sys.argv[3] == "y", "--dense" in sys.argv[4:])
    d, s, causal = int(d), int(sys.argv[2]), sys.argv[3] == "y"
    dv = int(dv) if dv else d
    fwd = "--fwd" in sys.argv[4:]  # forwards only: fa4gen's forward kernel, then flash-attn-4's
    swap = "--swap" in sys.argv[4:]  # also fa4gen's Sᵀ backward (pipeline.bwd_swap_ab), profiled second
    det = "--det" in sys.argv[4:]  # also fa4gen's deterministic backward, profiled after the default one
    cudnn = "--cudnn" in sys.argv[4:]  # also torch SDPA's cuDNN attention, profiled last
    gqa = "--gqa" in sys.argv[4:]  # key/value heads = query heads / 4, fa4gen's GQA backward kernel
    if gqa and (fwd or swap or det or cudnn):
        raise SystemExit("--gqa: backward of fa4gen's default kernel and flash-attn-4's only (not with --fwd, --swap, "
                         "--det or --cudnn)")
    b, h = 16384 // s, 2048 // d
    if gqa and h % 4:
        raise SystemExit(f"--gqa: {h} query heads (2048 / {d}) do not split into groups of 4; use a head dim with "
                         "2048 / D divisible by 4 (64, 128, 256)")
    h_kv = h // 4 if gqa else h
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=not fwd)
    k = torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=not fwd)
    v = torch.randn(b, s, h_kv, dv, device="cuda", dtype=torch.bfloat16, requires_grad=not fwd)
    if fwd:
        pkg = fa4gen.build(_fwd_spec(d, causal, dv))
        pkg.attention(q, k, v)
        fa4 = _fa4()
        if fa4 is not None:
            fa4(q, k, v, causal=causal)
        if cudnn:
            _sdpa_bshd(_sdpa("cudnn"), causal)(q, k, v)
        torch.cuda.synchronize()
        return
    runs = [fa4gen.build(_bwd_spec(d, causal, False, dv=dv, gqa=gqa)).attention]
    if swap:
        runs.append(fa4gen.build(_bwd_spec(d, causal, False, swap_ab=True, dv=dv)).attention)
    if det:
        runs.append(fa4gen.build(_bwd_spec(d, causal, True, dv=dv)).attention)
    fa4 = _fa4()
    if fa4 is not None:
        runs.append(lambda q, k, v: _first(fa4(q, k, v, causal=causal)))
    if cudnn:
        runs.append(_sdpa_bshd(_sdpa("cudnn"), causal))
    for run in runs:
        out = run(q, k, v)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()



def varlen(d: int, s: str, causal: bool, dense: bool):
    """One backward of fa4gen's varlen kernels (and with `dense` its dense ones on the same tokens), then
    flash-attn-4's varlen backward, on bwd_profile.py's packing for the case."""
    from bench_varlen import TOKENS, lengths, packed_kwargs
    from bwd_profile import _fa4_varlen, _spec

    lo, hi = (int(x) for x in s[1:].split("-"))
    if dense and (lo != hi or TOKENS % hi):
        raise SystemExit(f"--dense: needs equal sequences that tile the {TOKENS} tokens (vN-N), got {s}")
    lens = lengths(d + int(causal), lo, hi)
    h = 2048 // d
    kw = packed_kwargs(lens)
    q, k, v = (torch.randn(TOKENS, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    pkg = fa4gen.build(_spec(d, s, causal))
    runs = [lambda: pkg.attention(q, k, v, **kw)]
    if dense:
        qd, kd, vd = (t.detach().view(TOKENS // hi, hi, h, d).requires_grad_() for t in (q, k, v))
        dense_attn = fa4gen.build(_spec(d, str(hi), causal)).attention
        runs.append(lambda: dense_attn(qd, kd, vd))
    fa4v = _fa4_varlen()
    if fa4v is not None:
        runs.append(lambda: _first(fa4v(q, k, v, causal=causal, **kw)))
    for run in runs:
        out = run()
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()

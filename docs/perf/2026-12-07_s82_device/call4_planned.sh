#!/usr/bin/env bash
# s82 call 4: main 0f41fd7's kernels traced with one sampled query block per CTA (tools/bwd_timeline.py, branch diag):
# where the deterministic (192, 128) / d128 causal blocks spend the time the default ones do not
source tools/device_env.sh
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
mkdir -p $OUT/tl
tl() { timeout 50 python3 tools/bwd_timeline.py "$@" --out $OUT/tl 2>&1 | grep -v Warning | grep "^|\|sampled" | tail -4 | sed "s/^/$* : /"; }
tl --head-dim 192 --head-dim-v 128 --mask causal --deterministic --seqlens 2048
tl --head-dim 192 --head-dim-v 128 --mask causal --seqlens 2048
tl --head-dim 192 --head-dim-v 128 --mask none --deterministic --seqlens 8192

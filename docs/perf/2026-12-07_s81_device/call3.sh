#!/usr/bin/env bash
# s81 call 3: where the deterministic (192, 128) backward's time goes (traced timelines, det against default), and
# the d128 det / default ratio on this card; ordered by priority, each result written as it comes
source tools/device_env.sh
nvidia-smi --query-gpu=name,power.limit,clocks.sm --format=csv,noheader
mkdir -p $OUT/tl
for cfg in "causal --deterministic" "causal " "none --deterministic" "none "; do
  timeout 60 python3 tools/bwd_timeline.py --head-dim 192 --head-dim-v 128 --mask $cfg --seqlens 2048,8192 --out $OUT/tl 2>&1 | grep -v Warning | tail -5 | tee -a $OUT/tl/summary.txt
done
timeout 150 python3 tools/bench_fwd.py --bwd --deterministic --dims 128 --masks causal,none --seqlens 2048,8192 --prebuild 8 --skip cudnn,sdpa_flash --out $OUT/det128 2>&1 | tail -7

#!/usr/bin/env bash
# s83 call 2: docs/patches 0001 (this tree, branch p0001) against main 330318a (.ab/ref), deterministic backward A/B
source tools/device_env.sh
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
timeout 570 tools/ab_bench.sh run 2 -- --bwd --deterministic --dims 128,192x128 --masks causal,none --seqlens 2048,8192 2>&1 | grep -v Warning | tail -40

#!/usr/bin/env bash
# session 80, call 2: sustained A/Bs of branch s80 against main at the cap
source tools/device_env.sh
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
AB_SCRIPT=sustained_bench.py timeout 250 tools/ab_bench.sh run 2 -- --dims 64 --masks none --seqlens 12288,16384 --skip cudnn --warm 1.5 --seconds 2 2>&1 | tail -8
echo "ab long rc=$?"
AB_SCRIPT=sustained_bench.py timeout 320 tools/ab_bench.sh run 2 -- --dims 64 --masks none --seqlens 2048,4096,8192 --skip cudnn --warm 1.5 --seconds 2 2>&1 | tail -9
echo "ab persistent rc=$?"

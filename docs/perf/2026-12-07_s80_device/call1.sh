#!/usr/bin/env bash
# session 80, call 1: branch s80 (docs/patches 0001 + the kept V descriptor base): GPU tests, the short A/B, cubins
source tools/device_env.sh
python3 -m fa4gen build specs/ > /dev/null
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
timeout 300 tools/gpu_parallel.sh fwd 'python3 -m pytest -q tests/test_gpu_forward.py' golden 'python3 -m fa4gen test specs/vit_encoder.yaml specs/deepseek_mla.yaml specs/gemma2_9b.yaml specs/llama3_8b.yaml'
echo "tests rc=$?"
timeout 190 tools/ab_bench.sh run 2 -- --dims 64 --masks none --seqlens 512,1024,2048 2>&1 | tail -12
echo "ab rc=$?"
timeout 80 tools/gpu_cubins.sh $OUT/cubins.tar -- python3 tools/bench_fwd.py --dims 64 --masks none --seqlens 16384 --skip cudnn,sdpa_flash --out /tmp/x > /dev/null 2>&1
echo "cubins rc=$?"

#!/usr/bin/env bash
# s81 call 1: every GPU suite and every golden test on main HEAD (no kernel change)
source tools/device_env.sh
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
git rev-parse HEAD 2>/dev/null || true
mkdir -p $OUT/gold
( FA4GEN_CACHE_DIR=/tmp/fa4gen_gold timeout 540 python3 -m fa4gen test --all > $OUT/gold/gold.txt 2>&1; echo "gold rc=$?" >> $OUT/gold/gold.txt ) &
gp=$!
timeout 545 tools/split_pytest.sh 7 tests/test_gpu_api.py tests/test_gpu_backward.py tests/test_gpu_compile.py tests/test_gpu_dropin.py tests/test_gpu_forward.py tests/test_gpu_robustness.py tests/test_gpu_switches.py tests/test_gpu_varlen.py tests/test_gpu_specs_cpu.py
echo "split rc=$?"
wait $gp
tail -5 $OUT/gold/gold.txt

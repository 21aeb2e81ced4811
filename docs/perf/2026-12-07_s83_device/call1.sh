#!/usr/bin/env bash
# s83 call 1: traced (192, 128) backward timelines with the sampled query block (tools/bwd_timeline.py, first GPU run of
# session 82's sampled block) for main 330318a (.ab/ref) and this tree (branch p0001 = main + docs/patches 0001, the pass
# warp), then this tree's deterministic backward tests and vit_encoder's golden tests
source tools/device_env.sh
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
cat .ab/ref/COMMIT; git rev-parse HEAD 2>/dev/null
cp -r tools .ab/ref/
tl() {  # side mask seqlens [--deterministic]
  local side=$1 mask=$2 s=$3; shift 3
  local script=tools/bwd_timeline.py; [[ $side != new ]] && script=.ab/$side/tools/bwd_timeline.py
  mkdir -p $OUT/tl_$side
  FA4GEN_CACHE_DIR=/tmp/tl_$side timeout 80 python3 $script --head-dim 192 --head-dim-v 128 --mask $mask "$@" \
    --seqlens $s --out $OUT/tl_$side > $OUT/tl_$side/log_${mask}_${s}_${1:+det}.txt 2>&1
  echo "rc=$?" >> $OUT/tl_$side/log_${mask}_${s}_${1:+det}.txt
  grep -v Warning $OUT/tl_$side/log_${mask}_${s}_${1:+det}.txt | grep "^|\|sampled\|rc=\|Error" | tail -6 | sed "s/^/$side $mask $s $1: /"
}
tl ref causal 2048 --deterministic
tl new causal 2048 --deterministic
tl ref causal 2048
tl ref none 8192 --deterministic
tl new none 8192 --deterministic
mkdir -p $OUT/tests
( FA4GEN_CACHE_DIR=/tmp/fa4gen_gold timeout 200 python3 -m fa4gen test specs/vit_encoder.yaml > $OUT/tests/gold.txt 2>&1; echo "gold rc=$?" >> $OUT/tests/gold.txt ) &
timeout 200 tools/split_pytest.sh 4 tests/test_gpu_backward.py -k det
wait
tail -3 $OUT/tests/gold.txt

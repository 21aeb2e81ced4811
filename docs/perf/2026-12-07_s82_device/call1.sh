#!/usr/bin/env bash
# s82 call 1: the deterministic (192, 128) backward's per-block time in three trees, traced (tools/bwd_timeline.py):
# main a0535bd (.ab/ref), docs/patches 0001 = the next turn peeked (.ab/p1), and this tree p2 = 0001 + the turn passed
# a block late (the landing off the dQ warp's path); then p2's deterministic backward tests and vit_encoder's golden tests
source tools/device_env.sh
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
cat .ab/ref/COMMIT; git rev-parse HEAD 2>/dev/null
cp -r tools .ab/ref/
# p1 = this tree with 0001's template (the only file p2 changes)
mkdir -p .ab/p1 && cp -r fa4gen templates tools .ab/p1/ && cp .ab/p1_bwd.py.j2 .ab/p1/templates/sm90/bwd.py.j2
tl() {  # side mask seqlens
  local script=tools/bwd_timeline.py; [[ $1 != p2 ]] && script=.ab/$1/tools/bwd_timeline.py
  mkdir -p $OUT/tl_$1
  FA4GEN_CACHE_DIR=/tmp/tl_$1 timeout 70 python3 $script --head-dim 192 --head-dim-v 128 --mask $2 --deterministic \
    --seqlens $3 --out $OUT/tl_$1 2>&1 | grep -v Warning | tail -4 | sed "s/^/$1 $2: /"
}
for side in p2 p1 ref; do tl $side causal 2048,8192; done
for side in p2 p1 ref; do tl $side none 8192; done
mkdir -p $OUT/tests
( FA4GEN_CACHE_DIR=/tmp/fa4gen_gold timeout 200 python3 -m fa4gen test specs/vit_encoder.yaml > $OUT/tests/gold.txt 2>&1; echo "gold rc=$?" >> $OUT/tests/gold.txt ) &
timeout 200 tools/split_pytest.sh 4 tests/test_gpu_backward.py -k det
wait
tail -3 $OUT/tests/gold.txt

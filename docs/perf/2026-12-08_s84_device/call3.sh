#!/usr/bin/env bash
# s84 call 3 (run as call2.sh from the checkout root, with mkvariants_s84.py beside it): which part of the deterministic pass slows the consumers? (192, 128) deterministic timelines of main
# (.ab/ref, fence + relaxed add) against three diagnostic trees made on the device by mkvariants_s84.py (never to land):
# v1 no fence (relaxed add), v2 the fence on every second query block only, v4 the next block's counter read after the pass (acquire; a candidate: no atomic outstanding at the fence).
# v5 one fence per two query blocks (even blocks pass with the next odd one; acquire read of the next counter; a candidate).
source tools/device_env.sh
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
cat .ab/ref/COMMIT
cp -r tools .ab/ref/
python3 mkvariants_s84.py || exit 1
for run in "ref causal" "v1 causal" "v2 causal" "v4 causal" "v5 causal" "ref none" "v1 none" "v2 none" "v4 none" "v5 none"; do
  set -- $run
  seq=2048; [[ $2 == none ]] && seq=8192
  mkdir -p $OUT/tl_$1; log=$OUT/tl_$1/log_$2_${seq}_det.txt
  FA4GEN_CACHE_DIR=/tmp/tl_$1 timeout 80 python3 .ab/$1/tools/bwd_timeline.py --head-dim 192 --head-dim-v 128 \
    --mask $2 --deterministic --seqlens $seq --out $OUT/tl_$1 > $log 2>&1; echo "rc=$?" >> $log
  grep "^| [0-9]\|sampled\|rc=[1-9]\|Error" $log | sed "s/^/$run: /"
done
tar czf $OUT/tl.tgz -C $OUT tl_ref tl_v1 tl_v2 tl_v4 tl_v5 && rm -rf $OUT/tl_ref $OUT/tl_v1 $OUT/tl_v2 $OUT/tl_v4 $OUT/tl_v5

#!/usr/bin/env bash
# PLANNED for the next session (not run in s84: no device time left). Carry [".device", ".ab"] with .ab/ref prepared
# from main (`tools/ab_bench.sh prepare main`), run from the checkout root with mkvariants_s84.py copied beside it
# (`cp docs/perf/2026-12-08_s84_device/mkvariants_s84.py .`), ~280 s. The 2 x 2 of session 84's question (docs/PERF.md
# session 84, call 3): does the dQ warp's MEMBAR or its CCTL.IVALL (L1 invalidation) slow the consumers? Deterministic
# (192, 128) timelines of main (.ab/ref: fence = MEMBAR + IVALL, then a relaxed add) against diagnostic trees made on the
# device (never to land): v1 neither (relaxed add), v3 the MEMBAR without the fence's IVALL (a release add), v8 the
# IVALL without a MEMBAR (an acquire load, then a relaxed add); and v6, a correct candidate: one fence per two query
# blocks, the next block's counter read relaxed (docs/PERF.md session 84, call 3's v2 made correct by a one-block lag).
source tools/device_env.sh
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
cat .ab/ref/COMMIT
cp -r tools .ab/ref/
python3 mkvariants_s84.py || exit 1
for run in "ref none" "v1 none" "v3 none" "v8 none" "v6 none" "ref causal" "v1 causal" "v3 causal" "v8 causal" "v6 causal"; do
  set -- $run
  seq=2048; [[ $2 == none ]] && seq=8192
  mkdir -p $OUT/tl_$1; log=$OUT/tl_$1/log_$2_${seq}_det.txt
  FA4GEN_CACHE_DIR=/tmp/tl_$1 timeout 80 python3 .ab/$1/tools/bwd_timeline.py --head-dim 192 --head-dim-v 128 \
    --mask $2 --deterministic --seqlens $seq --out $OUT/tl_$1 > $log 2>&1; echo "rc=$?" >> $log
  grep "^| [0-9]\|sampled\|rc=[1-9]\|Error" $log | sed "s/^/$run: /"
done
tar czf $OUT/tl.tgz -C $OUT tl_ref tl_v1 tl_v3 tl_v8 tl_v6 && rm -rf $OUT/tl_ref $OUT/tl_v1 $OUT/tl_v3 $OUT/tl_v8 $OUT/tl_v6

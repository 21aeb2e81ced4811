#!/usr/bin/env bash
# PLANNED for the next session's first call (s84 had no device time left), ~500 s. Prepare in the checkout:
#   git checkout -b p1 && git am -3 docs/patches/000[12]-*.patch && fa4gen build specs/ && tools/ab_bench.sh prepare main
#   cp docs/perf/2026-12-08_s84_device/mkvariants_s84.py . && tools/device_trim.sh out tests/test_gpu_backward.py
#   (move generated/ but vit_encoder aside if the carry is over 64 MiB), carry [".device", ".ab"].
# The 2 x 2 of session 84's question (docs/PERF.md session 84, call 3): do the dQ warp's MEMBARs or its L1
# invalidations (CCTL.IVALL) slow the deterministic consumers? Deterministic (192, 128) timelines, causal s2k and no mask
# s8k, of main (.ab/ref: an acq_rel fence = MEMBAR + IVALL, a relaxed add, plus the landing wait's IVALL), the patch
# (new: a release add = MEMBAR only, relaxed reads; the landing wait's IVALL stays), v1 (no fence: the landing wait's
# IVALL only; a diagnostic) and v8 (v1 plus an acquire load: two IVALLs, no MEMBAR; a diagnostic); and v6 (one fence
# per two query blocks, relaxed reads; the alternative if the MEMBARs are the cost). Trees v1 / v6 / v8 are made on the
# device by mkvariants_s84.py from .ab/ref. Then the default (non-deterministic) timelines of main and the checkout
# (docs/patches 0002: the dQ claims relaxed, no L1 invalidation per block in the dQ warp; 0001 leaves these kernels
# as main's), and 0001's GPU tests (deterministic backward, vit_encoder's golden tests with their bitwise repeat).
source tools/device_env.sh
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
cat .ab/ref/COMMIT; git rev-parse HEAD 2>/dev/null
cp -r tools .ab/ref/
python3 mkvariants_s84.py || exit 1
for run in "ref none" "new none" "v1 none" "v8 none" "v6 none" "ref causal" "new causal" "v1 causal" "v8 causal" "v6 causal"; do
  set -- $run
  script=tools/bwd_timeline.py; [[ $1 != new ]] && script=.ab/$1/tools/bwd_timeline.py
  seq=2048; [[ $2 == none ]] && seq=8192
  mkdir -p $OUT/tl_$1; log=$OUT/tl_$1/log_$2_${seq}_det.txt
  FA4GEN_CACHE_DIR=/tmp/tl_$1 timeout 80 python3 $script --head-dim 192 --head-dim-v 128 \
    --mask $2 --deterministic --seqlens $seq --out $OUT/tl_$1 > $log 2>&1; echo "rc=$?" >> $log
  grep "^| [0-9]\|sampled\|rc=[1-9]\|Error" $log | sed "s/^/$run: /"
done
for run in "ref none" "new none" "ref causal" "new causal"; do
  set -- $run
  script=tools/bwd_timeline.py; [[ $1 != new ]] && script=.ab/$1/tools/bwd_timeline.py
  seq=2048; [[ $2 == none ]] && seq=8192
  log=$OUT/tl_$1/log_$2_${seq}_default.txt
  FA4GEN_CACHE_DIR=/tmp/tl_$1 timeout 80 python3 $script --head-dim 192 --head-dim-v 128 \
    --mask $2 --seqlens $seq --out $OUT/tl_$1 > $log 2>&1; echo "rc=$?" >> $log
  grep "^| [0-9]\|sampled\|rc=[1-9]\|Error" $log | sed "s/^/$run default: /"
done
tar czf $OUT/tl.tgz -C $OUT tl_ref tl_new tl_v1 tl_v8 tl_v6 && rm -rf $OUT/tl_ref $OUT/tl_new $OUT/tl_v1 $OUT/tl_v8 $OUT/tl_v6
timeout 150 tools/split_pytest.sh 4 tests/test_gpu_backward.py -k det
FA4GEN_CACHE_DIR=/tmp/fa4gen_gold timeout 150 python3 -m fa4gen test specs/vit_encoder.yaml 2>&1 | tail -3

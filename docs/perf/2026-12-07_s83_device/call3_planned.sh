#!/usr/bin/env bash
# s83 call 3 (DIAGNOSTIC): main 330318a's deterministic (192, 128) backward traced with the pass's gpu-scope fence left out
# (.ab/diag: bwd.pass_turn without fence_acq_rel_gpu, never to land; its dQ order is then not guaranteed), against main
# on the same machine: does the fence slow the consumers (their work / after intervals), not just the dQ warp?
# Planned in session 83 (the device had too little time left to start it); run from main's checkout, carry [".device"]
# (~150 s). The diagnostic tree is made on the device: main's fa4gen/templates/tools copied to .ab/diag, its pass_turn's
# fence line dropped (docs/perf/2026-12-07_s83_device/diag_no_fence.diff is the same change)
source tools/device_env.sh
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
mkdir -p .ab/diag && cp -r fa4gen templates tools .ab/diag/
python3 - <<'PY' || exit 1
p = ".ab/diag/fa4gen/device/bwd.py"
s = open(p).read()
old = "    cute.arch.fence_acq_rel_gpu()\n    cute.arch.red(counter, Int32(count)"
assert s.count(old) == 1, "pass_turn changed: update the diagnostic"
open(p, "w").write(s.replace(old, "    cute.arch.red(counter, Int32(count)"))
PY
# each run: the table row and the sampled-block line; the log in $OUT/tl_TREE, its timeline JSON beside it
for run in "diag causal --deterministic" "main causal --deterministic" "diag none --deterministic" "main none"; do
  set -- $run
  script=tools/bwd_timeline.py; [[ $1 == diag ]] && script=.ab/diag/tools/bwd_timeline.py
  seq=2048; [[ $2 == none ]] && seq=8192
  mkdir -p $OUT/tl_$1; log=$OUT/tl_$1/log_$2_${seq}${3:+_det}.txt
  FA4GEN_CACHE_DIR=/tmp/tl_$1 timeout 80 python3 $script --head-dim 192 --head-dim-v 128 --mask $2 $3 --seqlens $seq \
    --out $OUT/tl_$1 > $log 2>&1; echo "rc=$?" >> $log
  grep "^| [0-9]\|sampled\|rc=[1-9]\|Error" $log | sed "s/^/$run: /"
done
# the device returns at most 8 files: the logs and timelines in one archive
tar czf $OUT/tl.tgz -C $OUT tl_diag tl_main && rm -rf $OUT/tl_diag $OUT/tl_main

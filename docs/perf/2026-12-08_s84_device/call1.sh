#!/usr/bin/env bash
# (s84: run as call 1 of session 84, unchanged; docs/PERF.md "Session 84")
# s83's plan for the next session's first call, with docs/patches 0001 (the causal deterministic grid's last group first
# to last) applied in the checkout and main in .ab/ref: here `git checkout -b p1 && git am -3 docs/patches/0001-*.patch
# && fa4gen build specs/ && tools/ab_bench.sh prepare main && tools/device_trim.sh out tests/test_gpu_backward.py`,
# then run with carry [".device", ".ab"] (~300 s). It runs the fence diagnostic on main's code (.ab/diag:
# .ab/ref with bwd.pass_turn's fence dropped, never to land) and the patch's timeline and GPU tests; the A/B
# (docs/patches/README.md) is the next call.
source tools/device_env.sh
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
cat .ab/ref/COMMIT; git rev-parse HEAD 2>/dev/null
cp -r tools .ab/ref/  # the patch leaves tools/ as on main
mkdir -p .ab/diag && cp -r .ab/ref/fa4gen .ab/ref/templates .ab/ref/tools .ab/diag/
python3 - <<'PY' || exit 1
p = ".ab/diag/fa4gen/device/bwd.py"
s = open(p).read()
old = "    cute.arch.fence_acq_rel_gpu()\n    cute.arch.red(counter, Int32(count)"
assert s.count(old) == 1, "pass_turn changed: update the diagnostic"
open(p, "w").write(s.replace(old, "    cute.arch.red(counter, Int32(count)"))
PY
# each run: the table row and the sampled-block line; the log in $OUT/tl_TREE, its timeline JSON beside it
for run in "ref causal --deterministic" "diag causal --deterministic" "new causal --deterministic" \
           "ref none --deterministic" "diag none --deterministic" "ref none"; do
  set -- $run
  script=tools/bwd_timeline.py; [[ $1 != new ]] && script=.ab/$1/tools/bwd_timeline.py
  seq=2048; [[ $2 == none ]] && seq=8192
  mkdir -p $OUT/tl_$1; log=$OUT/tl_$1/log_$2_${seq}${3:+_det}.txt
  FA4GEN_CACHE_DIR=/tmp/tl_$1 timeout 80 python3 $script --head-dim 192 --head-dim-v 128 --mask $2 $3 --seqlens $seq \
    --out $OUT/tl_$1 > $log 2>&1; echo "rc=$?" >> $log
  grep "^| [0-9]\|sampled\|rc=[1-9]\|Error" $log | sed "s/^/$run: /"
done
# the device returns at most 8 files: the logs and timelines in one archive
tar czf $OUT/tl.tgz -C $OUT tl_ref tl_diag tl_new && rm -rf $OUT/tl_ref $OUT/tl_diag $OUT/tl_new
timeout 240 tools/split_pytest.sh 4 tests/test_gpu_backward.py -k "det or last_group"

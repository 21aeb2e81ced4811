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
tl() {  # side mask seqlens [--deterministic]
  local side=$1 mask=$2 s=$3; shift 3
  local script=tools/bwd_timeline.py; [[ $side != main ]] && script=.ab/$side/tools/bwd_timeline.py
  mkdir -p $OUT/tl_$side
  FA4GEN_CACHE_DIR=/tmp/tl_$side timeout 80 python3 $script --head-dim 192 --head-dim-v 128 --mask $mask "$@" \
    --seqlens $s --out $OUT/tl_$side > $OUT/tl_$side/log_${mask}_${s}_${1:+det}.txt 2>&1
  echo "rc=$?" >> $OUT/tl_$side/log_${mask}_${s}_${1:+det}.txt
  grep -v Warning $OUT/tl_$side/log_${mask}_${s}_${1:+det}.txt | grep "^| [0-9]\|sampled\|rc=[1-9]\|Error" | tail -4 | sed "s/^/$side $mask $s $1: /"
}
tl diag causal 2048 --deterministic
tl main causal 2048 --deterministic
tl diag none 8192 --deterministic
tl main none 8192
# the device returns at most 8 files: the logs and timelines in one archive
tar czf $OUT/tl.tgz -C $OUT tl_diag tl_main && rm -rf $OUT/tl_diag $OUT/tl_main

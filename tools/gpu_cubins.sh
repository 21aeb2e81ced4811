#!/usr/bin/env bash
# On the GPU machine: run a command that compiles kernels (a benchmark of one cell) and keep the cubins the GPU's own
# toolchain built, flash-attn-4's and fa4gen's, in one tar for tools/fa4_sass_cpu.py --cubins here. The GPU image's
# CuTe-DSL is the cu13 build and this machine's the cu12 one, whose ptxas lays the same kernel out otherwise (session
# 77), so a GPU kernel's SASS is read from these.
#
#   source tools/device_env.sh; tools/gpu_cubins.sh $OUT/cubins.tar -- python3 tools/bench_fwd.py --dims 64 \
#       --masks none --seqlens 16384 --skip cudnn,sdpa_flash --out /tmp/x
#   here: PYTHONPATH=. python tools/fa4_sass_cpu.py --cubins cubins.tar --cycles --ops 12 --bodies /tmp/loops
#
# The command runs with CUTE_DSL_KEEP=cubin and CUTE_DSL_DUMP_DIR (flash-attn-4 writes its cubins there; its own disk
# cache is turned off, else a kernel it compiled before is loaded and nothing is written: session 78's first try)
# and a fresh FA4GEN_CACHE_DIR (fa4gen's compile ignores CUTE_DSL_KEEP; its cache artifacts embed the cubin). The
# files go into the tar flat, fa4gen's named by their cache entry: the device tool returns at most 8 files from $OUT,
# none deeper than two folders. Exits non-zero when the command fails or left no cubin.
set -euo pipefail
out=${1:?usage: tools/gpu_cubins.sh OUT.tar -- COMMAND...}
shift
[[ ${1:-} == -- ]] || { echo "gpu_cubins: expected -- before the command" >&2; exit 2; }
shift
(( $# )) || { echo "gpu_cubins: no command after --" >&2; exit 2; }
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_cubins.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/dump" "$work/cache" "$work/flat"
rc=0
CUTE_DSL_KEEP=cubin CUTE_DSL_DUMP_DIR="$work/dump" FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0 \
  FA4GEN_CACHE_DIR="$work/cache" "$@" || rc=$?
if (( rc )); then echo "gpu_cubins: the command exited $rc" >&2; fi
n=0
while IFS= read -r -d '' f; do
  cp "$f" "$work/flat/"; n=$((n + 1))
done < <(find "$work/dump" -name '*.cubin' -print0)
while IFS= read -r -d '' f; do
  entry=$(basename "$(dirname "$f")")
  cp "$f" "$work/flat/fa4gen_${entry:0:16}_$(basename "$f")"; n=$((n + 1))
done < <(find "$work/cache" -name 'artifact*.o' -print0)
if (( n == 0 )); then
  echo "gpu_cubins: the command left no cubin in $work/dump and no artifact*.o in $work/cache" >&2
  exit 1
fi
mkdir -p "$(dirname "$out")"
tar cf "$out" -C "$work/flat" .
echo "gpu_cubins: $n file(s) in $out:"
ls -1 "$work/flat" | sed 's/^/  /'
exit "$rc"

#!/usr/bin/env bash
# Run several commands side by side on the lent GPU machine (GPU test suites, `fa4gen test`), each with its
# own compile cache and log, wait for exactly those processes, then print each one's last lines and its exit
# status. Session 19 waited with `while pgrep -f pytest`, which matched the device call's own shell (its
# command line names pytest) and spun until the call's 600 s limit: this waits on the PIDs it started.
#
#   source tools/device_env.sh; tools/gpu_parallel.sh NAME 'COMMAND' [NAME 'COMMAND' ...]
#
# NAME: letters, digits, '_', '-' (the log is NAME.txt). Logs go to $OUT/gpu_parallel/ when $OUT is set
# (packed into $OUT/gpu_parallel.tgz at the end: a device call returns at most 8 files), else to
# ./out/gpu_parallel/. FA4GEN_CACHE_DIR is /tmp/fa4gen_par_NAME for each command (compiles in parallel
# processes must not share a cache directory being written). GPU_PARALLEL_TAIL lines of each log are
# printed (default 3). The exit status is the number of commands that failed (0 when all passed).
set -uo pipefail
if (( $# == 0 || $# % 2 )); then
  echo "usage: tools/gpu_parallel.sh NAME 'COMMAND' [NAME 'COMMAND' ...]" >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
logs=${OUT:+$OUT/gpu_parallel}
logs=${logs:-$root/out/gpu_parallel}
mkdir -p "$logs"
names=() pids=()
while (( $# )); do
  name=$1 cmd=$2
  shift 2
  if [[ ! $name =~ ^[A-Za-z0-9_-]+$ ]]; then
    echo "gpu_parallel: NAME '$name': use letters, digits, '_' or '-'" >&2
    exit 2
  fi
  for seen in "${names[@]}"; do
    [[ $seen == "$name" ]] && { echo "gpu_parallel: NAME '$name' given twice" >&2; exit 2; }
  done
  (cd "$root" && FA4GEN_CACHE_DIR=/tmp/fa4gen_par_$name bash -c "$cmd") > "$logs/$name.txt" 2>&1 &
  names+=("$name") pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  rc=$?
  (( rc )) && failed=$((failed + 1))
  echo "== ${names[$i]}: exit $rc"
  tail -n "${GPU_PARALLEL_TAIL:-3}" "$logs/${names[$i]}.txt"
done
if [[ -n "${OUT:-}" ]]; then
  tar czf "$OUT/gpu_parallel.tgz" -C "$OUT" gpu_parallel && rm -rf "$logs"
fi
exit "$failed"

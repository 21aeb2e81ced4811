#!/usr/bin/env bash
# One Nsight Compute reading of a benchmark cell on the lent GPU machine: fa4gen's kernel beside flash-attn-4's
# (and, with --cudnn, torch SDPA's cuDNN one) as tools/bwd_ncu.py launches them, profiled once with the sections
# the session-59 comparisons used, then both pages exported and read by tools/ncu_compare.py.
#
#   source .device/setup.sh; source tools/device_env.sh
#   tools/ncu_cell.sh NAME BWD_NCU_ARGS...        e.g.  tools/ncu_cell.sh bwd128 128 2048 y
#                                                        tools/ncu_cell.sh fwd128 128 512 y --fwd --cudnn
#
# Writes under $OUT (else ./out/ncu/): NAME_log.txt (ncu's own output), NAME_details.txt (the details page),
# NAME_cycles.md (`ncu_compare.py --details`: duration, clock, elapsed cycles and their ratio to fa4gen's, DRAM / L2
# / compute throughput), NAME_compare.txt (the source-page reading) and NAME_src.csv.xz (the source page); prints
# the cycle table. Kernels: fa4gen's forward or backward main kernel, flash-attn-4's, and with --cudnn cuDNN's (one
# more kernel; ncu's -c counts them). NCU_TIMEOUT (seconds, default 240) bounds the profiled run.
# NCU_CELL_SECTIONS=light profiles only the Speed Of Light and launch sections (elapsed and SM-active cycles,
# registers: what a cycle A/B reads, tools/ncu_ab.sh) and writes NAME_log.txt, NAME_details.txt and NAME_cycles.md
# only: the source counters cost most of the replay passes.
set -euo pipefail
if (( $# < 4 )); then
  echo "usage: tools/ncu_cell.sh NAME D SEQLEN y|n [--fwd] [--cudnn] [--swap] [--det] [--gqa] (tools/bwd_ncu.py's arguments)" >&2
  exit 2
fi
name=$1
shift
if [[ ! $name =~ ^[A-Za-z0-9_-]+$ ]]; then
  echo "ncu_cell: NAME '$name': use letters, digits, '_' or '-'" >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/out/ncu}
mkdir -p "$out"
command -v ncu > /dev/null || { echo "ncu_cell: no ncu on PATH (source tools/device_env.sh on the GPU machine)" >&2; exit 2; }
# the kernels bwd_ncu.py launches: fa4gen's and flash-attn-4's, one more for each of --swap / --det / --cudnn
kernels='FlashBwdSm90|FlashAttentionBackwardSm90' extra='' count=2
for arg in "$@"; do
  case $arg in
    --fwd) kernels='FlashFwdSm90|FlashAttentionForwardSm90' ;;
    --swap|--det) count=$((count + 1)) ;;
    --cudnn) extra='|cudnn|sdpa|fmha' count=$((count + 1)) ;;
  esac
done
kernels+=$extra
report=$(mktemp -d)/report
sections=(--section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy
  --section SourceCounters --section InstructionStats --section MemoryWorkloadAnalysis_Tables)
case ${NCU_CELL_SECTIONS:-full} in
  full) ;;
  light) sections=(--section SpeedOfLight --section LaunchStats) ;;
  *) echo "ncu_cell: NCU_CELL_SECTIONS '$NCU_CELL_SECTIONS': expected full or light" >&2; exit 2 ;;
esac
timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none -k "regex:$kernels" -c "$count" "${sections[@]}" \
  -o "$report" python3 "$root/tools/bwd_ncu.py" "$@" > "$out/${name}_log.txt" 2>&1
ncu -i "$report.ncu-rep" --page details > "$out/${name}_details.txt"
python3 "$root/tools/ncu_compare.py" --details "$out/${name}_details.txt" > "$out/${name}_cycles.md"
if [[ ${NCU_CELL_SECTIONS:-full} == full ]]; then
  ncu -i "$report.ncu-rep" --page source --csv --print-source sass > "$report.csv"
  python3 "$root/tools/ncu_compare.py" "$report.csv" --top 25 > "$out/${name}_compare.txt"
  xz -c "$report.csv" > "$out/${name}_src.csv.xz"
fi
cat "$out/${name}_cycles.md"

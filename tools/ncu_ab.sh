#!/usr/bin/env bash
# A/B of kernel changes by Nsight Compute cycle counts: several source trees, one device call, each cell profiled
# once per tree per round (tools/ncu_cell.sh), the trees alternated, then the main kernels' cycles side by side.
# Session 61: a timed A/B (tools/ab_bench.sh) moved a control cell by ±1% and single cells by up to 2.5%, so it
# could not resolve the 1-2% a scheduling change makes; the same kernel's SM-active cycles under ncu repeated within
# 0.2%, and a pair of trees cost ~30 s per cell with every section profiled (fewer with the light set below).
#
#   here:        tools/ncu_ab.sh pack NAME REF     # REF's fa4gen/ + templates/ into .abtrees/NAME.tgz (ignored, ~0.2 MB)
#   on the GPU:  source tools/device_env.sh; tools/ncu_ab.sh run [ROUNDS] [--trees A,B] -- CELL [CELL ...]
#                (carry [".device", ".abtrees"]; CELL is tools/bwd_ncu.py's arguments joined by commas, e.g.
#                128,2048,y or 64,2048,n or 128,512,y,--fwd; --trees: only these packed trees beside "work")
#
# Each profile reads the Speed Of Light and launch sections only (NCU_CELL_SECTIONS=light: a few replay passes, the
# cycles and registers); NCU_AB_FULL=1 takes ncu_cell.sh's full set (stall reasons, source page) instead.
# flash-attn-4 keeps its compiled kernels on disk between the profiled processes (its CuTe-DSL cache), so it
# compiles once per cell rather than once per profile.
#
# The trees: "work" (this working tree) and every .abtrees/*.tgz, unpacked under /tmp/fa4gen_ncu_ab/trees and put
# first on PYTHONPATH for their runs (ncu_cell.sh runs tools/bwd_ncu.py as a script, so the working tree's folder
# is not ahead of it on sys.path: `python -c` and pytest would put it there). Odd rounds run the trees in order,
# even rounds reversed. Each tree has its own compile cache. Pages go to /tmp/fa4gen_ncu_ab/out and, with $OUT
# set, $OUT/ncu_ab.tgz (a call's later runs: ncu_ab_2.tgz, ...; refreshed after every profile, so a call stopped
# by its timeout returns what finished; the source pages' .csv.xz are left out unless NCU_AB_SOURCE=1). The summary is
# tools/ncu_ab.py's table. NCU_AB_TREES (default .abtrees), NCU_AB_WORK (default /tmp/fa4gen_ncu_ab) and
# NCU_AB_CELL (default tools/ncu_cell.sh) are for the tests.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
trees=${NCU_AB_TREES:-$root/.abtrees}
case "${1:-}" in
  pack)
    name=${2:?usage: tools/ncu_ab.sh pack NAME REF} ref=${3:?usage: tools/ncu_ab.sh pack NAME REF}
    [[ $name =~ ^[A-Za-z0-9_-]+$ && $name != work ]] || {
      echo "ncu_ab: NAME '$name': use letters, digits, '_' or '-' (and not 'work', this tree's name)" >&2; exit 2; }
    commit=$(git -C "$root" rev-parse --verify --quiet "$ref^{commit}") || { echo "ncu_ab: REF '$ref' is no commit" >&2; exit 2; }
    mkdir -p "$trees"
    # NCU_AB_PACK_EXTRA="PATH ..." packs more of REF (e.g. its tests/test_gpu_backward.py, fa4gen/golden,
    # generated): tools/tree_run.sh unpacks them over the working tree's copies, so a patch's own tests run
    git -C "$root" archive "$commit" fa4gen templates ":(exclude)templates/sm100" ":(exclude)fa4gen/golden" \
      ${NCU_AB_PACK_EXTRA:-} | gzip -n > "$trees/$name.tgz.tmp"
    mv "$trees/$name.tgz.tmp" "$trees/$name.tgz"
    echo "$commit" > "$trees/$name.commit"
    echo "packed $trees/$name.tgz from $ref ($commit, $(du -k "$trees/$name.tgz" | cut -f1) KB); carry [\".device\", \".abtrees\"]"
    ;;
  run)
    shift
    rounds=2
    if [[ "${1:-}" =~ ^[0-9]+$ ]]; then rounds=$1; shift; fi
    only=""
    if [[ "${1:-}" == "--trees" ]]; then only=${2:?--trees needs a comma list of packed tree names}; shift 2; fi
    [[ "${1:-}" == "--" ]] && shift
    (( $# )) || { echo "usage: tools/ncu_ab.sh run [ROUNDS] [--trees A,B] -- CELL [CELL ...]  (CELL e.g. 128,2048,y)" >&2; exit 2; }
    for cell in "$@"; do
      [[ $cell =~ ^[0-9x]+,v?[0-9-]+,[yn](,--[a-z]+)*$ ]] || {
        echo "ncu_ab: CELL '$cell': expected D,SEQLEN,y|n[,--flag...] (tools/bwd_ncu.py's arguments), e.g. 128,2048,y" >&2
        exit 2; }
    done
    cell_script=${NCU_AB_CELL:-$root/tools/ncu_cell.sh}
    work=${NCU_AB_WORK:-/tmp/fa4gen_ncu_ab}
    rm -rf "$work/out" && mkdir -p "$work/out" "$work/trees"
    names=(work) paths=("")
    shopt -s nullglob
    if [[ -n $only ]]; then
      IFS=, read -r -a wanted <<< "$only"
      for name in "${wanted[@]}"; do
        [[ -f $trees/$name.tgz ]] || { echo "ncu_ab: --trees: no $trees/$name.tgz (tools/ncu_ab.sh pack $name REF)" >&2; exit 2; }
      done
    fi
    for tgz in "$trees"/*.tgz; do
      name=$(basename "$tgz" .tgz)
      [[ -z $only || ",$only," == *",$name,"* ]] || continue
      rm -rf "${work:?}/trees/$name" && mkdir -p "$work/trees/$name"
      tar xzf "$tgz" -C "$work/trees/$name"
      names+=("$name") paths+=("$work/trees/$name")
    done
    (( ${#names[@]} > 1 )) || echo "ncu_ab: no .abtrees/*.tgz: profiling this tree alone (tools/ncu_ab.sh pack NAME REF adds one)" >&2
    for i in "${!names[@]}"; do
      pp=${paths[$i]:+${paths[$i]}:}$PYTHONPATH
      commit=""
      [[ -f $trees/${names[$i]}.commit ]] && commit=" (packed from $(cat "$trees/${names[$i]}.commit"))"
      echo "tree ${names[$i]}: fa4gen from $(cd /tmp && PYTHONPATH=$pp python3 -c 'import fa4gen, os; print(os.path.dirname(fa4gen.__file__))')$commit"
    done
    # one archive per run: a call's second run writes ncu_ab_2.tgz rather than replacing the first's
    archive=ncu_ab.tgz
    if [[ -n "${OUT:-}" ]]; then n=2; while [[ -e "$OUT/$archive" ]]; do archive=ncu_ab_$n.tgz; n=$((n + 1)); done; fi
    pack() {
      [[ -n "${OUT:-}" ]] || return 0
      local skip=(--exclude='*.csv.xz')
      [[ "${NCU_AB_SOURCE:-0}" == 1 ]] && skip=()
      tar czf "$OUT/$archive.tmp" "${skip[@]}" -C "$work" out && mv "$OUT/$archive.tmp" "$OUT/$archive"
    }
    export NCU_CELL_SECTIONS=light
    [[ "${NCU_AB_FULL:-0}" == 1 ]] && export NCU_CELL_SECTIONS=full
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$work/fa4_cache
    order=("${!names[@]}")
    for round in $(seq 1 "$rounds"); do
      seq_=("${order[@]}")
      if (( round % 2 == 0 )); then
        seq_=(); for (( j = ${#order[@]} - 1; j >= 0; j-- )); do seq_+=("${order[$j]}"); done
      fi
      for cell in "$@"; do
        IFS=, read -r -a args <<< "$cell"
        slug=${cell//,/_}; slug=${slug//-/}
        for i in "${seq_[@]}"; do
          name=${names[$i]}
          pp=${paths[$i]:+${paths[$i]}:}$PYTHONPATH
          tag="${name}__${slug}__r$round"
          if OUT=$work/out PYTHONPATH=$pp FA4GEN_CACHE_DIR=$work/cache_$name bash "$cell_script" "$tag" "${args[@]}" \
              > "$work/out/${tag}_run.txt" 2>&1; then
            echo "round $round $cell $name: done"
          else
            echo "round $round $cell $name: exit $? (see ${tag}_run.txt)"
          fi
          pack
        done
      done
    done
    python3 "$root/tools/ncu_ab.py" "$work/out" --markdown "$work/out/ncu_ab.md"
    pack
    ;;
  *)
    sed -n 2,25p "$0"; exit 2 ;;
esac

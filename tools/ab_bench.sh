#!/usr/bin/env bash
# A/B benchmark of this tree against a git ref, alternated in one device call (run-to-run spread on the
# H200 is several percent per cell, so two builds are only compared inside one machine session).
#
#   here:        tools/ab_bench.sh prepare REF        # REF's fa4gen/ and templates/ into .ab/ (ignored)
#   on the GPU:  source tools/device_env.sh; tools/ab_bench.sh run [ROUNDS] -- BENCH_FWD_ARGS...
#                (carry [".device", ".ab"]; prints tools/ab_compare.py; with $OUT set, the runs go to
#                /tmp/fa4gen_ab/ab/{new,ref}_N/ and $OUT/ab.tgz holds them (a call's later A/Bs: ab_2.tgz, ...), refreshed after every run, so a
#                call stopped by its timeout still returns each finished run and the last one's finished
#                cells (ab_compare.py reads those too) in one file: a call returns at most 8 files)
#                AB_SCRIPT=bench_varlen.py (another script in tools/ taking --out) runs that instead, and
#                prints each run's markdown table in place of the comparison (AB_SCRIPT=bwd_profile.py: the
#                main-kernel table of tools/profile_compare.py instead; AB_SCRIPT=sustained_bench.py: its --ab
#                table, new/ref per long cell at each kernel's steady clock); bench_fwd.py runs with
#                --skip cudnn,sdpa_flash (the comparison reads fa4gen and flash-attn-4 only; AB_ALL=1 times all)
#                and, before the rounds, both sides' fa4gen kernels are compiled in parallel processes
#                (bench_fwd.py --prebuild N --prebuild-only, half the cores per side; AB_NO_PREBUILD=1 skips it)
#                and flash-attn-4 keeps its compiled kernels on disk between the runs (AB_FA4_CACHE=0: it does not);
#                AB_NEW_ARGS="..." adds arguments to the new side's runs only, so with .ab prepared from HEAD one
#                tree compares two settings (e.g. AB_NEW_ARGS=--bwd-allow-gqa: the spec default's GQA backward
#                against the MHA one on MHA calls)
#
# .ab/ holds only what an SM90 benchmark imports (no SM100 templates, no golden package): the carry limit
# is 64 MiB for .device (~61 MiB with anchors) + .ab + every tracked file, so it is tight.
# "new" is this working tree, "ref" the prepared copy; each side has its own compile cache and runs
# tools/bench_fwd.py in a fresh process, in ABBA order (new ref ref new ...), and ab_compare.py divides
# each run's cell by the same run's flash-attn-4 cell before comparing the sides, so clock drift between
# processes cancels; use an even number of rounds.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
  prepare)
    ref=${2:?usage: tools/ab_bench.sh prepare REF}
    rm -rf "$root/.ab" && mkdir -p "$root/.ab/ref"
    git -C "$root" archive "$ref" fa4gen templates ":(exclude)templates/sm100" ":(exclude)fa4gen/golden" | tar -x -C "$root/.ab/ref"
    git -C "$root" rev-parse "$ref" > "$root/.ab/ref/COMMIT"
    echo "prepared .ab/ref from $ref ($(cat "$root/.ab/ref/COMMIT")); carry [\".device\", \".ab\"]"
    ;;
  run)
    shift
    rounds=2
    if [[ "${1:-}" =~ ^[0-9]+$ ]]; then rounds=$1; shift; fi
    [[ "${1:-}" == "--" ]] && shift
    [[ -f "$root/.ab/ref/COMMIT" ]] || { echo "no .ab/ref: run 'tools/ab_bench.sh prepare REF' first" >&2; exit 2; }
    out=$root/out/ab
    if [[ -n "${OUT:-}" ]]; then out=/tmp/fa4gen_ab/ab; rm -rf "$out"; fi
    # one archive per A/B: a call's second A/B writes ab_2.tgz rather than replacing the first's ab.tgz
    archive=ab.tgz
    if [[ -n "${OUT:-}" ]]; then n=2; while [[ -e "$OUT/$archive" ]]; do archive=ab_$n.tgz; n=$((n + 1)); done; fi
    pack() { [[ -n "${OUT:-}" ]] && tar czf "$OUT/$archive.tmp" -C "$(dirname "$out")" ab && mv "$OUT/$archive.tmp" "$OUT/$archive"; true; }
    script=${AB_SCRIPT:-bench_fwd.py}
    [[ -f "$root/tools/$script" ]] || { echo "AB_SCRIPT: no tools/$script" >&2; exit 2; }
    # the comparison reads fa4gen and flash-attn-4 only: cuDNN and SDPA's flash go untimed (AB_ALL=1 keeps them)
    extra=()
    [[ $script == bench_fwd.py && -z "${AB_ALL:-}" ]] && extra=(--skip cudnn,sdpa_flash)
    mkdir -p "$out"
    # flash-attn-4's own persistent compile cache (off by default in its 4.0 betas): its kernels compile in
    # the first run and load in the others instead of compiling again in every process (AB_FA4_CACHE=0: off)
    if [[ "${AB_FA4_CACHE:-1}" != 0 ]]; then
      export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4gen_ab_fa4_cache
    fi
    if [[ $script == bench_fwd.py && -z "${AB_NO_PREBUILD:-}" ]]; then
      # both sides' fa4gen kernels compiled first, side by side, half the cores each (tools/prebuild.py): the
      # timed runs then load them from their caches instead of compiling one kernel at a time
      workers=$(( $(nproc) / 2 )); (( workers < 1 )) && workers=1
      for side in new ref; do
        pp=$PYTHONPATH
        [[ $side == ref ]] && pp="$root/.ab/ref:$PYTHONPATH"
        side_args=()
        [[ $side == new && -n "${AB_NEW_ARGS:-}" ]] && read -r -a side_args <<< "$AB_NEW_ARGS"
        (cd "$root/tools" && PYTHONPATH=$pp FA4GEN_CACHE_DIR=/tmp/fa4gen_ab_$side python3 bench_fwd.py "$@" \
          ${side_args[@]+"${side_args[@]}"} --prebuild "$workers" --prebuild-only > "$out/prebuild_$side.log" 2>&1 || echo "  prebuild $side: exit $? (see $out/prebuild_$side.log)") &
      done
      wait
      echo "prebuild: $(tail -n 1 "$out/prebuild_new.log") (new), $(tail -n 1 "$out/prebuild_ref.log") (ref)"
    fi
    for round in $(seq 1 "$rounds"); do
      # ABBA: odd rounds new first, even rounds ref first, so a steady clock drift over the call does not
      # favour one side (the same order every round did)
      sides="new ref"; (( round % 2 == 0 )) && sides="ref new"
      for side in $sides; do
        pp=$PYTHONPATH
        [[ $side == ref ]] && pp="$root/.ab/ref:$PYTHONPATH"
        # the script's own folder (tools/) comes first on sys.path, then PYTHONPATH: check which fa4gen loads
        used=$(cd "$root/tools" && PYTHONPATH=$pp python3 -c "import fa4gen.render as r; print(r.TEMPLATES_DIR)")
        side_args=()
        [[ $side == new && -n "${AB_NEW_ARGS:-}" ]] && read -r -a side_args <<< "$AB_NEW_ARGS"
        echo "round $round $side: templates from $used${side_args[*]:+, with ${side_args[*]}}"
        PYTHONPATH=$pp FA4GEN_CACHE_DIR=/tmp/fa4gen_ab_$side python3 "$root/tools/$script" "$@" ${extra[@]+"${extra[@]}"} \
          ${side_args[@]+"${side_args[@]}"} \
          --out "$out/${side}_$round" > "$out/${side}_$round.log" 2>&1 || echo "  exit $? (see $out/${side}_$round.log)" &
        # the bench runs in the background so the tarball also follows its cells while it runs
        bench=$! ticks=0
        while kill -0 $bench 2>/dev/null; do sleep 1; (( ++ticks % 15 == 0 )) && pack; done
        wait $bench || true
        pack
      done
    done
    if [[ $script == bench_fwd.py ]]; then
      python3 "$root/tools/ab_compare.py" "$out"
    elif [[ $script == sustained_bench.py ]]; then
      python3 "$root/tools/sustained_bench.py" --ab "$out" | tee "$out/ab.md"
    elif [[ $script == bwd_profile.py ]]; then
      join() { local IFS=,; echo "$*"; }
      python3 "$root/tools/profile_compare.py" "$(join "$out"/new_*/)" "$(join "$out"/ref_*/)" --markdown "$out/ab.md"
    else
      for md in "$out"/*_*/*.md; do echo "== $md"; cat "$md"; done
    fi
    pack
    ;;
  *)
    sed -n 2,13p "$0"; exit 2 ;;
esac

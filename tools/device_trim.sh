#!/usr/bin/env bash
# Trim the working tree under the device tool's carry limit (64 MiB for the tree's files plus the carried
# ignored paths) before a device call, and put it back afterwards.
#
#   tools/device_trim.sh out [TEST_FILE ...]   # docs/ and every tests/ file but conftest.py and the named
#                                               # ones go to $FA4GEN_TRIM_DIR (default ../.fa4gen_trim)
#   tools/device_trim.sh back                   # everything moved comes back
#   tools/device_trim.sh size [PATH ...]        # MiB the call would carry: tracked files present + PATHs
#
# `out` refuses to run while an earlier trim is still out (so nothing is moved twice), and `back` refuses
# to overwrite a file that reappeared in the tree meanwhile. `out` prints the carry size with .device and,
# when present, .ab and .abtrees, so the limit is checked before the call is spent.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
stash=${FA4GEN_TRIM_DIR:-$root/../.fa4gen_trim}
limit_mib=64

size() {  # tracked files that exist, plus the named paths
  (cd "$root" && { git ls-files -z | xargs -0 -r du -cb 2>/dev/null | tail -n 1; for p in "$@"; do
    if [[ -e $p ]]; then du -sb "$p"; fi; done; } | awk '{s += $1} END {printf "%.2f\n", s / 1048576}')
}

case "${1:-}" in
  out)
    shift
    if [[ -e $stash ]]; then
      echo "device_trim: $stash exists (an earlier trim is out): run 'tools/device_trim.sh back' first" >&2
      exit 2
    fi
    for name in "$@"; do
      [[ -f $root/tests/$(basename "$name") ]] || { echo "device_trim: no tests/$(basename "$name")" >&2; exit 2; }
    done
    mkdir -p "$stash/tests"
    mv "$root/docs" "$stash/docs"
    for f in "$root"/tests/*; do
      base=$(basename "$f")
      keep=0
      if [[ $base == conftest.py ]]; then keep=1; fi
      for name in "$@"; do
        if [[ $base == "$(basename "$name")" ]]; then keep=1; fi
      done
      if (( ! keep )); then mv "$f" "$stash/tests/"; fi
    done
    carried=(.device)
    if [[ -d $root/.ab ]]; then carried+=(.ab); fi
    if [[ -d $root/.abtrees ]]; then carried+=(.abtrees); fi
    mib=$(size "${carried[@]}")
    echo "device_trim: docs/ and $(ls "$stash/tests" | wc -l) tests/ entries moved to $stash; kept: $(ls "$root/tests" | tr '\n' ' ')"
    echo "device_trim: carry with ${carried[*]}: $mib MiB (limit $limit_mib)"
    if awk -v m="$mib" -v l="$limit_mib" 'BEGIN {exit !(m > l)}'; then echo "device_trim: over the limit" >&2; exit 1; fi
    ;;
  back)
    [[ -d $stash ]] || { echo "device_trim: nothing is out ($stash does not exist)" >&2; exit 2; }
    if [[ -e $root/docs ]]; then echo "device_trim: $root/docs exists; not overwriting it" >&2; exit 2; fi
    for f in "$stash"/tests/*; do
      [[ -e $f ]] || continue
      if [[ -e $root/tests/$(basename "$f") ]]; then
        echo "device_trim: tests/$(basename "$f") exists in the tree; not overwriting it" >&2; exit 2
      fi
    done
    mv "$stash/docs" "$root/docs"
    for f in "$stash"/tests/*; do
      if [[ -e $f ]]; then mv "$f" "$root/tests/"; fi
    done
    rmdir "$stash/tests" "$stash"
    echo "device_trim: docs/ and tests/ back"
    ;;
  size)
    shift
    echo "$(size "$@") MiB"
    ;;
  *)
    echo "usage: tools/device_trim.sh out [TEST_FILE ...] | back | size [PATH ...]" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# Run one pytest selection as N processes side by side through tools/gpu_parallel.sh (a GPU suite's parts compile
# their kernels on the machine's cores at once, each with its own compile cache and log), so a whole suite fits in
# one device call without listing its parts by hand.
#
#   tools/split_pytest.sh N [PYTEST_ARGS ...]     e.g. tools/split_pytest.sh 4 tests/test_gpu_backward.py -k causal
#   with a packed tree: tools/tree_run.sh NAME -- tools/split_pytest.sh 4 tests/test_gpu_backward.py
#
# The selection is collected once (`pytest --co -q`) and its test ids dealt out in turn, so every test runs exactly
# once; PYTEST_ARGS's options (what starts with '-', and the value after -k / -m / -p) go to every part: give any
# other option that takes a value as --name=value (a separate value would be read as a path). Parts are
# named part_0 ... (SPLIT_PYTEST_NAME=X: X_0 ...); logs and exit status as gpu_parallel.sh's (the number of parts
# that failed; with $OUT set the logs come back in $OUT/gpu_parallel.tgz). Nothing selected: pytest's status 5.
set -euo pipefail
n=${1:-}
[[ $n =~ ^[1-9][0-9]*$ ]] || { echo "usage: tools/split_pytest.sh N [PYTEST_ARGS ...]  (N: processes, >= 1)" >&2; exit 2; }
shift
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
ids=$(mktemp -t split_pytest_ids.XXXXXX)
trap 'rm -f "$ids" "$ids.out"' EXIT
collect=0
"$py" -m pytest --co -q -p no:cacheprovider "$@" > "$ids.out" 2>&1 || collect=$?
# the ids are the lines before the first blank one (a warnings summary may follow with lines of its own)
awk 'NF == 0 { exit } /::/' "$ids.out" > "$ids"
if [[ ! -s $ids ]]; then
  tail -5 "$ids.out" >&2
  echo "split_pytest: no tests collected (pytest --co exit status $collect)" >&2
  exit $(( collect ? collect : 5 ))
fi
total=$(wc -l < "$ids")
(( n > total )) && n=$total
echo "split_pytest: $total tests in $n parts" >&2
opts=() prev=""
for a in "$@"; do
  [[ $a == -* || $prev == -[kmp] ]] && opts+=("$a")
  prev=$a
done
# gpu_parallel.sh starts each part in the project root (its parent folder): each goes back to this folder first,
# where the ids were collected
parts=()
for (( i = 0; i < n; i++ )); do
  cmd="cd $(printf '%q' "$(pwd)") && $(printf '%q ' "$py" -m pytest -q -p no:cacheprovider "${opts[@]}")"
  while IFS= read -r id; do cmd+=$(printf '%q ' "$id"); done < <(awk -v n="$n" -v i="$i" '(NR - 1) % n == i' "$ids")
  parts+=("${SPLIT_PYTEST_NAME:-part}_$i" "$cmd")
done
rm -f "$ids" "$ids.out"
trap - EXIT
exec "$here/gpu_parallel.sh" "${parts[@]}"

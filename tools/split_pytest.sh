#!/usr/bin/env bash
# Run one pytest selection as N processes side by side (GPU suites in one device call: each process compiles its
# own kernels on the machine's cores while the others run theirs), then print each part's summary line.
#
#   tools/split_pytest.sh N [PYTEST_ARGS ...]     e.g. tools/split_pytest.sh 4 tests/test_gpu_backward.py -k causal
#   with a packed tree: tools/tree_run.sh NAME -- tools/split_pytest.sh 4 tests/test_gpu_backward.py
#
# The selection is collected once (`pytest --co -q`) and its test ids dealt out in turn, so every test runs exactly
# once. Part i's output goes to $SPLIT_PYTEST_LOGS/part_i.log (default $OUT when set, else a fresh temporary
# folder). The exit status is 0 when every part passed, else the first failing part's (5 when nothing was
# selected, as pytest's).
set -euo pipefail
n=${1:-}
[[ $n =~ ^[1-9][0-9]*$ ]] || { echo "usage: tools/split_pytest.sh N [PYTEST_ARGS ...]  (N: processes, >= 1)" >&2; exit 2; }
shift
logs=${SPLIT_PYTEST_LOGS:-${OUT:-$(mktemp -d -t split_pytest.XXXXXX)}}
mkdir -p "$logs"
py=${PYTHON:-python3}
ids=$(mktemp -t split_pytest_ids.XXXXXX)
trap 'rm -f "$ids"' EXIT
collect=0
"$py" -m pytest --co -q -p no:cacheprovider "$@" > "$ids.out" 2>&1 || collect=$?
grep '::' "$ids.out" > "$ids" || true
if [[ ! -s $ids ]]; then
  tail -5 "$ids.out" >&2; rm -f "$ids.out"
  echo "split_pytest: no tests collected (pytest --co exit status $collect)" >&2
  exit $(( collect ? collect : 5 ))
fi
rm -f "$ids.out"
total=$(wc -l < "$ids")
(( n > total )) && n=$total
echo "split_pytest: $total tests in $n parts, logs in $logs" >&2
# options (everything that is not a path or test id) go to every part; the ids replace the paths
opts=()
for a in "$@"; do [[ $a == -* || ${prev:-} == -[kmp] ]] && opts+=("$a"); prev=$a; done
pids=()
for (( i = 0; i < n; i++ )); do
  mapfile -t part < <(awk -v n="$n" -v i="$i" '(NR - 1) % n == i' "$ids")
  "$py" -m pytest -q -p no:cacheprovider "${opts[@]}" "${part[@]}" > "$logs/part_$i.log" 2>&1 &
  pids+=($!)
done
status=0
for (( i = 0; i < n; i++ )); do
  rc=0; wait "${pids[$i]}" || rc=$?
  echo "part $i (rc $rc): $(tail -1 "$logs/part_$i.log")"
  (( status == 0 && rc != 0 )) && status=$rc
done
exit $status

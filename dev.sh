#!/usr/bin/env bash
# fa4gen developer entry point. Creates .venv (with the package and its test extras) if missing.
#   ./dev.sh build   build every spec in specs/ and compile it ahead of time (no GPU needed)
#   ./dev.sh test    run the test suite (GPU tests skip without a Hopper GPU)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import fa4gen, cutlass, torch, pytest" 2>/dev/null; then
  echo "setting up .venv ..." >&2
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # A CPU build of torch is all this machine needs; prefer one that is already on disk.
  .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0" \
    || .venv/bin/python -m pip install -q torch
  .venv/bin/python -m pip install -q -e ".[test]"
fi
cmd=${1:-}
shift || true
case "$cmd" in
  build) exec .venv/bin/python -m fa4gen build specs/ --compile "$@" ;;
  test) exec .venv/bin/python -m pytest -q "$@" ;;
  *) echo "usage: ./dev.sh build|test [args...]" >&2; exit 2 ;;
esac

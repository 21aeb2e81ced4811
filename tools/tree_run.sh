#!/usr/bin/env bash
# Run a command (GPU test suites, `fa4gen test`, a benchmark) against a packed source tree on the lent GPU
# machine, so a candidate kernel change is verified in the same call that measured it, without checking it out.
#
#   here:        tools/ncu_ab.sh pack NAME REF           # REF's fa4gen/ + templates/ into .abtrees/NAME.tgz
#   on the GPU:  source tools/device_env.sh; tools/tree_run.sh NAME -- COMMAND [ARG ...]
#
# The tree is unpacked into $TREE_RUN_WORK/NAME (default /tmp/fa4gen_tree_run); everything else the command
# needs (tests/, tools/, specs/, pyproject.toml, generated/, fa4gen/golden, templates/sm100) is copied beside it
# from this working tree, the command runs there (`cd`: pytest and `python -c` put their folder first on
# sys.path, so the working tree would otherwise win) with the tree first on PYTHONPATH, and a fresh compile
# cache (FA4GEN_CACHE_DIR, unless set) so no kernel compiled from another tree is reused. The command's exit
# status is tree_run's. The tree's commit is printed first.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
trees=${NCU_AB_TREES:-$root/.abtrees}
name=${1:-}
[[ -n $name && $name =~ ^[A-Za-z0-9_-]+$ ]] || { echo "usage: tools/tree_run.sh NAME -- COMMAND [ARG ...]  (NAME: a packed tree)" >&2; exit 2; }
shift
[[ "${1:-}" == "--" ]] && shift
(( $# )) || { echo "tree_run: no COMMAND after '$name --'" >&2; exit 2; }
[[ -f $trees/$name.tgz ]] || { echo "tree_run: no $trees/$name.tgz (tools/ncu_ab.sh pack $name REF)" >&2; exit 2; }
dest=${TREE_RUN_WORK:-/tmp/fa4gen_tree_run}/$name
rm -rf "$dest" && mkdir -p "$dest"
# the working tree minus the packed parts and what never travels
(cd "$root" && tar cf - --exclude=./.git --exclude=./.device --exclude=./.abtrees --exclude=./.venv \
  --exclude=./fa4gen --exclude=./templates --exclude='*/__pycache__' .) | tar xf - -C "$dest"
tar xzf "$trees/$name.tgz" -C "$dest"
# the golden package and SM100 templates from the working tree, unless the tree packed its own
[[ -d $root/fa4gen/golden && ! -d $dest/fa4gen/golden ]] && cp -r "$root/fa4gen/golden" "$dest/fa4gen/"
[[ -d $root/templates/sm100 && ! -d $dest/templates/sm100 ]] && cp -r "$root/templates/sm100" "$dest/templates/"
commit=""
[[ -f $trees/$name.commit ]] && commit=" (packed from $(cat "$trees/$name.commit"))"
echo "tree_run: $name$commit in $dest" >&2
cd "$dest"
export PYTHONPATH=$dest${PYTHONPATH:+:$PYTHONPATH}
export FA4GEN_CACHE_DIR=${FA4GEN_CACHE_DIR:-/tmp/fa4gen_tree_run_cache/$name}
exec "$@"

"""The masks trace one select per element, not a conditional expression's if-region: compiled for sm_90a on the CPU
with CuTe-DSL's KEEP=ir, the first call's kernel of a causal d128 spec (the persistent forward that
tools/compile_time_cpu.py times for #3's cold-compile target) holds few `scf.if` regions after canonicalize + CSE.
Each masked element's region survived the MLIR passes (192 regions in that kernel until session 41, 64 since: the
rest are per-row and per-tile branches) and cost compile time for the same SASS (docs/PERF.md, session 41)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.compile

pytest.importorskip("cutlass")

ROOT = Path(__file__).resolve().parent.parent
SPEC = dict(name="trace_ops_d128", targets=["sm90"], dtype="bf16", head_dim=128, mask={"kind": "causal"})
CHILD = """
import json, sys
import fa4gen
op = fa4gen.build({spec!r})._forward
plan = op.forward_plan("sm90", 128)
op.function(plan)
print("TILE", json.dumps([plan["tile_m"], plan["tile_n"]]))
"""


def _ir_counts(folder: Path) -> dict:
    """tools/compile_time_cpu.py's --ir-ops count (one implementation of what a clean-IR count reads)."""
    spec = importlib.util.spec_from_file_location("compile_time_cpu", ROOT / "tools" / "compile_time_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ir_counts(folder)


def test_masked_forward_traces_no_region_per_element(tmp_path):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ir", CUTE_DSL_DUMP_DIR=str(tmp_path / "ir"),
               FA4GEN_CACHE_DIR=str(tmp_path / "cache"), FA4GEN_QUIET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    (tmp_path / "ir").mkdir()
    r = subprocess.run([sys.executable, "-c", CHILD.format(spec=SPEC)], env=env, capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    tile_m, tile_n = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("TILE "))[5:])
    assert len(list((tmp_path / "ir").glob("*_clean.mlir"))) == 1
    regions = _ir_counts(tmp_path / "ir")["scf_if"]
    # a thread holds tile_m * tile_n / 256 scores of its warpgroup's rows per block: one region each (the old
    # form, in the diagonal block and the ragged last block) would add 2 * 64 = 128 at 128 x 128
    per_thread = tile_m * tile_n // 256
    assert 0 < regions < per_thread + 32, f"{regions} scf.if regions: a per-element conditional expression is back?"

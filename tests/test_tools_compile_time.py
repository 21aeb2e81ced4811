"""tools/compile_time_cpu.py's --ir-ops counting on a hand-written clean-IR file (no compile)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("compile_time_cpu", ROOT / "tools" / "compile_time_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ir_counts_reads_op_lines_regions_and_loads(tmp_path):
    (tmp_path / "k_clean.mlir").write_text(
        "func {\n"
        "  %0 = cute.memref.load(%v, %c) : f32\n"
        "  %1 = scf.if %p -> (f32) {\n"
        "    %2 = cute.memref.load(%v, %d) : f32\n"
        "    scf.yield %2 : f32\n"
        "  }\n"
        "  %3 = arith.select %p, %0, %1 : f32\n"
        "}\n"
    )
    (tmp_path / "k.mlir").write_text("%9 = scf.if raw IR, not counted\n")
    assert _tool().ir_counts(tmp_path) == dict(op_lines=4, scf_if=1, memref_load=2)


def test_ir_counts_names_the_folder_when_nothing_was_kept(tmp_path):
    with pytest.raises(SystemExit, match="no \\*_clean.mlir"):
        _tool().ir_counts(tmp_path)

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


def test_against_ref_names_the_missing_reference_tree(tmp_path, monkeypatch):
    """--against-ref needs `tools/ab_bench.sh prepare REF`'s .ab/ref and says so, before any compile."""
    tool = _tool()
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    with pytest.raises(SystemExit, match="no .ab/ref/fa4gen"):
        tool.main(["--against-ref", "--rounds", "1"])


def test_against_ref_stops_when_a_side_imported_the_other_tree(tmp_path, monkeypatch):
    """Each child's RESULT names the fa4gen it imported: a reference side that ran this tree (as session 44 found
    of tools/cold_first_call_ab.py) stops the run instead of printing a same-tree ratio."""
    tool = _tool()
    (tmp_path / ".ab" / "ref" / "fa4gen").mkdir(parents=True)
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    seen = []

    def child(code, env, passes=0, cwd=None):
        seen.append((env["PYTHONPATH"].split(":")[0], cwd))
        return dict(first_compile_s=1.0, trace_s=0.1, native_s=0.5, fa4gen_from=str(tmp_path / "fa4gen" / "__init__.py"))

    monkeypatch.setattr(tool, "run_child", child)
    with pytest.raises(SystemExit, match="side ref: fa4gen came from"):
        tool.main(["--against-ref", "--rounds", "1"])
    assert seen[-1][0] == str(tmp_path / ".ab" / "ref") and seen[-1][1] != tmp_path


def test_variants_time_the_same_call_on_both_sides():
    """--head-dim / --mask: fa4gen's spec and flash-attn-4's call take the same head dim and mask; the default
    (d128 causal) keeps the spec, so its name and cache keys, as before."""
    tool = _tool()
    assert tool.spec_for(128, True) is tool.SPEC
    spec = tool.spec_for(64, False)
    assert (spec["name"], spec["head_dim"], spec["mask"]) == ("compile_time_d64_none", 64, {"kind": "none"})
    from fa4gen.spec import spec_from_dict

    assert spec_from_dict(spec).head_dim == 64
    code = tool.fa4_code(False, "", "/x", 64, False)
    assert "torch.empty(1, 128, 1, 64," in code and "flash_attn_func(q, q, q, causal=False)" in code
    assert 'plan = op.forward_plan("sm90", 8192)' in tool.child_code(False, "", spec, 8192)


def test_backward_times_the_backward_kernels_of_a_training_spec():
    """--backward: fa4gen's side compiles the backward plan of an MHA training spec, flash-attn-4's calls
    _flash_attn_bwd on fake tensors of the same head dim and mask."""
    tool = _tool()
    spec = tool.spec_for(128, True, backward=True)
    assert spec is not tool.SPEC and spec["backward"] is True and spec["allow_gqa"] is False
    assert spec["name"] == "compile_time_d128_causal_bwd" and spec["mask"] == {"kind": "causal"}
    from fa4gen.spec import spec_from_dict

    assert spec_from_dict(spec).backward
    ours = tool.child_code(True, "", spec, 128)
    assert 'plan = op.bwd_plans["sm90"]' in ours and "op.function(plan)" in ours and "forward_plan" not in ours
    theirs = tool.fa4_code(True, "", "/x", 128, True)
    assert "_flash_attn_bwd(q, q, q, q, q, lse, None, True, 0.0)" in theirs and "1, 128, 1, 128," in theirs
    assert "flash_attn_func(q" not in theirs

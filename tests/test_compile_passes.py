"""fa4gen compiles with a cute-to-nvvm pass switched off (fa4gen.compile.generated.SKIPPED_PASS_OPTIONS) because
it costs first-call compile time and changes no instruction of its kernels. These tests keep both halves of that
true: the options reach CuTe-DSL's pipeline (an unknown one fails the compile, so the SASS comparison below is
not comparing a compile with itself), the cache keys tell the two pipelines apart, and a forward and a backward
compile to the same SASS either way (tools/pipeline_sass_check.py checks every kernel of specs/)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_full_pipeline_switch_and_cache_key(monkeypatch):
    from fa4gen.compile import generated

    monkeypatch.delenv("FA4GEN_FULL_PIPELINE", raising=False)
    monkeypatch.delenv("FA4GEN_PASS_OPTIONS", raising=False)
    assert generated.pass_options() == "use-strength-reduction-pass=false"
    trimmed = generated.kernel_cache_key("x = 1\n", "sm_90a", used={})
    monkeypatch.setenv("FA4GEN_FULL_PIPELINE", "1")
    assert generated.pass_options() == ""
    assert generated.kernel_cache_key("x = 1\n", "sm_90a", used={}) != trimmed  # never served for each other
    monkeypatch.setenv("FA4GEN_FULL_PIPELINE", "0")
    assert generated.kernel_cache_key("x = 1\n", "sm_90a", used={}) == trimmed
    # other options to try (tools/pipeline_sass_check.py --options), read at each compile, keyed apart
    monkeypatch.setenv("FA4GEN_PASS_OPTIONS", " use-nvgpu-optimization-pass=false  ")
    assert generated.pass_options() == "use-nvgpu-optimization-pass=false"
    assert generated.kernel_cache_key("x = 1\n", "sm_90a", used={}) != trimmed
    monkeypatch.setenv("FA4GEN_FULL_PIPELINE", "1")
    assert generated.pass_options() == ""  # (the whole pipeline wins)


def _pairs(modules):
    from fa4gen.plan import plan_kernels
    from fa4gen.spec import spec_from_dict

    spec = spec_from_dict(dict(name="passes", targets=["sm90"], dtype="bf16", head_dim=64, mask={"kind": "causal"},
                               backward=True, allow_gqa=False))
    return [(spec, [p for p in plan_kernels(spec, "sm90") if p.module in modules])]


def test_pass_options_reach_the_pipeline(tmp_path, monkeypatch):
    """The options reach cute-to-nvvm's option string (an unknown one is rejected there, so they are not dropped on
    the way); a rejected option falls back to the whole pipeline with a warning instead of failing every compile
    (a CuTe-DSL release without the pass), and that fallback compiles the same SASS as the whole pipeline."""
    pytest.importorskip("cutlass")
    from fa4gen.compile import generated
    from fa4gen.compile.sass import instruction_lines

    monkeypatch.delenv("FA4GEN_FULL_PIPELINE", raising=False)
    monkeypatch.delenv("FA4GEN_PASS_OPTIONS", raising=False)
    monkeypatch.setattr(generated, "SKIPPED_PASS_OPTIONS", ("use-no-such-pass=false",))
    warned = "rejects 'use-no-such-pass=false'; compiling with the whole pipeline"
    with pytest.warns(generated.FA4GenPipelineWarning, match=warned):
        ((plan, report, sass),) = _compile(tmp_path / "bogus", "bogus")
    assert report.status == "compiled", report.detail
    monkeypatch.setenv("FA4GEN_FULL_PIPELINE", "1")
    ((_, whole_report, whole),) = _compile(tmp_path / "whole", "whole")
    assert whole_report.status == "compiled" and instruction_lines(sass) == instruction_lines(whole)
    # options asked for by name (tools/pipeline_sass_check.py --options) fail as they are, naming the option
    monkeypatch.delenv("FA4GEN_FULL_PIPELINE")
    monkeypatch.setenv("FA4GEN_PASS_OPTIONS", "use-no-such-pass=false")
    ((_, asked, listing),) = _compile(tmp_path / "asked", "asked")
    assert asked.status == "failed" and listing is None and "use-no-such-pass=false" in asked.detail


def _compile(root, package):
    from fa4gen.builder import compile_specs_for_sass

    return compile_specs_for_sass(_pairs({"fwd_sm90"}), root, package, workers=1)[0]


def test_forward_and_backward_compile_to_the_same_sass_without_the_passes(tmp_path, monkeypatch):
    pytest.importorskip("cutlass")
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from pipeline_sass_check import compile_all
    finally:
        sys.path.remove(str(ROOT / "tools"))
    monkeypatch.delenv("FA4GEN_FULL_PIPELINE", raising=False)  # (compile_all sets and restores them)
    monkeypatch.delenv("FA4GEN_PASS_OPTIONS", raising=False)
    pairs = _pairs({"fwd_sm90", "bwd_sm90"})
    full = compile_all(pairs, tmp_path / "full", True, 0, None)
    trim = compile_all(pairs, tmp_path / "trim", False, 0, None)
    assert sorted(full) == sorted(trim) == [("passes", "sm90", "bwd_sm90"), ("passes", "sm90", "fwd_sm90")]
    for key in full:
        assert full[key] and len(full[key][0]) > 1000 and full[key][1], key  # (a real kernel, not an empty listing)
        assert full[key] == trim[key], key  # instructions and resources


def test_listings_compare_instructions_not_addresses_or_symbols():
    """The comparison's normalization (fa4gen.compile.sass.instruction_lines): addresses, encodings and the kernel
    symbols (which carry the cache key) are left out; any other difference in an instruction is kept."""
    from fa4gen.compile.sass import instruction_lines as instructions

    a = ("        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */\n"
         "        /*0010*/                   RET.REL.NODEC R4 `(kernel_aaaa_FlashFwdSm90_0) ;  /* 0x1 */\n"
         "  .section .text.kernel_aaaa,\"ax\",@progbits\n")
    b = ("        /*0400*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b99 */\n"
         "        /*0410*/                   RET.REL.NODEC R4 `(kernel_bbbb_FlashFwdSm90_0) ;  /* 0x2 */\n")
    assert instructions(a) == instructions(b) == ["LDC R1, c[0x0][0x28]", "RET.REL.NODEC R4 `(SYM)"]
    assert instructions(b.replace("R1,", "R2,")) != instructions(a)

"""`fa4gen dispatch`: the kernels it names are the ones the package's runtime selects for the same call, at the
dispatch bounds on both sides, and bad calls or options end in one problem line with exit status 2 (CPU only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fa4gen.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"


def dispatch(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["dispatch", *args])
    return result.exit_code, result.output


def report(*args: str) -> dict:
    code, out = dispatch(*args, "--json")
    assert code == 0, out
    return json.loads(out)


def lock(name: str) -> dict:
    return json.loads((ROOT / "generated" / name / "spec.lock.json").read_text())


def test_forward_follows_the_long_call_bound_of_the_lock_file():
    """llama3_8b's one-CTA-per-tile forward runs from its plan's min_seqlen_q on, the persistent one below."""
    long_plan = next(p for p in lock("llama3_8b")["plans"] if p["direction"] == "fwd" and p.get("min_seqlen_q"))
    bound = long_plan["min_seqlen_q"]
    spec = str(SPECS / "llama3_8b.yaml")
    below = report(spec, "-s", str(bound - 1), "--heads", "32", "--kv-heads", "8")
    at = report(spec, "-s", str(bound), "--heads", "32", "--kv-heads", "8")
    assert below["forward"]["module"] == "fwd_sm90" and below["forward"]["scheduler"] == "persistent"
    assert at["forward"]["module"] == long_plan["module"]
    assert at["forward"]["runs"] == f"calls with seqlen_q >= {bound}"
    assert {k["module"] for k in below["other_kernels"]} >= {long_plan["module"], "bwd_sm90_mha"}


def test_backward_follows_the_head_counts():
    spec = str(SPECS / "llama3_8b.yaml")
    gqa = report(spec, "-s", "1024", "--heads", "32", "--kv-heads", "8")
    mha = report(spec, "-s", "1024", "--heads", "32")
    assert gqa["backward"]["module"] == "bwd_sm90" and gqa["backward"]["dkv"].startswith("fp32 workspaces")
    assert mha["backward"]["module"] == "bwd_sm90_mha" and mha["backward"]["dkv"] == "stored from the CTA"
    assert mha["call"]["kv_heads"] == 32  # --kv-heads defaults to --heads


def test_vit_lengths_take_the_128_row_twin():
    """vit_encoder (d64, no mask): 197 tokens run the 128-row twin, 512 the 192-row default (the lock file's
    seqlen_q_ranges say which)."""
    twin = next(p for p in lock("vit_encoder")["plans"] if p.get("seqlen_q_ranges"))
    first, last = twin["seqlen_q_ranges"][-1]
    inside = report(str(SPECS / "vit_encoder.yaml"), "-s", str(last), "--heads", "12", "-b", "64")
    outside = report(str(SPECS / "vit_encoder.yaml"), "-s", str(last + 1), "--heads", "12", "-b", "64")
    assert inside["forward"]["module"] == twin["module"]
    assert outside["forward"]["module"] != twin["module"]
    assert inside["backward"]["deterministic"] is True


def test_a_short_window_keeps_the_persistent_forward_at_long_calls():
    """mistral_7b: a long call runs the one-CTA-per-tile kernel unless its window spans fewer keys per row than
    the kernel's min_window_keys."""
    long_plan = next(p for p in lock("mistral_7b")["plans"] if p.get("min_window_keys"))
    keys, s = long_plan["min_window_keys"], str(long_plan["min_seqlen_q"])
    spec = str(SPECS / "mistral_7b.yaml")
    short = report(spec, "-s", s, "--heads", "32", "--kv-heads", "8", "--window", f"{keys - 2},0")  # keys - 1 wide
    wide = report(spec, "-s", s, "--heads", "32", "--kv-heads", "8", "--window", f"{keys - 1},0")  # keys wide
    assert short["forward"]["module"] == "fwd_sm90"
    assert wide["forward"]["module"] == long_plan["module"]
    assert wide["call"]["window"] == [keys - 1, 0]
    assert short["backward"] is None  # backward: false


def test_package_folder_and_spec_file_agree():
    by_spec = report(str(SPECS / "llama32_1b.yaml"), "-s", "3000", "--heads", "32", "--kv-heads", "8")
    by_package = report(str(ROOT / "generated" / "llama32_1b"), "-s", "3000", "--heads", "32", "--kv-heads", "8")
    assert by_spec == by_package


def test_packed_spec_dispatches_on_the_longest_sequence():
    out = report(str(SPECS / "qwen2_7b_packed.yaml"), "-s", "3000", "--heads", "28", "--kv-heads", "4", "-b", "3")
    assert out["call"]["packed"] is True
    assert out["forward"]["module"].startswith("fwd_sm90")


def test_text_output_names_every_kernel():
    code, out = dispatch(str(SPECS / "llama3_8b.yaml"), "-s", "4096", "--heads", "32", "--kv-heads", "8")
    assert code == 0, out
    modules = {p["module"] for p in lock("llama3_8b")["plans"]}
    for module in modules:
        assert module in out
    assert out.splitlines()[0].startswith("llama3_8b (sm90): batch 1, seqlen_q 4096")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--heads", "32", "--kv-heads", "7"], "kv heads (7) must divide q heads (32)"),
        (["--heads", "32", "--window", "3,3"], "window applies to sliding_window specs only"),
        (["--heads", "32", "--window", "5"], "--window"),
        (["--heads", "32", "--arch", "sm100"], "--arch: llama3_8b has no sm100 kernels"),
        (["--heads", "0"], "--heads"),
    ],
)
def test_bad_calls_and_options_are_one_problem_line(args, expected):
    code, out = dispatch(str(SPECS / "llama3_8b.yaml"), "-s", "1024", *args)
    assert code == 2
    assert expected in out
    assert "Traceback" not in out


def test_a_folder_that_is_not_a_package_is_refused(tmp_path):
    code, out = dispatch(str(tmp_path), "-s", "1024", "--heads", "8")
    assert code == 2 and "not a generated package" in out


def test_dispatch_leaves_an_imported_package_its_operators():
    """The runtime dispatch builds for a package folder does not register torch.compile operators, so a
    package this process imported keeps its own (their namespace is per folder)."""
    import importlib

    from fa4gen.api import library

    module = importlib.import_module("generated.llama32_1b")
    ns = library.namespace(module._forward)
    assert library._OWNERS[ns] is module._forward
    report(str(ROOT / "generated" / "llama32_1b"), "-s", "1024", "--heads", "32", "--kv-heads", "8")
    assert library._OWNERS[ns] is module._forward


def test_a_damaged_lock_file_is_one_problem_line(tmp_path):
    (tmp_path / "spec.lock.json").write_text("{not json")
    code, out = dispatch(str(tmp_path), "-s", "1024", "--heads", "8")
    assert code == 2 and "unreadable" in out and "fa4gen build" in out


def test_gqa_calls_take_the_head_loop_backward_from_its_cta_bound():
    """llama3_8b (32 q heads / 8 kv heads): the head-loop backward runs GQA calls whose key blocks x kv heads x
    batch reach its plan's min_kv_ctas, the fp32-workspace one below."""
    loop = next(p for p in lock("llama3_8b")["plans"] if p.get("gqa_head_loop"))
    blocks = -(-loop["min_kv_ctas"] // 8)  # key blocks a batch-1 call needs with 8 kv heads
    spec = str(SPECS / "llama3_8b.yaml")
    at = report(spec, "-s", str(blocks * loop["tile_n"]), "--heads", "32", "--kv-heads", "8")
    below = report(spec, "-s", str((blocks - 1) * loop["tile_n"]), "--heads", "32", "--kv-heads", "8")
    assert at["backward"]["module"] == loop["module"]
    assert at["backward"]["runs"].startswith(f"GQA / MQA calls (not packed) of at least {loop['min_kv_ctas']} CTAs")
    assert below["backward"]["module"] == "bwd_sm90"
    assert loop["module"] in {k["module"] for k in below["other_kernels"]}

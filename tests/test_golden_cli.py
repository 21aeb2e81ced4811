"""`fa4gen test`: argument handling, which checks run where, the table and the exit status, and
an end-to-end CPU run on a package outside the repository (compile + SASS + emulator)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fa4gen.cli.main import main
from fa4gen.golden import CheckResult, load_variant, run_variant
from fa4gen.golden import runner as golden_runner

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "generated"


def _fake_check(status="pass"):
    def check(variant, plan, **_):
        return CheckResult(variant.name, plan["arch"], "fake", status, "fake check")
    return check


@pytest.fixture
def fast_checks(monkeypatch):
    """Replace the compile and emulator checks with instant ones (the table logic is under test)."""
    calls = []

    def compile_check(variant, plan):
        calls.append(("compile", variant.name, plan["arch"]))
        return CheckResult(variant.name, plan["arch"], "compile + SASS", "pass", "fake")

    def emulator_check(variant, plan):
        calls.append(("emulator", variant.name, plan["arch"]))
        return CheckResult(variant.name, plan["arch"], "emulator vs reference", "pass", "fake")

    def gpu_check(variant, plan):
        calls.append(("gpu", variant.name, plan["arch"]))
        return [CheckResult(variant.name, plan["arch"], "kernel vs reference", "pass", "fake")]

    monkeypatch.setattr(golden_runner, "compile_and_sass", compile_check)
    monkeypatch.setattr(golden_runner, "emulator_vs_reference", emulator_check)
    monkeypatch.setattr(golden_runner, "kernel_numerics", gpu_check)
    monkeypatch.setattr("fa4gen.golden.has_hopper", lambda: False)
    return calls


def _invoke(*args, cwd=ROOT):
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(main, ["test", *args], catch_exceptions=False)
    finally:
        os.chdir(old)


def test_needs_an_argument():
    result = _invoke()
    assert result.exit_code == 2
    assert "name spec files or generated package folders, or pass --all" in result.stderr


def test_unknown_paths_and_unbuilt_specs_exit_2(tmp_path):
    spec = tmp_path / "fresh.yaml"
    spec.write_text("name: fresh_spec\ntargets: [sm90]\ndtype: bf16\nhead_dim: 64\n")
    result = _invoke(str(tmp_path / "missing.yaml"), str(spec), "--out", str(tmp_path / "out"))
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert any("missing.yaml" in line and "not found" in line for line in lines)
    missing = f"{tmp_path / 'out' / 'fresh_spec'} is not a generated package; run `fa4gen build"
    assert any(missing in line for line in lines)
    assert "Traceback" not in result.output


def test_all_with_no_packages_exits_2(tmp_path):
    (tmp_path / "empty").mkdir()
    result = _invoke("--all", "--out", str(tmp_path / "empty"))
    assert result.exit_code == 2
    assert "no generated packages found" in result.stderr


def test_cpu_runs_compile_and_emulator_per_target(fast_checks):
    result = _invoke("specs/deepseek_mla.yaml", str(GENERATED / "vit_encoder"))
    assert result.exit_code == 0, result.output
    # every built target of each variant is compiled and emulated; targets whose family is not
    # available yet appear as skipped rows
    expected, skipped = [], 0
    for name in ("deepseek_mla", "vit_encoder"):
        lock = json.loads((GENERATED / name / "spec.lock.json").read_text())
        for plan in lock["plans"]:
            expected += [("compile", name, plan["arch"]), ("emulator", name, plan["arch"])]
        skipped += len(lock.get("unavailable_targets", {}))
    assert fast_checks == expected
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows[0][:5] == ["variant", "arch", "check", "result", "time"]
    assert result.stdout.splitlines()[-1].startswith(f"{len(expected)} passed, 0 failed, {skipped} skipped")


def test_all_covers_every_generated_package(fast_checks):
    result = _invoke("--all")
    assert result.exit_code == 0, result.output
    tested = sorted({name for _, name, _ in fast_checks})
    assert tested == sorted(p.name for p in GENERATED.iterdir() if (p / "spec.lock.json").exists())


def test_gpu_runs_the_kernel_and_other_targets_compile(fast_checks, monkeypatch):
    variant = load_variant(GENERATED / "llama3_8b")
    fake = dict(variant.plans[0], arch="sm100", cute_arch="sm_100a")
    variant.lock = {**variant.lock, "plans": [*variant.plans, fake]}
    results = run_variant(variant, gpu=True)
    assert fast_checks == [("gpu", "llama3_8b", "sm90"), ("compile", "llama3_8b", "sm100"),
                           ("emulator", "llama3_8b", "sm100")]
    assert [r.check for r in results] == ["kernel vs reference", "compile + SASS", "emulator vs reference"]


def test_a_failing_check_exits_1_after_the_whole_table(fast_checks, monkeypatch):
    monkeypatch.setattr(golden_runner, "emulator_vs_reference", _fake_check("FAIL"))
    result = _invoke(str(GENERATED / "llama3_8b"), str(GENERATED / "vit_encoder"))
    assert result.exit_code == 1
    assert result.stdout.count(" FAIL ") == 2
    assert "2 passed, 2 failed, 0 skipped" in result.stdout


def test_a_crashing_check_is_a_failed_row_not_a_crash(fast_checks, monkeypatch):
    def boom(variant, plan):
        raise RuntimeError("emulator exploded")

    monkeypatch.setattr(golden_runner, "emulator_vs_reference", boom)
    result = _invoke(str(GENERATED / "vit_encoder"))
    assert result.exit_code == 1
    assert "RuntimeError: emulator exploded" in result.stdout


def test_a_plan_with_a_bad_algorithm_fails_the_emulator_check(tmp_path, monkeypatch, fast_checks):
    """The real emulator check on a package whose plan asks for a degree-1 polynomial everywhere."""
    from fa4gen.golden import checks

    monkeypatch.setattr(golden_runner, "emulator_vs_reference", checks.emulator_vs_reference)
    pkg = tmp_path / "vit_copy"
    shutil.copytree(GENERATED / "vit_encoder", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    lock = json.loads((pkg / "spec.lock.json").read_text())
    lock["plans"][0].update(poly_every=1, poly_coeffs=[1.0, 0.9218067623528994])
    (pkg / "spec.lock.json").write_text(json.dumps(lock))
    result = _invoke(str(pkg))
    assert result.exit_code == 1
    row = next(line for line in result.stdout.splitlines() if "emulator vs reference" in line)
    assert " FAIL " in row and "budget" in row


@pytest.mark.compile
def test_end_to_end_on_a_package_outside_the_repo(tmp_path):
    """Build a spec into a folder outside the repo and golden-test it from there, on the CPU."""
    spec = tmp_path / "tiny.yaml"
    spec.write_text("name: tiny_golden\ntargets: [sm90]\ndtype: fp16\nhead_dim: 64\nmask: {kind: causal}\n"
                    "return_lse: true\npipeline: {poly_exp: {share: 0.25}}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FA4GEN_QUIET": "1", "FA4GEN_CACHE_DIR": str(tmp_path / "cache")}
    cli = lambda *a: subprocess.run([sys.executable, "-m", "fa4gen", *a], cwd=tmp_path, env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=600)
    built = cli("build", "--out", "elsewhere", "tiny.yaml")
    assert built.returncode == 0, built.stderr
    result = cli("test", "--cpu", str(tmp_path / "elsewhere" / "tiny_golden"))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {tuple(line.split()[:4]) for line in result.stdout.splitlines()}
    assert ("tiny_golden", "sm90", "compile", "+") in rows  # "compile + SASS"
    assert any(line.startswith("tiny_golden") and "emulator vs reference" in line and " pass " in line
               for line in result.stdout.splitlines())
    assert "HGMMA" in result.stdout and "LDL/STL 0/0" in result.stdout
    same_by_spec = cli("test", "--cpu", "tiny.yaml", "--out", "elsewhere")
    assert same_by_spec.returncode == 0, same_by_spec.stdout + same_by_spec.stderr

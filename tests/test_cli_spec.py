"""Tests for the spec commands of the CLI: validate, schema, list, show, and error reporting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the package is used from the source tree, not installed
    sys.path.insert(0, str(ROOT))

from fa4gen.cli.main import main  # noqa: E402
from fa4gen.spec import load_spec  # noqa: E402

SPECS_DIR = ROOT / "specs"
BAD_SPEC = "name: bad\ntargets: [sm90]\ndtype: bf16\nhead_dim: 128\npipeline:\n  two_cta: true\n"


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def bad_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_SPEC)
    return path


def test_validate_specs_dir_ok(runner: CliRunner):
    result = runner.invoke(main, ["validate", str(SPECS_DIR)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == len(list(SPECS_DIR.glob("*.yaml")))
    assert all(line.startswith("ok  ") for line in lines)
    assert any("(deepseek_mla: targets sm90,sm100, d192/128, causal)" in line for line in lines)


def test_validate_bad_spec_exit_2_names_field(runner: CliRunner, bad_yaml: Path):
    result = runner.invoke(main, ["validate", str(bad_yaml), str(SPECS_DIR / "llama3_8b.yaml")])
    assert result.exit_code == 2
    assert result.stderr == f"{bad_yaml}: pipeline.two_cta: two_cta needs 'sm100' in targets " \
        "(got ['sm90'])\n"
    assert "Traceback" not in result.output
    assert "ok  " in result.stdout and "llama3_8b" in result.stdout


def test_validate_missing_path_exit_2(runner: CliRunner, tmp_path: Path):
    result = runner.invoke(main, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "not found" in result.stderr


def test_validate_subprocess_no_traceback(tmp_path: Path, bad_yaml: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "fa4gen", "validate", str(bad_yaml)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "pipeline.two_cta" in proc.stderr
    assert proc.stdout == ""


def test_spec_error_in_any_command_is_reported_not_raised(runner: CliRunner, tmp_path: Path):
    path = tmp_path / "syntax.yaml"
    path.write_text("name: x\ntargets: [sm90\n")
    result = runner.invoke(main, ["show", str(path)])
    assert result.exit_code == 2
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.stderr.startswith(f"{path}: <document>: YAML syntax error at line ")


def test_schema_prints_json(runner: CliRunner):
    result = runner.invoke(main, ["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    assert {"name", "targets", "dtype", "head_dim", "mask", "pipeline"} <= set(schema["properties"])


def test_list_table(runner: CliRunner):
    result = runner.invoke(main, ["list", str(SPECS_DIR)])
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["name", "targets", "dtype", "head", "dims", "mask", "file"]
    assert len(rows) == len(list(SPECS_DIR.glob("*.yaml")))
    gemma = next(r for r in rows if r.startswith("gemma2_9b "))
    assert "d256" in gemma and "sliding_window(left=4095, right=0)" in gemma


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_show_resolves_defaults(runner: CliRunner, fmt: str):
    path = SPECS_DIR / "mistral_7b.yaml"
    result = runner.invoke(main, ["show", str(path), "--format", fmt])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout) if fmt == "json" else yaml.safe_load(result.stdout)
    assert data == load_spec(path).model_dump(mode="json")
    assert data["head_dim_v"] == 128 and data["pipeline"]["tile_m"] == "auto"


def test_version(runner: CliRunner):
    result = runner.invoke(main, ["--version"])
    assert result.exit_code == 0 and result.stdout.startswith("fa4gen, version ")

"""CLI stage: `fa4gen plan`, `fa4gen build` error handling and `fa4gen cache`, through `python -m fa4gen`.

Expected outputs come from the Python API (plan_kernels, render_spec, DiskCache) so the CLI is
checked against the stages it wraps. Every run happens in a tmp project (copy of specs/).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import fa4gen_cli

from fa4gen.builder import render_spec
from fa4gen.compile.cache import DiskCache
from fa4gen.plan import plan_kernels
from fa4gen.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]

GOOD_EXTRA = "name: extra_ok\ntargets: [sm90]\ndtype: fp16\nhead_dim: 64\n"
BAD_TWO_PROBLEMS = "name: bad_spec\ntargets: [sm90]\ndtype: fp8\nhead_dim: 100\n"
OVER_BUDGET = (
    "name: too_big\ntargets: [sm90]\ndtype: bf16\nhead_dim: 256\n"
    "pipeline:\n  tile_n: 256\n  kv_stages: 4\n"
)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    return tmp_path


def _no_traceback(result: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in result.stderr + result.stdout


# --- plan --------------------------------------------------------------------------------------


def test_plan_prints_the_plan(work: Path):
    """A spec with backward: true, allow_gqa and one forward (gemma2_9b: d256, one CTA per tile) has three sm90
    plans: the forward, the backward of MHA calls, then the (GQA) backward, a blank line apart."""
    result = fa4gen_cli("plan", "specs/gemma2_9b.yaml", "--arch", "sm90", cwd=work)
    assert result.returncode == 0, result.stderr
    fwd, mha, bwd = plan_kernels(load_spec(work / "specs" / "gemma2_9b.yaml"), "sm90")
    assert (fwd.direction, mha.direction, bwd.direction) == ("fwd", "bwd", "bwd")
    assert result.stdout == "\n\n".join(p.describe() for p in (fwd, mha, bwd)) + "\n"
    fwd_text, mha_text, bwd_text = result.stdout.split("\n\n")
    assert fwd_text.startswith("plan gemma2_9b [sm90 fwd] -> module fwd_sm90\n")
    assert mha_text.startswith("plan gemma2_9b [sm90 bwd] -> module bwd_sm90_mha\n")
    assert bwd_text.startswith("plan gemma2_9b [sm90 bwd] -> module bwd_sm90\n")
    for plan, text in ((fwd, fwd_text), (mha, mha_text), (bwd, bwd_text)):
        lines = [line.split() for line in text.splitlines()]
        assert ["tile_m", str(plan.tile_m)] in lines and ["tile_n", str(plan.tile_n)] in lines
        smem = plan.budgets[0]
        assert f"shared memory per CTA: {smem.used} / {227 * 1024} bytes" in text
        assert re.search(r"register file per SM: \d+ / 65536 regs", text)
    assert ["tile_m", "128"] in [line.split() for line in fwd_text.splitlines()]
    assert ["deterministic", "False"] in [line.split() for line in bwd_text.splitlines()]


def test_plan_of_a_forward_only_spec_prints_one_plan(work: Path):
    result = fa4gen_cli("plan", "specs/mistral_7b.yaml", cwd=work)
    assert result.returncode == 0, result.stderr
    plans = plan_kernels(load_spec(work / "specs" / "mistral_7b.yaml"), "sm90")  # persistent + its long-call twin
    assert [p.direction for p in plans] == ["fwd", "fwd"]
    assert result.stdout == "\n\n".join(p.describe() for p in plans) + "\n"


def test_plan_json(work: Path):
    """--json prints one JSON document: the list of plans, as the lock file holds them."""
    result = fa4gen_cli("plan", "specs/gemma2_9b.yaml", "--json", cwd=work)
    assert result.returncode == 0, result.stderr
    plans = plan_kernels(load_spec(work / "specs" / "gemma2_9b.yaml"), "sm90")
    printed = json.loads(result.stdout)
    assert printed == [json.loads(plan.to_json()) for plan in plans]
    assert [p["direction"] for p in printed] == ["fwd", "bwd", "bwd"]  # (allow_gqa: the MHA calls' backward too)
    assert printed == json.loads((ROOT / "generated" / "gemma2_9b" / "spec.lock.json").read_text())["plans"]


def test_plan_sm100(work: Path):
    result = fa4gen_cli("plan", "specs/deepseek_mla.yaml", "--arch", "sm100", cwd=work)
    assert result.returncode == 0, result.stderr
    (plan,) = plan_kernels(load_spec(work / "specs" / "deepseek_mla.yaml"), "sm100")
    assert plan.describe() in result.stdout
    assert "TMEM columns" in result.stdout
    _no_traceback(result)


def test_plan_without_arch_lists_every_target(work: Path):
    result = fa4gen_cli("plan", "specs/deepseek_mla.yaml", cwd=work)
    assert result.returncode == 0, result.stderr
    spec = load_spec(work / "specs" / "deepseek_mla.yaml")
    for arch in ("sm90", "sm100"):
        (plan,) = plan_kernels(spec, arch)
        assert plan.describe() in result.stdout
    assert "not available yet" not in result.stdout + result.stderr


def test_plan_arch_not_in_targets(work: Path):
    result = fa4gen_cli("plan", "specs/llama3_8b.yaml", "--arch", "sm100", cwd=work)
    assert result.returncode == 2
    assert "targets:" in result.stderr and "not among the spec's targets" in result.stderr
    _no_traceback(result)


def test_plan_arch_over_a_directory_picks_the_specs_that_target_it(work: Path):
    # it stopped at the first spec without the target (session 12 review)
    result = fa4gen_cli("plan", "specs", "--arch", "sm100", cwd=work)
    assert result.returncode == 0, result.stderr
    sm100 = [p for p in sorted((work / "specs").iterdir()) if "sm100" in load_spec(p).targets]
    assert sm100 and len(sm100) < len(list((work / "specs").iterdir()))
    for path in sm100:
        for plan in plan_kernels(load_spec(path), "sm100"):
            assert plan.describe() in result.stdout
    assert "sm90 fwd" not in result.stdout
    only_sm90 = work / "only_sm90"
    only_sm90.mkdir()
    (only_sm90 / "a.yaml").write_text((work / "specs" / "llama3_8b.yaml").read_text())
    result = fa4gen_cli("plan", "only_sm90", "--arch", "sm100", cwd=work)
    assert result.returncode == 2 and "no spec in only_sm90 targets it" in result.stderr
    _no_traceback(result)


def test_plan_over_budget(work: Path):
    (work / "big.yaml").write_text(OVER_BUDGET)
    result = fa4gen_cli("plan", "big.yaml", cwd=work)
    assert result.returncode == 2
    assert "shared memory" in result.stderr and result.stderr.startswith("too_big [sm90]: pipeline")
    _no_traceback(result)


# --- build errors ------------------------------------------------------------------------------


def test_build_invalid_spec(work: Path):
    (work / "bad.yaml").write_text(BAD_TWO_PROBLEMS)
    out = work / "X"
    result = fa4gen_cli("build", "bad.yaml", "--out", str(out), cwd=work)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith("bad.yaml: dtype: ") and "'fp8'" in lines[0]
    assert lines[1].startswith("bad.yaml: head_dim: ") and "100" in lines[1]
    assert not (out / "bad_spec").exists()
    _no_traceback(result)


def test_build_never_replaces_a_folder_it_did_not_generate(work: Path):
    """A spec named like a folder of the user's (here `specs`) must not empty it: the package folder's
    stray files are removed on a rebuild, so the build refuses a folder without spec.lock.json, and an
    <out>/__init__.py it did not write. Nothing is written; the error names the field."""
    (work / "evil.yaml").write_text("name: specs\ntargets: [sm90]\ndtype: bf16\nhead_dim: 64\n")
    before = sorted(p.name for p in (work / "specs").iterdir())
    result = fa4gen_cli("build", "evil.yaml", "--out", str(work), cwd=work)
    assert result.returncode == 2 and "name: " in result.stderr and "not a generated package" in result.stderr
    assert sorted(p.name for p in (work / "specs").iterdir()) == before
    assert not (work / "__init__.py").exists()
    _no_traceback(result)
    foreign = work / "mine"
    foreign.mkdir()
    (foreign / "__init__.py").write_text("VALUE = 1\n")
    (work / "ok.yaml").write_text(GOOD_EXTRA)
    result = fa4gen_cli("build", "ok.yaml", "--out", str(foreign), cwd=work)
    assert result.returncode == 2 and "--out: " in result.stderr
    assert (foreign / "__init__.py").read_text() == "VALUE = 1\n" and not (foreign / "extra_ok").exists()
    _no_traceback(result)


def test_build_good_and_bad(work: Path):
    (work / "bad.yaml").write_text(BAD_TWO_PROBLEMS)
    out = work / "X"
    result = fa4gen_cli("build", "specs/llama3_8b.yaml", "bad.yaml", "--out", str(out), cwd=work)
    assert result.returncode == 2
    assert [line.split(":")[1].strip() for line in result.stderr.splitlines()] == ["dtype", "head_dim"]
    assert not (out / "bad_spec").exists()
    pkg, _, _ = render_spec(load_spec(work / "specs" / "llama3_8b.yaml"), "specs/llama3_8b.yaml")
    written = {p.name: p.read_text() for p in (out / "llama3_8b").iterdir()}
    assert written == pkg.files  # (test_render checks these against the committed generated/)
    assert sorted(written) == ["__init__.py", "bwd_sm90.py", "bwd_sm90_gqa.py", "bwd_sm90_mha.py", "fwd_sm90.py", "fwd_sm90_long.py",
                               "spec.lock.json"]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("llama3_8b ")]
    # one row per kernel
    assert [row[2] for row in rows] == ["fwd_sm90", "fwd_sm90_long", "bwd_sm90_gqa", "bwd_sm90_mha", "bwd_sm90"]
    assert all(" ".join(row[3:6]) == "wrote 7 file(s)" for row in rows)
    # each kernel's row shows its own plan's shared memory
    plans = plan_kernels(load_spec(work / "specs" / "llama3_8b.yaml"), "sm90")
    assert [row[-4] for row in rows] == [f"{p.budgets[0].used // 1024}K" for p in plans]


def test_build_plan_failure_writes_nothing_for_that_spec(work: Path):
    (work / "big.yaml").write_text(OVER_BUDGET)
    (work / "ok.yaml").write_text(GOOD_EXTRA)
    out = work / "X"
    result = fa4gen_cli("build", "big.yaml", "ok.yaml", "--out", str(out), cwd=work)
    assert result.returncode == 2
    assert "shared memory" in result.stderr
    assert all(line.startswith("too_big [sm90]: ") for line in result.stderr.splitlines())
    assert not (out / "too_big").exists()
    assert (out / "extra_ok" / "fwd_sm90.py").is_file()
    _no_traceback(result)


def test_build_writes_the_sm100_kernel(work: Path):
    out = work / "X"
    result = fa4gen_cli("build", "specs/deepseek_mla.yaml", "--out", str(out), cwd=work)
    assert result.returncode == 0, result.stderr
    row = [line for line in result.stdout.splitlines() if " sm100 " in line]
    assert len(row) == 1 and "fwd_sm100" in row[0] and "not available" not in row[0]
    assert (out / "deepseek_mla" / "fwd_sm100.py").is_file()
    lock = json.loads((out / "deepseek_mla" / "spec.lock.json").read_text())
    assert [p["arch"] for p in lock["plans"]] == ["sm90", "sm100"]
    assert lock["unavailable_targets"] == {}


def test_build_missing_file(work: Path):
    result = fa4gen_cli("build", "nope.yaml", "--out", "X", cwd=work)
    assert result.returncode == 2
    assert result.stderr.startswith("nope.yaml: <document>: ")
    assert "not found" in result.stderr
    assert not (work / "X").exists()
    _no_traceback(result)


def test_build_yaml_syntax_error(work: Path):
    (work / "broken.yaml").write_text("name: broken\ntargets: [sm90\ndtype: bf16\n")
    result = fa4gen_cli("build", "broken.yaml", "--out", "X", cwd=work)
    assert result.returncode == 2
    assert "YAML syntax error" in result.stderr
    m = re.search(r"at line (\d+), column (\d+)", result.stderr)
    assert m and 2 <= int(m.group(1)) <= 4
    assert not (work / "X").exists()
    _no_traceback(result)


def test_build_check_with_problems_exits_2_not_1(work: Path):
    """Spec problems win over staleness: exit 2, and the problem is named."""
    (work / "bad.yaml").write_text(BAD_TWO_PROBLEMS)
    result = fa4gen_cli("build", "--check", "bad.yaml", "--out", "X", cwd=work)
    assert result.returncode == 2
    assert "head_dim" in result.stderr


# --- cache ---------------------------------------------------------------------------------------


def test_cache_ls_and_clear(tmp_path: Path):
    root = tmp_path / "cache"
    env = {"FA4GEN_CACHE_DIR": str(root)}
    empty = fa4gen_cli("cache", "ls", cwd=tmp_path, env=env)
    assert empty.returncode == 0, empty.stderr
    assert f"cache: {root} (0 entries)" in empty.stdout

    key = "ab" * 32
    DiskCache(root).put(key, b"\x7fELF fake object", {"name": "llama3_8b.fwd_sm90", "arch": "sm_90a", "registers": 168})
    listed = fa4gen_cli("cache", "ls", cwd=tmp_path, env=env)
    assert listed.returncode == 0
    assert "(1 entries)" in listed.stdout
    row = [line for line in listed.stdout.splitlines() if line.startswith(key[:16])]
    assert len(row) == 1 and row[0].split()[1:4] == ["llama3_8b.fwd_sm90", "sm_90a", "168"]

    cleared = fa4gen_cli("cache", "clear", cwd=tmp_path, env=env)
    assert cleared.returncode == 0
    assert cleared.stdout.strip() == f"removed 1 entries from {root}"
    assert not (root / key).exists()
    assert DiskCache(root).ls() == []
    assert "(0 entries)" in fa4gen_cli("cache", "ls", cwd=tmp_path, env=env).stdout


def test_cache_clear_leaves_folders_that_are_not_entries_and_ls_survives_damaged_meta(tmp_path: Path):
    """A mistyped FA4GEN_CACHE_DIR pointing at a project: `cache clear` removes only folders put() made
    (it deleted src/ and docs/ before); a meta.json whose `created` is not a time does not crash `ls`."""
    root = tmp_path / "proj"
    (root / "src").mkdir(parents=True)
    (root / "src" / "model.py").write_text("x = 1\n")
    (root / "docs").mkdir()
    (root / "docs" / "README.md").write_text("# mine\n")
    env = {"FA4GEN_CACHE_DIR": str(root)}
    DiskCache(root).put("cd" * 32, b"obj", {"name": "k"})
    meta = json.loads((root / ("cd" * 32) / "meta.json").read_text())
    for created in ("yesterday", None, 1e20):
        meta["created"] = created
        (root / ("cd" * 32) / "meta.json").write_text(json.dumps(meta))
        listed = fa4gen_cli("cache", "ls", cwd=tmp_path, env=env)
        assert listed.returncode == 0 and "(1 entries)" in listed.stdout, listed.stderr
        _no_traceback(listed)
    cleared = fa4gen_cli("cache", "clear", cwd=tmp_path, env=env)
    assert cleared.stdout.strip() == f"removed 1 entries from {root}"
    assert (root / "src" / "model.py").exists() and (root / "docs" / "README.md").exists()


def test_build_problems_that_used_to_lose_data_or_crash(work: Path):
    """A spec that fails to load keeps its generated package (it was removed as an orphan); two specs of
    one name are refused (the second silently overwrote the first); an --out that is a file is named, not
    a traceback; a stale check names the real --out."""
    out = work / "gen"
    assert fa4gen_cli("build", "--out", str(out), cwd=work).returncode == 0
    (work / "specs" / "mistral_7b.yaml").write_text("name: mistral_7b\nname: again\n")
    broken = fa4gen_cli("build", "--out", str(out), cwd=work)
    assert broken.returncode == 2 and "mistral_7b.yaml" in broken.stderr
    assert (out / "mistral_7b" / "spec.lock.json").exists()
    _no_traceback(broken)
    (work / "twin.yaml").write_text(GOOD_EXTRA)
    (work / "twin2.yaml").write_text(GOOD_EXTRA)
    twins = fa4gen_cli("build", "twin.yaml", "twin2.yaml", "--out", str(work / "t"), cwd=work)
    assert twins.returncode == 2 and "twin2.yaml: name: 'extra_ok' is also the name of twin.yaml" in twins.stderr
    (work / "afile").write_text("")
    to_file = fa4gen_cli("build", "twin.yaml", "--out", "afile", cwd=work)
    assert to_file.returncode == 2 and "--out: cannot write" in to_file.stderr
    _no_traceback(to_file)
    (out / "llama3_8b" / "__init__.py").write_text((out / "llama3_8b" / "__init__.py").read_text() + "# edited\n")
    check = fa4gen_cli("build", "specs/llama3_8b.yaml", "--check", "--out", str(out), cwd=work)
    assert check.returncode == 1 and f"{out}/ is stale: run `fa4gen build --out {out}`" in check.stderr


def test_build_output_does_not_depend_on_the_working_directory_and_names_misses(work: Path):
    """The header's spec path is relative to --out's parent, so a check from specs/ agrees with one from
    the project; --arch a named spec does not target is an error, not silently ignored; --check on an
    empty --out says the package is missing in one line instead of printing every file as a diff."""
    assert fa4gen_cli("build", "specs/llama3_8b.yaml", "--out", "generated", cwd=work).returncode == 0
    check = fa4gen_cli("build", "llama3_8b.yaml", "--check", "--out", "../generated", cwd=work / "specs")
    assert check.returncode == 0, check.stderr
    arch = fa4gen_cli("build", "specs/llama3_8b.yaml", "--arch", "sm100", "--out", "x", cwd=work)
    assert arch.returncode == 2 and "--arch: sm100 not among the spec's targets (sm90)" in arch.stderr
    missing = fa4gen_cli("build", "specs/llama3_8b.yaml", "--check", "--out", "empty", cwd=work)
    assert missing.returncode == 1 and "empty/llama3_8b is missing (not built yet)" in missing.stderr
    assert "@@" not in missing.stderr


# --- inspect and cache (session 13 review) -------------------------------------------------------


def _cli(args, monkeypatch, cwd):
    from click.testing import CliRunner

    from fa4gen.cli.main import main

    monkeypatch.chdir(cwd)
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_inspect_exits_1_when_a_kernel_fails_to_compile(monkeypatch):
    import fa4gen.cli.build_cmds as cmds

    def failing(jobs, **_):
        return [cmds.KernelReport(j.plan.arch, j.plan.module, "failed", "RuntimeError: nvdisasm failed (exit 3)")
                for j in jobs]

    monkeypatch.setattr(cmds, "compile_jobs", failing)
    result = _cli(["inspect", "specs/mistral_7b.yaml"], monkeypatch, ROOT)
    assert result.exit_code == 1 and "failed" in result.output and "nvdisasm failed" in result.output


def test_inspect_refuses_a_named_spec_without_the_arch_and_negative_opcodes(monkeypatch):
    result = _cli(["inspect", "--arch", "sm100", "specs/mistral_7b.yaml"], monkeypatch, ROOT)
    assert result.exit_code == 2 and "--arch: sm100 not among the spec's targets (sm90)" in result.output
    result = _cli(["inspect", "--opcodes", "-3", "specs/mistral_7b.yaml"], monkeypatch, ROOT)
    assert result.exit_code == 2 and "--opcodes" in result.output


def test_cache_clear_removes_only_its_own_entries_and_locks(tmp_path: Path, monkeypatch):
    """A mistyped FA4GEN_CACHE_DIR (a project folder): clear removed its poetry.lock, Cargo.lock and empty
    build/ folder; now only entries put() made and their <64-hex-key>.lock files go."""
    from fa4gen.compile.cache import DiskCache

    root = tmp_path / "project"
    cache = DiskCache(root)
    key = "ab" * 32
    cache.put(key, b"object", {"name": "k"})
    for name in ("poetry.lock", "Cargo.lock", "cd" * 32 + ".lock"):  # the last: an orphan lock of the cache's
        (root / name).write_text("x")
    (root / "build").mkdir()
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(root))
    result = _cli(["cache", "clear"], monkeypatch, tmp_path)
    assert result.exit_code == 0 and result.output.startswith("removed 1 entries")
    assert sorted(p.name for p in root.iterdir()) == ["Cargo.lock", "build", "poetry.lock"]


def test_cache_commands_on_a_file_or_an_entry_they_cannot_remove(tmp_path: Path, monkeypatch):
    from fa4gen.compile.cache import DiskCache

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(not_a_dir))
    for cmd in ("ls", "clear"):
        result = _cli(["cache", cmd], monkeypatch, tmp_path)
        assert result.exit_code == 2 and "is not a folder" in result.output, cmd
    root = tmp_path / "c"
    DiskCache(root).put("ef" * 32, b"object", {"name": "k"})
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(root))
    monkeypatch.setattr("shutil.rmtree", lambda *a, **k: None)  # as if the entry's files were read-only
    result = _cli(["cache", "clear"], monkeypatch, tmp_path)
    assert result.exit_code == 2 and "could not remove cache entry" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("module", ["fa4gen.cli.build_cmds", "fa4gen.cli.dispatch_cmd", "fa4gen.cli.test_cmd",
                                    "fa4gen.cli.main"])
def test_each_cli_module_imports_first_in_a_fresh_process(module):
    """Any CLI module imported first (a fresh interpreter, as a test file run alone imports it) loads: dispatch_cmd
    once took ARCH_CHOICE from build_cmds while build_cmds, importing main, was still half-initialized (ImportError
    when build_cmds came first); the choice now lives in main, which every command module imports."""
    import sys

    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

"""`fa4gen build --compile` / `fa4gen inspect` and tools/prebuild.py compile many kernels in parallel
processes (`fa4gen.builder.compile_jobs`): what the processes store must be what this process's key finds
(the second build reports every kernel cached without compiling), a kernel that fails, or a compile process
that dies, is reported for that kernel while the others finish, and the process count follows --jobs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import ROOT, fa4gen_cli

from fa4gen.builder import CompileJob, compile_jobs, compile_workers, plan_spec, render_spec, write_package
from fa4gen.spec import spec_from_dict

# a forward-only d64 spec without a mask: two small kernels (the persistent short-call one and the long one; tile_m
# set, since auto adds a third, the 128-row twin for the seqlen_q that pad 192-row tiles worst)
SPEC = dict(name="jobs_probe", targets=["sm90"], dtype="bf16", head_dim=64, mask={"kind": "none"},
            pipeline={"tile_m": 192})
SPEC_YAML = "name: jobs_probe\ntargets: [sm90]\ndtype: bf16\nhead_dim: 64\nmask: {kind: none}\npipeline: {tile_m: 192}\n"


def test_worker_count():
    assert compile_workers(1, 10) == 1
    assert compile_workers(4, 3) == 3  # never more processes than kernels
    assert compile_workers(4, 0) == 1
    assert 1 <= compile_workers(0, 5) <= 5  # auto: CPUs and memory, at most the kernels
    with pytest.raises(ValueError, match="jobs: expected 0"):
        compile_workers(-2, 5)


def _jobs(root: Path, sources: dict[str, str] | None = None) -> list[CompileJob]:
    """The probe spec rendered under root; `sources` replaces modules' text (broken kernels)."""
    spec = spec_from_dict(SPEC, source="<dict>")
    pkg, plans, _ = render_spec(spec, "<dict>")
    write_package(pkg, root)
    for module, text in (sources or {}).items():
        (root / spec.name / f"{module}.py").write_text(text)
    return [CompileJob(root / spec.name, f"probe.{spec.name}", p, spec.name) for p in plans]


def test_a_broken_kernel_and_a_dead_compile_process_are_reported_per_kernel(tmp_path, cache_root):
    """One module does not parse (its compile fails in the process, with the error), the other ends its
    compile process (os._exit while it is traced): both come back as "failed" with the reason, in job order,
    and the build does not hang or raise."""
    pytest.importorskip("cutlass")  # the dying module dies where a compile would trace it
    plans = plan_spec(spec_from_dict(SPEC, source="<dict>"))[0]
    assert len(plans) == 2
    broken, dying = plans[0].module, plans[1].module
    jobs = _jobs(tmp_path, {broken: "def (:\n", dying: "import os\nos._exit(3)\n"})
    lines = []
    reports = compile_jobs(jobs, keep_sass=False, workers=2, log=lines.append)
    assert [r.module for r in reports] == [broken, dying]
    assert all(r.status == "failed" for r in reports), reports
    assert "SyntaxError" in reports[0].detail or "compile process died" in reports[0].detail
    assert "compile process died" in reports[1].detail and "--jobs 1" in reports[1].detail
    assert lines[0] == "compiling 2 kernels in 2 processes ..."
    assert not any(cache_root.glob("*/meta.json"))  # nothing stored


@pytest.mark.compile
def test_build_compiles_in_processes_and_the_next_build_finds_every_kernel(tmp_path, cache_root):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "jobs_probe.yaml").write_text(SPEC_YAML)
    env = {"FA4GEN_CACHE_DIR": str(cache_root)}
    first = fa4gen_cli("build", "specs", "--compile", "--jobs", "2", "--no-sass", cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr
    assert "compiling 2 kernels in 2 processes ..." in first.stderr
    assert "[2/2, " in first.stderr and "jobs_probe.fwd_sm90" in first.stderr
    rows = [line.split() for line in first.stdout.splitlines() if line.startswith("jobs_probe")]
    assert [r[2:4] for r in rows] == [["fwd_sm90", "compiled"], ["fwd_sm90_long", "compiled"]]
    assert all(r[5].isdigit() for r in rows)  # registers: the compile processes' meta came back
    # the keys the processes stored under are the ones this process computes: nothing compiles again
    again = fa4gen_cli("build", "specs", "--compile", "--no-sass", cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr
    assert "compiling" not in again.stderr
    assert [line.split()[2:4] for line in again.stdout.splitlines() if line.startswith("jobs_probe")] == [
        ["fwd_sm90", "cached"], ["fwd_sm90_long", "cached"]]
    # --jobs 1 compiles in the build's own process; with the SASS asked for, the cached entries (stored
    # without it) compile their listing there, one line per kernel
    sass = fa4gen_cli("build", "specs", "--compile", "--jobs", "1", cwd=tmp_path, env=env)
    assert sass.returncode == 0, sass.stderr
    assert sass.stderr.count("compiling jobs_probe.") == 2 and "processes" not in sass.stderr
    assert all(line.split()[8] != "-" for line in sass.stdout.splitlines() if line.startswith("jobs_probe"))


def test_a_script_without_a_main_guard_compiles_in_processes(tmp_path):
    """The compile processes are plain subprocesses: a user's script that calls compile_jobs at top level (no
    `if __name__ == "__main__":`) runs once, where a spawned multiprocessing child would run it again in
    every worker (which then dies re-entering the pool)."""
    import subprocess
    import sys

    script = tmp_path / "build_them.py"
    script.write_text(
        "from pathlib import Path\n"
        "from fa4gen.builder import CompileJob, compile_jobs, plan_spec\n"
        "from fa4gen.spec import spec_from_dict\n"
        f"plans = plan_spec(spec_from_dict({SPEC!r}, source='<dict>'))[0]\n"
        "print('SCRIPT RAN')\n"
        "jobs = [CompileJob(Path('no_such_package'), 'x', p) for p in plans]\n"
        "for r in compile_jobs(jobs, keep_sass=False, workers=2, log=print):\n"
        "    print('REPORT', r.module, r.status, r.detail.split(':')[0])\n"
    )
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "FA4GEN_CACHE_DIR": str(tmp_path / "c")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("SCRIPT RAN") == 1 and "compiling 2 kernels in 2 processes ..." in out.stdout
    reports = [line.split() for line in out.stdout.splitlines() if line.startswith("REPORT")]
    assert [r[2:] for r in reports] == [["failed", "FileNotFoundError"]] * 2, out.stdout


def test_build_rejects_a_negative_job_count(tmp_path):
    result = fa4gen_cli("build", "--compile", "--jobs", "-1", cwd=tmp_path)
    assert result.returncode == 2 and "--jobs" in result.stderr


def test_precompile_refuses_bad_arguments_before_compiling(cache_root):
    from fa4gen import build

    pkg = build(SPEC)
    import torch

    before = sorted(cache_root.glob("*/meta.json"))  # (the module's cache: other tests' entries)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"precompile: arch: no CUDA device here to take it from; name one of \['sm90'\]"):
            pkg.precompile()
    with pytest.raises(ValueError, match=r"precompile: arch: expected one of \['sm90'\], got 'sm100'"):
        pkg.precompile("sm100")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="precompile: jobs: expected 0"):
            pkg.precompile("sm90", jobs=bad)
    assert sorted(cache_root.glob("*/meta.json")) == before  # nothing compiled


@pytest.mark.compile
def test_precompile_compiles_every_kernel_of_the_package_once(cache_root):
    """A package's precompile() compiles its kernels for the arch in parallel processes; the entries are the
    ones its calls look up (a second precompile finds them all)."""
    from fa4gen import build
    from fa4gen.compile.cache import DiskCache
    from fa4gen.compile.generated import cached_meta

    pkg = build(SPEC)
    assert pkg.precompile("sm90", jobs=2) == {"fwd_sm90": "compiled", "fwd_sm90_long": "compiled"}
    assert pkg.precompile("sm90") == {"fwd_sm90": "cached", "fwd_sm90_long": "cached"}
    op = pkg._forward
    for plan in (op.forward_plan("sm90", 128), op.forward_plan("sm90", 1 << 20)):  # the calls' two kernels
        assert cached_meta(op.dir / f"{plan['module']}.py", plan, DiskCache()) is not None


def test_build_without_compile_imports_no_compile_stack(tmp_path):
    """`fa4gen build` / `--check` only render: they run where the compile stack's dependencies (filelock,
    CuTe-DSL) are missing, as they did before compile_jobs (which now returns before importing it)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['filelock'] = None\n"  # an import of it now fails
            "from fa4gen.cli.main import main\n"
            "main(['build', '--check'], prog_name='fa4gen')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]


def test_precompile_of_several_packages_refuses_what_is_not_one(cache_root):
    import fa4gen

    pkg = fa4gen.build(SPEC)
    with pytest.raises(TypeError, match=r"precompile: packages\[1\]: expected a generated package"):
        fa4gen.precompile(pkg, "generated.llama3_8b", arch="sm90")
    with pytest.raises(TypeError, match="got none"):
        fa4gen.precompile(arch="sm90")
    with pytest.raises(ValueError, match=r"jobs_probe: precompile: arch: expected one of \['sm90'\], got 'sm100'"):
        fa4gen.precompile(pkg, arch="sm100")
    with pytest.raises(ValueError, match="precompile: jobs: expected 0"):
        fa4gen.precompile(pkg, arch="sm90", jobs=-1)


@pytest.mark.compile
def test_precompile_of_several_packages_compiles_them_in_one_pool(cache_root):
    """fa4gen.precompile(a, b): both packages' kernels in one pool of compile processes, per package the
    statuses a package's own precompile() reports; a second call finds them all in the cache."""
    import fa4gen

    a, b = fa4gen.build(SPEC), fa4gen.build(dict(SPEC, name="jobs_probe_b"))
    first = fa4gen.precompile(a, b, arch="sm90", jobs=2)
    assert sorted(first) == ["jobs_probe", "jobs_probe_b"]
    assert first["jobs_probe_b"] == {"fwd_sm90": "compiled", "fwd_sm90_long": "compiled"}
    assert set(first["jobs_probe"]) == {"fwd_sm90", "fwd_sm90_long"}  # (compiled by an earlier test, or here)
    assert fa4gen.precompile(a, b, arch="sm90") == {n: {"fwd_sm90": "cached", "fwd_sm90_long": "cached"}
                                                    for n in ("jobs_probe", "jobs_probe_b")}
    assert b.precompile("sm90") == {"fwd_sm90": "cached", "fwd_sm90_long": "cached"}


def test_gpu_suites_compile_the_selected_tests_packages_ahead(monkeypatch):
    """conftest.precompile_selected (the GPU suites' module fixture): on a Hopper GPU, one pool compiles the
    packages named by this module's selected tests (each once), only the directions asked for; elsewhere nothing."""
    from types import SimpleNamespace

    import torch
    from conftest import precompile_selected

    import fa4gen.api.runtime as runtime

    here, other = SimpleNamespace(), SimpleNamespace()
    item = lambda module, **params: SimpleNamespace(module=module, callspec=SimpleNamespace(params=params))  # noqa: E731
    items = [item(here, name="b"), item(here, name="a", shape=1), item(here, name="b"), item(other, name="c"),
             SimpleNamespace(module=here), item(here, dtype="bf16")]
    request = SimpleNamespace(module=here, session=SimpleNamespace(items=items))
    calls = []
    monkeypatch.setattr(runtime, "precompile_ops", lambda targets, directions: calls.append((targets, directions)))
    package_of = lambda name: SimpleNamespace(_forward=f"op_{name}")  # noqa: E731
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    precompile_selected(request, package_of)
    assert calls == []  # no GPU: the tests skip, nothing compiles
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    precompile_selected(request, package_of, directions=("fwd",))
    assert calls == [([("op_a", "sm90"), ("op_b", "sm90")], ("fwd",))]

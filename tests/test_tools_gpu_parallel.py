"""tools/gpu_parallel.sh runs commands side by side on the GPU machine and waits for exactly those
processes (session 19's `while pgrep -f pytest` matched the device call's own shell and spun until the
call's limit). Checked here with plain shell commands: every command's log and exit status, the count
of failures as the exit status, a cache directory per command, the tarball under $OUT, bad names."""

import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "gpu_parallel.sh"


def _run(*args, out: Path | None = None):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run(["bash", str(TOOL), *args], capture_output=True, text=True, env=env, timeout=60)


def test_waits_for_each_command_and_counts_failures(tmp_path):
    # the first command names pytest in its command line, as the GPU suites do, and outlives the others
    done = _run("slow", "echo pytest; sleep 1; echo finished slow", "bad", "echo oops; exit 3",
                "cache", "echo $FA4GEN_CACHE_DIR", out=tmp_path)
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == ["== slow: exit 0", "pytest", "finished slow"]
    assert "== bad: exit 3" in lines and "oops" in lines
    assert "/tmp/fa4gen_par_cache" in lines
    assert not (tmp_path / "gpu_parallel").exists()  # packed: a device call returns at most 8 files
    with tarfile.open(tmp_path / "gpu_parallel.tgz") as tar:
        names = sorted(tar.getnames())
        assert names == ["gpu_parallel", "gpu_parallel/bad.txt", "gpu_parallel/cache.txt", "gpu_parallel/slow.txt"]
        assert tar.extractfile("gpu_parallel/slow.txt").read().decode() == "pytest\nfinished slow\n"


def test_all_passing_exits_zero(tmp_path):
    done = _run("a", "true", "b", "echo b", out=tmp_path)
    assert done.returncode == 0
    assert "== a: exit 0" in done.stdout and "== b: exit 0" in done.stdout


def test_rejects_bad_arguments(tmp_path):
    assert _run(out=tmp_path).returncode == 2
    assert _run("only-a-name", out=tmp_path).returncode == 2
    bad = _run("no/slash", "true", out=tmp_path)
    assert bad.returncode == 2 and "NAME 'no/slash'" in bad.stderr
    twice = _run("x", "true", "x", "true", out=tmp_path)
    assert twice.returncode == 2 and "given twice" in twice.stderr

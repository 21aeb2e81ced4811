"""tools/device_trim.sh: docs/ and the unnamed tests/ files out of the tree for a device call, and back."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "device_trim.sh"

pytestmark = pytest.mark.skipif(shutil.which("git") is None or shutil.which("bash") is None,
                                reason="needs git and bash")


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "tools" / "device_trim.sh")
    (root / "docs").mkdir()
    (root / "docs" / "PERF.md").write_text("x" * 5000)
    (root / "tests").mkdir()
    for name in ("conftest.py", "test_a.py", "test_b.py"):
        (root / "tests" / name).write_text(f"# {name}\n")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    return root


def _run(root: Path, stash: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "tools" / "device_trim.sh"), *args], cwd=root, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "FA4GEN_TRIM_DIR": str(stash)})


def test_out_keeps_conftest_and_named_tests_then_back_restores(tmp_path):
    root, stash = _tree(tmp_path), tmp_path / "stash"
    res = _run(root, stash, "out", "tests/test_a.py")
    assert res.returncode == 0, res.stderr
    assert not (root / "docs").exists() and (stash / "docs" / "PERF.md").exists()
    assert sorted(p.name for p in (root / "tests").iterdir()) == ["conftest.py", "test_a.py"]
    assert "MiB (limit 64)" in res.stdout
    # a second trim while one is out is refused, and moves nothing
    again = _run(root, stash, "out")
    assert again.returncode == 2 and "back' first" in again.stderr
    assert (root / "tests" / "test_a.py").exists()
    res = _run(root, stash, "back")
    assert res.returncode == 0, res.stderr
    assert (root / "docs" / "PERF.md").read_text() == "x" * 5000
    assert sorted(p.name for p in (root / "tests").iterdir()) == ["conftest.py", "test_a.py", "test_b.py"]
    assert not stash.exists()
    nothing = _run(root, stash, "back")
    assert nothing.returncode == 2 and "nothing is out" in nothing.stderr


def test_refusals_name_the_problem(tmp_path):
    root, stash = _tree(tmp_path), tmp_path / "stash"
    missing = _run(root, stash, "out", "test_nope.py")
    assert missing.returncode == 2 and "no tests/test_nope.py" in missing.stderr
    assert (root / "docs").exists() and not stash.exists()  # nothing moved
    assert _run(root, stash, "out").returncode == 0
    (root / "tests" / "test_b.py").write_text("# new\n")  # reappeared meanwhile: back must not overwrite it
    clash = _run(root, stash, "back")
    assert clash.returncode == 2 and "tests/test_b.py exists" in clash.stderr
    assert (root / "tests" / "test_b.py").read_text() == "# new\n" and (stash / "docs").exists()


def test_size_counts_tracked_files_present_and_named_paths(tmp_path):
    root, stash = _tree(tmp_path), tmp_path / "stash"
    (root / "big").write_bytes(b"\0" * (3 * 1048576))
    with_big = _run(root, stash, "size", "big")
    without = _run(root, stash, "size")
    assert with_big.returncode == 0 and without.returncode == 0
    assert float(with_big.stdout.split()[0]) - float(without.stdout.split()[0]) == pytest.approx(3.0, abs=0.01)

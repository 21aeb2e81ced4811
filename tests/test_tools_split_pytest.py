"""tools/split_pytest.sh on the CPU: one pytest selection dealt out over N processes (through tools/gpu_parallel.sh)
runs every selected test exactly once, passes pytest's options to every part, brings the parts' logs back in
$OUT/gpu_parallel.tgz, and fails when a part fails or nothing was selected; a bad N stops with a usage error."""

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "split_pytest.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None,
                                reason="needs bash and tar")

_CASES = '''
import os
import warnings
import pytest

warnings.warn("a collection warning naming test_cases.py::test_case (not an id)")  # in --co's warnings summary

@pytest.mark.parametrize("i", range(7))
def test_case(i):
    with open(os.environ["SPLIT_RECORD"], "a") as f:
        f.write(f"{i} {os.getpid()}\\n")
    assert i != int(os.environ.get("SPLIT_FAIL", "-1"))

def test_other():
    with open(os.environ["SPLIT_RECORD"], "a") as f:
        f.write(f"other {os.getpid()}\\n")
'''


def _run(tmp_path: Path, *args: str, fail: int | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    (tmp_path / "test_cases.py").write_text(_CASES)
    record = tmp_path / "record.txt"
    record.unlink(missing_ok=True)
    out = tmp_path / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    env = dict(os.environ, PYTHON=sys.executable, SPLIT_RECORD=str(record), OUT=str(out))
    if fail is not None:
        env["SPLIT_FAIL"] = str(fail)
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    return done, record.read_text().split("\n")[:-1] if record.exists() else []


def _logs(tmp_path: Path) -> dict[str, str]:
    with tarfile.open(tmp_path / "out" / "gpu_parallel.tgz") as tar:
        return {Path(m.name).name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}


def test_every_test_runs_once_over_the_parts(tmp_path):
    done, ran = _run(tmp_path, "3", "test_cases.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(r.split()[0] for r in ran) == sorted([*map(str, range(7)), "other"])
    assert len({r.split()[1] for r in ran}) == 3  # three processes
    assert "8 tests in 3 parts" in done.stderr  # the warnings summary's lines are no ids
    assert re.findall(r"^== (part_\d): exit 0", done.stdout, re.M) == ["part_0", "part_1", "part_2"]
    logs = _logs(tmp_path)
    assert sorted(logs) == ["part_0.txt", "part_1.txt", "part_2.txt"]
    assert all(re.search(r"\b[23] passed", log) for log in logs.values())  # 8 tests dealt 3 / 3 / 2


def test_options_reach_every_part_and_a_failure_fails_the_run(tmp_path):
    done, ran = _run(tmp_path, "2", "test_cases.py", "-k", "not other", "-rA", fail=4)
    assert done.returncode == 1  # gpu_parallel.sh's status: one part failed
    assert sorted(r.split()[0] for r in ran) == list(map(str, range(7)))  # -k "not other": test_other deselected
    assert len(re.findall(r"^== part_\d: exit 1", done.stdout, re.M)) == 1
    for log in _logs(tmp_path).values():  # -rA: each part's log lists its results
        assert "PASSED test_cases.py::test_case" in log


def test_more_parts_than_tests_and_empty_selections(tmp_path):
    done, ran = _run(tmp_path, "16", "test_cases.py", "-k", "other")
    assert done.returncode == 0 and ran and ran[0].startswith("other") and "1 tests in 1 parts" in done.stderr
    done, _ = _run(tmp_path, "2", "test_cases.py", "-k", "nothing_matches")
    assert done.returncode == 5 and "no tests collected" in done.stderr


@pytest.mark.parametrize("n", ["", "0", "x"])
def test_bad_part_count_is_a_usage_error(tmp_path, n):
    done, _ = _run(tmp_path, *([n] if n else []))
    assert done.returncode == 2 and "usage: tools/split_pytest.sh N" in done.stderr

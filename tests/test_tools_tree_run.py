"""tools/tree_run.sh on the CPU: a command run against a packed tree imports that tree's fa4gen and templates (not
the working tree's), runs in a folder holding the working tree's tests/ and fa4gen/golden beside the packed parts,
gets a compile cache of its own, and passes its exit status through; bad arguments stop with a usage error."""

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACK = ROOT / "tools" / "ncu_ab.sh"
SCRIPT = ROOT / "tools" / "tree_run.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None,
                                reason="needs bash and git")


def _env(tmp_path: Path) -> dict:
    env = dict(os.environ, NCU_AB_TREES=str(tmp_path / "trees"), TREE_RUN_WORK=str(tmp_path / "work"),
               PYTHONPATH=str(ROOT))
    env.pop("FA4GEN_CACHE_DIR", None)
    return env


def _sh(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)


def _pack_marked_tree(tmp_path: Path, env: dict) -> None:
    """Pack HEAD, then mark the packed template so the test can tell the tree's copy from the working tree's."""
    done = subprocess.run(["bash", str(PACK), "pack", "cand", "HEAD"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    tgz = tmp_path / "trees" / "cand.tgz"
    unpacked = tmp_path / "unpacked"
    with tarfile.open(tgz) as tar:
        tar.extractall(unpacked, filter="data")
    (unpacked / "templates" / "sm90" / "MARK").write_text("candidate\n")
    with tarfile.open(tgz, "w:gz") as tar:
        for top in ("fa4gen", "templates"):
            tar.add(unpacked / top, arcname=top)


def test_the_command_sees_the_packed_tree(tmp_path):
    env = _env(tmp_path)
    _pack_marked_tree(tmp_path, env)
    probe = ("import fa4gen, os, pathlib; here = pathlib.Path.cwd(); "
             "print(os.path.dirname(fa4gen.__file__)); print(here); "
             "print((here / 'templates/sm90/MARK').read_text().strip()); "
             "print(all((here / p).exists() for p in ('tests/conftest.py', 'fa4gen/golden', 'templates/sm100', "
             "'pyproject.toml', 'tools/tree_run.sh'))); print(os.environ['FA4GEN_CACHE_DIR'])")
    done = _sh(env, "cand", "--", "python3", "-c", probe)
    assert done.returncode == 0, done.stderr
    where, cwd, mark, beside, cache = done.stdout.split("\n")[:5]
    dest = tmp_path / "work" / "cand"
    assert where == str(dest / "fa4gen") and cwd == str(dest)
    assert mark == "candidate" and beside == "True"
    assert cache.endswith("/cand") and "packed from " in done.stderr
    assert not (ROOT / "templates" / "sm90" / "MARK").exists()


def test_exit_status_passes_through_and_bad_arguments_stop(tmp_path):
    env = _env(tmp_path)
    _pack_marked_tree(tmp_path, env)
    assert _sh(env, "cand", "--", "bash", "-c", "exit 3").returncode == 3
    for args, message in ((["no-tree", "--", "true"], "no "), (["a b", "--", "true"], "usage:"),
                          (["cand", "--"], "no COMMAND"), ([], "usage:")):
        done = _sh(env, *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert message in done.stderr, (args, done.stderr)

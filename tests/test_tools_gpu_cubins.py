"""tools/gpu_cubins.sh: the GPU machine's own cubins of a command, flash-attn-4's and fa4gen's, in one flat tar that
tools/fa4_sass_cpu.py --cubins reads here."""

import subprocess
import sys
import tarfile

from conftest import ROOT, load_tool

SCRIPT = ROOT / "tools" / "gpu_cubins.sh"

# what a run leaves where the script points it: flash-attn-4 a cubin in CUTE_DSL_DUMP_DIR (only with its own cache
# off), fa4gen its cache entries' artifacts under FA4GEN_CACHE_DIR
STUB = """
import os, pathlib
assert os.environ["CUTE_DSL_KEEP"] == "cubin" and os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "0"
pathlib.Path(os.environ["CUTE_DSL_DUMP_DIR"], "fa4_fwd.sm_90a.cubin").write_bytes(b"fa4")
entry = pathlib.Path(os.environ["FA4GEN_CACHE_DIR"], "0123456789abcdef0123", "sub")
entry.mkdir(parents=True)
(entry / "artifact.o").write_bytes(b"ours")
(entry / "artifact.so").write_bytes(b"not kept")
"""


def _run(tmp_path, *command):
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out" / "cubins.tar"), "--", *command],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)})


def test_gpu_cubins_tars_both_flat(tmp_path):
    r = _run(tmp_path, sys.executable, "-c", STUB)
    assert r.returncode == 0, r.stderr
    with tarfile.open(tmp_path / "out" / "cubins.tar") as tar:
        files = {m.name.removeprefix("./"): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert files == {"fa4_fwd.sm_90a.cubin": b"fa4", "fa4gen_sub_artifact.o": b"ours"}
    assert "2 file(s)" in r.stdout
    assert not list(tmp_path.glob("gpu_cubins.*"))  # its work folder is removed


def test_gpu_cubins_fails_when_nothing_was_built(tmp_path):
    r = _run(tmp_path, "true")
    assert r.returncode == 1 and "left no cubin" in r.stderr
    assert not (tmp_path / "out" / "cubins.tar").exists()


def test_gpu_cubins_passes_on_the_commands_failure(tmp_path):
    r = _run(tmp_path, sys.executable, "-c", STUB + "\nraise SystemExit(3)")
    assert r.returncode == 3 and "the command exited 3" in r.stderr
    assert (tmp_path / "out" / "cubins.tar").exists()  # what it built before failing is kept


def test_gpu_cubins_wants_a_command(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "x.tar"), "true"], capture_output=True, text=True)
    assert r.returncode == 2 and "expected -- before the command" in r.stderr


def test_fa4_sass_cpu_names_a_tar_without_cubins(tmp_path, capsys):
    tool = load_tool("fa4_sass_cpu")
    note = tmp_path / "note.txt"
    note.write_text("no cubin")
    with tarfile.open(tmp_path / "empty.tar", "w") as tar:
        tar.add(note, arcname="note.txt")
    try:
        tool.main(["--cubins", str(tmp_path / "empty.tar")])
    except SystemExit as err:
        assert "holds no .cubin or .o file" in str(err)
    else:
        raise AssertionError("a tar without cubins was listed")

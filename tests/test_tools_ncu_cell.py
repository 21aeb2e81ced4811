"""tools/ncu_cell.sh, the one-call Nsight Compute reading of a cell, run on the CPU against a stand-in `ncu` on PATH
(it records its arguments and writes the report pages from tests/test_tools_ncu.py's samples): the kernel filter and
count follow bwd_ncu.py's flags, every output file lands under $OUT, and bad arguments stop it with a usage error."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_tools_ncu import DETAILS, HEADER

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "ncu_cell.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("xz") is None,
                                reason="needs bash and xz")

CSV = "\n".join(['"Kernel Name","ours"', HEADER,
                 '"0x10","      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], RZ","30","100","800","800","30","0","9"'])

# the stand-in: the profiling call (-o REPORT) records its arguments and makes REPORT.ncu-rep; `ncu -i` prints a page
STUB = f"""#!{sys.executable}
import sys
args = sys.argv[1:]
if "-o" in args:
    open(args[args.index("-o") + 1] + ".ncu-rep", "w").write("report")
    open({{log!r}}, "w").write("\\n".join(args))
    print("==PROF== Report written")
elif "--page" in args and args[args.index("--page") + 1] == "details":
    sys.stdout.write({DETAILS!r})
else:
    sys.stdout.write({CSV!r})
"""


def _run(tmp_path: Path, *args: str, ncu: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if ncu:
        stub = bin_dir / "ncu"
        stub.write_text(STUB.replace("{log!r}", repr(str(tmp_path / "ncu_args.txt"))))
        stub.chmod(0o755)
    # python3 and xz stay reachable; a real ncu elsewhere on PATH must not be
    keep = {Path(shutil.which(t)).parent for t in ("python3", "xz", "mktemp", "timeout") if shutil.which(t)}
    path = os.pathsep.join([str(bin_dir), *sorted(str(p) for p in keep)])
    env = dict(os.environ, PATH=path, OUT=str(tmp_path / "out"), **(env or {}))
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def test_ncu_cell_profiles_and_reads_both_pages(tmp_path):
    done = _run(tmp_path, "fwd128", "128", "512", "y", "--fwd", "--cudnn")
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "ncu_args.txt").read_text().split("\n")
    # the forward kernels and cuDNN's: three kernels
    assert args[args.index("-k") + 1] == "regex:FlashFwdSm90|FlashAttentionForwardSm90|cudnn|sdpa|fmha"
    assert args[args.index("-c") + 1] == "3" and "--clock-control" in args
    assert args[-7:] == ["python3", str(ROOT / "tools" / "bwd_ncu.py"), "128", "512", "y", "--fwd", "--cudnn"]
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    assert names == ["fwd128_compare.txt", "fwd128_cycles.md", "fwd128_details.txt", "fwd128_log.txt",
                     "fwd128_src.csv.xz"]
    assert "| ours_FlashBwdSm90_1 | 609.86 | 1.75 | 1,076,365 | 1.000 |" in done.stdout  # the cycle table
    assert "instructions executed 100" in (out / "fwd128_compare.txt").read_text()


def test_ncu_cell_backward_count_and_usage_errors(tmp_path):
    done = _run(tmp_path, "bwd", "128", "2048", "y", "--swap", "--det")
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "ncu_args.txt").read_text().split("\n")
    assert args[args.index("-k") + 1] == "regex:FlashBwdSm90|FlashAttentionBackwardSm90"
    assert args[args.index("-c") + 1] == "4"  # fa4gen's, its Sᵀ and deterministic variants, flash-attn-4's
    for bad, message in ((["x"], "usage: tools/ncu_cell.sh"), (["a b", "128", "512", "y"], "NAME 'a b'")):
        done = _run(tmp_path, *bad)
        assert done.returncode == 2 and message in done.stderr, done.stderr
    light = tmp_path / "light"
    light.mkdir()
    done = _run(light, "cyc", "64", "2048", "y", env={"NCU_CELL_SECTIONS": "light"})
    assert done.returncode == 0, done.stderr
    args = (light / "ncu_args.txt").read_text().split("\n")
    assert [a for i, a in enumerate(args) if i and args[i - 1] == "--section"] == ["SpeedOfLight", "LaunchStats"]
    assert sorted(p.name for p in (light / "out").iterdir()) == ["cyc_cycles.md", "cyc_details.txt", "cyc_log.txt"]
    done = _run(light, "cyc", "64", "2048", "y", env={"NCU_CELL_SECTIONS": "most"})
    assert done.returncode == 2 and "NCU_CELL_SECTIONS 'most'" in done.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    done = _run(bare, "fwd", "64", "512", "n", "--fwd", ncu=False)
    assert done.returncode == 2 and "no ncu on PATH" in done.stderr, done.stderr


def _bwd_ncu(*args: str) -> subprocess.CompletedProcess:
    """tools/bwd_ncu.py run as ncu would run it (its collector's variable set), without a GPU."""
    return subprocess.run([sys.executable, str(ROOT / "tools" / "bwd_ncu.py"), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT / "tools",
                          env=dict(os.environ, PYTHONPATH=str(ROOT), CUDA_INJECTION64_PATH="stand-in"))


def test_bwd_ncu_gqa_refuses_what_it_cannot_profile():
    """bwd_ncu.py --gqa profiles fa4gen's GQA backward and flash-attn-4's only: with a flag that adds a kernel the
    count ncu_cell.sh passes (-c) would name the wrong ones, and a head dim whose 2048 / D query heads do not split
    into groups of 4 has no GQA layout: both stop with a message before touching the GPU."""
    pytest.importorskip("torch")
    for flag in ("--det", "--swap", "--fwd", "--cudnn"):
        done = _bwd_ncu("128", "2048", "y", "--gqa", flag)
        assert done.returncode != 0 and "--gqa: backward of fa4gen's default kernel" in done.stderr, (flag, done.stderr)
    done = _bwd_ncu("96", "2048", "y", "--gqa")
    assert done.returncode != 0 and "21 query heads (2048 / 96) do not split into groups of 4" in done.stderr

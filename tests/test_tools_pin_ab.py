"""tools/pin_ab.py on the CPU: its argument checks and its refusal without a GPU (the timing itself runs on the
device: docs/patches/README.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "pin_ab.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


@pytest.mark.parametrize("args, message", [
    ((), "exactly one of --chunk KEYS / --window LEFT / --mask"),
    (("--chunk", "1024", "--window", "512"), "exactly one of"),
    (("--mask", "causal", "--chunk", "64"), "exactly one of"),
    (("--mask", "window"), "invalid choice"),
    (("--chunk", "1024", "--rounds", "0"), "--rounds: expected a positive count"),
    (("--chunk", "1024", "--kernels", "fwd_sm90"), "--kernels: expected two forward kernels"),
])
def test_refuses_bad_arguments(args, message):
    done = _run(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_refuses_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the refusal is for CPU machines")
    done = _run("--chunk", "1024")
    assert done.returncode == 1 and "pin_ab: needs a CUDA GPU" in done.stderr, done.stderr

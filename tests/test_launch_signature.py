"""Every kernel of every committed package is launched by the API with what its compiled function takes (CPU, no
compile): the arguments of a call through the package's runtime, its launches captured, against the generated
module's `fake_arguments()` — the signature `fa4gen.compile` compiles (the stream aside, which TVM-FFI takes from
the caller's context). Same count; tensors of the same rank and dtype, every static extent and unit stride equal,
every symbolic extent and stride a multiple of its divisibility and one value per symbol across the arguments
(the compiled function's own argument checks: a mismatch would be a launch-time error on the GPU); scalars of the
kind the kernel declares. Each kernel runs pinned, so the long-call, twin, MHA-only and GQA kernels all launch."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from tests.launch_check import check_launches

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent.name for p in (ROOT / "generated").glob("*/spec.lock.json"))


def _kernels():
    for name in PACKAGES:
        lock = json.loads((ROOT / "generated" / name / "spec.lock.json").read_text())
        for plan in lock["plans"]:
            yield pytest.param(name, plan["arch"], plan["module"], id=f"{name}.{plan['module']}")


@pytest.mark.parametrize(("name", "arch", "module"), list(_kernels()))
def test_the_api_launches_each_kernel_with_its_compiled_signature(name, arch, module, monkeypatch):
    check_launches(importlib.import_module(f"generated.{name}"), arch, module, monkeypatch)

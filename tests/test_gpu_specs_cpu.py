"""The GPU suites' hand-written spec variants plan, render and import on the CPU (no compile), through each suite's
own `_package`: a variant that no longer validates or plans fails here, in CI, instead of in a device session (the
GPU modules themselves skip without a Hopper GPU). Each of their kernels is then launched once through the API on
the CPU, its launch checked against its compiled signature (tests/launch_check.py, as tests/test_launch_signature.py
does for the committed packages): these variants add the hand-set pipelines (dQ by atomics, deterministic turns,
packed sequences, ...)."""

from __future__ import annotations

import importlib
import sys

import pytest

from tests.launch_check import check_launches

# suite module -> the dicts of variant specs its `_package(name)` builds
SUITES = {
    "test_gpu_backward": ("SPECS",),
    "test_gpu_forward": ("EXTRA",),
    "test_gpu_varlen": ("VARIANTS", "BWD_VARIANTS"),
}


def _variants():
    for module, tables in SUITES.items():
        suite = importlib.import_module(f"tests.{module}")
        for table in tables:
            for name in sorted(getattr(suite, table)):
                yield pytest.param(module, name, id=f"{module}.{name}")


@pytest.fixture
def scratch_cache(tmp_path, monkeypatch):
    """fa4gen.build writes rendered packages under the cache: a fresh one per test, and the packages imported from
    it forgotten after (a later build of the same spec must not find a module whose folder is gone)."""
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path / "cache"))
    before = set(sys.modules)
    yield
    for mod in set(sys.modules) - before:
        if mod.startswith("fa4gen_pkg_"):
            del sys.modules[mod]


@pytest.mark.parametrize(("module", "name"), list(_variants()))
def test_gpu_suite_variant_builds_and_launches_on_the_cpu(module, name, scratch_cache, monkeypatch):
    suite = importlib.import_module(f"tests.{module}")
    cache = getattr(suite, "_built", None)
    if isinstance(cache, dict):
        cache.pop(name, None)  # build it here, in this test's cache
    pkg = suite._package(name)
    kernels = [p["module"] for p in pkg._forward.kernel_plans("sm90")]
    assert kernels and all(p.startswith(("fwd_sm90", "bwd_sm90")) for p in kernels)
    assert pkg._forward.name == name
    for kernel in kernels:
        check_launches(pkg, "sm90", kernel, monkeypatch)

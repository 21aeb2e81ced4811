"""compile_kernel, and compile_generated from the key on, pause Python's cyclic garbage collector while a kernel
is keyed, traced and compiled (session 33, dev CPU: a full collection cost 0.16-0.19 s of a first call) and
give the caller's setting back afterwards, also when the compile raises, never turning on a collector the
caller had turned off."""

import gc

import pytest

from fa4gen.compile.aot import compile_kernel


def _compile_and_fail(seen):
    def build():
        seen.append(gc.isenabled())
        raise RuntimeError("trace failed")

    with pytest.raises(RuntimeError, match="trace failed"):
        compile_kernel(build_fn=build, arch="sm_90a", name="probe", cache=None, key=None, keep_sass=False)


def test_collector_paused_during_compile_and_restored_after_an_error():
    assert gc.isenabled()
    seen = []
    _compile_and_fail(seen)
    assert seen == [False]
    assert gc.isenabled()


def test_collector_left_off_when_the_caller_had_it_off():
    seen = []
    gc.disable()
    try:
        _compile_and_fail(seen)
        assert seen == [False] and not gc.isenabled()
    finally:
        gc.enable()


def test_collector_paused_while_a_generated_kernel_is_keyed(monkeypatch, tmp_path):
    """The cold key's helper-import parse is what set the first call's full collection off (session 33):
    compile_generated keeps the collector paused from the key on."""
    import fa4gen.compile.generated as gen

    seen = []

    def keyed(path, plan):
        seen.append(gc.isenabled())
        raise RuntimeError("parse failed")

    monkeypatch.setattr(gen, "_keyed_source", keyed)
    with pytest.raises(RuntimeError, match="parse failed"):
        gen.compile_generated(tmp_path / "k.py", "pkg.k", {"cute_arch": "sm_90a"}, cache=None)
    assert seen == [False] and gc.isenabled()

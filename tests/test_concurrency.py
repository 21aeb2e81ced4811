"""Several processes or threads doing the same thing at once, as the ranks of a torchrun job do on their
first step (they share ~/.cache/fa4gen, possibly over NFS): writing one generated package, importing
one package, putting one cache entry. CPU only, no kernels compiled."""

from __future__ import annotations

import multiprocessing
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from fa4gen.builder import render_spec, write_package
from fa4gen.compile.cache import DiskCache, cache_key
from fa4gen.fileio import atomic_write
from fa4gen.compile.generated import import_from_path
from fa4gen.spec import spec_from_dict

SPEC = dict(name="conc", targets=["sm90"], dtype="bf16", head_dim=64, backward=True)


def _writer(pkg, root: str, barrier, errors) -> None:
    try:
        barrier.wait()
        write_package(pkg, Path(root))
    except BaseException as err:  # noqa: BLE001 — reported to the parent
        errors.put(f"{type(err).__name__}: {err}")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork start method")
def test_processes_writing_one_package_at_once(tmp_path):
    """Each write goes through its own temporary and renames it into place; a folder holding only this
    package's files (its spec.lock.json not written yet by another process) is not refused; a stray
    file two processes both remove is no error. Before: a shared `.name.tmp` (FileNotFoundError when
    another process renamed it first) and refusals, in 6 of 360 writer runs."""
    pkg, _, _ = render_spec(spec_from_dict(SPEC), "conc.yaml")
    ctx = multiprocessing.get_context("fork")
    procs_n, rounds = 6, 8
    for r in range(rounds):
        root = tmp_path / f"r{r}"
        if r % 2:  # a stray file from an older rendering: every writer removes it
            (root / "conc").mkdir(parents=True)
            (root / "conc" / "old_module.py").write_text("# stale\n")
            (root / "conc" / "spec.lock.json").write_text("{}")
        barrier, errors = ctx.Barrier(procs_n), ctx.Queue()
        procs = [ctx.Process(target=_writer, args=(pkg, str(root), barrier, errors)) for _ in range(procs_n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        found = []
        while not errors.empty():
            found.append(errors.get())
        assert not found, found
        assert all(p.exitcode == 0 for p in procs)
        names = sorted(p.name for p in (root / "conc").iterdir())
        assert names == sorted(pkg.files), names  # no temporaries left, the stray one gone
        for rel, text in pkg.files.items():
            assert (root / "conc" / rel).read_text() == text


def test_threads_importing_one_package_get_the_finished_module(tmp_path):
    """A module sits in sys.modules while it executes: a second thread must wait for it, not take the
    half-run module (it saw no `attention` before the import lock)."""
    pkg_dir = tmp_path / "slow_pkg_for_threads"
    pkg_dir.mkdir()
    (pkg_dir / "__init__.py").write_text("import time\ntime.sleep(0.3)\nattention = 'ready'\n")
    seen = {}

    def load(i):
        module = import_from_path("slow_pkg_for_threads_x", pkg_dir / "__init__.py", package=True)
        seen[i] = getattr(module, "attention", None)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    threads[0].start()
    time.sleep(0.05)
    threads[1].start()
    for t in threads:
        t.join()
    assert seen == {0: "ready", 1: "ready"}


def test_putting_an_entry_another_process_committed_keeps_it(tmp_path):
    """Ranks compiling the same kernel put identical files: the second put leaves the committed entry
    (same inodes: a reader that loaded it, on NFS say, is not pulled from under) and its side files."""
    cache = DiskCache(tmp_path / "cache")
    key = cache_key(source="x", helper_sources={}, arch="sm_90a", options={})
    first = cache.put(key, b"\x7fELF", {"name": "fwd"}, extras={"kernel.sass": "HGMMA"})
    artifact = first.artifact_path
    inode = artifact.stat().st_ino
    again = cache.put(key, b"\x7fELF", {"name": "fwd"})  # no side file this time
    assert again.meta == first.meta and artifact.stat().st_ino == inode
    assert (again.path / "kernel.sass").read_text() == "HGMMA"
    changed = cache.put(key, b"\x7fELF v2", {"name": "fwd"})  # different bytes still replace the entry
    assert cache.get(key).artifact_path.read_bytes() == b"\x7fELF v2" and changed.meta != first.meta


def test_atomic_writes_get_the_mode_a_plain_write_would(tmp_path):
    """mkstemp makes 0600 files: a cache shared by a group's users then never hit for the others."""
    atomic_write(tmp_path / "a", b"x")
    (tmp_path / "b").write_bytes(b"x")
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == stat.S_IMODE((tmp_path / "b").stat().st_mode)

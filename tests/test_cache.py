"""Compile stage: the on-disk cache and its key, without compiling anything."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest

from fa4gen.compile import cache as cache_mod
from fa4gen.compile.cache import (
    ARTIFACT_NAME,
    IMPORTS_MEMO_FILE,
    META_NAME,
    DiskCache,
    FA4GenCacheWarning,
    cache_dir,
    cache_key,
    device_helper_sources,
    toolchain_versions,
)

BASE = dict(
    source="def kernel(): pass\n",
    helper_sources={"softmax.py": "x = 1\n", "mask.py": "y = 2\n"},
    arch="sm_90a",
    options={"tile_m": 128, "symbolic": ["batch", "seqlen"]},
)


def _key(**changes) -> str:
    return cache_key(**{**BASE, **changes})


# -- key ------------------------------------------------------------------------------
def test_key_is_stable_sha256():
    assert _key() == _key()
    assert len(_key()) == 64 and int(_key(), 16) >= 0


def test_key_ignores_ordering():
    helpers = dict(reversed(list(BASE["helper_sources"].items())))
    options = dict(reversed(list(BASE["options"].items())))
    assert _key(helper_sources=helpers, options=options) == _key()


@pytest.mark.parametrize(
    "change",
    [
        dict(source="def kernel(): return 1\n"),
        dict(helper_sources={**BASE["helper_sources"], "mask.py": "y = 3\n"}),
        dict(helper_sources={**BASE["helper_sources"], "new.py": ""}),
        dict(helper_sources={"softmax.py": "x = 1\n"}),
        dict(helper_sources={"softmax2.py": "x = 1\n", "mask.py": "y = 2\n"}),
        dict(arch="sm_100a"),
        dict(options={**BASE["options"], "tile_m": 64}),
        dict(options={**BASE["options"], "extra": None}),
    ],
    ids=["source", "helper-text", "helper-added", "helper-removed", "helper-renamed", "arch", "option", "option-added"],
)
def test_key_changes_with_inputs(change):
    assert _key(**change) != _key()


def test_key_changes_with_toolchain(monkeypatch):
    real = toolchain_versions()
    before = _key()
    monkeypatch.setattr(cache_mod, "toolchain_versions", lambda: {**real, "nvidia-cutlass-dsl": "9.9.9"})
    assert _key() != before
    monkeypatch.setattr(cache_mod, "toolchain_versions", lambda: dict(real))
    assert _key() == before


def test_key_rejects_unserializable_options():
    with pytest.raises(TypeError, match="JSON-serializable"):
        _key(options={"fn": object()})


def test_toolchain_versions_lists_cutlass_dsl_and_tvm_ffi():
    versions = toolchain_versions()
    assert "nvidia-cutlass-dsl" in versions
    assert all(n.startswith("nvidia-cutlass-dsl") or n == "apache-tvm-ffi" for n in versions)


def test_device_helper_sources(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "softmax.py").write_text("a = 1\n")
    (tmp_path / "sub" / "mask.py").write_text("b = 2\n")
    (tmp_path / "notes.txt").write_text("ignored")
    assert device_helper_sources(tmp_path) == {"softmax.py": "a = 1\n", "sub/mask.py": "b = 2\n"}
    assert device_helper_sources(tmp_path / "missing") == {}
    # The default root is the package's device/ folder (may be empty while it is written).
    default = device_helper_sources()
    assert all(path.endswith(".py") for path in default)


# -- location -------------------------------------------------------------------------
def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("FA4GEN_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "fa4gen"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "fa4gen"
    assert DiskCache().root == tmp_path / "home" / ".cache" / "fa4gen"


# -- put / get ------------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path) -> DiskCache:
    return DiskCache(tmp_path / "cache")


def test_put_get_roundtrip(cache, tmp_path):
    key = _key()
    entry = cache.put(key, b"\x7fELF object", {"name": "fwd", "arch": "sm_90a", "registers": 168})
    assert entry.artifact_path.read_bytes() == b"\x7fELF object"
    got = cache.get(key)
    assert got == entry and got.meta == entry.meta
    assert got.meta["name"] == "fwd" and got.meta["registers"] == 168
    assert got.meta["files"][ARTIFACT_NAME]["size"] == len(b"\x7fELF object")
    assert got.meta["created"] > 0
    # From a path, with a side file; the old entry is replaced whole.
    src = tmp_path / "k.o"
    src.write_bytes(b"v2")
    cache.put(key, src, {"name": "fwd"}, extras={"kernel.sass": "HGMMA"})
    got = cache.get(key)
    assert got.artifact_path.read_bytes() == b"v2" and "registers" not in got.meta
    assert got.file("kernel.sass").read_text() == "HGMMA"
    assert sorted(p.name for p in got.path.iterdir()) == [ARTIFACT_NAME, "kernel.sass", META_NAME]


def test_put_leaves_no_temp_files(cache):
    cache.put(_key(), b"x", {})
    assert sorted(p.name for p in cache.root.iterdir()) == [_key(), f"{_key()}.lock"]
    assert not [p for p in (cache.root / _key()).iterdir() if p.name.endswith(".tmp")]


def test_put_failure_keeps_entry_uncommitted(cache, monkeypatch):
    key = _key()
    cache.put(key, b"old", {})
    real_replace = os.replace

    def fail_on_meta(src, dst):
        if Path(dst).name == META_NAME:
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(cache_mod.os, "replace", fail_on_meta)
    with pytest.raises(OSError, match="disk full"):
        cache.put(key, b"new", {})
    monkeypatch.setattr(cache_mod.os, "replace", real_replace)
    with pytest.warns(FA4GenCacheWarning, match="meta.json missing"):
        assert cache.get(key) is None
    assert not (cache.root / key).exists()


def test_get_missing_is_silent(cache):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get(_key()) is None  # root does not exist yet
        cache.root.mkdir(parents=True)
        assert cache.get(_key()) is None


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: (d / ARTIFACT_NAME).write_bytes(b"tampered"), "sha256"),
        (lambda d: (d / ARTIFACT_NAME).unlink(), "missing"),
        (lambda d: (d / META_NAME).write_text("{not json"), "parse"),
        (lambda d: (d / META_NAME).write_text("[1, 2]"), "not an object"),
        (lambda d: (d / META_NAME).unlink(), "meta.json missing"),
        (lambda d: _edit_meta(d, files={}), "no artifact"),
        (lambda d: _edit_meta(d, format=-1), "format"),
        (lambda d: (d / "kernel.sass").write_text("changed"), "sha256"),
    ],
    ids=["artifact-tampered", "artifact-missing", "meta-garbage", "meta-list", "meta-missing", "meta-no-files", "format", "extra-tampered"],
)
def test_corrupt_entry_warns_and_is_evicted(cache, damage, reason):
    key = _key()
    entry = cache.put(key, b"object", {"name": "fwd"}, extras={"kernel.sass": "sass"})
    damage(entry.path)
    with pytest.warns(FA4GenCacheWarning, match=f"{reason}.*rebuilding"):
        assert cache.get(key) is None
    assert not entry.path.exists()
    cache.put(key, b"object", {"name": "fwd"})
    assert cache.get(key) is not None


def _edit_meta(entry_dir: Path, **changes) -> None:
    meta = json.loads((entry_dir / META_NAME).read_text())
    meta.update(changes)
    (entry_dir / META_NAME).write_text(json.dumps(meta))


def test_invalid_keys_and_extras(cache):
    for bad in ("", "../x", "a/b", ".hidden", "x" * 200):
        with pytest.raises(ValueError, match="invalid cache key"):
            cache.get(bad)
    with pytest.raises(ValueError, match="invalid extra"):
        cache.put(_key(), b"x", {}, extras={"../evil": "x"})
    with pytest.raises(ValueError, match="invalid extra"):
        cache.put(_key(), b"x", {}, extras={META_NAME: "x"})


def test_reserved_meta_keys_are_set_by_the_cache(cache):
    entry = cache.put(_key(), b"x", {"key": "spoof", "files": {}, "format": 99, "name": "n"})
    assert entry.meta["key"] == _key() and entry.meta["format"] == cache_mod.CACHE_FORMAT
    assert cache.get(_key()).meta["name"] == "n"


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="needs POSIX permissions, not root")
def test_read_only_cache_is_read_without_lock(cache):
    key = _key()
    cache.put(key, b"object", {"name": "fwd"})
    (cache.root / f"{key}.lock").unlink()
    cache.root.chmod(0o555)
    try:
        assert cache.get(key).artifact_path.read_bytes() == b"object"
    finally:
        cache.root.chmod(0o755)


def test_unusable_cache_warns_once(cache, monkeypatch):
    key = _key()
    cache.put(key, b"object", {})

    def broken(*args, **kwargs):
        raise PermissionError("permission denied")

    monkeypatch.setattr(cache_mod, "_read_verified_meta", broken)
    with pytest.warns(FA4GenCacheWarning, match="unusable.*compiling without it"):
        assert cache.get(key) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get(key) is None


def test_read_only_lock_falls_back_to_plain_read(cache, monkeypatch):
    key = _key()
    cache.put(key, b"object", {})

    class ReadOnlyLock:
        def __enter__(self):
            raise PermissionError("read-only file system")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(DiskCache, "_lock", lambda self, key: ReadOnlyLock())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get(key).artifact_path.read_bytes() == b"object"


# -- ls / clear -----------------------------------------------------------------------
def test_ls_and_clear(cache):
    assert cache.ls() == [] and cache.clear() == 0
    keys = [_key(arch=a) for a in ("sm_90a", "sm_100a", "sm_103a")]
    for i, key in enumerate(keys):
        cache.put(key, f"obj{i}".encode(), {"name": f"k{i}"})
    (cache.root / "not-an-entry.txt").write_text("x")
    (cache.root / IMPORTS_MEMO_FILE).write_text("{}")  # the helper-imports memo goes with the entries
    (cache.root / keys[2] / META_NAME).write_text("garbage")
    listed = cache.ls()
    assert sorted(e.key for e in listed) == sorted(keys[:2])  # unparseable meta skipped
    created = [e.meta["created"] for e in listed]
    assert created == sorted(created)  # oldest first
    assert cache.clear() == 3
    assert cache.ls() == []
    assert sorted(p.name for p in cache.root.iterdir()) == ["not-an-entry.txt"]

"""Compile stage: the on-disk cache of compiled kernels (pure Python, no cutlass import).

A cache entry is a folder ``<root>/<key>/`` holding ``artifact.o`` (the object that
``export_to_c`` writes: host launch code plus the embedded cubin), optional side files
(e.g. ``kernel.sass``) and ``meta.json``. ``meta.json`` is written last and is the commit
record: it names every file of the entry with its size and sha256, so a torn or edited
entry is detected on ``get`` and rebuilt with a :class:`FA4GenCacheWarning`.

Writers and readers of one key serialize on ``<root>/<key>.lock`` (``filelock``); every
file is written to a temporary name in the entry folder and moved into place with
``os.replace``. The key is a sha256 over everything that decides the compiled bytes
(:func:`cache_key`). Mirrors the role of FlashInfer's JIT cache and FA4's
``cache_utils.py``, with integrity checks on read.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

from filelock import FileLock, Timeout

from fa4gen.fileio import atomic_write, is_temporary

#: Bump when the entry layout or the key recipe changes: every old entry becomes a miss.
CACHE_FORMAT = 1
ARTIFACT_NAME = "artifact.o"
META_NAME = "meta.json"
LOCK_TIMEOUT_S = 600.0

_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HEX_KEY_RE = re.compile(r"^[0-9a-f]{64}$")  # cache_key()'s keys (sha256)
_RESERVED_META = ("format", "key", "created", "files")


class FA4GenCacheWarning(UserWarning):
    """A cache entry could not be used (corrupt, unreadable); the kernel is rebuilt."""


# fa4gen/compile/generated.py's record of which device helpers each text imports (content-keyed; `clear` removes it)
IMPORTS_MEMO_FILE = "helper_imports.json"


def cache_dir() -> Path:
    """``$FA4GEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/fa4gen``, else ``~/.cache/fa4gen``."""
    explicit = os.environ.get("FA4GEN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "fa4gen"
    return Path.home() / ".cache" / "fa4gen"


def toolchain_versions() -> dict[str, str]:
    """Installed versions of the ``nvidia-cutlass-dsl`` distributions and ``apache-tvm-ffi``
    (``TOOLCHAIN``), read once per process."""
    return dict(_installed_toolchain())


# The distributions whose bytes end up in a compiled kernel. Asking for each by name is a few ms;
# enumerating every installed distribution took 50-200 ms, most of a cache hit's cost.
TOOLCHAIN = (
    "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13", "apache-tvm-ffi",
)


@functools.lru_cache(maxsize=1)
def _installed_toolchain() -> tuple[tuple[str, str], ...]:
    versions: dict[str, str] = {}
    for name in TOOLCHAIN:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return tuple(sorted(versions.items()))


def device_helper_sources(root: Path | None = None) -> dict[str, str]:
    """Every ``*.py`` under the ``fa4gen/device`` folder: relative posix path -> text."""
    root = Path(__file__).resolve().parent.parent / "device" if root is None else Path(root)
    if not root.is_dir():
        return {}
    return {
        path.relative_to(root).as_posix(): path.read_text(encoding="utf-8")
        for path in sorted(root.rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def _sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def cache_key(*, source: str, helper_sources: Mapping[str, str], arch: str, options: Mapping[str, Any]) -> str:
    """sha256 over a canonical JSON of everything that decides the compiled bytes.

    ``options`` must be JSON-serializable (compile options, symbolic-shape choices, ...).
    """
    record = {
        "format": CACHE_FORMAT,
        "source": _sha256(source),
        "helpers": {path: _sha256(text) for path, text in sorted(helper_sources.items())},
        "toolchain": toolchain_versions(),
        "arch": arch,
        "options": options,
    }
    try:
        canonical = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    except TypeError as err:
        raise TypeError(f"cache_key options must be JSON-serializable: {err}") from None
    return _sha256(canonical)


@dataclass(frozen=True)
class Entry:
    """One verified cache entry: ``path`` is its folder, ``meta`` the parsed ``meta.json``."""

    key: str
    path: Path
    meta: dict[str, Any] = field(compare=False, hash=False)

    @property
    def artifact_path(self) -> Path:
        return self.path / ARTIFACT_NAME

    def file(self, name: str) -> Path:
        """Path of a side file stored with ``put(..., extras=...)``."""
        if name not in self.meta.get("files", {}):
            raise KeyError(f"cache entry {self.key} has no file {name!r}")
        return self.path / name


class _CorruptEntry(Exception):
    pass


class DiskCache:
    """Kernel cache rooted at ``root`` (default :func:`cache_dir`)."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else cache_dir()
        self._warned_unusable = False

    def __repr__(self) -> str:
        return f"DiskCache({str(self.root)!r})"

    # -- paths --------------------------------------------------------------------------
    def _entry_dir(self, key: str) -> Path:
        if not _KEY_RE.match(key):
            raise ValueError(f"invalid cache key {key!r}: expected [A-Za-z0-9._-], at most 128 chars")
        return self.root / key

    def _lock(self, key: str) -> FileLock:
        return FileLock(str(self.root / f"{key}.lock"), timeout=LOCK_TIMEOUT_S)

    # -- read ---------------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        """The verified entry for ``key``, or None.

        A missing cache folder or entry is a silent miss. A corrupt entry (unparseable or
        incomplete meta, missing file, sha256 mismatch) is warned about, deleted and
        reported as a miss. An unusable cache folder (e.g. permissions) is a miss with one
        warning per ``DiskCache``; a read-only folder is read without taking the lock.
        """
        entry_dir = self._entry_dir(key)
        try:
            if not entry_dir.is_dir():
                return None
        except OSError as err:
            self._warn_unusable(err)
            return None
        try:
            with self._lock(key):
                return self._read_or_evict(key, entry_dir)
        except Timeout:
            self._warn_unusable(TimeoutError(f"lock on {key} held for over {LOCK_TIMEOUT_S:.0f} s"))
            return None
        except OSError:
            # No lock file can be created (read-only cache): nobody can be writing here.
            try:
                return self._read_or_evict(key, entry_dir)
            except OSError as err:
                self._warn_unusable(err)
                return None

    def _read_or_evict(self, key: str, entry_dir: Path) -> Entry | None:
        try:
            meta = _read_verified_meta(key, entry_dir)
        except _CorruptEntry as reason:
            warnings.warn(
                f"fa4gen cache entry {key} in {self.root} is unusable ({reason}); rebuilding",
                FA4GenCacheWarning,
                stacklevel=3,
            )
            shutil.rmtree(entry_dir, ignore_errors=True)
            return None
        return Entry(key=key, path=entry_dir, meta=meta)

    def _warn_unusable(self, err: BaseException) -> None:
        if not self._warned_unusable:
            self._warned_unusable = True
            warnings.warn(
                f"fa4gen cache at {self.root} is unusable ({err}); compiling without it",
                FA4GenCacheWarning,
                stacklevel=3,
            )

    # -- write --------------------------------------------------------------------------
    def put(
        self,
        key: str,
        artifact: Path | str | bytes,
        meta: Mapping[str, Any],
        *,
        extras: Mapping[str, bytes | str] | None = None,
    ) -> Entry:
        """Store ``artifact`` (a path or the object bytes), side files and ``meta``.

        ``meta`` is caller data (name, arch, registers, SASS summary, ...) and must be
        JSON-serializable; the keys ``format``, ``key``, ``created`` and ``files`` are
        filled in here. Raises ``OSError`` when the cache folder is not writable.
        """
        entry_dir = self._entry_dir(key)
        data = artifact if isinstance(artifact, bytes) else Path(artifact).read_bytes()
        files: dict[str, bytes] = {ARTIFACT_NAME: data}
        for name, content in (extras or {}).items():
            if not _FILE_RE.match(name) or name in (ARTIFACT_NAME, META_NAME):
                raise ValueError(f"invalid extra file name {name!r}")
            files[name] = content.encode("utf-8") if isinstance(content, str) else content
        record = {k: v for k, v in meta.items() if k not in _RESERVED_META}
        record.update(
            format=CACHE_FORMAT,
            key=key,
            created=time.time(),
            files={name: {"size": len(blob), "sha256": _sha256(blob)} for name, blob in files.items()},
        )
        meta_bytes = json.dumps(record, indent=2, sort_keys=True).encode("utf-8")

        self.root.mkdir(parents=True, exist_ok=True)
        with self._lock(key):
            entry_dir.mkdir(exist_ok=True)
            # Another process (a rank of the same job) committed these very files already: keep its
            # entry, which may be loaded elsewhere (replacing files under a reader, on NFS say, is not
            # safe), and any side file it has that this put does not bring.
            try:
                existing = _read_verified_meta(key, entry_dir)
            except (_CorruptEntry, OSError):
                existing = None
            if existing is not None and all(
                existing["files"].get(name, {}).get("sha256") == record["files"][name]["sha256"] for name in files
            ):
                return Entry(key=key, path=entry_dir, meta=existing)
            # Uncommit first: a crash below leaves an entry that get() evicts.
            (entry_dir / META_NAME).unlink(missing_ok=True)
            for stale in entry_dir.iterdir():
                if stale.name not in files:
                    _remove(stale)
            for name, blob in files.items():
                atomic_write(entry_dir / name, blob)
            atomic_write(entry_dir / META_NAME, meta_bytes)
        return Entry(key=key, path=entry_dir, meta=record)

    # -- housekeeping -------------------------------------------------------------------
    def ls(self) -> list[Entry]:
        """Entries whose ``meta.json`` parses, oldest first (files are not re-hashed)."""
        entries = []
        for entry_dir in self._entry_dirs():
            try:
                meta = json.loads((entry_dir / META_NAME).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(meta, dict):
                entries.append(Entry(key=entry_dir.name, path=entry_dir, meta=meta))
        return sorted(entries, key=lambda e: (_created(e.meta), e.key))

    def clear(self) -> int:
        """Remove every entry (and its lock file); returns the number of entries removed.

        Meant for ``fa4gen cache clear`` while no compile is running.
        """
        removed = 0
        for entry_dir in self._entry_dirs():
            if not _looks_like_entry(entry_dir):
                continue  # a folder of something else under the cache root (a mistyped FA4GEN_CACHE_DIR)
            with self._lock(entry_dir.name):
                shutil.rmtree(entry_dir, ignore_errors=True)
            if entry_dir.exists():
                raise OSError(f"could not remove cache entry {entry_dir} (permissions?); {removed} removed before it")
            removed += 1
            (self.root / f"{entry_dir.name}.lock").unlink(missing_ok=True)
        if self.root.is_dir():
            (self.root / IMPORTS_MEMO_FILE).unlink(missing_ok=True)
            # lock files of entries gone earlier: only the cache's own key format (64 hex digits), never
            # another project's poetry.lock under a mistyped FA4GEN_CACHE_DIR
            for lock in self.root.glob("*.lock"):
                if _HEX_KEY_RE.match(lock.name[: -len(".lock")]) and not (self.root / lock.stem).exists():
                    lock.unlink(missing_ok=True)
        return removed

    def _entry_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and _KEY_RE.match(p.name))


def _created(meta: Mapping[str, Any]) -> float:
    """An entry's creation time for ordering; a damaged or foreign value sorts first."""
    value = meta.get("created", 0.0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else 0.0


def _looks_like_entry(entry_dir: Path) -> bool:
    """A folder put() made: it holds a meta.json or an artifact (an uncommitted entry), or nothing but
    write temporaries. Anything else is not the cache's to delete."""
    names = [p.name for p in entry_dir.iterdir()]
    # (an empty folder is not one: put() creates the folder and its first file under the entry's lock, so
    # an empty folder under a mistyped FA4GEN_CACHE_DIR is someone else's build/ or src/)
    return META_NAME in names or ARTIFACT_NAME in names or bool(names) and all(is_temporary(n) for n in names)


def _read_verified_meta(key: str, entry_dir: Path) -> dict[str, Any]:
    try:
        meta = json.loads((entry_dir / META_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _CorruptEntry("meta.json missing") from None
    except ValueError as err:
        raise _CorruptEntry(f"meta.json does not parse: {err}") from None
    if not isinstance(meta, dict):
        raise _CorruptEntry("meta.json is not an object")
    if meta.get("format") != CACHE_FORMAT or meta.get("key") != key:
        raise _CorruptEntry(f"meta.json format/key is {meta.get('format')}/{meta.get('key')}")
    files = meta.get("files")
    if not isinstance(files, dict) or ARTIFACT_NAME not in files:
        raise _CorruptEntry("meta.json lists no artifact")
    for name, info in files.items():
        if not _FILE_RE.match(str(name)) or not isinstance(info, dict):
            raise _CorruptEntry(f"meta.json has a bad file record {name!r}")
        try:
            blob = (entry_dir / name).read_bytes()
        except FileNotFoundError:
            raise _CorruptEntry(f"{name} missing") from None
        if len(blob) != info.get("size") or _sha256(blob) != info.get("sha256"):
            raise _CorruptEntry(f"{name} does not match its sha256 in meta.json")
    return meta


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)

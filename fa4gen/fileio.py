"""Atomic file writes, shared by the package writer (fa4gen.builder) and the kernel cache
(fa4gen.compile.cache). Standard library only, so `fa4gen build` without compiling needs nothing of the
compile stack."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _process_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_process_umask()  # what open() would give: mkstemp's 0600 kept other users out


def atomic_write(path: Path, data: bytes) -> None:
    """Write `path` through a temporary unique to this write (.<name>.<random>.tmp in the same folder),
    then rename it into place: readers see the old or the new file, never a mix, and processes writing
    the same path at once never share a temporary. The file gets the mode a plain write would."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def is_temporary(name: str) -> bool:
    """Whether a file name is one of atomic_write's temporaries (a write in progress, maybe another
    process's)."""
    return name.startswith(".") and name.endswith(".tmp")


__all__ = ["atomic_write", "is_temporary"]

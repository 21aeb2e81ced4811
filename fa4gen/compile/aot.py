"""Compile stage: ahead-of-time compile of one kernel, through the on-disk cache.

What CuTe-DSL 4.8.1 does, and what this module relies on:

* Environment variables (``CUTE_DSL_ARCH``, ``CUTE_DSL_KEEP``, ``CUTE_DSL_DUMP_DIR``, ...)
  are read once, at ``import cutlass``: the DSL singleton builds its
  ``EnvironmentVarManager`` eagerly and the getters are ``lru_cache``-d. Setting
  ``os.environ`` after that import changes nothing. The manager's ``arch`` is a property
  with a setter (and a deleter for ``mock.patch`` teardown), so :func:`target_arch` sets
  ``CuTeDSL._get_dsl().envar.arch`` for the duration of the compile instead. The
  per-compile option ``cute.compile(..., options="--gpu-arch sm_90a")`` also works and
  wins over ``envar.arch``. Without a GPU and without either, the arch defaults to
  sm_100a (driver probe fails; detection falls back to 10.0 and appends "a" for >= 9).
* The cubin: ``compiled.__cubin__`` is None unless cubin keeping is on (``CUTE_DSL_KEEP=cubin``
  at import, or ``options="--keep-cubin --dump-dir D"``, which writes
  ``D/<mangled>.<arch>.cubin`` and reads it back). We need no dump folder: the object
  that ``compiled.export_to_c(object_file_path=..., function_name=...)`` writes (TVM-FFI
  flavor, needs ``options="--enable-tvm-ffi"``) embeds the cubin byte-for-byte, and
  :func:`fa4gen.compile.elf.extract_cubins` finds it. That also works on a cache hit.
* Loading: ``cute.runtime.load_module(path, enable_tvm_ffi=True)`` JIT-links the object
  (no GPU needed to load; calling needs one) and ``getattr(module, EXPORT_NAME)`` is a
  ``tvm_ffi.Function`` that keeps the engine alive. Objects exported under the same name
  load side by side. FA4 preloads the runtime libraries with ``RTLD_GLOBAL`` against
  undefined symbols; we do the same once (not needed on 4.8.1 CPU-only in our tests).
* The JIT link takes ~100 ms per kernel on the H200 host (and needs ``import cutlass``, 2-3 s
  per process there). So a miss also links the object into a shared library with the system C
  compiler (``cc -shared``: the object is position-independent) and records the runtime
  libraries' paths; a hit then preloads those (``RTLD_GLOBAL``) and ``tvm_ffi.load_module``s the
  library — a ``dlopen``, no cutlass import. Without a C compiler, or if that load fails, the
  object is JIT-linked as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import inspect
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from fa4gen.compile.cache import DiskCache, Entry, FA4GenCacheWarning
from fa4gen.compile.elf import cubin_arch, extract_cubins
from fa4gen.compile.sass import disassemble, resource_usage, summarize_sass

#: Symbol every kernel is exported under; one object holds one kernel, so it never clashes.
EXPORT_NAME = "fa4gen_kernel"
SASS_FILE = "kernel.sass"
SHARED_FILE = "artifact.so"  # the object linked as a shared library (when a C compiler is there)

_ARCH_RE = re.compile(r"^sm_(?P<sm>\d+)(?P<suffix>[af]?)$")
_COMPILE_LOCK = threading.RLock()
_preloaded: set[str] = set()  # runtime libraries already loaded RTLD_GLOBAL in this process


@dataclass(frozen=True)
class CompileResult:
    """A compiled (or cache-loaded) kernel.

    ``seconds`` is the ``build_fn`` time on a miss and the load time on a hit. ``meta`` holds
    ``registers``, ``smem_static``, ``smem_dynamic`` (None), ``stack_frame``,
    ``spill_stores``/``spill_loads`` (None without SASS), ``kernels`` (per-function table),
    ``cubin_arch``, ``compile_seconds`` and, with ``keep_sass``, ``sass`` (the
    :class:`~fa4gen.compile.sass.SassSummary` dict); plus ``name``/``arch``. ``sass_text``
    is the full listing when ``keep_sass`` was asked for.
    """

    name: str
    arch: str
    seconds: float
    cache_hit: bool
    key: str | None
    meta: dict[str, Any] = field(compare=False, hash=False)
    function: Callable[..., Any] = field(compare=False, hash=False, repr=False)
    sass_text: str | None = field(default=None, compare=False, hash=False, repr=False)


def _check_arch(arch: str) -> re.Match[str]:
    match = _ARCH_RE.match(arch)
    if not match:
        raise ValueError(f"arch must look like 'sm_90a' or 'sm_100a', got {arch!r}")
    return match


@contextlib.contextmanager
def target_arch(arch: str) -> Iterator[None]:
    """Make CuTe-DSL compile for ``arch`` inside the block (thread-safe, restores on exit)."""
    _check_arch(arch)
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    with _COMPILE_LOCK:
        # Read the stored value, not the property: the property would probe the driver.
        previous = vars(envar).get("_arch")
        envar.arch = arch
        try:
            yield
        finally:
            envar.arch = previous


def _preload(libs: list[str], *, strict: bool) -> None:
    """Load `libs` with RTLD_GLOBAL once per process (their symbols resolve the kernels' undefined
    ones). `strict`: a library that does not load raises; else it is skipped."""
    for lib in libs:
        if lib in _preloaded:
            continue
        try:
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            if strict:
                raise
            continue
        _preloaded.add(lib)


def _preload_runtime() -> None:
    """The CuTe-DSL runtime libraries, before JIT-linking an object (imports cutlass)."""
    _preload(runtime_libraries(), strict=False)


def runtime_libraries() -> list[str]:
    """The CuTe-DSL runtime libraries an exported kernel links against (imports cutlass)."""
    import cutlass.cute as cute

    return [str(Path(p).resolve()) for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False)]


def link_shared(obj: bytes) -> bytes | None:
    """``obj`` linked as a shared library by the system C compiler (``$CC``, else cc / gcc / clang),
    or None when there is none or it fails (the cache then keeps the object only)."""
    cc = shlex.split(os.environ.get("CC", "")) or [next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), "")]
    if not cc[0] or not shutil.which(cc[0]):
        return None
    with tempfile.TemporaryDirectory(prefix="fa4gen-so-") as tmp:
        src, out = Path(tmp) / "artifact.o", Path(tmp) / SHARED_FILE
        src.write_bytes(obj)
        try:
            done = subprocess.run([*cc, "-shared", "-o", str(out), str(src)], capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.read_bytes() if done.returncode == 0 and out.is_file() else None


def _load_shared(entry: Entry) -> Callable[..., Any] | None:
    """The entry's shared library through ``tvm_ffi`` (no cutlass import), or None if it has none or
    its runtime libraries are gone (e.g. another environment)."""
    libs = entry.meta.get("runtime_libs") or []
    if SHARED_FILE not in entry.meta.get("files", {}) or not libs or not all(Path(p).is_file() for p in libs):
        return None
    import tvm_ffi

    _preload(libs, strict=True)
    return tvm_ffi.load_module(str(entry.file(SHARED_FILE))).get_function(EXPORT_NAME)


def load_cached(entry: Entry) -> Callable[..., Any]:
    """The kernel stored in ``entry`` as a callable ``tvm_ffi.Function``: its shared library when it
    has one (a dlopen), else the object JIT-linked by CuTe-DSL."""
    try:
        function = _load_shared(entry)
    except Exception as err:  # noqa: BLE001 - the object below is the fallback
        warnings.warn(f"fa4gen: {entry.key}'s shared library does not load ({err}); JIT-linking its object",
                      FA4GenCacheWarning, stacklevel=2)
        function = None
    if function is not None:
        return function
    return _jit_link(entry.artifact_path)


def _jit_link(obj_path: Path) -> Callable[..., Any]:
    """The exported object at ``obj_path`` JIT-linked by CuTe-DSL (read at once: the file may go after)."""
    import cutlass.cute as cute

    _preload_runtime()
    module = cute.runtime.load_module(str(obj_path), enable_tvm_ffi=True)
    return getattr(module, EXPORT_NAME)


def _cache_extras(obj: bytes, sass_text: str | None, meta: dict) -> dict[str, bytes | str]:
    """Side files stored with a kernel: its SASS (when computed) and its shared library (when a C
    compiler links it; the runtime libraries it needs go into ``meta``)."""
    extras: dict[str, bytes | str] = {SASS_FILE: sass_text} if sass_text is not None else {}
    shared = link_shared(obj)
    if shared is not None:
        extras[SHARED_FILE] = shared
        meta["runtime_libs"] = runtime_libraries()
    return extras


def export_object(compiled: Any, path: Path) -> None:
    """Write ``compiled`` (a TVM-FFI ``cute.compile`` result) as a relocatable object."""
    export = getattr(compiled, "export_to_c", None)
    if export is None or "object_file_path" not in inspect.signature(export).parameters:
        raise TypeError(
            "build_fn must return cute.compile(..., options='--enable-tvm-ffi ...'); "
            f"got {type(compiled).__name__}, which cannot be exported as a TVM-FFI object"
        )
    export(object_file_path=str(path), function_name=EXPORT_NAME)


def inspect_object(obj: bytes, *, arch: str | None = None, keep_sass: bool) -> tuple[dict[str, Any], str | None]:
    """Resource usage (and SASS summary) of an exported object: ``(meta, sass_text)``.

    With ``arch``, checks that the embedded cubin was built for it.
    """
    cubins = extract_cubins(obj)
    if not cubins:
        raise RuntimeError("the exported object embeds no cubin")
    built_for = cubin_arch(cubins[0])
    if arch is not None:
        want = _check_arch(arch)
        got = _check_arch(built_for)
        # Only the SM number is compared: the "a" flag bit differs between the cu12 and cu13
        # toolchains' ELF headers (an sm_90a cubin reads as sm_90 with the H200 machine's cu13).
        if got["sm"] != want["sm"]:
            raise RuntimeError(f"asked to compile for {arch}, but the cubin targets {built_for}")
    sass_text = "\n".join(disassemble(c) for c in cubins) if keep_sass else None
    usage = resource_usage(obj, sass=sass_text, disassemble_missing=False)
    meta = {k: v for k, v in usage.items() if k != "arch"}
    meta["cubin_arch"] = built_for
    if sass_text is not None:
        meta["sass"] = summarize_sass(sass_text).to_dict()
    return meta, sass_text


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector paused while a kernel is keyed, traced and compiled (restored after, also
    on an error; left off if the caller had it off). Tracing and the helper-import parse allocate objects by the
    million, and with torch and cutlass imported each full collection they set off walks every live object:
    on the dev CPU (session 33) a first call's compile ran one, 0.16-0.19 s, set off by the cold key's helper
    parse, and a bare compile in a smaller process three, ~0.4 s. Paused, that work folds into the
    collections that come after. Memory is still freed by reference counting; only cyclic garbage waits for
    the collector."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def compile_kernel(
    *,
    build_fn: Callable[[], Any],
    arch: str,
    name: str,
    cache: DiskCache | None,
    key: str | None,
    keep_sass: bool,
    store: bool = True,
) -> CompileResult:
    """Compile ``build_fn()`` for ``arch`` (no GPU needed), or load it from ``cache``.

    ``build_fn`` is zero-argument and returns ``cute.compile(fn, *fake_args,
    options="--enable-tvm-ffi")``, best with ``no_jit_engine=True`` (the result's ``function`` is then the
    exported kernel, loaded as a hit loads it, and its host code is generated once instead of twice);
    it runs under :func:`target_arch`. On a miss the object is exported, inspected (registers, smem,
    stack; SASS summary with ``keep_sass``) and stored under ``key``; a cache that cannot be written is warned
    about and skipped. On a hit the stored object is loaded; with ``keep_sass`` and an
    entry stored without SASS, the SASS is computed from the stored cubin and the entry
    is updated. With ``store`` False a miss is not stored (what it compiled may not be what ``key``
    describes, e.g. helpers edited on disk after this process imported them).
    """
    _check_arch(arch)
    use_cache = cache is not None and key is not None
    if use_cache:
        hit = _try_hit(cache, key, arch=arch, name=name, keep_sass=keep_sass)
        if hit is not None:
            return hit

    with target_arch(arch), collector_paused():
        start = time.perf_counter()
        compiled = build_fn()
        seconds = time.perf_counter() - start

    # compiled without a JIT engine (cute.compile(..., no_jit_engine=True): its host code is generated once,
    # for the export, instead of twice): the callable is what was exported, loaded as a cache hit loads it
    exported_only = getattr(compiled, "engine", True) is None
    function, entry = compiled, None
    with tempfile.TemporaryDirectory(prefix="fa4gen-aot-") as tmp:
        obj_path = Path(tmp) / "artifact.o"
        export_object(compiled, obj_path)
        obj = obj_path.read_bytes()
        meta, sass_text = inspect_object(obj, arch=arch, keep_sass=keep_sass)
        meta.update(name=name, arch=arch, compile_seconds=round(seconds, 3))
        if use_cache and store:
            extras = _cache_extras(obj, sass_text, meta)
            try:
                entry = cache.put(key, obj, meta, extras=extras)
                meta = entry.meta
            except OSError as err:
                warnings.warn(f"fa4gen cache at {cache.root} not written ({err})", FA4GenCacheWarning, stacklevel=2)
        if exported_only:
            function = load_cached(entry) if entry is not None else _jit_link(obj_path)
    return CompileResult(
        name=name, arch=arch, seconds=seconds, cache_hit=False, key=key,
        meta=meta, function=function, sass_text=sass_text,
    )


def _try_hit(cache: DiskCache, key: str, *, arch: str, name: str, keep_sass: bool) -> CompileResult | None:
    entry = cache.get(key)
    if entry is None:
        return None
    if entry.meta.get("arch") != arch:
        warnings.warn(
            f"fa4gen cache entry {key} was built for {entry.meta.get('arch')}, not {arch}; rebuilding",
            FA4GenCacheWarning,
            stacklevel=3,
        )
        return None
    start = time.perf_counter()
    try:
        function = load_cached(entry)
    except Exception as err:  # a verified object the runtime will not link: rebuild it
        warnings.warn(f"fa4gen cache entry {key} does not load ({err}); rebuilding", FA4GenCacheWarning, stacklevel=3)
        return None
    seconds = time.perf_counter() - start
    meta, sass_text = entry.meta, None
    if keep_sass:
        if SASS_FILE in meta.get("files", {}):
            sass_text = entry.file(SASS_FILE).read_text(encoding="utf-8")
        else:
            obj = entry.artifact_path.read_bytes()
            fresh, sass_text = inspect_object(obj, keep_sass=True)
            meta = {**meta, **fresh}
            with contextlib.suppress(OSError):
                meta = cache.put(key, obj, meta, extras=_cache_extras(obj, sass_text, meta)).meta
    return CompileResult(
        name=name, arch=arch, seconds=seconds, cache_hit=True, key=key,
        meta=meta, function=function, sass_text=sass_text,
    )

"""Compile stage: compile one generated kernel module (generated/<name>/<module>.py) through the cache.

A generated kernel module defines the kernel class named by its plan and `fake_arguments()`;
compiling it needs no GPU. The cache key covers the module's text, the device helpers it imports
(transitively, as this process first read them), the installed CuTe-DSL/TVM-FFI versions, the arch,
the compile options and the CuTe-DSL settings in the environment that change code. A miss compiles
exactly the text the key hashed (a fresh module, never one already in sys.modules).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import linecache
import os
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

from fa4gen.compile.aot import CompileResult, compile_kernel
from fa4gen.compile.cache import DiskCache, FA4GenCacheWarning, cache_key, device_helper_sources

COMPILE_OPTIONS = "--enable-tvm-ffi"


# one import at a time: a module sits in sys.modules while it executes, so without it a second thread
# importing the same package would get the unfinished module (re-entrant: a package's __init__ imports
# its own modules through here)
_IMPORT_LOCK = threading.RLock()


def import_from_path(qualified_name: str, path: Path, *, package: bool = False) -> ModuleType:
    """Import a generated module (or, with `package`, the package whose __init__.py is `path`) from
    its file, for generated code outside sys.path; a module that fails to execute is not kept."""
    with _IMPORT_LOCK:
        if qualified_name in sys.modules:
            return sys.modules[qualified_name]
        locations = [str(Path(path).parent)] if package else None
        spec = importlib.util.spec_from_file_location(qualified_name, path, submodule_search_locations=locations)
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[qualified_name]
            raise
        return module


def _imported_helpers(source: str) -> set[str]:
    """The fa4gen.device submodules `source` imports, in any spelling Python allows (from-imports of
    the package or of a submodule, parenthesised or not, relative imports inside fa4gen/device,
    `import fa4gen.device.x`); a regex of one spelling once let an import of another through."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: only fa4gen/device's own modules import that way
                module = "fa4gen.device" + (f".{module}" if module else "")
            if module == "fa4gen.device":
                found.update(alias.name for alias in node.names)
            elif module.startswith("fa4gen.device."):
                found.add(module.split(".")[2])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("fa4gen.device."))
    return found


def used_helper_sources(source: str, helpers: Mapping[str, str] | None = None) -> dict[str, str]:
    """The device-helper modules `source` imports, transitively (so that editing one family's
    helpers does not invalidate the other family's cached kernels)."""
    helpers = device_helper_sources() if helpers is None else helpers
    wanted, todo = {"__init__.py"}, [source]
    while todo:
        for name in _imported_helpers(todo.pop()):
            rel = f"{name}.py"
            if rel in helpers and rel not in wanted:
                wanted.add(rel)
                todo.append(helpers[rel])
    return {rel: text for rel, text in helpers.items() if rel in wanted}


# The device helpers as this process first read them. Kernels trace the helper modules this process
# imported, so a helper edited on disk afterwards must not change the key: the key would describe the new
# text while the kernel came from the old one, and the cache would serve that kernel to every later
# process (a review's finding, session 13). The key uses this snapshot; a changed helper is warned about
# and what compiles with it is not stored.
_HELPER_SNAPSHOT: dict[str, str] | None = None
_WARNED_STALE: set[str] = set()


def _helpers_for_key() -> tuple[dict[str, str], set[str]]:
    """(the helper texts keys use, the helpers whose file changed since the snapshot)."""
    global _HELPER_SNAPSHOT
    current = device_helper_sources()
    if _HELPER_SNAPSHOT is None:
        _HELPER_SNAPSHOT = current
    changed = {rel for rel in set(current) | set(_HELPER_SNAPSHOT) if current.get(rel) != _HELPER_SNAPSHOT.get(rel)}
    return _HELPER_SNAPSHOT, changed


def compile_settings() -> dict[str, str]:
    """The CuTe-DSL settings from the environment that change compiled code (CUTE_DSL_DEBUG, _LINEINFO,
    _ENABLE_ASSERTIONS, _COMPILER_OPT, ...): a debug build must not be served to a release run, nor the
    reverse. The arch is keyed on its own; folders, logging and what to keep do not change the code."""
    skip = ("ARCH", "DIR", "LOG", "KEEP", "PRINT")
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith("CUTE_DSL_") and not any(word in k[len("CUTE_DSL_"):] for word in skip)}


def kernel_cache_key(source: str, cute_arch: str, used: Mapping[str, str] | None = None) -> str:
    """The key of `source` for `cute_arch`; `used` = its helpers (used_helper_sources), read from disk when
    not given."""
    return cache_key(
        source=source, helper_sources=used_helper_sources(source) if used is None else used, arch=cute_arch,
        options={"options": COMPILE_OPTIONS, "env": compile_settings()},
    )


def _module_from_source(qualified_name: str, path: Path, source: str, key: str) -> ModuleType:
    """A fresh module executed from exactly `source` (the text the key hashed), under a name unique to
    that text: a module of the same name already in sys.modules (a package rebuilt in this process, a
    reload) would otherwise be traced instead, and its kernel stored under the new text's key. The
    source is registered with linecache under a name of its own, so CuTe-DSL's source inspection reads
    this text too, not whatever the file holds by then."""
    name = f"{qualified_name}__{key[:16]}"
    filename = f"<fa4gen {path} {key[:16]}>"
    with _IMPORT_LOCK:
        if name in sys.modules:
            return sys.modules[name]
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        module = ModuleType(name)
        module.__file__ = filename
        sys.modules[name] = module
        try:
            exec(compile(source, filename, "exec"), module.__dict__)
        except BaseException:
            del sys.modules[name]
            raise
        return module


def compile_generated(
    path: Path, qualified_name: str, plan: Mapping[str, Any], *, cache: DiskCache | None, keep_sass: bool = False
) -> CompileResult:
    """Compile (or load from `cache`) the kernel in `path` for the plan's arch."""
    source = Path(path).read_text()
    helpers, changed = _helpers_for_key()
    used = used_helper_sources(source, helpers)
    stale = sorted(set(used) & changed)
    if stale and not set(stale) <= _WARNED_STALE:
        _WARNED_STALE.update(stale)
        warnings.warn(
            f"fa4gen.device helpers changed on disk since this process imported them ({', '.join(stale)}): "
            "kernels compiled now are not cached; restart the process to use the new helpers",
            FA4GenCacheWarning, stacklevel=2,
        )
    key = kernel_cache_key(source, plan["cute_arch"], used)

    def build():
        # Imported only on a cache miss: a hit needs neither the module nor a trace.
        import cutlass.cute as cute

        module = _module_from_source(qualified_name, Path(path), source, key)
        kernel = getattr(module, plan["class_name"])()
        return cute.compile(kernel, *module.fake_arguments(), options=COMPILE_OPTIONS)

    return compile_kernel(
        build_fn=build,
        arch=plan["cute_arch"],
        name=f"{plan['name']}.{plan['module']}",
        cache=cache,
        key=key if cache is not None else None,
        keep_sass=keep_sass,
        store=not stale,
    )

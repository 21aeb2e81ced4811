"""Compile stage: compile one generated kernel module (generated/<name>/<module>.py) through the cache.

A generated kernel module defines the kernel class named by its plan and `fake_arguments()`;
compiling it needs no GPU. The cache key covers the module's text, the device helpers it imports
(transitively, as this process first read them), the installed CuTe-DSL/TVM-FFI versions, the arch,
the compile options and the CuTe-DSL settings in the environment that change code. A miss compiles
exactly the text the key hashed (a fresh module, never one already in sys.modules).

Which helpers a text imports comes from parsing it, ~40 ms for a kernel and its helpers, which was most of a
cache hit's time; the answer per text (by its SHA-256) is kept in `<cache dir>/helper_imports.json`, so a
process parses only texts no earlier process has seen.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import json
import linecache
import os
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

from fa4gen.compile.aot import SASS_FILE, CompileResult, collector_paused, compile_kernel
from fa4gen.compile.cache import (
    IMPORTS_MEMO_FILE, DiskCache, FA4GenCacheWarning, cache_dir, cache_key, device_helper_sources,
)

# the compile option fa4gen sets, as it enters the cache key (the compile passes it as cute.compile[EnableTVMFFI])
COMPILE_OPTIONS = "--enable-tvm-ffi"

# Passes of CuTe-DSL's cute-to-nvvm pipeline that fa4gen's kernels compile without. StrengthReductionPass: the SASS
# of all 300 kernels checked (the committed specs' and a sweep over head dims, masks, softcap, GQA, varlen,
# determinism and pipeline switches; sm_90a and sm_100a) is identical with and without it, instruction for
# instruction (session 50, CPU: tools/pipeline_sass_check.py; tests/test_compile_passes.py keeps a forward and a
# backward checked), while it took 0.10 s of the persistent d128 causal forward's 1.2 s native compile (flash-attn-4's
# forward: 0.055 s; tools/compile_time_cpu.py --pass-timing): the index arithmetic it would reduce is written reduced
# already (fast-divmod divisors, per-tile offsets) and ptxas reduces the rest. (NvgpuOptimizationPass, 0.045 s, was
# tried too: it changes the GQA kernels' head-group division, so it stays on.)
# FA4GEN_FULL_PIPELINE=1 compiles with the whole pipeline (to compare, or if a toolchain disagrees).
SKIPPED_PASS_OPTIONS = ("use-strength-reduction-pass=false",)


class FA4GenPipelineWarning(UserWarning):
    """CuTe-DSL's pipeline rejected one of SKIPPED_PASS_OPTIONS (another CuTe-DSL release); the kernel was compiled
    with the whole pipeline instead."""


def pass_options() -> str:
    """The cute-to-nvvm options this process compiles with, read at each compile: empty with FA4GEN_FULL_PIPELINE=1,
    FA4GEN_PASS_OPTIONS when set (other `use-...-pass=false` options to try: tools/pipeline_sass_check.py
    --options; unlike CUTE_DSL_COMPILER_OPT, which CuTe-DSL reads once per process, it applies to the next compile),
    else SKIPPED_PASS_OPTIONS."""
    if os.environ.get("FA4GEN_FULL_PIPELINE") == "1":
        return ""
    chosen = os.environ.get("FA4GEN_PASS_OPTIONS")
    return " ".join(chosen.split()) if chosen is not None else " ".join(SKIPPED_PASS_OPTIONS)


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


# What `_parse_imports` found per text, by SHA-256: loaded from the cache folder once per process, written
# back when a text was parsed. The version names the parser and the Python whose `ast` ran it; a file of
# another version, or one that does not read as this format, is ignored (and replaced).
_IMPORTS_MEMO_VERSION = f"1-py{sys.version_info[0]}.{sys.version_info[1]}"
_IMPORTS_MEMO_MAX = 1024  # entries kept (the newest): kernels of many specs, each text ~100 bytes
_IMPORTS_MEMO: dict[str, list[str]] | None = None
_IMPORTS_MEMO_DIRTY = False
_IMPORTS_MEMO_LOCK = threading.RLock()


def _imports_memo() -> dict[str, list[str]]:
    global _IMPORTS_MEMO
    if _IMPORTS_MEMO is None:
        _IMPORTS_MEMO = {}
        try:
            data = json.loads((cache_dir() / IMPORTS_MEMO_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = None
        entries = data.get("imports") if isinstance(data, dict) and data.get("version") == _IMPORTS_MEMO_VERSION else None
        if isinstance(entries, dict):
            _IMPORTS_MEMO = {
                digest: names for digest, names in entries.items()
                if isinstance(digest, str) and len(digest) == 64 and isinstance(names, list)
                and all(isinstance(n, str) and n.isidentifier() for n in names)
            }
    return _IMPORTS_MEMO


def _save_imports_memo() -> None:
    """Write the memo back if this process added to it (best effort: a cache folder that cannot be written
    only means the next process parses again)."""
    global _IMPORTS_MEMO_DIRTY
    if not _IMPORTS_MEMO_DIRTY or _IMPORTS_MEMO is None:
        return
    _IMPORTS_MEMO_DIRTY = False
    entries = dict(list(_IMPORTS_MEMO.items())[-_IMPORTS_MEMO_MAX:])
    path = cache_dir() / IMPORTS_MEMO_FILE
    tmp = path.with_name(f".{IMPORTS_MEMO_FILE}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": _IMPORTS_MEMO_VERSION, "imports": entries}), encoding="utf-8")
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # e.g. the folder itself could not be made
            pass


def _imported_helpers(source: str) -> set[str]:
    """The fa4gen.device submodules `source` imports (`_parse_imports`), remembered per text."""
    global _IMPORTS_MEMO_DIRTY
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()
    with _IMPORTS_MEMO_LOCK:
        memo = _imports_memo()
        names = memo.get(digest)
        if names is None:
            names = memo[digest] = sorted(_parse_imports(source))
            _IMPORTS_MEMO_DIRTY = True
        return set(names)


def _parse_imports(source: str) -> set[str]:
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
    with _IMPORTS_MEMO_LOCK:
        while todo:
            for name in _imported_helpers(todo.pop()):
                rel = f"{name}.py"
                if rel in helpers and rel not in wanted:
                    wanted.add(rel)
                    todo.append(helpers[rel])
        _save_imports_memo()
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
        options={"options": COMPILE_OPTIONS, "passes": pass_options(), "env": compile_settings()},
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


def _keyed_source(path: Path, plan: Mapping[str, Any]) -> tuple[str, str, list[str]]:
    """(the kernel module's text, its cache key, the helpers it uses that changed on disk since this process
    read them: what compiles now must not be stored under the key)."""
    source = Path(path).read_text()
    helpers, changed = _helpers_for_key()
    used = used_helper_sources(source, helpers)
    return source, kernel_cache_key(source, plan["cute_arch"], used), sorted(set(used) & changed)


def cached_meta(path: Path, plan: Mapping[str, Any], cache: DiskCache, *, keep_sass: bool = False) -> dict | None:
    """The stored meta of the kernel in `path` if `cache` holds it for the plan's arch (with its SASS when
    `keep_sass`), else None; nothing is loaded or compiled. A builder asks first, so that only the misses
    go to compile processes."""
    _, key, stale = _keyed_source(path, plan)
    if stale:
        return None
    entry = cache.get(key)
    if entry is None or entry.meta.get("arch") != plan["cute_arch"]:
        return None
    if keep_sass and SASS_FILE not in entry.meta.get("files", {}):
        return None
    return dict(entry.meta)


def compile_generated(
    path: Path, qualified_name: str, plan: Mapping[str, Any], *, cache: DiskCache | None, keep_sass: bool = False
) -> CompileResult:
    """Compile (or load from `cache`) the kernel in `path` for the plan's arch (the cyclic garbage collector
    paused throughout: `aot.collector_paused`)."""
    with collector_paused():
        return _compile_generated(path, qualified_name, plan, cache=cache, keep_sass=keep_sass)


def _compile_generated(
    path: Path, qualified_name: str, plan: Mapping[str, Any], *, cache: DiskCache | None, keep_sass: bool
) -> CompileResult:
    source, key, stale = _keyed_source(path, plan)
    if stale and not set(stale) <= _WARNED_STALE:
        _WARNED_STALE.update(stale)
        warnings.warn(
            f"fa4gen.device helpers changed on disk since this process imported them ({', '.join(stale)}): "
            "kernels compiled now are not cached; restart the process to use the new helpers",
            FA4GenCacheWarning, stacklevel=2,
        )

    def build():
        # Imported only on a cache miss: a hit needs neither the module nor a trace.
        import cutlass.cute as cute
        from cutlass.base_dsl.compiler import EnableTVMFFI, ExtraCompilerOpts

        module = _module_from_source(qualified_name, Path(path), source, key)
        kernel = getattr(module, plan["class_name"])()
        # (options as option objects: an options= string replaces them, and raw pass options have no string form;
        # a fresh compile callable each time, since CUTE_DSL_COMPILER_OPT from the environment is appended to it)
        passes = pass_options()
        # no JIT engine: compile_kernel loads the exported kernel instead (the host code is not generated twice)
        if not passes:
            return cute.compile[EnableTVMFFI](kernel, *module.fake_arguments(), no_jit_engine=True)
        try:
            return cute.compile[EnableTVMFFI, ExtraCompilerOpts(passes)](kernel, *module.fake_arguments(),
                                                                         no_jit_engine=True)
        except Exception as err:  # a CuTe-DSL whose pipeline lacks one of fa4gen's options: the whole pipeline
            if "cute-to-nvvm" not in str(err) or passes not in str(err) or "FA4GEN_PASS_OPTIONS" in os.environ:
                raise  # (options asked for by name fail as they are)
            warnings.warn(f"this CuTe-DSL's cute-to-nvvm pipeline rejects {passes!r}; compiling with the whole "
                          "pipeline (set FA4GEN_FULL_PIPELINE=1 to skip this attempt)", FA4GenPipelineWarning,
                          stacklevel=2)
            kernel = getattr(module, plan["class_name"])()
            return cute.compile[EnableTVMFFI](kernel, *module.fake_arguments(), no_jit_engine=True)

    return compile_kernel(
        build_fn=build,
        arch=plan["cute_arch"],
        name=f"{plan['name']}.{plan['module']}",
        cache=cache,
        key=key if cache is not None else None,
        keep_sass=keep_sass,
        store=not stale,
    )

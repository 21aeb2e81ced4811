"""Compile stage: compile one generated kernel module (generated/<name>/<module>.py) through the cache.

A generated kernel module defines the kernel class named by its plan and `fake_arguments()`;
compiling it needs no GPU. The cache key covers the module's text, every device-helper source,
the installed CuTe-DSL/TVM-FFI versions, the arch and the compile options.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

from fa4gen.compile.aot import CompileResult, compile_kernel
from fa4gen.compile.cache import DiskCache, cache_key, device_helper_sources

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


def import_kernel_module(path: Path, qualified_name: str) -> ModuleType:
    """Import a generated kernel module from its file (works for packages outside sys.path)."""
    return import_from_path(qualified_name, Path(path))


_HELPER_IMPORT = re.compile(r"^\s*from fa4gen\.device(?:\.(\w+))? import ([\w, ]+)", re.MULTILINE)


def used_helper_sources(source: str) -> dict[str, str]:
    """The device-helper modules `source` imports, transitively (so that editing one family's
    helpers does not invalidate the other family's cached kernels)."""
    helpers = device_helper_sources()
    wanted, todo = {"__init__.py"}, [source]
    while todo:
        for sub, names in _HELPER_IMPORT.findall(todo.pop()):
            for name in [sub] if sub else [n.strip() for n in names.split(",")]:
                rel = f"{name.split(' as ')[0].strip()}.py"
                if rel in helpers and rel not in wanted:
                    wanted.add(rel)
                    todo.append(helpers[rel])
    return {rel: text for rel, text in helpers.items() if rel in wanted}


def kernel_cache_key(source: str, cute_arch: str) -> str:
    return cache_key(
        source=source, helper_sources=used_helper_sources(source), arch=cute_arch,
        options={"options": COMPILE_OPTIONS},
    )


def compile_generated(
    path: Path, qualified_name: str, plan: Mapping[str, Any], *, cache: DiskCache | None, keep_sass: bool = False
) -> CompileResult:
    """Compile (or load from `cache`) the kernel in `path` for the plan's arch."""
    source = Path(path).read_text()

    def build():
        # Imported only on a cache miss: a hit needs neither the module nor a trace.
        import cutlass.cute as cute

        module = import_kernel_module(Path(path), qualified_name)
        kernel = getattr(module, plan["class_name"])()
        return cute.compile(kernel, *module.fake_arguments(), options=COMPILE_OPTIONS)

    return compile_kernel(
        build_fn=build,
        arch=plan["cute_arch"],
        name=f"{plan['name']}.{plan['module']}",
        cache=cache,
        key=kernel_cache_key(source, plan["cute_arch"]) if cache is not None else None,
        keep_sass=keep_sass,
    )

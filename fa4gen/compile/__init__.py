"""Compile stage: AOT-compile CuTe-DSL kernels, cache them on disk, inspect their SASS.

Importing this package does not import cutlass; :func:`compile_kernel` and
:func:`load_cached` import it when called.
"""

from fa4gen.compile.aot import CompileResult, compile_kernel, load_cached, target_arch
from fa4gen.compile.cache import (
    DiskCache,
    Entry,
    FA4GenCacheWarning,
    cache_dir,
    cache_key,
    device_helper_sources,
    toolchain_versions,
)
from fa4gen.compile.sass import (
    SassSummary,
    disassemble,
    find_nvdisasm,
    resource_usage,
    summarize_sass,
)

__all__ = [
    "CompileResult",
    "DiskCache",
    "Entry",
    "FA4GenCacheWarning",
    "SassSummary",
    "cache_dir",
    "cache_key",
    "compile_kernel",
    "device_helper_sources",
    "disassemble",
    "find_nvdisasm",
    "load_cached",
    "resource_usage",
    "summarize_sass",
    "target_arch",
    "toolchain_versions",
]

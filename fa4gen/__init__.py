"""fa4gen: a compiler from declarative attention specs to FlashAttention-4-class CuTe-DSL kernels.

Pipeline (each stage imports only earlier ones): spec -> plan -> render -> device helpers ->
compile/cache -> api -> cli. `fa4gen.build(spec)` runs it programmatically and returns the
loaded generated package.
"""

__version__ = "0.1.0"


def build(spec, *, out_dir=None):
    """Build a spec (AttentionSpec, dict, or path) and return the imported generated package."""
    from fa4gen.builder import build_module

    return build_module(spec, out_dir=out_dir)

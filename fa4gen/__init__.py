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


def precompile(*packages, arch=None, jobs=0):
    """Compile (or find in the disk cache) every kernel of several generated packages in one pool of `jobs`
    compile processes (0: one per CPU as memory allows), each for `arch` (None: the current GPU's), and load
    the current GPU's: a model with several specs compiles them side by side, not one package after another.
    {package name: {kernel module: "cached" | "compiled"}}. One package: `package.precompile()` does the same."""
    from fa4gen.api.runtime import ForwardOp, precompile_ops

    ops = []
    for i, pkg in enumerate(packages):
        op = getattr(pkg, "_forward", None)
        if not isinstance(op, ForwardOp):
            raise TypeError(f"precompile: packages[{i}]: expected a generated package (`import generated.<name>` or "
                            f"fa4gen.build(spec)), got {type(pkg).__name__}")
        ops.append(op)
    if not ops:
        raise TypeError("precompile: expected one or more generated packages, got none")
    return precompile_ops([(op, op.precompile_arch(arch)) for op in ops], jobs=jobs)


def flash_attn_func(q, k, v, **kwargs):
    """flash_attn_func-style attention through a package fa4gen derives from the call (fa4gen/dropin.py)."""
    from fa4gen.dropin import flash_attn_func as call

    return call(q, k, v, **kwargs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, **kwargs):
    """flash_attn_varlen_func-style attention over packed sequences (fa4gen/dropin.py)."""
    from fa4gen.dropin import flash_attn_varlen_func as call

    return call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)


def flash_attn_qkvpacked_func(qkv, **kwargs):
    """flash_attn_qkvpacked_func-style attention on a (batch, seqlen, 3, heads, head_dim) tensor (fa4gen/dropin.py)."""
    from fa4gen.dropin import flash_attn_qkvpacked_func as call

    return call(qkv, **kwargs)


def flash_attn_kvpacked_func(q, kv, **kwargs):
    """flash_attn_kvpacked_func-style attention with kv (batch, seqlen_k, 2, kv_heads, head_dim) (fa4gen/dropin.py)."""
    from fa4gen.dropin import flash_attn_kvpacked_func as call

    return call(q, kv, **kwargs)

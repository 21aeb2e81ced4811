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

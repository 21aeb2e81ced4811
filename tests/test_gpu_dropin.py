"""fa4gen.flash_attn_func on the GPU (fa4gen/dropin.py; skipped without a Hopper GPU): its derived spec
builds the same kernels as a spec file with the same specialisation, so a call's forward equals that
package's bit for bit; a sliding window with causal=True follows flash-attn's convention (right = 0) within the
forward's golden rule against the exact reference."""

import pytest
import torch

from fa4gen.golden.tolerance import grad_budget, reference_budget
from fa4gen.reference import attention_ref, attention_ref_grads

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")]


def _qkv(b=2, s=333, h=8, h_kv=2, d=128, grad=False):
    gen = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda hh: torch.randn(b, s, hh, d, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    return tuple(t.requires_grad_(grad) for t in (mk(h), mk(h_kv), mk(h_kv)))


def test_same_kernels_as_the_spec_file():
    import fa4gen
    import generated.llama3_8b as pkg  # bf16, d128, causal, GQA, backward

    q, k, v = _qkv(grad=True)
    out, lse = fa4gen.flash_attn_func(q, k, v, causal=True, return_lse=True)
    want_out, want_lse = pkg.attention(q, k, v, return_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    # the non-deterministic backward adds dQ (and GQA's dK / dV) in any order: both packages' gradients
    # against the exact reference, by the backward's golden rule
    dout = torch.randn_like(out)
    exact = attention_ref_grads(q, k, v, dout, causal=True)
    low = attention_ref_grads(q, k, v, dout, causal=True, upcast=False)
    for grads in (torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(want_out, (q, k, v), dout)):
        for name, g, e, lo in zip(("dq", "dk", "dv"), grads, exact, low):
            err = (g.float() - e.float()).abs().max().item()
            budget = grad_budget(e.float(), lo.float(), q.dtype, softcap=False)
            assert err <= budget, f"{name}: max error {err:.3g} > budget {budget:.3g}"


def test_causal_window_follows_flash_attn():
    import fa4gen

    q, k, v = _qkv(s=700)
    out = fa4gen.flash_attn_func(q, k, v, causal=True, window_size=(100, -1))
    ref, _ = attention_ref(q, k, v, window=(100, 0))
    low, _ = attention_ref(q, k, v, window=(100, 0), upcast=False)
    err = (out.float() - ref).abs().max().item()
    assert err <= reference_budget(ref, low), f"max error {err:.3g}"

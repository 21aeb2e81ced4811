"""torch.compile of generated packages on the GPU (fa4gen/api/library.py; skipped without a Hopper GPU).

A compiled training step (Inductor, fullgraph=True) runs the same kernels as the eager one: its out and
LSE must equal eager's bit for bit, and so must the gradients of a deterministic spec; a
non-deterministic spec's gradients must meet the backward's golden rule against the exact reference
(fa4gen.golden.tolerance.grad_budget). CUDA-graph replay (mode="reduce-overhead") must give eager's
output on fresh inputs copied into the graph's static buffers.
"""

import pytest
import torch

from fa4gen.golden.tolerance import grad_budget
from fa4gen.reference import attention_ref_grads

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")]


def _step(pkg, **kw):
    def step(q, k, v, w):
        out, lse = pkg.attention(q, k, v, return_lse=True, **kw)
        return (out.float() * w).sum() + lse.sum(), out, lse

    return step


def _run(step, q, k, v, w):
    for t in (q, k, v):
        t.grad = None
    loss, out, lse = step(q, k, v, w)
    loss.backward()
    torch.cuda.synchronize()
    return out.detach(), lse.detach(), [t.grad.clone() for t in (q, k, v)]


def _inputs(b, s, h, h_kv, d, seed, packed=False, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lead = (b * s,) if packed else (b, s)
    mk = lambda hh: torch.randn(*lead, hh, d, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    q, k, v = (t.requires_grad_() for t in (mk(h), mk(h_kv), mk(h_kv)))
    w = torch.randn(*lead, h, d, device="cuda", generator=gen)
    return q, k, v, w


# llama3_8b: bf16 causal GQA, non-deterministic; vit_encoder: fp16 MHA without a mask, deterministic
@pytest.mark.parametrize("name, causal, h_kv, d", [("llama3_8b", True, 2, 128), ("vit_encoder", False, 4, 64)])
def test_inductor_training_step_matches_eager(name, causal, h_kv, d):
    import importlib

    pkg = importlib.import_module(f"generated.{name}")
    dtype = getattr(torch, pkg._forward.plans["sm90"]["torch_dtype"])
    deterministic = pkg._forward.bwd_plans["sm90"]["deterministic"]
    step = _step(pkg)
    compiled = torch.compile(step, fullgraph=True)
    for seed, s in ((0, 300), (1, 517)):
        q, k, v, w = _inputs(2, s, 4, h_kv, d, seed, dtype=dtype)
        want_out, want_lse, want_grads = _run(step, q, k, v, w)
        out, lse, grads = _run(compiled, q, k, v, w)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse), f"{name} s={s}: forward differs from eager"
        exact = attention_ref_grads(q, k, v, w.to(q.dtype), dlse=torch.ones_like(lse), causal=causal)
        low = attention_ref_grads(q, k, v, w.to(q.dtype), dlse=torch.ones_like(lse), causal=causal, upcast=False)
        for g_name, g, g_eager, e, lo in zip(("dq", "dk", "dv"), grads, want_grads, exact, low):
            if deterministic:
                assert torch.equal(g, g_eager), f"{name} s={s}: {g_name} differs from eager (deterministic spec)"
            err = (g.float() - e.float()).abs().max().item()
            budget = grad_budget(e.float(), lo.float(), q.dtype, softcap=False)
            assert err <= budget, f"{name} s={s}: {g_name} max error {err:.3g} > budget {budget:.3g}"


def test_inductor_packed_training_step_matches_eager():
    import generated.qwen2_7b_packed as pkg

    cu = torch.tensor([0, 100, 137, 600], dtype=torch.int32, device="cuda")
    q, k, v, w = _inputs(1, 600, 7, 1, 128, seed=2, packed=True)
    step = _step(pkg, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=463, max_seqlen_k=463)
    want_out, want_lse, _ = _run(step, q, k, v, w)
    out, lse, grads = _run(torch.compile(step, fullgraph=True), q, k, v, w)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
    exact = attention_ref_grads(q, k, v, w.to(q.dtype), dlse=torch.ones_like(lse), causal=True, packed=packed)
    low = attention_ref_grads(q, k, v, w.to(q.dtype), dlse=torch.ones_like(lse), causal=True, packed=packed,
                              upcast=False)
    for g_name, g, e, lo in zip(("dq", "dk", "dv"), grads, exact, low):
        err = (g.float() - e.float()).abs().max().item()
        budget = grad_budget(e.float(), lo.float(), q.dtype, softcap=False)
        assert err <= budget, f"packed: {g_name} max error {err:.3g} > budget {budget:.3g}"


def test_cuda_graph_replay_matches_eager():
    import generated.llama3_8b as pkg

    f = torch.compile(lambda q, k, v: pkg.attention(q, k, v), mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for seed in range(4):  # the first calls record the graph, the later ones replay it on new data
            q, k, v, _ = (t.detach() for t in _inputs(2, 256, 8, 2, 128, seed))
            got = f(q, k, v).clone()
            torch.cuda.synchronize()
            assert torch.equal(got, pkg.attention(q, k, v)), f"call {seed}"

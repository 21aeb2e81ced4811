"""fa4gen.flash_attn_func / flash_attn_varlen_func without CUDA (fa4gen/dropin.py): the spec derived
from a flash-attn call, one package per spec, flash-attn's mask conventions mapped onto the kernels'
run-time window, clear errors for what fa4gen does not do, and torch.compile. The kernels are the CPU
stand-ins of test_backward_cpu (the exact reference, asserting the calling convention), so an output
equal to the reference under flash-attn's own semantics checks the mapping."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fa4gen
from fa4gen import dropin
from fa4gen.reference import attention_ref
from fa4gen.spec import spec_from_dict
from test_api_cpu import naive_attention
from test_backward_cpu import FakeKernels
from test_torch_compile_cpu import FakeVarlenKernels


@pytest.fixture
def built(tmp_path, monkeypatch):
    """The packages built in a test (spec name -> package), their kernels replaced by CPU stand-ins."""
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(dropin, "_PACKAGES", {})
    monkeypatch.setattr(dropin, "_RESOLVED", {})
    monkeypatch.setattr(dropin, "_arch_of_device", lambda device: "sm90")
    real = dropin.package_for
    seen: dict = {}

    def package_for(spec):
        new = spec["name"] not in dropin._PACKAGES
        pkg = real(spec)
        if new:
            stand_in = FakeVarlenKernels if spec["varlen"] else FakeKernels
            stand_in(pkg._forward).install(monkeypatch)
            seen[spec["name"]] = pkg
        return pkg

    monkeypatch.setattr(dropin, "package_for", package_for)
    before = set(sys.modules)
    torch._dynamo.reset()
    yield seen
    torch._dynamo.reset()
    for mod in set(sys.modules) - before:
        if mod.startswith("fa4gen_pkg_"):
            del sys.modules[mod]


def _qkv(b=2, s_q=9, s_k=11, h=4, h_kv=2, d=32, d_v=None, dtype=torch.bfloat16, grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((b, s_q, h, d), (b, s_k, h_kv, d), (b, s_k, h_kv, d_v or d))
    return tuple(torch.randn(*s, generator=gen).to(dtype).requires_grad_(grad) for s in shapes)


@pytest.mark.parametrize(
    "kw, mask",
    [
        ({}, {"kind": "none"}),
        ({"causal": True}, {"kind": "causal"}),
        ({"causal": True, "window_size": (5, -1)}, {"kind": "sliding_window", "left": 0, "right": 0}),
        ({"window_size": (-1, 3)}, {"kind": "sliding_window", "left": 0, "right": 0}),
        ({"window_size": (-1, 0)}, {"kind": "causal"}),  # flash-attn's other spelling of causal
    ],
)
def test_spec_of_a_call(kw, mask):
    q, k, v = _qkv()
    spec = dropin.flash_attn_spec(q, k, v, arch="sm90", **kw)
    assert spec["mask"] == mask
    assert (spec["dtype"], spec["head_dim"], spec["allow_gqa"], spec["varlen"]) == ("bf16", 32, True, False)
    assert spec["backward"] and spec["return_lse"] and not spec["deterministic"] and "head_dim_v" not in spec
    assert spec_from_dict(dict(spec), source="<dict>").name == spec["name"]  # a valid spec, as written
    # the name is content-addressed: the same call gives the same name, a different specialisation another
    assert dropin.flash_attn_spec(q, k, v, arch="sm90", **kw)["name"] == spec["name"]
    assert dropin.flash_attn_spec(q, k, v, arch="sm90", softcap=5.0, **kw)["name"] != spec["name"]


def test_spec_follows_the_tensors_and_the_arch():
    q, k, v = _qkv(h_kv=4, d=64, d_v=64, dtype=torch.float16)
    spec = dropin.flash_attn_spec(q, k, v, deterministic=True, arch="sm90")
    assert (spec["dtype"], spec["head_dim"], spec["allow_gqa"], spec["deterministic"]) == ("fp16", 64, False, True)
    q, k, v = _qkv(d=192, d_v=128)
    assert dropin.flash_attn_spec(q, k, v, arch="sm90")["head_dim_v"] == 128
    blackwell = dropin.flash_attn_spec(q, k, v, deterministic=True, arch="sm100")
    assert blackwell["targets"] == ["sm100"] and not blackwell["backward"] and not blackwell["deterministic"]


@pytest.mark.parametrize(
    "kw, want",
    [
        ({}, {}),
        ({"causal": True}, {"causal": True}),
        ({"causal": True, "window_size": (4, -1)}, {"window": (4, 0)}),
        ({"causal": True, "window_size": (4, 0)}, {"window": (4, 0)}),
        ({"window_size": (2, 3)}, {"window": (2, 3)}),
        ({"window_size": (-1, 1)}, {"window": (-1, 1)}),
        ({"window_size": (-1, 0)}, {"causal": True}),
        ({"softmax_scale": 0.25, "softcap": 4.0}, {"softmax_scale": 0.25, "softcap": 4.0}),
    ],
)
def test_output_follows_flash_attn_semantics(built, kw, want):
    q, k, v = _qkv()
    out, lse = fa4gen.flash_attn_func(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = attention_ref(q, k, v, **want)
    torch.testing.assert_close(out, ref_out.to(out.dtype), rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=0, atol=0)


def test_one_package_per_specialisation(built):
    q, k, v = _qkv()
    for window in ((4, -1), (2, -1), (7, -1)):  # the window's sizes are run-time arguments: one package
        fa4gen.flash_attn_func(q, k, v, causal=True, window_size=window)
    assert len(built) == 1
    fa4gen.flash_attn_func(q, k, v, causal=True)
    fa4gen.flash_attn_func(*_qkv(h_kv=4), causal=True)  # MHA: its own kernels (no GQA reductions)
    assert len(built) == 3


def test_training_step_and_torch_compile(built):
    q, k, v = _qkv(grad=True)

    def step(q, k, v):
        out, lse = fa4gen.flash_attn_func(q, k, v, causal=True, window_size=(4, -1), softcap=30.0, return_lse=True)
        return out.float().square().sum() + lse.sum()

    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)):
        for t in (q, k, v):
            t.grad = None
        loss = fn(q, k, v)
        loss.backward()
        results.append([loss.detach()] + [t.grad.clone() for t in (q, k, v)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(built) == 1


def test_varlen(built):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(11, 4, 32, generator=gen).bfloat16()
    k, v = (torch.randn(11, 2, 32, generator=gen).bfloat16() for _ in range(2))
    cu = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    out, lse = fa4gen.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True, return_lse=True)
    for a, b in ((0, 4), (4, 5), (5, 11)):
        ref_out, ref_lse = attention_ref(q[None, a:b], k[None, a:b], v[None, a:b], causal=True)
        torch.testing.assert_close(out[a:b], ref_out[0].to(out.dtype), rtol=0, atol=0)
        torch.testing.assert_close(lse[:, a:b], ref_lse[0].float(), rtol=0, atol=0)
    assert [p._forward.spec["varlen"] for p in built.values()] == [True]


@pytest.mark.parametrize(
    "kw, kind, message",
    [
        ({"dropout_p": 0.1}, ValueError, "dropout_p: fa4gen kernels have no attention dropout"),
        ({"alibi_slopes": torch.ones(4)}, ValueError, "alibi_slopes: fa4gen kernels have no ALiBi"),
        ({"return_attn_probs": True}, ValueError, "return_attn_probs"),
        ({"window_size": (2.5, 0)}, ValueError, "window_size: expected (left, right) ints"),
        ({"window_size": (3, -2)}, ValueError, "window_size: expected (left, right) ints"),
        ({"causal": True, "window_size": (3, 2)}, ValueError, "so right must be -1 or 0, got 2"),
        ({"causal": 1}, TypeError, "causal: expected True or False"),
        ({"softcap": -1.0}, ValueError, "softcap: expected a float >= 0"),
        ({"deterministic": "yes"}, TypeError, "deterministic: expected True or False"),
    ],
)
def test_bad_arguments_are_named(built, kw, kind, message):
    with pytest.raises(kind) as err:
        fa4gen.flash_attn_func(*_qkv(), **kw)
    assert message in str(err.value)
    assert not built


def test_bad_tensors_are_named(built):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"q: expected dtype torch.bfloat16 or torch.float16, got torch.float32"):
        fa4gen.flash_attn_func(q.float(), k, v)
    with pytest.raises(ValueError, match=r"k: expected 4 dims \(batch, seqlen, heads, head_dim\), got 3"):
        fa4gen.flash_attn_func(q, k[0], v)
    with pytest.raises(TypeError, match="v: expected a torch.Tensor, got list"):
        fa4gen.flash_attn_func(q, k, [1])
    # a head dim no spec allows: the spec stage names it
    with pytest.raises(Exception, match="head_dim"):
        fa4gen.flash_attn_func(*_qkv(d=20))


def test_cpu_tensors_are_refused_before_any_build(tmp_path, monkeypatch):
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(dropin, "_PACKAGES", {})
    monkeypatch.setattr(dropin, "_RESOLVED", {})
    with pytest.raises(ValueError, match="q: expected a CUDA tensor, got device cpu"):
        fa4gen.flash_attn_func(*_qkv())
    assert not dropin._PACKAGES and not (tmp_path / "cache").exists()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s_q=st.integers(1, 9), s_k=st.integers(1, 9), causal=st.booleans(), left=st.integers(-1, 6),
       right=st.integers(-1, 6), seed=st.integers(0, 2**16))
def test_mask_mapping_against_flash_attn_semantics(built, s_q, s_k, causal, left, right, seed):
    """Any causal / window_size a flash-attn call may pass (right -1 or 0 with causal) against a naive loop
    that applies flash-attn's definition directly (test_api_cpu.naive_attention: bottom-right aligned,
    causal and the window both applied): the LSE pins the visible key set of every row (-inf where none)."""
    if causal:
        right = min(right, 0)
    q, k, v = _qkv(b=1, s_q=s_q, s_k=s_k, h=2, h_kv=1, seed=seed)
    out, lse = fa4gen.flash_attn_func(q, k, v, causal=causal, window_size=(left, right), return_lse=True)
    window = None if (left, right) == (-1, -1) else (left, right)
    _, want = naive_attention(q.double(), k.double(), v.double(), scale=32 ** -0.5, causal=causal, window=window)
    torch.testing.assert_close(lse.double(), want, rtol=1e-5, atol=1e-5, equal_nan=False)


def test_grad_on_a_gpu_without_backward_kernels_is_refused(built, monkeypatch):
    monkeypatch.setattr(dropin, "_arch_of_device", lambda device: "sm100")
    monkeypatch.setattr(dropin, "package_for", lambda spec: dropin._PACKAGES.setdefault(
        spec["name"], fa4gen.build(dict(spec))))
    q, k, v = _qkv(grad=True)
    with pytest.raises(RuntimeError, match="needs backward kernels, and fa4gen has them for Hopper"):
        fa4gen.flash_attn_func(q, k, v, causal=True)
    assert [p._forward.spec["targets"] for p in dropin._PACKAGES.values()] == [["sm100"]]


def test_repeated_calls_skip_the_spec_but_not_the_checks(built, monkeypatch):
    """The second call of a specialisation finds its package by a dict hit (no spec derivation, no hash);
    an argument of another type (causal=1, a list window) is never taken for a cached one."""
    q, k, v = _qkv()
    first = fa4gen.flash_attn_func(q, k, v, causal=True, window_size=(3, -1))
    describe = dropin._describe
    monkeypatch.setattr(dropin, "_describe", lambda *a, **kw: pytest.fail("the spec was derived again"))
    torch.testing.assert_close(fa4gen.flash_attn_func(q, k, v, causal=True, window_size=(3, -1)), first,
                               rtol=0, atol=0)
    monkeypatch.setattr(dropin, "_describe", describe)
    with pytest.raises(TypeError, match="causal: expected True or False"):
        fa4gen.flash_attn_func(q, k, v, causal=1, window_size=(3, -1))
    torch.testing.assert_close(fa4gen.flash_attn_func(q, k, v, causal=True, window_size=[3, -1]), first,
                               rtol=0, atol=0)
    assert len(built) == 1


def test_packed_qkv_and_kv(built):
    """Views of a fused projection's output: the same result as separate tensors, and gradients flow back
    into the packed tensor."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 9, 3, 4, 32, generator=gen).bfloat16().requires_grad_()
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    got = fa4gen.flash_attn_qkvpacked_func(qkv, causal=True)
    want = fa4gen.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    dout = torch.randn(got.shape, generator=gen).bfloat16()
    got.backward(dout)
    want.backward(dout)
    torch.testing.assert_close(qkv.grad, torch.stack([q.grad, k.grad, v.grad], 2), rtol=0, atol=0)
    kv = torch.stack([k, v], 2).detach()
    torch.testing.assert_close(fa4gen.flash_attn_kvpacked_func(q.detach(), kv, causal=True), want.detach(),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"qkv: expected a \(batch, seqlen, 3, heads, head_dim\) tensor"):
        fa4gen.flash_attn_qkvpacked_func(qkv[:, :, :2])
    with pytest.raises(ValueError, match=r"kv: expected a \(batch, seqlen_k, 2, kv_heads, head_dim\) tensor"):
        fa4gen.flash_attn_kvpacked_func(q, qkv)

"""Backward without CUDA: the exact reference gradients (`attention_ref_grads`) against a closed-form
derivation and torch SDPA, and the autograd wiring of a generated package with backward: true.

The wiring tests replace the compiled kernels with CPU stand-ins that follow the kernels' calling
convention (fa4gen/api/runtime.py ForwardOp.backward) and assert it: the workspaces' shapes, dtypes
and zeroing, the run-time argument list, and that the backward sees the forward call's scale,
window and chunk size. Their gradients are the exact reference's, so autograd's result must equal
the reference computed directly, bit for bit.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys

import pytest
import torch

import fa4gen
from fa4gen.api.runtime import LOG2_E, Packed
from fa4gen.reference import attention_ref, attention_ref_grads, error_budget, visible

# --- reference gradients ---------------------------------------------------------------------------


def closed_form_grads(q, k, v, dout, dlse, *, scale, causal=False, window=None, chunk=None, softcap=0.0):
    """dq, dk, dv from the backward's own equations, per (batch, head), in fp64:
    P = exp(S - lse), dV = Pᵀ·dO, dP = dO·Vᵀ, dS = P ∘ (dP − rowsum(dO ∘ O) + dlse), through the
    softcap's tanh, dQ = scale·dS·K, dK = scale·dSᵀ·Q; dK and dV summed over a kv head's q heads."""
    b, s_q, h, _ = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    group = h // h_kv
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros(b, s_k, h_kv, v.shape[3], dtype=q.dtype)
    ok = visible(s_q, s_k, causal=causal, window=window, chunk=chunk)
    for bi in range(b):
        for hi in range(h):
            hk = hi // group
            Q, K, V, dO = q[bi, :, hi], k[bi, :, hk], v[bi, :, hk], dout[bi, :, hi]
            raw = scale * Q @ K.T
            t = torch.tanh(raw / softcap) if softcap else None
            S = (softcap * t if softcap else raw).masked_fill(~ok, -math.inf)
            lse = torch.logsumexp(S, dim=-1, keepdim=True)
            P = torch.exp(S - lse.masked_fill(lse == -math.inf, 0.0))
            O = P @ V
            dP = dO @ V.T
            dS = P * (dP - (dO * O).sum(-1, keepdim=True) + dlse[bi, hi][:, None])
            if softcap:
                dS = dS * (1 - t * t)
            dq[bi, :, hi] = scale * dS @ K
            dk[bi, :, hk] += scale * dS.T @ Q
            dv[bi, :, hk] += P.T @ dO
    return dq, dk, dv


GRAD_CASES = {
    "none": dict(s_q=5, s_k=9),
    "causal": dict(s_q=7, s_k=9, causal=True),
    "causal_rows_before_keys": dict(s_q=9, s_k=4, causal=True),  # the first rows see no key
    "window": dict(s_q=7, s_k=9, window=(2, 1)),
    "window_left_only": dict(s_q=9, s_k=9, window=(3, -1)),
    "chunked": dict(s_q=7, s_k=9, chunk=3),
    "softcap": dict(s_q=6, s_k=6, causal=True, softcap=2.0, scale=1.3),
    "gqa": dict(s_q=5, s_k=7, h=4, h_kv=2, causal=True),
    "mqa_softcap_window": dict(s_q=6, s_k=8, h=3, h_kv=1, window=(2, 2), softcap=1.5),
    "head_dim_v": dict(s_q=4, s_k=6, d=12, dv=8, window=(1, 1)),
    "one_key": dict(s_q=1, s_k=1),
}


def _case(name):
    c = dict(GRAD_CASES[name])
    shape = dict(s_q=c.pop("s_q"), s_k=c.pop("s_k"), h=c.pop("h", 2), h_kv=c.pop("h_kv", 2), d=c.pop("d", 16))
    shape["dv"] = c.pop("dv", shape["d"])
    scale = c.pop("scale", None)
    gen = torch.Generator().manual_seed(list(GRAD_CASES).index(name))
    b = 2
    q = torch.randn(b, shape["s_q"], shape["h"], shape["d"], generator=gen, dtype=torch.float64) * 2
    k = torch.randn(b, shape["s_k"], shape["h_kv"], shape["d"], generator=gen, dtype=torch.float64) * 2
    v = torch.randn(b, shape["s_k"], shape["h_kv"], shape["dv"], generator=gen, dtype=torch.float64)
    dout = torch.randn(b, shape["s_q"], shape["h"], shape["dv"], generator=gen, dtype=torch.float64)
    dlse = torch.randn(b, shape["h"], shape["s_q"], generator=gen, dtype=torch.float64)
    return q, k, v, dout, dlse, scale, c


@pytest.mark.parametrize("case", list(GRAD_CASES))
@pytest.mark.parametrize("with_dlse", [False, True])
def test_reference_grads_match_closed_form(case, with_dlse):
    q, k, v, dout, dlse, scale, sem = _case(case)
    grads = attention_ref_grads(q, k, v, dout, dlse=dlse if with_dlse else None, softmax_scale=scale, **sem)
    want = closed_form_grads(q, k, v, dout, dlse if with_dlse else torch.zeros_like(dlse),
                             scale=scale if scale is not None else q.shape[-1] ** -0.5, **sem)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert got.dtype == torch.float64 and got.shape == ref.shape, name
        assert torch.isfinite(got).all(), f"{case} {name}: not finite"
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12, msg=f"{case} {name}")
    # the LSE gradient is not lost: it changes dq and dk whenever a row sees more than one key
    if with_dlse and GRAD_CASES[case]["s_k"] > 1:
        plain = attention_ref_grads(q, k, v, dout, softmax_scale=scale, **sem)
        assert not torch.allclose(grads[0], plain[0])


def test_reference_grads_of_fully_masked_rows_are_zero():
    q, k, v, dout, dlse, _, sem = _case("causal_rows_before_keys")
    dq, _, _ = attention_ref_grads(q, k, v, dout, dlse=dlse, **sem)
    empty = ~visible(q.shape[1], k.shape[1], **sem).any(dim=1)  # (s_q,)
    assert empty.any() and (dq[:, empty] == 0).all() and (dq[:, ~empty] != 0).any()


@pytest.mark.parametrize("causal, h_kv", [(False, 2), (True, 2), (True, 1), (False, 4)])
def test_reference_grads_match_torch_sdpa(causal, h_kv):
    gen = torch.Generator().manual_seed(h_kv + 10 * causal)
    b, s_q, s_k, h, d = 2, 6, 9, 4, 16
    q = torch.randn(b, s_q, h, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, s_k, h_kv, d, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, s_k, h_kv, d, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(b, s_q, h, d, generator=gen, dtype=torch.float64)
    mask = visible(s_q, s_k, causal=causal)  # bottom-right aligned, as SDPA's is_causal is not
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask, enable_gqa=h != h_kv
    ).transpose(1, 2)
    want = torch.autograd.grad(out, (q, k, v), dout)
    got = attention_ref_grads(q, k, v, dout, causal=causal)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_grads_set_a_useful_budget(dtype):
    """upcast=False: autograd through the input-precision forward; gradients in the input dtype,
    off the exact ones by a rounding-sized amount (the 2x rule's budget)."""
    q, k, v, dout, dlse, scale, sem = _case("mqa_softcap_window")
    low_in = [t.to(dtype) for t in (q, k, v, dout)]
    exact = attention_ref_grads(*low_in, dlse=dlse.float(), softmax_scale=scale, dtype=torch.float64, **sem)
    low = attention_ref_grads(*low_in, dlse=dlse.float(), softmax_scale=scale, upcast=False, **sem)
    eps = torch.finfo(dtype).eps
    for name, lo, ex in zip(("dq", "dk", "dv"), low, exact):
        assert lo.dtype == dtype and torch.isfinite(lo).all(), name
        scale_of = ex.abs().max().item()
        budget = error_budget(lo, ex)
        assert 1e-5 < budget < 64 * eps * scale_of, f"{name}: budget {budget:.3g} for values up to {scale_of:.3g}"


def test_reference_grads_leave_inputs_alone():
    q, k, v, dout, _, _, _ = _case("none")
    q.requires_grad_()
    with torch.no_grad():
        grads = attention_ref_grads(q, k, v, dout)
    assert q.grad is None and all(g.requires_grad is False for g in grads)


# --- a generated package with backward: true, its kernels replaced by CPU stand-ins -----------------

@pytest.fixture
def build_pkg(tmp_path, monkeypatch):
    """fa4gen.build of a backward spec into a temporary cache (rendered, never compiled here)."""
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path / "cache"))
    before = set(sys.modules)
    yield lambda **spec: fa4gen.build(dict(targets=["sm90"], backward=True, **spec))
    for mod in set(sys.modules) - before:
        if mod.startswith("fa4gen_pkg_"):
            del sys.modules[mod]


SPECS = {
    # every optional kernel argument: softcap, window, dK/dV accumulators, both semaphores
    "local": dict(name="bwd_local", dtype="bf16", head_dim=32, mask={"kind": "sliding_window", "left": 6, "right": 2},
                  softcap=5.0, allow_gqa=True, deterministic=True, return_lse=True),
    # the fewest: no softcap, no accumulators, no semaphores; a run-time chunk size
    "chunked": dict(name="bwd_chunked", dtype="fp16", head_dim=32, mask={"kind": "chunked", "chunk_size": 4},
                    allow_gqa=False),
    "causal": dict(name="bwd_causal", dtype="bf16", head_dim=32, mask={"kind": "causal"}, allow_gqa=True),
    # the persistent backward (MHA without a mask): its CTA count after the run-time arguments
    "none_mha": dict(name="bwd_none_mha", dtype="bf16", head_dim=32, allow_gqa=False),
}


# the dispatcher's thread-local key sets of plain eager code: a torch.library operator's implementation
# (fa4gen/api/library.py, the torch.compile path) runs with autograd's keys excluded, where the stand-in
# backward's reference (torch.autograd.grad) could not record a graph
_EAGER_KEYS = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())


class FakeKernels:
    """The compiled forward and backward, in Python on the CPU, asserting the calling convention."""

    def __init__(self, op):
        self.op = op
        # (a package without a backward: the forward's plan, whose run-time arguments are the same)
        self.fwd_plan = op.plans["sm90"]
        self.plan = self.default_plan = op.bwd_plans.get("sm90", self.fwd_plan)
        self.calls: list[dict] = []

    def install(self, monkeypatch):
        monkeypatch.setattr(self.op, "_check_devices", lambda device, named: None)
        monkeypatch.setattr(self.op, "arch_for", lambda device: "sm90")
        monkeypatch.setattr(self.op, "_launch", lambda fn, device, args: fn(*args))
        monkeypatch.setattr(self.op, "function",
                            lambda plan: functools.partial(self.backward_of, plan) if plan["direction"] == "bwd"
                            else self.forward)
        return self

    def backward_of(self, plan, *a):
        """The backward of the launched plan (a package with allow_gqa holds two: bwd_sm90_mha for MHA calls)."""
        self.plan = plan
        try:
            self.backward(*a)
        finally:
            self.plan = self.default_plan
        self.calls[-1]["module"] = plan["module"]

    def _semantics(self, args: list, *, backward: bool) -> dict:
        plan, args = self.plan, list(args)
        scale_log2 = args.pop(0)
        if plan["softcap"] > 0:
            scale = args.pop(0) * plan["softcap"]
            assert scale_log2 == pytest.approx(plan["softcap"] * LOG2_E)
        else:
            scale = scale_log2 / LOG2_E
        sem: dict = dict(softmax_scale=scale, softcap=plan["softcap"])
        if backward:
            assert args.pop(0) == pytest.approx(scale), "grad_scale must be the softmax scale"
        if plan["local"]:
            sem["window"] = (args.pop(0), args.pop(0))
        elif plan["chunked"]:
            sem["chunk"] = args.pop(0)
        else:
            sem["causal"] = plan["causal"]
        assert not args, f"unexpected run-time arguments {args}"
        return sem

    def forward(self, q, k, v, out, lse, *args):
        if self.fwd_plan["scheduler"] == "persistent":  # its CTA count last: the plan's stand-in off CUDA
            *args, num_ctas = args
            assert num_ctas == self.fwd_plan["persistent_ctas"]
        sem = self._semantics(args, backward=False)
        o, l = attention_ref(q, k, v, **sem)
        out.copy_(o)
        lse.copy_(l)

    def backward(self, *a):
        plan = self.plan
        claim = plan.get("dq_claim", False)
        n = 13 + 2 * plan["dkv_accum"] + claim + plan["deterministic"] + (plan["deterministic"] and plan["dkv_accum"])
        tensors, args = a[:n], a[n:]
        ctas = None
        if plan["scheduler"] == "persistent":  # its CTA count last: the plan's stand-in off CUDA
            *args, ctas = args
            assert ctas == plan["persistent_ctas"] > 0
        q, k, v, out, dout, lse, dlse, dq, dk, dv, lse_log2, dpsum, dq_accum = tensors[:13]
        extra = list(tensors[13:])
        b, s_q, h, d = q.shape
        s_k, h_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
        dtype = q.dtype
        assert (out.shape, dout.shape, out.dtype, dout.dtype) == ((b, s_q, h, d_v),) * 2 + (dtype,) * 2
        assert dout.is_contiguous() and dlse.is_contiguous()
        for t in (lse, dlse):
            assert t.shape == (b, h, s_q) and t.dtype == torch.float32
        for t in (lse_log2, dpsum):  # per query tile, padded (the preprocess writes the padding)
            assert t.shape == (b, h, math.ceil(s_q / plan["tile_m"]) * plan["tile_m"]) and t.dtype == torch.float32
        for t, like in ((dq, q), (dk, k), (dv, v)):
            assert t.shape == like.shape and t.dtype == dtype and t.is_contiguous()
        # uninitialised: the backward's preprocess zeroes it before the main kernel adds into it (with the
        # hand-offs the first key block of each chunk stores instead, and the postprocess zeroes the chunks
        # no key block reaches, by their turn counter or claim flag); every
        # query tile (padded to tile_m rows) as flat fragment-order chunks per (batch, head)
        tile_m = plan["tile_m"]
        assert dq_accum.shape == (b, h, math.ceil(s_q / tile_m) * tile_m * d) and dq_accum.dtype == torch.float32
        assert dq_accum.is_contiguous()
        if plan["dkv_accum"]:
            dk_accum, dv_accum = extra.pop(0), extra.pop(0)
            assert dk_accum.shape == (b, s_k, h_kv, d) and dv_accum.shape == (b, s_k, h_kv, d_v)
            assert dk_accum.dtype == dv_accum.dtype == torch.float32 and not dk_accum.any() and not dv_accum.any()
        # the non-deterministic hand-off's claim flags / the deterministic turn counters: one per query tile,
        # allocated without a fill (the compiled backward's preprocess zeroes them; this stand-in does too);
        # with the overlapped dQ conversion, one more per (batch, head): its count of landed key blocks
        if claim:
            claim_dq = extra.pop(0)
            slots = math.ceil(s_q / plan["tile_m"]) + plan["dq_post_overlap"]
            assert claim_dq.shape == (b, h, slots) and claim_dq.dtype == torch.int32
            claim_dq.zero_()
        if plan["deterministic"]:
            sem_dq = extra.pop(0)
            assert sem_dq.shape == (b, h, math.ceil(s_q / plan["tile_m"])) and sem_dq.dtype == torch.int32
            sem_dq.zero_()
            if plan["dkv_accum"]:
                sem_dkv = extra.pop(0)
                assert sem_dkv.shape == (b, h_kv, math.ceil(s_k / plan["tile_n"])) and sem_dkv.dtype == torch.int32
                assert not sem_dkv.any()
        sem = self._semantics(args, backward=True)
        torch.testing.assert_close(lse, attention_ref(q, k, v, **sem)[1].float(), msg="the forward's LSE")
        with torch._C._ForceDispatchKeyGuard(*_EAGER_KEYS):
            want = attention_ref_grads(q, k, v, dout, dlse=dlse, **sem)
        for t, g in zip((dq, dk, dv), want):
            t.copy_(g)
        self.calls.append(dict(sem=sem, dlse=dlse.clone(), dout=dout.clone(), ctas=ctas))


def _inputs(pkg, b=2, s_q=9, s_k=11, h=4, h_kv=2, seed=0):
    plan = pkg._forward.plans["sm90"]
    dtype = getattr(torch, plan["torch_dtype"])
    if not plan["allow_gqa"]:
        h_kv = h
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen).to(dtype).requires_grad_()  # noqa: E731
    return mk(b, s_q, h, plan["head_dim"]), mk(b, s_k, h_kv, plan["head_dim"]), mk(b, s_k, h_kv, plan["head_dim_v"])


def _ref_grads(q, k, v, dout, dlse=None, **sem):
    return [g.to(q.dtype) for g in attention_ref_grads(q, k, v, dout, dlse=dlse, **sem)]


def _assert_grads(tensors, want, where=""):
    for name, t, w in zip(("q", "k", "v"), tensors, want):
        if w is None:
            assert t.grad is None, f"{where}: {name}.grad should be None"
            continue
        assert t.grad is not None and t.grad.dtype == t.dtype, f"{where}: {name}.grad"
        torch.testing.assert_close(t.grad, w, rtol=0, atol=0, msg=f"{where}: {name}.grad")


def test_backward_package_api(build_pkg):
    pkg = build_pkg(**SPECS["local"])
    assert pkg._forward.bwd_plans["sm90"]["direction"] == "bwd"
    params = inspect.signature(pkg.attention).parameters
    assert list(params) == ["q", "k", "v", "softmax_scale", "window", "return_lse", "out"]
    doc = pkg.attention.__doc__
    assert ".backward()" in doc and "softmax_scale and window" in doc and "deterministic: true" in doc
    assert "sm90 bwd" in pkg.__doc__


def test_autograd_matches_reference_with_every_kernel_argument(build_pkg, monkeypatch):
    """Softcap, a run-time window and softmax_scale, GQA, deterministic: the backward gets the
    forward call's arguments, and the LSE's gradient reaches it."""
    pkg = build_pkg(**SPECS["local"])
    fake = FakeKernels(pkg._forward).install(monkeypatch)
    q, k, v = _inputs(pkg)
    out, lse = pkg.attention(q, k, v, softmax_scale=0.3, window=(5, 1), return_lse=True)
    assert out.requires_grad and lse.requires_grad and lse.dtype == torch.float32
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=gen).to(out.dtype)
    dlse = torch.randn(lse.shape, generator=gen)
    ((out.float() * dout.float()).sum() + (lse * dlse).sum()).backward()
    assert len(fake.calls) == 1
    sem = dict(softmax_scale=0.3, softcap=5.0, window=(5, 1))
    got = fake.calls[0]["sem"]
    assert got["window"] == (5, 1) and got["softmax_scale"] == pytest.approx(0.3) and got["softcap"] == 5.0
    assert torch.equal(fake.calls[0]["dlse"], dlse)
    _assert_grads((q, k, v), _ref_grads(q, k, v, dout, dlse, **sem))


def test_persistent_backward_launch_ends_in_its_cta_count(build_pkg, monkeypatch):
    """An MHA spec without a mask gets the persistent backward (one CTA per SM over the key-block tiles): its
    launch carries the CTA count after the run-time arguments (off CUDA the plan's stand-in, on a GPU its SM
    count), and autograd's gradients are the reference's. Its dQ conversion overlaps the last round
    (plan dq_post_overlap): the claim flags end in one more int32 per (batch, head), its count of landed key
    blocks (the stand-in checks the shape)."""
    pkg = build_pkg(**SPECS["none_mha"])
    plan = pkg._forward.bwd_plans["sm90"]
    assert plan["scheduler"] == "persistent" and not pkg._forward.bwd_mha_plans
    assert plan["dq_post_overlap"] and plan["dq_claim"]
    fake = FakeKernels(pkg._forward).install(monkeypatch)
    q, k, v = _inputs(pkg, h=4, h_kv=4, seed=21)
    out = pkg.attention(q, k, v)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(21)).to(out.dtype)
    out.backward(dout)
    assert fake.calls[-1]["ctas"] == plan["persistent_ctas"]
    _assert_grads((q, k, v), _ref_grads(q, k, v, dout, causal=False))


def test_lse_gradient_alone_and_zero_when_unused(build_pkg, monkeypatch):
    pkg = build_pkg(**SPECS["local"])
    fake = FakeKernels(pkg._forward).install(monkeypatch)
    q, k, v = _inputs(pkg, seed=3)
    _, lse = pkg.attention(q, k, v, return_lse=True)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(4))
    (lse * dlse).sum().backward()  # out's gradient is None: the kernel gets a zero dout
    assert not fake.calls[0]["dout"].any()
    _assert_grads((q, k, v), _ref_grads(q, k, v, torch.zeros_like(fake.calls[0]["dout"]), dlse, window=(6, 2),
                                        softcap=5.0))
    for t in (q, k, v):
        t.grad = None
    out = pkg.attention(q, k, v)  # return_lse=False: the kernel gets a zero dlse
    out.float().sum().backward()  # stride-0 dout, copied to a contiguous one
    assert not fake.calls[1]["dlse"].any()
    _assert_grads((q, k, v), _ref_grads(q, k, v, torch.ones_like(out), window=(6, 2), softcap=5.0))


def test_chunked_spec_reuses_the_call_chunk_size(build_pkg, monkeypatch):
    pkg = build_pkg(**SPECS["chunked"])
    fake = FakeKernels(pkg._forward).install(monkeypatch)
    q, k, v = _inputs(pkg, s_q=13, s_k=13, seed=5)
    out = pkg.attention(q, k, v, chunk_size=3)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(out.dtype)
    out.backward(dout)
    assert fake.calls[0]["sem"]["chunk"] == 3
    _assert_grads((q, k, v), _ref_grads(q, k, v, dout, chunk=3))


def test_allow_gqa_runs_mha_calls_on_the_mha_backward(build_pkg, monkeypatch):
    """A spec with allow_gqa (the default) holds two backwards: an MHA call launches bwd_sm90_mha with the
    allow_gqa: false calling convention (no fp32 dK/dV workspaces, its own tile's statistics), a GQA call
    bwd_sm90 with the workspaces; both give the reference gradients."""
    pkg = build_pkg(**SPECS["causal"])
    fake = FakeKernels(pkg._forward).install(monkeypatch)
    modules = []
    for h_kv, seed in ((4, 11), (2, 12), (1, 13)):
        q, k, v = _inputs(pkg, h=4, h_kv=h_kv, seed=seed)
        out = pkg.attention(q, k, v)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
        out.backward(dout)
        modules.append(fake.calls[-1]["module"])
        _assert_grads((q, k, v), _ref_grads(q, k, v, dout, causal=True), f"h_kv={h_kv}")
    assert modules == ["bwd_sm90_mha", "bwd_sm90", "bwd_sm90"]
    mha, gqa = (pkg._forward.backward_plan("sm90", 4, n) for n in (4, 2))
    assert (mha["dkv_accum"], gqa["dkv_accum"]) == (False, True)


def test_only_inputs_that_require_grad_get_one(build_pkg, monkeypatch):
    pkg = build_pkg(**SPECS["causal"])
    FakeKernels(pkg._forward).install(monkeypatch)
    q, k, v = _inputs(pkg, seed=7)
    k, v = k.detach(), v.detach()
    out = pkg.attention(q, k, v)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(out.dtype)
    out.backward(dout)
    want = _ref_grads(q, k, v, dout, causal=True)
    _assert_grads((q, k, v), [want[0], None, None])


@pytest.mark.parametrize("s_q, s_k", [(9, 0), (0, 9)])
def test_empty_sequences_give_zero_grads_without_a_launch(build_pkg, monkeypatch, s_q, s_k):
    pkg = build_pkg(**SPECS["causal"])
    fake = FakeKernels(pkg._forward).install(monkeypatch)
    monkeypatch.setattr(pkg._forward, "function", lambda arch: pytest.fail("forward launched"))
    q, k, v = _inputs(pkg, s_q=s_q, s_k=s_k)
    out, lse = pkg.attention(q, k, v, return_lse=True)
    (out.float().sum() + lse.masked_fill(lse.isinf(), 0).sum()).backward()
    assert not fake.calls
    for t in (q, k, v):
        assert t.grad.shape == t.shape and not t.grad.any()


def test_no_grad_and_detached_calls_skip_autograd(build_pkg, monkeypatch):
    pkg = build_pkg(**SPECS["causal"])
    FakeKernels(pkg._forward).install(monkeypatch)
    q, k, v = _inputs(pkg)
    with torch.no_grad():
        assert not pkg.attention(q, k, v).requires_grad
    assert not pkg.attention(q.detach(), k.detach(), v.detach()).requires_grad


def test_out_is_refused_with_autograd(build_pkg):
    pkg = build_pkg(**SPECS["causal"])
    q, k, v = _inputs(pkg)
    out = torch.empty(*q.shape[:3], 32, dtype=q.dtype)
    with pytest.raises(RuntimeError, match="^out: out= does not support autograd"):
        pkg.attention(q, k, v, out=out)


def test_cpu_tensors_are_refused_before_anything_runs(build_pkg):
    """Without the stand-ins: a backward spec's attention on CPU tensors that require grad fails on
    the device check (not the no-backward error), and so does calling its backward directly."""
    pkg = build_pkg(**SPECS["local"])
    q, k, v = _inputs(pkg)
    with pytest.raises(ValueError, match="^q: expected a CUDA tensor, got device cpu"):
        pkg.attention(q, k, v)
    out = torch.zeros(*q.shape[:3], 32, dtype=q.dtype)
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    with pytest.raises(ValueError, match="^q: expected a CUDA tensor, got device cpu"):
        pkg._forward.backward(q.detach(), k.detach(), v.detach(), out, torch.ones_like(out), lse)


@pytest.mark.parametrize("bad, kind, message", [
    (lambda out, lse: out[:, :-1], ValueError, r"^dout: expected shape \(2, 9, 4, 32\)"),
    (lambda out, lse: out.float(), TypeError, "^dout: expected dtype torch.bfloat16"),
    (lambda out, lse: [[1.0]], TypeError, "^dout: expected a torch.Tensor or None, got list"),
])
def test_bad_dout_is_named(build_pkg, monkeypatch, bad, kind, message):
    pkg = build_pkg(**SPECS["local"])
    fake = FakeKernels(pkg._forward).install(monkeypatch)
    monkeypatch.setattr(pkg._forward, "function",
                        lambda plan: pytest.fail("launched") if plan["direction"] == "bwd" else fake.forward)
    q, k, v = (t.detach() for t in _inputs(pkg))
    out, lse = pkg.attention(q, k, v, return_lse=True)
    with pytest.raises(kind, match=message):
        pkg._forward.backward(q, k, v, out, bad(torch.ones_like(out), lse), lse)
    with pytest.raises(ValueError, match=r"^dlse: expected shape \(2, 4, 9\)"):
        pkg._forward.backward(q, k, v, out, torch.ones_like(out), lse, lse[:, :1])


def test_arch_without_backward_kernel_fails_at_backward_time(build_pkg, monkeypatch):
    pkg = build_pkg(**SPECS["causal"])
    op = pkg._forward
    FakeKernels(op).install(monkeypatch)
    monkeypatch.setitem(op.plans, "sm100", dict(op.plans["sm90"], arch="sm100"))
    monkeypatch.setattr(op, "arch_for", lambda device: "sm100")
    q, k, v = _inputs(pkg)
    out = pkg.attention(q, k, v)  # the forward exists for this arch
    with pytest.raises(RuntimeError, match=r"bwd_causal: no backward kernel for sm100 .*\['sm90'\]"):
        out.float().sum().backward()


def test_double_backward_is_refused(build_pkg, monkeypatch):
    """A create_graph=True gradient is refused when differentiated, whether or not the incoming gradient
    requires grad (with a loss linear in out it does not, and the gradient used to come back as a
    constant: a gradient penalty's term silently lost)."""
    pkg = build_pkg(**SPECS["causal"])
    FakeKernels(pkg._forward).install(monkeypatch)
    q, k, v = _inputs(pkg)
    for loss_of in (lambda o: o.float().sum(), lambda o: o.float().pow(2).sum()):
        out = pkg.attention(q, k, v)
        (dq,) = torch.autograd.grad(loss_of(out), q, create_graph=True)
        assert dq.requires_grad
        with pytest.raises(RuntimeError, match="fa4gen attention: its backward is not differentiable"):
            (loss_of(out) + dq.float().pow(2).sum()).backward()
    # first-order gradients under create_graph are still the plain ones
    out = pkg.attention(q, k, v)
    (dq_cg,) = torch.autograd.grad(out.float().sum(), q, create_graph=True)
    (dq,) = torch.autograd.grad(pkg.attention(q, k, v).float().sum(), q)
    assert torch.equal(dq_cg.detach(), dq)


# --- repeated calls: the signature cache (ForwardOp._replay) -------------------------------------


def _counting(fake: "FakeKernels", monkeypatch):
    """Count the full checks (validate) and the kernel launches of the package."""
    op, counts = fake.op, {"validate": 0, "launch": 0}
    validate = op.validate

    def counted_validate(*a, **kw):
        counts["validate"] += 1
        return validate(*a, **kw)

    def counted_launch(fn, device, args):
        counts["launch"] += 1
        fn(*args)

    monkeypatch.setattr(op, "validate", counted_validate)
    monkeypatch.setattr(op, "_launch", counted_launch)
    return counts


def test_a_repeated_call_skips_the_checks_and_gives_the_same_result(build_pkg, monkeypatch):
    pkg = build_pkg(**SPECS["local"])
    counts = _counting(FakeKernels(pkg._forward).install(monkeypatch), monkeypatch)
    q, k, v = (t.detach() for t in _inputs(pkg))
    first, first_lse = pkg.attention(q, k, v, return_lse=True)
    again, again_lse = pkg.attention(q.clone(), k.clone(), v.clone(), return_lse=True)
    assert counts == {"validate": 1, "launch": 2}
    assert torch.equal(first, again) and torch.equal(first_lse, again_lse) and again is not first
    # what the key holds changes: the full checks again (a window is the kernel's run-time argument)
    windowed = pkg.attention(q, k, v, window=(3, 1))
    assert counts == {"validate": 2, "launch": 3}
    sem = dict(window=(3, 1), softcap=5.0)
    torch.testing.assert_close(windowed, attention_ref(q, k, v, **sem)[0].to(q.dtype))
    pkg.attention(q, k, v, window=[3, 1])  # a list gets its own key (checked once), not the tuple's
    pkg.attention(q, k, v, window=[3, 1])
    assert counts == {"validate": 3, "launch": 5} and len(pkg._forward._calls) == 3


def test_a_cached_signature_does_not_let_bad_values_through(build_pkg, monkeypatch):
    """True == 1 and hash(True) == hash(1): keys keep the argument types, so a refused value never
    reaches a launch through an accepted one's key; other shapes, dtypes and devices miss the cache."""
    pkg = build_pkg(**SPECS["chunked"])
    counts = _counting(FakeKernels(pkg._forward).install(monkeypatch), monkeypatch)
    q, k, v = (t.detach() for t in _inputs(pkg))
    pkg.attention(q, k, v, chunk_size=1)
    pkg.attention(q, k, v, chunk_size=1)
    assert counts == {"validate": 1, "launch": 2}
    with pytest.raises(ValueError, match="^chunk_size: expected an int"):
        pkg.attention(q, k, v, chunk_size=True)
    with pytest.raises(TypeError, match="^q: expected dtype"):
        pkg.attention(q.float(), k, v, chunk_size=1)
    with pytest.raises(ValueError, match="^k: "):
        pkg.attention(q, k[:, :, :, :16], v, chunk_size=1)
    assert counts["launch"] == 2


def test_a_cached_out_signature_still_refuses_an_out_that_overlaps_or_needs_grad(build_pkg, monkeypatch):
    """The key holds out's shape and strides, not its address or autograd state: an out= call replayed
    from the cache with out overlapping an input, or requiring grad, takes the full checks, which refuse
    it naming out (a launch would store O over inputs other tiles still load, or behind autograd)."""
    pkg = build_pkg(**SPECS["local"])
    counts = _counting(FakeKernels(pkg._forward).install(monkeypatch), monkeypatch)
    q, k, v = (t.detach() for t in _inputs(pkg))
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    pkg.attention(q, k, v, out=out)
    pkg.attention(q, k, v, out=out)
    assert counts == {"validate": 1, "launch": 2}
    with pytest.raises(ValueError, match="^out: overlaps q"):
        pkg.attention(q, k, v, out=q[..., : v.shape[-1]] if q.shape[-1] != v.shape[-1] else q)
    with pytest.raises(RuntimeError, match="^out: must not require grad"):
        pkg.attention(q, k, v, out=torch.empty_like(out).requires_grad_())
    assert counts == {"validate": 3, "launch": 2}


def test_calls_that_need_more_than_a_launch_take_the_full_path(build_pkg, monkeypatch):
    pkg = build_pkg(**SPECS["causal"])
    op = pkg._forward
    counts = _counting(FakeKernels(op).install(monkeypatch), monkeypatch)
    q, k, v = _inputs(pkg)
    out = pkg.attention(q, k, v)  # requires grad: autograd, never the launch cache (its own check cache)
    out.sum().backward()
    pkg.attention(q, k, v)
    assert counts["validate"] == 1 and not op._calls and len(op._grad_calls) == 1
    qd, kd, vd = (t.detach() for t in (q, k, v))
    pkg.attention(qd, kd, vd)
    assert counts["validate"] == 2 and len(op._calls) == 1
    # a base address off 16 bytes: the slow path copies it (and the cache is not used for it)
    buf = torch.empty(qd.numel() + 1, dtype=qd.dtype)
    shifted = buf[1:].view(qd.shape).copy_(qd)
    assert shifted.stride() == qd.stride() and shifted.data_ptr() % 16
    torch.testing.assert_close(pkg.attention(shifted, kd, vd), pkg.attention(qd, kd, vd))
    assert counts["validate"] == 3
    # pinned kernels: the full path every time
    with op.pinned(op.plans["sm90"]["module"]):
        pkg.attention(qd, kd, vd)
        pkg.attention(qd, kd, vd)
    assert counts["validate"] == 5


def test_a_repeated_training_call_skips_the_checks_not_autograd(build_pkg, monkeypatch):
    """Calls that record autograd keep their checks' verdict per signature (ForwardOp._grad_calls, the same key as
    the launch cache): from the second call on they go straight to AttentionFunction, whose forward allocates
    and launches and whose backward still runs the kernels — gradients as the first call's; a call whose
    signature changes, or that asks for something refused with autograd (out=), takes the full checks."""
    pkg = build_pkg(**SPECS["causal"])
    op = pkg._forward
    counts = _counting(FakeKernels(op).install(monkeypatch), monkeypatch)
    q, k, v = _inputs(pkg)
    grads = []
    for _ in range(3):
        out, lse = pkg.attention(q, k, v, return_lse=True)
        grads.append(torch.autograd.grad((out.float().sum() + lse.sum()), (q, k, v)))
    assert counts["validate"] == 1 and len(op._grad_calls) == 1 and not op._calls
    for first, again in zip(grads[0], grads[2]):
        assert torch.equal(first, again)
    pkg.attention(q, k, v)  # without return_lse: its own key
    pkg.attention(q[:, :-1], k, v)  # another shape
    assert counts["validate"] == 3
    with pytest.raises(RuntimeError, match="^out: out= does not support autograd"):
        pkg.attention(q, k, v, out=torch.empty_like(q))
    assert counts["validate"] == 4
    with torch.no_grad():  # the same signature without autograd: the launch cache, checked once for it
        pkg.attention(q, k, v, return_lse=True)
    assert counts["validate"] == 5


def test_a_discarded_lse_goes_to_the_scratch_buffer(build_pkg, monkeypatch):
    """Calls without grad that do not return the LSE write it into the package's per-device scratch
    buffer (no allocation per call): every such call of any signature shares it, a call that needs more
    grows it to at least twice its size (the old one is kept, never handed back to the allocator), and calls that
    return the LSE, or record autograd, get their own."""
    pkg = build_pkg(**SPECS["causal"])
    op = pkg._forward
    FakeKernels(op).install(monkeypatch)
    launched = []
    monkeypatch.setattr(op, "_launch", lambda fn, device, args: (launched.append(args[4]), fn(*args)))
    q, k, v = (t.detach() for t in _inputs(pkg))
    want, want_lse = pkg.attention(q, k, v, return_lse=True)
    for _ in range(2):  # first call (full checks), then the replay
        torch.testing.assert_close(pkg.attention(q, k, v), want, rtol=0, atol=0)
    scratch = op._lse_scratch[q.device.index]
    assert scratch.numel() == want_lse.numel()
    assert all(lse.untyped_storage().data_ptr() == scratch.untyped_storage().data_ptr() for lse in launched[1:])
    torch.testing.assert_close(launched[-1], want_lse, rtol=0, atol=0)  # the kernel's LSE, written there
    _, lse = pkg.attention(q, k, v, return_lse=True)  # returned: its own, on the replay path too
    assert lse.untyped_storage().data_ptr() != scratch.untyped_storage().data_ptr()
    # longer calls outgrow the buffer: to at least twice its size, the old buffer kept
    q2, k2, v2 = (torch.cat([t, t, t], dim=1)[:, : t.shape[1] * 3 // 2] for t in (q, k, v))
    pkg.attention(q2, k2, v2)
    grown = op._lse_scratch[q.device.index]
    assert grown.numel() == 2 * want_lse.numel() and op._lse_retired == [scratch]
    q3, k3, v3 = (torch.cat([t, t, t], dim=1) for t in (q, k, v))
    pkg.attention(q3, k3, v3)
    assert op._lse_scratch[q.device.index].numel() == 4 * want_lse.numel() and len(op._lse_retired) == 2
    grown = op._lse_scratch[q.device.index]
    pkg.attention(q, k, v)  # the shorter signature's view still points into the retired buffer: fine
    assert launched[-1].untyped_storage().data_ptr() == scratch.untyped_storage().data_ptr()
    # autograd: the LSE is saved for the backward, so never the scratch
    qg = q.clone().requires_grad_()
    pkg.attention(qg, k, v)
    assert launched[-1].untyped_storage().data_ptr() not in {
        scratch.untyped_storage().data_ptr(), grown.untyped_storage().data_ptr()}


def test_out_is_part_of_the_signature(build_pkg, monkeypatch):
    """out= calls are replayed too: the key holds out's shape, strides, dtype and device, the replay
    writes into the given buffer, and a misaligned or wrong out still gets the full checks' error."""
    pkg = build_pkg(**SPECS["causal"])
    counts = _counting(FakeKernels(pkg._forward).install(monkeypatch), monkeypatch)
    q, k, v = (t.detach() for t in _inputs(pkg))
    want = pkg.attention(q, k, v)
    for _ in range(2):
        out = torch.full_like(want, float("nan"))
        assert pkg.attention(q, k, v, out=out) is out and torch.equal(out, want)
    assert counts == {"validate": 2, "launch": 3}
    buf = torch.empty(want.numel() + 1, dtype=want.dtype)
    shifted = buf[1:].view(want.shape)
    with pytest.raises(ValueError, match="^out: expected a 16-byte aligned"):
        pkg.attention(q, k, v, out=shifted)
    with pytest.raises(ValueError, match="^out: expected shape"):
        pkg.attention(q, k, v, out=want[:, :1])
    with pytest.raises(TypeError, match="^out: expected a torch.Tensor"):
        pkg.attention(q, k, v, out=want.tolist())
    assert counts["launch"] == 3


@pytest.mark.parametrize("layout", ["qkv_packed", "bhsd"])
@pytest.mark.parametrize("d, dv", [(32, 32), (192, 128)])
def test_a_replayed_call_allocates_a_fresh_contiguous_output(build_pkg, monkeypatch, d, dv, layout):
    """A replayed call allocates out like q (empty_like, contiguous format) when they share shape and dtype,
    else from the remembered shape: either way a fresh contiguous tensor of the output's shape, also for q, k, v
    that are strided views (of one packed buffer, with gaps; or of BHSD tensors, dense but permuted, whose
    strides a plain empty_like would copy)."""
    pkg = build_pkg(name=f"bwd_replay_d{d}", dtype="bf16", head_dim=d, head_dim_v=dv, mask={"kind": "causal"},
                    allow_gqa=False)
    counts = _counting(FakeKernels(pkg._forward).install(monkeypatch), monkeypatch)
    b, s, h = 2, 9, 4
    gen = torch.Generator().manual_seed(1)
    if layout == "qkv_packed":
        qkv = torch.randn(b, s, 3, h, d, generator=gen).to(torch.bfloat16)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2, :, :dv]
    else:
        q, k = (torch.randn(b, h, s, d, generator=gen).to(torch.bfloat16).transpose(1, 2) for _ in range(2))
        v = torch.randn(b, h, s, dv, generator=gen).to(torch.bfloat16).transpose(1, 2)
    assert not q.is_contiguous() and q.shape == (b, s, h, d)
    first = pkg.attention(q, k, v)
    outs = [pkg.attention(q, k, v) for _ in range(2)]
    assert counts == {"validate": 1, "launch": 3}
    for out in outs:
        assert out.shape == (b, s, h, dv) and out.dtype == torch.bfloat16 and out.is_contiguous()
        assert out.data_ptr() != first.data_ptr() and torch.equal(out, first)
    torch.testing.assert_close(first, attention_ref(q, k, v, causal=True)[0].to(q.dtype))


def test_backward_refuses_a_dq_accumulator_past_32_bit_offsets():
    """The backward's dQ accumulator (per batch and head: query rows padded to whole tiles x head_dim
    fp32) is addressed with 32-bit offsets; a call that would overflow them is refused by name."""
    from fa4gen.api.runtime import check_dq_accumulator

    check_dq_accumulator(2**31 // 256 - 64, 256)  # the largest tile-padded row count that fits
    with pytest.raises(ValueError, match=r"q: the backward supports up to 8388607 query rows .* head_dim 256"):
        check_dq_accumulator(2**31 // 256, 256)



def test_a_packed_backward_past_the_int32_grid_is_refused_by_name(build_pkg, monkeypatch):
    """The packed backward numbers (key tile, head) in one int32 blockIdx.x: a call with more is refused
    before anything is allocated (stride-0 inputs stand for the rows)."""
    pkg = build_pkg(name="vl_grid", dtype="bf16", head_dim=32, varlen=True)
    op = pkg._forward
    monkeypatch.setattr(op, "_check_devices", lambda device, named: None)
    monkeypatch.setattr(op, "arch_for", lambda device: "sm90")
    tile_n, heads = op.bwd_plans["sm90"]["tile_n"], 4096
    rows = (2**31 // heads - 1) * tile_n  # with the one sequence's extra tile: past 2**31 - 1 CTAs
    big = torch.zeros(1, 1, 32, dtype=torch.bfloat16).expand(rows, heads, 32)
    lse = torch.zeros(1, 1).expand(heads, rows)
    cu = torch.tensor([0, rows], dtype=torch.int32)
    packed = Packed.check(op.name, True, cu, cu, rows, None)
    packed.resolve(rows, rows)
    with pytest.raises(ValueError, match=r"k: a packed backward launches one CTA per \(key tile"):
        op.backward(big, big, big, big, big, lse, None, softmax_scale=1.0, packed=packed)


def test_varlen_boundaries_changed_in_place_before_the_backward_are_refused(build_pkg, monkeypatch):
    """cu_seqlens refilled in place (a static buffer reused for the next batch) between forward and
    backward: autograd's in-place error, not a backward run on the new boundaries (silently wrong
    gradients: the backward used to receive the new values)."""
    pkg = build_pkg(name="vl_bwd", dtype="bf16", head_dim=32, varlen=True, mask={"kind": "causal"})
    op = pkg._forward

    def fwd(q, k, v, out, lse, *args):
        out.zero_()
        lse.zero_()

    def bwd(*args):
        raise AssertionError("the backward launched on changed sequence boundaries")

    monkeypatch.setattr(op, "_check_devices", lambda device, named: None)
    monkeypatch.setattr(op, "arch_for", lambda device: "sm90")
    monkeypatch.setattr(op, "_launch", lambda fn, device, args: fn(*args))
    monkeypatch.setattr(op, "function", lambda plan: bwd if plan["direction"] == "bwd" else fwd)
    q = torch.randn(10, 4, 32).bfloat16().requires_grad_()
    k = torch.randn(12, 2, 32).bfloat16().requires_grad_()
    v = torch.randn(12, 2, 32).bfloat16().requires_grad_()
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 12], dtype=torch.int32)
    out = pkg.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    cu_q.copy_(torch.tensor([0, 7, 10]))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()


def test_a_missing_lse_gradient_reads_the_shared_zeros(build_pkg, monkeypatch):
    """A backward without an LSE gradient reads the package's per-device zeros as its dLSE (no fill kernel
    per call, session 19): every such call shares them, a longer call grows them to at least twice their
    size and keeps the old ones (a replayed launch may still read them), and a given dLSE is passed as is."""
    pkg = build_pkg(**SPECS["causal"])
    op = pkg._forward
    fake = FakeKernels(op).install(monkeypatch)
    seen = []
    run = fake.backward
    monkeypatch.setattr(fake, "backward", lambda *a: (seen.append(a[6]), run(*a)))
    q, k, v = _inputs(pkg, seed=5)
    for _ in range(2):
        pkg.attention(q, k, v).float().sum().backward()
    zeros = op._dlse_zeros[q.device.index]
    assert zeros.numel() == seen[0].numel() and not zeros.any()
    assert all(d.untyped_storage().data_ptr() == zeros.untyped_storage().data_ptr() for d in seen)
    q2, k2, v2 = (torch.cat([t, t], dim=1).detach().requires_grad_() for t in (q, k, v))
    pkg.attention(q2, k2, v2).float().sum().backward()
    grown = op._dlse_zeros[q.device.index]
    assert grown.numel() == 2 * zeros.numel() and op._dlse_retired == [zeros] and not grown.any()
    assert seen[-1].untyped_storage().data_ptr() == grown.untyped_storage().data_ptr()
    _assert_grads((q2, k2, v2), _ref_grads(q2, k2, v2, torch.ones(q2.shape[:-1] + (v2.shape[-1],)), causal=True))
    _, lse = pkg.attention(q, k, v, return_lse=True)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(6))
    (lse * dlse).sum().backward()
    assert torch.equal(seen[-1], dlse) and seen[-1].untyped_storage().data_ptr() != grown.untyped_storage().data_ptr()


def test_the_zero_dlse_view_is_made_once_per_shape_and_stays_zero_after_growth(build_pkg, monkeypatch):
    """The zeros' view for a dLSE shape is made once and handed to every later backward of that shape (no
    slice and view per call); a view made before the buffer grew still reads zeros (the old buffer is kept),
    and the cache is bounded (packed calls bring a new total each batch)."""
    from fa4gen.api import runtime

    pkg = build_pkg(**SPECS["causal"])
    op = pkg._forward
    cpu = torch.device("cpu")
    first = op._zero_dlse((2, 4, 9), cpu)
    assert op._zero_dlse((2, 4, 9), cpu) is first
    grown = op._zero_dlse((2, 4, 40), cpu)  # larger: a new buffer, the old one retired
    assert grown.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    assert op._zero_dlse((2, 4, 9), cpu) is first and not first.any() and not grown.any()
    for total in range(runtime.DLSE_VIEWS + 1):
        assert not op._zero_dlse((1, 4, total + 1), cpu).any()
    assert len(op._dlse_views) <= runtime.DLSE_VIEWS


@pytest.mark.parametrize("tile_m", [64, 80, 128])
def test_the_preprocess_zeroes_every_query_tiles_flag_once(tile_m):
    """The dense preprocess's row blocks zero the claim flags / turn counters (fa4gen/device/bwd.py
    `_zero_tile_flags`, spelled out here per thread): over the grid of ceil(q_tiles * tile_m / ROWS_PER_CTA)
    blocks every query tile's entry is written exactly once and nothing past the last tile. A missed entry
    would leave a turn counter uninitialised (a deterministic backward waiting forever) or a claim flag set."""
    from fa4gen.device.bwd import ROWS_PER_CTA

    for q_tiles in range(1, 40):
        written = []
        for blk in range(-(-q_tiles * tile_m // ROWS_PER_CTA)):
            first = blk * ROWS_PER_CTA
            for tidx in range(ROWS_PER_CTA // tile_m + 1):
                tile = (first + tile_m - 1) // tile_m + tidx
                if tile * tile_m < first + ROWS_PER_CTA and tile < q_tiles:
                    written.append(tile)
        assert sorted(written) == list(range(q_tiles)), (tile_m, q_tiles)

"""torch.compile of a generated package's attention, without CUDA (fa4gen/api/library.py).

Under torch.compile a call is one torch.library operator (forward) whose autograd formula calls a second
one (backward), so `fullgraph=True` traces a training step without graph breaks. The kernels are replaced
by the CPU stand-ins of test_backward_cpu (the exact reference, asserting the calling convention), and
a compiled call must equal the same eager call bit for bit — outputs, LSE and gradients — since both run
the same launches. Backend `aot_eager` runs Dynamo, fake-tensor propagation and AOTAutograd (what
Inductor would receive) without a C++ toolchain; Inductor on the GPU is a device check
(tests/test_gpu_api.py).
"""

from __future__ import annotations

import sys

import pytest
import torch

import fa4gen
from fa4gen.api import library, runtime
from fa4gen.reference import attention_ref_grads, attention_ref_varlen
from test_backward_cpu import _EAGER_KEYS, SPECS, FakeKernels, _inputs


@pytest.fixture
def build(tmp_path, monkeypatch):
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path / "cache"))
    before = set(sys.modules)
    torch._dynamo.reset()
    yield lambda **spec: fa4gen.build(dict(targets=["sm90"], **spec))
    torch._dynamo.reset()
    for mod in set(sys.modules) - before:
        if mod.startswith("fa4gen_pkg_"):
            del sys.modules[mod]


def _compiled(fn, **kw):
    return torch.compile(fn, backend="aot_eager", fullgraph=True, **kw)


def _step(pkg, kwargs):
    """A training step's loss from attention's out and LSE (both differentiated)."""

    def step(q, k, v):
        out, lse = pkg.attention(q, k, v, return_lse=True, **kwargs)
        return out.float().square().sum() + (lse * 0.5).sum(), out, lse

    return step


def _run(step, q, k, v):
    for t in (q, k, v):
        t.grad = None
    loss, out, lse = step(q, k, v)
    loss.backward()
    return [loss.detach(), out.detach(), lse.detach()] + [t.grad.clone() for t in (q, k, v)]


CALLS = {"local": dict(softmax_scale=0.3, window=(3, 1)), "chunked": dict(chunk_size=3), "causal": {}, "none_mha": {}}


@pytest.mark.parametrize("which", sorted(SPECS))
@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_training_step_equals_eager(build, monkeypatch, which, dynamic):
    pkg = build(backward=True, **SPECS[which])
    fake = FakeKernels(pkg._forward).install(monkeypatch)
    step = _step(pkg, CALLS[which])
    compiled = _compiled(step, dynamic=dynamic)
    for shape in (dict(s_q=9, s_k=11), dict(s_q=13, s_k=7, seed=1)):  # a second shape: a recompile or a dynamic hit
        q, k, v = _inputs(pkg, **shape)
        want = _run(step, q, k, v)
        sem = fake.calls[-1]["sem"]
        got = _run(compiled, q, k, v)
        for name, g, w in zip(("loss", "out", "lse", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0, msg=f"{which} {shape}: {name}")
        assert fake.calls[-1]["sem"] == sem, "the compiled backward must see the call's scale / window / chunk"
        if which == "local":
            assert sem["window"] == (3, 1) and sem["softmax_scale"] == pytest.approx(0.3)


def test_compiled_graph_holds_the_operators(build, monkeypatch):
    """One forward and one backward operator in the traced graphs, nothing else from fa4gen."""
    pkg = build(backward=True, **SPECS["causal"])
    FakeKernels(pkg._forward).install(monkeypatch)
    ns = library.namespace(pkg._forward)
    seen: list[str] = []

    def backend(gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def record(g, _):
            seen.extend(str(n.target) for n in g.graph.nodes if n.op == "call_function")
            return make_boxed_func(g)

        return aot_module_simplified(gm, example_inputs, fw_compiler=record, bw_compiler=record)

    step = torch.compile(_step(pkg, {}), backend=backend, fullgraph=True)
    q, k, v = _inputs(pkg)
    step(q, k, v)[0].backward()
    assert f"{ns}.fwd.default" in seen and f"{ns}.bwd.default" in seen
    assert sum(s.startswith(ns) for s in seen) == 2


def test_compiled_inference_with_out_and_without_lse(build, monkeypatch):
    pkg = build(backward=True, **SPECS["causal"])
    FakeKernels(pkg._forward).install(monkeypatch)
    q, k, v = (t.detach() for t in _inputs(pkg))
    want = pkg.attention(q, k, v)
    out = torch.full_like(want, float("nan"))
    with torch.no_grad():
        got = _compiled(lambda q, k, v, o: pkg.attention(q, k, v, out=o))(q, k, v, out)
        plain = _compiled(lambda q, k, v: pkg.attention(q, k, v))(q, k, v)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(plain, want, rtol=0, atol=0)
    assert got.data_ptr() == out.data_ptr() or torch.equal(got, out)


def test_only_the_out_gradient_flows(build, monkeypatch):
    """A loss of out alone: the LSE's gradient is zero, as eager's is None."""
    pkg = build(backward=True, **SPECS["chunked"])
    FakeKernels(pkg._forward).install(monkeypatch)

    def step(q, k, v):
        out = pkg.attention(q, k, v)
        return out.float().sum(), out, out

    q, k, v = _inputs(pkg)
    want = _run(step, q, k, v)
    got = _run(_compiled(step), q, k, v)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _error(fn, *args) -> str:
    """The message of what fn raised: our exception, or Dynamo's wrapper with it inside (fullgraph)."""
    with pytest.raises(Exception) as info:
        fn(*args)
    return str(info.value) + repr(info.value.__cause__)


def test_bad_calls_name_the_argument_under_compile(build, monkeypatch):
    pkg = build(backward=True, **SPECS["local"])
    FakeKernels(pkg._forward).install(monkeypatch)
    q, k, v = _inputs(pkg)
    for dynamic in (False, True):
        torch._dynamo.reset()
        # a tensor check (the operator's fake implementation) names example sizes, never symbols
        msg = _error(_compiled(lambda q, k, v: pkg.attention(q, k, v), dynamic=dynamic), q[..., :16], k, v)
        assert "q: expected head_dim 32" in msg and "got 16" in msg
        msg = _error(_compiled(lambda q, k, v: pkg.attention(q, k, v, window=(3.5, 1)), dynamic=dynamic), q, k, v)
        assert "window: expected (left, right) ints" in msg
        msg = _error(_compiled(lambda q, k, v: pkg.attention(q, k, v, softmax_scale=-1.0), dynamic=dynamic), q, k, v)
        assert "softmax_scale: expected a positive float" in msg
        out = torch.empty(2, 9, 4, 16, dtype=q.dtype)
        with torch.no_grad():
            msg = _error(_compiled(lambda q, k, v, o: pkg.attention(q, k, v, out=o), dynamic=dynamic), q, k, v, out)
        assert "out: expected shape (2, 9, 4, 32)" in msg
        msg = _error(_compiled(lambda q, k, v, o: pkg.attention(q, k, v, out=o)), q, k, v, out)
        assert "out: out= does not support autograd" in msg
    # without fullgraph, a check before the operator falls back to eager at the raise, which raises our
    # error itself; the fake implementation's is wrapped by Dynamo, with ours inside
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"window: expected \(left, right\) ints"):
        torch.compile(lambda q, k, v: pkg.attention(q, k, v, window=(3.5, 1)), backend="aot_eager")(q, k, v)
    with pytest.raises(Exception, match="q: expected head_dim 32"):
        torch.compile(lambda q, k, v: pkg.attention(q, k, v), backend="aot_eager")(q[..., :16], k, v)


def test_spec_without_backward_refuses_grad_under_compile(build, monkeypatch):
    pkg = build(backward=False, **SPECS["causal"])
    q, k, v = _inputs(pkg)
    msg = _error(_compiled(lambda q, k, v: pkg.attention(q, k, v)), q, k, v)
    assert "q requires grad but this spec has no backward" in msg
    with pytest.raises(RuntimeError, match="this spec has no backward"):
        torch.compile(lambda q, k, v: pkg.attention(q, k, v), backend="aot_eager")(q, k, v)


def test_return_lse_needs_a_spec_that_writes_it(build):
    pkg = build(backward=False, **dict(SPECS["chunked"], return_lse=False))
    q, k, v = (t.detach() for t in _inputs(pkg))
    msg = _error(_compiled(lambda q, k, v: pkg.attention(q, k, v, return_lse=True)), q, k, v)
    assert "return_lse: spec bwd_chunked was built without return_lse" in msg


def test_namespaces_are_per_package_directory(build, tmp_path):
    """Two packages of one spec name in two directories get their own operators; a package imported again
    takes its directory's operators over."""
    a = build(backward=False, **SPECS["causal"])
    b = fa4gen.build(dict(targets=["sm90"], backward=False, **dict(SPECS["causal"], softcap=3.0)),
                     out_dir=tmp_path / "elsewhere")
    na, nb = library.namespace(a._forward), library.namespace(b._forward)
    assert na != nb and na.startswith("fa4gen_bwd_causal_") and nb.startswith("fa4gen_bwd_causal_")
    assert library._OWNERS[na] is a._forward and library._OWNERS[nb] is b._forward
    again = type(a._forward)(str(a._forward.dir / "__init__.py"), a.__name__)
    assert library.namespace(again) == na and library._OWNERS[na] is again


# --- varlen ----------------------------------------------------------------------------------------

VARLEN = dict(name="compile_varlen", dtype="bf16", head_dim=32, mask={"kind": "causal"}, varlen=True,
              allow_gqa=True, return_lse=True)


class FakeVarlenKernels(FakeKernels):
    """The packed calling convention: batch-1 views, then (cu_seqlens_q, cu_seqlens_k, seqused_k or its
    stand-in) after the tensors and the use_seqused flag last."""

    def forward(self, q, k, v, out, lse, cu_q, cu_k, used, *args):
        *args, use_seqused = args
        sem = self._semantics(args, backward=False)
        o, l = attention_ref_varlen(q[0], k[0], v[0], cu_q, cu_k, seqused_k=used if use_seqused else None, **sem)
        out[0].copy_(o)
        lse[0].copy_(l)

    def backward(self, *a):
        plan = self.plan
        n = 13 + 2 * plan["dkv_accum"] + plan.get("dq_claim", False) + plan["deterministic"] * (1 + plan["dkv_accum"])
        q, k, v, out, dout, lse, dlse, dq, dk, dv = a[:10]
        cu_q, cu_k, used = a[n:n + 3]
        *args, use_seqused = a[n + 3:]
        sem = self._semantics(args, backward=True)
        packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used if use_seqused else None)
        with torch._C._ForceDispatchKeyGuard(*_EAGER_KEYS):
            want = attention_ref_grads(q[0], k[0], v[0], dout[0], dlse=dlse[0], packed=packed, **sem)
        for t, g in zip((dq, dk, dv), want):
            t[0].copy_(g)
        self.calls.append(dict(sem=sem, cu=(cu_q.tolist(), cu_k.tolist())))


@pytest.mark.parametrize("max_seqlen, seqused", [(None, False), (6, False), (None, True)])
def test_compiled_varlen_training_step_equals_eager(build, monkeypatch, max_seqlen, seqused):
    pkg = build(backward=True, **VARLEN)
    fake = FakeVarlenKernels(pkg._forward).install(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    q, k, v = (torch.randn(11, h, 32, generator=gen).to(torch.bfloat16).requires_grad_() for h in (4, 2, 2))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
    if seqused:  # keys past seqused_k unused: their gradients are zero on both paths
        kw["seqused_k"] = torch.tensor([3, 1, 4], dtype=torch.int32)
    step = _step(pkg, kw)
    want = _run(step, q, k, v)
    assert fake.calls[-1]["cu"] == ([0, 4, 5, 11],) * 2
    got = _run(_compiled(step), q, k, v)
    assert fake.calls[-1]["cu"] == ([0, 4, 5, 11],) * 2
    for name, g, w in zip(("loss", "out", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=name)


def test_torch_export_keeps_the_operator(build, monkeypatch):
    """torch.export (what AOTInductor and other deployment paths take) records the forward operator, and
    the exported program computes the eager call's result."""
    pkg = build(backward=False, **{k: v for k, v in SPECS["local"].items() if k != "deterministic"})
    op = pkg._forward
    FakeKernels(op).install(monkeypatch)

    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            return pkg.attention(q, k, v, window=(2, 0)) * 2

    q, k, v = (t.detach() for t in _inputs(pkg))
    program = torch.export.export(Block(), (q, k, v))
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert f"{library.namespace(op)}.fwd.default" in targets
    torch.testing.assert_close(program.module()(q, k, v), Block()(q, k, v), rtol=0, atol=0)


def test_a_refused_registration_falls_back_to_the_eager_path(build, monkeypatch):
    """If torch.library refuses the operators, the package still imports and computes; torch.compile then
    traces the eager path (a graph break at attention) and gets the same result."""

    def refuse(op):
        raise RuntimeError("no custom ops here")

    warnings: list[str] = []
    monkeypatch.setattr(library, "register", refuse)
    monkeypatch.setattr(runtime.log, "warning", lambda fmt, *args: warnings.append(fmt % args))
    pkg = build(backward=True, **dict(SPECS["causal"], name="fallback_probe"))
    assert pkg._forward._compiled is None
    assert warnings == ["fallback_probe: no torch.compile operators (RuntimeError: no custom ops here); compiled "
                        "models break the graph at attention"]
    FakeKernels(pkg._forward).install(monkeypatch)
    step = _step(pkg, {})
    q, k, v = _inputs(pkg)
    want = _run(step, q, k, v)
    got = _run(torch.compile(step, backend="aot_eager"), q, k, v)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)

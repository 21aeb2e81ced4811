"""GPU numerics of the SM90 varlen forward and backward (packed sequences; skipped without a Hopper GPU).

Tolerance rule as in tests/test_gpu_forward.py: max abs error against the fp32 reference
(fa4gen.reference.attention_ref_varlen, per sequence, masks bottom-right aligned per sequence) at
most 2x that of the same attention in the input precision, plus 1e-5. Outputs are poisoned with NaN
before each call, so rows the kernel skips fail; keys past seqused_k are NaN, so a kernel that reads
them into P·V fails; a sentinel row after the packed output catches stores past the last sequence.
Backward: dq/dk/dv through autograd against attention_ref_grads(packed=...) with the backward's
rule (tests/test_gpu_backward.py), gradient buffers poisoned with NaN, keys past seqused_k must
get exactly zero gradient, deterministic variants bitwise identical over repeats.
"""

import math
import zlib

import pytest
import torch

import fa4gen
from conftest import precompile_selected
from fa4gen.golden.tolerance import grad_budget
from fa4gen.reference import attention_ref_grads, attention_ref_varlen

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")]

VARIANTS = {
    "vl_bf16_d128_causal_gqa": dict(dtype="bf16", head_dim=128, mask={"kind": "causal"}),
    "vl_fp16_d64_none": dict(dtype="fp16", head_dim=64),
    "vl_bf16_d96_window": dict(dtype="bf16", head_dim=96, mask={"kind": "sliding_window", "left": 100, "right": 20}),
    "vl_fp16_d192_128_chunked_softcap": dict(dtype="fp16", head_dim=192, head_dim_v=128,
                                             mask={"kind": "chunked", "chunk_size": 96}, softcap=20.0),
    "vl_bf16_d256_causal": dict(dtype="bf16", head_dim=256, mask={"kind": "causal"}),
    # the 192-row kernel with a mask (what a masked d64 spec's long calls run), on every packing
    "vl_bf16_d64_causal_m192": dict(dtype="bf16", head_dim=64, mask={"kind": "causal"}, pipeline={"tile_m": 192}),
}
# (query lengths, key lengths, keys used or None): empty sequences on either side, single rows,
# lengths off the tile grid, one long sequence among short ones
LENGTHS = [
    ([128, 1, 300, 0, 77], [128, 5, 257, 40, 0], None),
    ([1000], [1000], None),
    ([64, 700, 3], [700, 64, 3], None),
    ([200, 129, 50], [300, 300, 300], [300, 7, 0]),
]
HEADS = (4, 2)


BWD_VARIANTS = {
    "vlb_bf16_d128_causal_gqa": dict(dtype="bf16", head_dim=128, mask={"kind": "causal"}),
    "vlb_bf16_d64_none_mha_det": dict(dtype="bf16", head_dim=64, allow_gqa=False, deterministic=True),
    "vlb_fp16_d128_window_gqa_det": dict(dtype="fp16", head_dim=128, deterministic=True,
                                         mask={"kind": "sliding_window", "left": 100, "right": 20}),
    # deterministic above d128: dQ from registers, the turn warp waiting and passing per packed query tile
    "vlb_bf16_d256_causal_gqa_det": dict(dtype="bf16", head_dim=256, mask={"kind": "causal"}, deterministic=True),
    # (192, 128) MHA: 64 x 96 tiles, dK/dV computed transposed
    "vlb_bf16_d192_128_causal_mha_dkvt": dict(dtype="bf16", head_dim=192, head_dim_v=128, mask={"kind": "causal"},
                                              allow_gqa=False),
    "vlb_fp16_d192_128_window_mha_det_dkvt": dict(dtype="fp16", head_dim=192, head_dim_v=128, allow_gqa=False,
                                                  deterministic=True,
                                                  mask={"kind": "sliding_window", "left": 100, "right": 20}),
    "vlb_bf16_d256_chunked_softcap": dict(dtype="bf16", head_dim=256, mask={"kind": "chunked", "chunk_size": 96},
                                          softcap=20.0),
    # the Sᵀ layout on packed sequences: statistics padded per query tile, bulk-copied with Q
    "vlb_bf16_d128_none_gqa_swap80": dict(dtype="bf16", head_dim=128, pipeline={"bwd_swap_ab": True}),
    "vlb_bf16_d64_causal_swap128": dict(dtype="bf16", head_dim=64, mask={"kind": "causal"},
                                        pipeline={"bwd_swap_ab": True}),
    # GQA + deterministic + causal at d64: the tile record carries the epilogue's coordinates, the q head's
    # turn and the consumers' query-block range (14 LDL/STL before it)
    "vlb_bf16_d64_causal_gqa_det": dict(dtype="bf16", head_dim=64, mask={"kind": "causal"}, deterministic=True),
    # session 13's coverage audit: packed variants no GPU test had run (a chunked mask with softcap on the
    # fixed 192-row forward and the d64 softcap backward with GQA; (192, 128) chunked + softcap + determinism
    # with dQ from registers, poly-exp, ping-pong and overlap off; d128 MHA with dQ from registers)
    "vlp_bf16_d64_chunked_softcap_m192": dict(dtype="bf16", head_dim=64, mask={"kind": "chunked", "chunk_size": 96},
                                              softcap=20.0, pipeline={"tile_m": 192}),
    "vlp_fp16_d192_128_chunked_softcap_det_mha_dkvt_atomic_poly": dict(
        dtype="fp16", head_dim=192, head_dim_v=128, mask={"kind": "chunked", "chunk_size": 96}, softcap=20.0,
        allow_gqa=False, deterministic=True,
        pipeline={"bwd_dq_atomic": True, "poly_exp": {"share": 0.25, "degree": 3}, "ping_pong": False,
                  "intra_wg_overlap": False}),
    "vlp_bf16_d128_none_mha_atomic_plain": dict(dtype="bf16", head_dim=128, allow_gqa=False,
                                                pipeline={"bwd_dq_atomic": True, "intra_wg_overlap": False}),
}


def _package(name: str):
    if name in BWD_VARIANTS:
        return fa4gen.build(dict(name=name, targets=["sm90"], varlen=True, backward=True, **BWD_VARIANTS[name]))
    return fa4gen.build(dict(name=name, targets=["sm90"], varlen=True, return_lse=True, **VARIANTS[name]))


@pytest.fixture(scope="module", autouse=True)
def _kernels_compiled_ahead(request):
    """The selected tests' kernels, compiled in parallel processes before the first test (conftest)."""
    precompile_selected(request, _package)


def _semantics(pkg):
    spec = pkg._forward.spec
    kind = spec["mask"]["kind"]
    sem = dict(softcap=spec["softcap"])
    if kind == "sliding_window":
        sem["window"] = (spec["mask"]["left"], spec["mask"]["right"])
    elif kind == "chunked":
        sem["chunk"] = spec["mask"]["chunk_size"]
    else:
        sem["causal"] = kind == "causal"
    return sem


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_varlen_matches_reference(name):
    pkg = _package(name)
    spec = pkg._forward.spec
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec["dtype"]]
    d, dv = spec["head_dim"], spec["head_dim_v"]
    h, h_kv = HEADS
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
    sem = _semantics(pkg)
    for lq, lk, used in LENGTHS:
        for give_max in (False, True):
            tq, tk = sum(lq), sum(lk)
            q = torch.randn(tq, h, d, device="cuda", dtype=dtype, generator=gen)
            k = torch.randn(tk, h_kv, d, device="cuda", dtype=dtype, generator=gen)
            v = torch.randn(tk, h_kv, dv, device="cuda", dtype=dtype, generator=gen)
            cu_q, cu_k = _cu(lq), _cu(lk)
            seqused = None
            if used is not None:
                seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
                for i, n in enumerate(used):  # unused cache slots: NaN must never reach the output
                    start = int(cu_k[i]) + n
                    k[start:int(cu_k[i + 1])] = float("nan")
                    v[start:int(cu_k[i + 1])] = float("nan")
            # one extra NaN row after the packed output: it must stay NaN (no store past the end)
            buf = torch.full((tq + 1, h, dv), float("nan"), device="cuda", dtype=dtype)
            out = buf[:tq]
            kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused, out=out, return_lse=True)
            if give_max:
                kw["max_seqlen_q"] = max(lq)
            res_out, lse = pkg.attention(q, k, v, **kw)
            torch.cuda.synchronize()
            assert res_out.data_ptr() == out.data_ptr()
            where = f"{name} lengths q={lq} k={lk} used={used} max_seqlen_q given={give_max}"
            ref, ref_lse = attention_ref_varlen(q, k, v, cu_q, cu_k, seqused_k=seqused, **sem)
            low, _ = attention_ref_varlen(q, k, v, cu_q, cu_k, seqused_k=seqused, upcast=False, **sem)
            assert not torch.isnan(out).any(), f"{where}: unwritten or NaN output rows"
            assert torch.isnan(buf[tq:]).all(), f"{where}: a store ran past the last sequence"
            err = (out.float() - ref).abs().max().item() if tq else 0.0
            budget = 2 * ((low.float() - ref).abs().max().item() if tq else 0.0) + 1e-5
            assert err <= budget, f"{where}: max error {err:.3g} > budget {budget:.3g}"
            assert lse.shape == (h, tq)
            assert torch.equal(lse.isinf(), ref_lse.isinf()), f"{where}: LSE -inf rows differ"
            fin = ~ref_lse.isinf()
            assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-3, rtol=1e-4), f"{where}: LSE mismatch"


def test_varlen_repeated_unchecked_calls_replay_with_new_sequences():
    """Packed calls with max_seqlen_q given take the signature cache from their second call (ForwardOp._replay,
    packed_key): each call's output is still its own inputs' attention over its own sequence boundaries — the
    same shapes, other cu_seqlens values each time — within the forward's rule, with and without return_lse
    (the latter writing its LSE into the scratch buffer), and the package holds one key per form."""
    name = sorted(VARIANTS)[0]
    pkg = _package(name)
    op, spec = pkg._forward, pkg._forward.spec
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec["dtype"]]
    h, h_kv = HEADS
    gen = torch.Generator(device="cuda").manual_seed(7)
    sem = _semantics(pkg)
    op._calls.clear()
    for lq in ([100, 60, 96], [3, 200, 53], [128, 128, 0]):  # 256 tokens in 3 sequences each time
        q = torch.randn(256, h, spec["head_dim"], device="cuda", dtype=dtype, generator=gen)
        k = torch.randn(256, h_kv, spec["head_dim"], device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(256, h_kv, spec["head_dim_v"], device="cuda", dtype=dtype, generator=gen)
        cu = _cu(lq)
        out, lse = pkg.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, return_lse=True)
        alone = pkg.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200)
        torch.cuda.synchronize()
        ref, ref_lse = attention_ref_varlen(q, k, v, cu, cu, **sem)
        low, _ = attention_ref_varlen(q, k, v, cu, cu, upcast=False, **sem)
        budget = 2 * (low.float() - ref).abs().max().item() + 1e-5
        for got in (out, alone):
            err = (got.float() - ref).abs().max().item()
            assert err <= budget, f"{name} lengths {lq}: max error {err:.3g} > budget {budget:.3g}"
        fin = ~ref_lse.isinf()
        assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-3, rtol=1e-4), f"{name} lengths {lq}: LSE mismatch"
    assert len(op._calls) == 2  # one key with return_lse, one without


def test_varlen_rows_are_independent_of_their_neighbours():
    """A sequence's output does not depend on what is packed around it: the same sequence alone and
    between two others gives bitwise the same rows (the kernel never reads across a boundary)."""
    pkg = _package("vl_bf16_d128_causal_gqa")
    gen = torch.Generator(device="cuda").manual_seed(7)
    h, h_kv = HEADS
    lq, lk = [50, 333, 90], [70, 301, 130]
    q = torch.randn(sum(lq), h, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(sum(lk), h_kv, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(sum(lk), h_kv, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    packed = pkg.attention(q, k, v, cu_seqlens_q=_cu(lq), cu_seqlens_k=_cu(lk))
    alone = pkg.attention(q[50:383].contiguous(), k[70:371].contiguous(), v[70:371].contiguous(),
                          cu_seqlens_q=_cu([333]), cu_seqlens_k=_cu([301]))
    assert torch.equal(packed[50:383], alone)


def test_varlen_bad_sequence_values_are_named():
    pkg = _package("vl_fp16_d64_none")
    q = torch.randn(10, 2, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(12, 2, 64, device="cuda", dtype=torch.float16)
    i32 = dict(dtype=torch.int32, device="cuda")
    cases = [
        (dict(cu_seqlens_q=torch.tensor([0, 4, 9], **i32), cu_seqlens_k=torch.tensor([0, 6, 12], **i32)),
         "cu_seqlens_q: last entry must equal the packed length 10"),
        (dict(cu_seqlens_q=torch.tensor([0, 6, 4, 10][:3], **i32), cu_seqlens_k=torch.tensor([0, 6, 12], **i32)),
         "cu_seqlens_q: must be non-decreasing"),
        (dict(cu_seqlens_q=torch.tensor([1, 4, 10], **i32), cu_seqlens_k=torch.tensor([0, 6, 12], **i32)),
         "cu_seqlens_q: must start at 0"),
        (dict(cu_seqlens_q=torch.tensor([0, 4, 10], **i32), cu_seqlens_k=torch.tensor([0, 6, 12], **i32),
              seqused_k=torch.tensor([7, 1], **i32)), "seqused_k: entry 0 must be in [0, 6]"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            pkg.attention(q, k, k, **kw)


def test_varlen_all_keys_empty():
    pkg = _package("vl_bf16_d128_causal_gqa")
    h, h_kv = HEADS
    q = torch.randn(5, h, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(0, h_kv, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = pkg.attention(q, k, k, cu_seqlens_q=_cu([2, 3]), cu_seqlens_k=_cu([0, 0]), return_lse=True)
    assert (out == 0).all() and (lse == -math.inf).all()


def _packed_inputs(spec, lq, lk, used, h, h_kv, gen):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec["dtype"]]
    d, dv = spec["head_dim"], spec["head_dim_v"]
    q = torch.randn(sum(lq), h, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(sum(lk), h_kv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(sum(lk), h_kv, dv, device="cuda", dtype=dtype, generator=gen)
    cu_q, cu_k = _cu(lq), _cu(lk)
    seqused = None
    if used is not None:
        seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
        for i, n in enumerate(used):
            k[int(cu_k[i]) + n:int(cu_k[i + 1])] = float("nan")
            v[int(cu_k[i]) + n:int(cu_k[i + 1])] = float("nan")
    return q, k, v, dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused)


@pytest.mark.parametrize("name", sorted(BWD_VARIANTS))
def test_varlen_backward_matches_reference(name):
    pkg = _package(name)
    spec = pkg._forward.spec
    h, h_kv = (4, 4) if not spec["allow_gqa"] else HEADS
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
    sem = _semantics(pkg)
    for lq, lk, used in LENGTHS:
        q, k, v, seq = _packed_inputs(spec, lq, lk, used, h, h_kv, gen)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = pkg.attention(*leaves, return_lse=True, **seq)
        dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
        dlse = torch.randn(lse.shape, device="cuda", generator=gen)
        junk = [torch.full_like(t, float("nan")) for t in (q, k, v)]  # poison the gradient allocations
        del junk
        grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
        torch.cuda.synchronize()
        where = f"{name} lengths q={lq} k={lk} used={used}"
        # NaN keys past seqused_k: the reference must not see them either (they are unused), so it
        # gets zeros there; the kernel's gradients for those rows must be exactly zero
        k_ref, v_ref = k.nan_to_num(0.0), v.nan_to_num(0.0)
        ref = attention_ref_grads(q, k_ref, v_ref, dout, dlse=dlse, packed=seq, **sem)
        low = attention_ref_grads(q, k_ref, v_ref, dout, dlse=dlse, packed=seq, upcast=False, **sem)
        for g_name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref, low):
            assert not torch.isnan(g).any(), f"{where}: {g_name} has NaN (unwritten or poisoned)"
            err = (g.float() - r).abs().max().item() if g.numel() else 0.0
            budget = grad_budget(r, lo, lo.dtype, softcap=bool(spec["softcap"]))
            assert err <= budget, f"{where}: {g_name} max error {err:.3g} > budget {budget:.3g}"
        if used is not None:
            cu_k = seq["cu_seqlens_k"]
            for i, n in enumerate(used):
                for g in grads[1:]:
                    assert (g[int(cu_k[i]) + n:int(cu_k[i + 1])] == 0).all(), f"{where}: unused keys got a gradient"
        if spec["deterministic"]:
            again = torch.autograd.grad(pkg.attention(*leaves, return_lse=True, **seq), leaves, [dout, dlse])
            for g_name, a, b in zip(("dq", "dk", "dv"), grads, again):
                assert torch.equal(a, b), f"{where}: deterministic {g_name} differs between runs"


@pytest.mark.parametrize("name", sorted(BWD_VARIANTS))
def test_varlen_backward_padding_rows_unchecked(name):
    """max_seqlen_q given (the sequence values go unchecked, no device sync) and packed tensors that end in
    rows no sequence covers (the padding of static shapes): those rows' gradients are exactly 0 — written by
    the kernels, since the gradients are allocated uninitialised (and poisoned here) — and the sequences'
    rows match the reference. The query padding spans more than one tile, so several spare tiles share it."""
    pkg = _package(name)
    spec = pkg._forward.spec
    h, h_kv = (4, 4) if not spec["allow_gqa"] else HEADS
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()) + 1)
    sem = _semantics(pkg)
    lq, lk, pad_q, pad_k = [37, 200, 129], [53, 160, 201], 211, 97
    q, k, v, seq = _packed_inputs(spec, lq, lk, None, h, h_kv, gen)
    pads = [torch.randn(n, *t.shape[1:], device="cuda", dtype=t.dtype, generator=gen)
            for n, t in ((pad_q, q), (pad_k, k), (pad_k, v))]
    leaves = [torch.cat([t, p]).requires_grad_() for t, p in zip((q, k, v), pads)]
    out, lse = pkg.attention(*leaves, return_lse=True, max_seqlen_q=max(lq), **seq)
    tq, tk = sum(lq), sum(lk)
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
    dlse = torch.randn(lse.shape, device="cuda", generator=gen)
    junk = [torch.full_like(t, float("nan")) for t in leaves]  # poison the gradient allocations
    del junk
    grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
    torch.cuda.synchronize()
    for g_name, g, n in zip(("dq", "dk", "dv"), grads, (tq, tk, tk)):
        assert (g[n:] == 0).all(), f"{name}: {g_name} rows after the last sequence are not 0 (unchecked values)"
    ref = attention_ref_grads(q, k, v, dout[:tq], dlse=dlse[:, :tq], packed=seq, **sem)
    low = attention_ref_grads(q, k, v, dout[:tq], dlse=dlse[:, :tq], packed=seq, upcast=False, **sem)
    for g_name, g, r, lo, n in zip(("dq", "dk", "dv"), grads, ref, low, (tq, tk, tk)):
        err = (g[:n].float() - r).abs().max().item()
        budget = grad_budget(r, lo, lo.dtype, softcap=bool(spec["softcap"]))
        assert err <= budget, f"{name} (unchecked, padded): {g_name} max error {err:.3g} > budget {budget:.3g}"


@pytest.mark.parametrize("name", ["vlb_bf16_d128_causal_gqa", "vlb_bf16_d64_none_mha_det"])
def test_varlen_backward_reads_unchecked_values_monotone(name):
    """The backward launches unchecked sequence values (max_seqlen_q given) as the caller passed them, and its
    three kernels read them monotone (fa4gen/device/varlen.py `monotone_chunk`: the first 0, each entry clamped
    into [0, total], the running maximum): overlapping, decreasing and out-of-range values give the gradients
    of their monotone reading — bitwise for a deterministic spec, to the atomics' fp32 reordering otherwise —
    and rows after its last sequence get zeros, with no stray access (poisoned, uninitialised gradients)."""
    from fa4gen.api.runtime import Packed

    pkg = _package(name)
    op, spec = pkg._forward, pkg._forward.spec
    h, h_kv = (4, 4) if not spec["allow_gqa"] else HEADS
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()) + 2)
    lq, lk = [300, 77, 129, 64], [256, 90, 129, 33]
    q, k, v, seq = _packed_inputs(spec, lq, lk, None, h, h_kv, gen)
    tq, tk = sum(lq), sum(lk)
    raw = {  # overlapping, decreasing, negative and past the end; each entry's monotone reading beside it
        "cu_seqlens_q": ([7, 300, 250, -4, tq + 90], [0, 300, 300, 300, tq]),
        "cu_seqlens_k": ([0, 256, 400, 380, tk + 5], [0, 256, 400, 400, tk]),
    }
    as_tensor = {n: [torch.tensor(x, dtype=torch.int32, device="cuda") for x in pair] for n, pair in raw.items()}
    mono = dict(cu_seqlens_q=as_tensor["cu_seqlens_q"][1], cu_seqlens_k=as_tensor["cu_seqlens_k"][1])
    out, lse = pkg.attention(q, k, v, return_lse=True, **mono)  # the monotone packing, checked
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
    dlse = torch.randn(lse.shape, device="cuda", generator=gen)
    grads = {}
    for which in (0, 1):
        cu_q, cu_k = as_tensor["cu_seqlens_q"][which], as_tensor["cu_seqlens_k"][which]
        packed = Packed.check(op.name, True, cu_q, cu_k, 300, None)
        packed.resolve(tq, tk)
        assert not packed.checked
        junk = [torch.full_like(t, float("nan")) for t in (q, k, v)]  # poison the gradient allocations
        del junk
        grads[which] = op.backward(q, k, v, out, dout, lse, dlse, packed=packed)
    torch.cuda.synchronize()
    for g_name, a, b in zip(("dq", "dk", "dv"), grads[0], grads[1]):
        assert not torch.isnan(a).any(), f"{name}: {g_name} from the raw values has NaN (unwritten rows)"
        if spec["deterministic"]:
            assert torch.equal(a, b), f"{name}: {g_name} from the raw values differs from their monotone reading"
        else:
            err = (a.float() - b.float()).abs().max().item()
            scale = b.float().abs().max().item()
            assert err <= 2 ** -7 * scale, f"{name}: {g_name} raw vs monotone differ by {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("name", ["vlb_bf16_d128_causal_gqa", "vlp_bf16_d128_none_mha_atomic_plain"])
def test_varlen_unchecked_calls_make_no_device_sync(name):
    """With max_seqlen_q given, the varlen forward and backward enqueue their work without synchronising with
    the device, as flash_attn_varlen_func does: the backward used to write `c[0] = 0` into the launch's
    sequence copies, a pageable host-to-device copy that PyTorch follows with a stream synchronisation, so
    the GPU idled while the host enqueued the rest of every backward (session 23's profile showed the copy).
    torch's sync debug mode raises on any synchronising call."""
    pkg = _package(name)
    spec = pkg._forward.spec
    h, h_kv = (4, 4) if not spec["allow_gqa"] else HEADS
    gen = torch.Generator(device="cuda").manual_seed(3)
    lq, lk = [300, 77, 129], [256, 90, 129]
    q, k, v, seq = _packed_inputs(spec, lq, lk, None, h, h_kv, gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(sum(lq), h, spec["head_dim_v"], device="cuda", dtype=q.dtype, generator=gen)
    torch.autograd.grad(pkg.attention(*leaves, max_seqlen_q=max(lq), **seq), leaves, dout)  # loads the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = torch.autograd.grad(pkg.attention(*leaves, max_seqlen_q=max(lq), **seq), leaves, dout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(not torch.isnan(g).any() for g in grads)

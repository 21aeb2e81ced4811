"""GPU numerics of the SM90 backward through autograd (skipped without a Hopper GPU).

Tolerance rule (FlashAttention's, as for the forward): each of dq, dk, dv may be at most 2x as far
from the fp32 reference gradients as the gradients of the same attention computed in the input
precision (autograd through bf16/fp16 matmuls with P rounded, `attention_ref_grads(upcast=False)`),
plus an atol. The gradient buffers are poisoned through the caching allocator (NaN-filled blocks of
their sizes freed just before the backward), so elements the kernels leave unwritten fail.

Every spec below costs a forward and a backward compile, so each one serves several cases: head
dims 64/128/256 and (192, 128), bf16 and fp16, every mask kind with run-time window / chunk size,
softcap, MHA/GQA/MQA, seqlens 1, odd and unequal, the LSE's gradient, a transposed (BHSD) q, and
the deterministic mode's bitwise reproducibility.
"""

import zlib

import pytest
import torch

import fa4gen
from conftest import precompile_selected
from fa4gen.golden.tolerance import grad_budget  # the golden check's rule
from fa4gen.reference import attention_ref_grads

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")]

SPECS = {
    "gb_bf16_d128_causal_gqa": dict(dtype="bf16", head_dim=128, mask={"kind": "causal"}),
    "gb_fp16_d64_none_mha": dict(dtype="fp16", head_dim=64, allow_gqa=False),
    # the grid's d128 MHA backward without a mask: 80-row Sᵀ steps, persistent (as the d64 one above)
    "gb_bf16_d128_none_mha": dict(dtype="bf16", head_dim=128, allow_gqa=False),
    # the other persistent stagings of dK / dV in the dS buffers (plan.dkv_staging, session 67): d96 in two phases over
    # 16 KB stages, d128 with softcap (64-row steps) in two phases that fill both stages exactly
    "gb_bf16_d96_none_mha": dict(dtype="bf16", head_dim=96, allow_gqa=False),
    "gb_bf16_d128_softcap_none_mha": dict(dtype="bf16", head_dim=128, softcap=20.0, allow_gqa=False),
    # the causal persistent backward (session 67's patch, GPU-run in session 68): dK / dV in dS stage 1 (head dims up
    # to 64; the d128 form, dV in the dQ buffers, passed this file's tests in session 68 but is kept on the grid)
    "gb_fp16_d64_causal_mha": dict(dtype="fp16", head_dim=64, mask={"kind": "causal"}, allow_gqa=False),
    "gb_bf16_d256_window": dict(dtype="bf16", head_dim=256, mask={"kind": "sliding_window", "left": 100, "right": 20}),
    "gb_fp16_d192_128_chunked_softcap": dict(dtype="fp16", head_dim=192, head_dim_v=128, softcap=20.0,
                                             mask={"kind": "chunked", "chunk_size": 96}),
    # (192, 128) deterministic MHA: the 64 x 96 dKᵀ/dVᵀ tile with dQ added in turns; GQA takes 128 query
    # rows per step next to 64 keys (S, dP, dQ by rows, dK/dV by head-dim halves)
    "gb_bf16_d192_128_causal_det_mha": dict(dtype="bf16", head_dim=192, head_dim_v=128, mask={"kind": "causal"},
                                            allow_gqa=False, deterministic=True),
    "gb_bf16_d192_128_none_det_gqa": dict(dtype="bf16", head_dim=192, head_dim_v=128, deterministic=True),
    # (192, 128) MHA: 64 x 96 tiles with dKᵀ = Qᵀ·dS, dVᵀ = dOᵀ·P (flash-attn-4's layout), stored transposed;
    # here with dQ added from registers (pipeline.bwd_dq_atomic: true; auto hands it over at (192, 128))
    "gb_bf16_d192_128_none_mha_dkvt": dict(dtype="bf16", head_dim=192, head_dim_v=128, allow_gqa=False,
                                           pipeline={"bwd_dq_atomic": True}),
    "gb_fp16_d192_128_window_softcap_mha_dkvt": dict(dtype="fp16", head_dim=192, head_dim_v=128, softcap=20.0,
                                                     mask={"kind": "sliding_window", "left": 100, "right": 20},
                                                     allow_gqa=False),
    # the same tile with dQ through shared memory, bulk-reduced by the dQ warp (flash-attn-4's choice there:
    # P/dS 1 stage, 2 dQ buffers; auto's since session 11), ordered when deterministic
    "gb_bf16_d192_128_causal_mha_dkvt_handoff": dict(dtype="bf16", head_dim=192, head_dim_v=128,
                                                     mask={"kind": "causal"}, allow_gqa=False,
                                                     pipeline={"bwd_dq_atomic": False}),
    "gb_fp16_d192_128_none_det_mha_dkvt_handoff": dict(dtype="fp16", head_dim=192, head_dim_v=128, allow_gqa=False,
                                                       deterministic=True, pipeline={"bwd_dq_atomic": False}),
    "gb_bf16_d128_none_det_gqa": dict(dtype="bf16", head_dim=128, deterministic=True),
    # fp16 deterministic MHA with 80-row Sᵀ steps: the dS stmatrix partition's masked thread index
    # (templates/sm90/bwd.py.j2, ds_thread_masked)
    "gb_fp16_d128_none_det_mha": dict(dtype="fp16", head_dim=128, deterministic=True, allow_gqa=False),
    # d96: dQ's postprocess stages through shared memory with 4 threads per 96-column row
    "gb_bf16_d96_causal_gqa": dict(dtype="bf16", head_dim=96, mask={"kind": "causal"}),
    # d64 chunked GQA: the head-loop backward's 128-row S steps with a chunked mask (HEAD_LOOP_SPECS)
    "gb_bf16_d64_chunked_gqa": dict(dtype="bf16", head_dim=64, mask={"kind": "chunked", "chunk_size": 96}),
    "gb_bf16_d64_causal_softcap_det_mha": dict(dtype="bf16", head_dim=64, mask={"kind": "causal"}, softcap=30.0,
                                               deterministic=True, allow_gqa=False),
    # the opt-in Sᵀ layout (pipeline.bwd_swap_ab, d <= 128): Pᵀ/dSᵀ from registers, per-query statistics by shuffle
    "gb_bf16_d128_causal_gqa_swap": dict(dtype="bf16", head_dim=128, mask={"kind": "causal"},
                                         pipeline={"bwd_swap_ab": True}),
    # Sᵀ without a mask at d128: 80 query rows per step, dQᵀ = Kᵀ·dSᵀ (chunks of 64 head-dim rows x 80)
    "gb_bf16_d128_none_gqa_swap80": dict(dtype="bf16", head_dim=128, pipeline={"bwd_swap_ab": True}),
    # opt-in Sᵀ at d64: 128 query rows per step (flash-attn-4's d64 tile)
    "gb_bf16_d64_causal_mha_swap128": dict(dtype="bf16", head_dim=64, mask={"kind": "causal"}, allow_gqa=False,
                                           pipeline={"bwd_swap_ab": True}),
    # dQ added from registers (pipeline.bwd_dq_atomic; auto above d128, forced here on the Sᵀ 80-row dQᵀ
    # chunks), GQA's fp32 dK/dV staged in the Q buffers
    "gb_bf16_d128_none_gqa_dqatomic": dict(dtype="bf16", head_dim=128, pipeline={"bwd_dq_atomic": True}),
    # deterministic with dQ from registers: each warpgroup takes the query block's turn before its adds
    "gb_bf16_d256_causal_det_gqa_dqatomic": dict(dtype="bf16", head_dim=256, mask={"kind": "causal"},
                                                 deterministic=True, pipeline={"bwd_dq_atomic": True}),
    "gb_fp16_d64_window_softcap_det_swap": dict(dtype="fp16", head_dim=64, softcap=20.0, deterministic=True,
                                                mask={"kind": "sliding_window", "left": 100, "right": 20},
                                                pipeline={"bwd_swap_ab": True}),
}
# every other head dim the planner accepts (multiples of 16), one spec each, masks alternating: the tile
# and chunk choices per head dim run here (the 80-row dQᵀ tile at 112 once ran past K: caught on the CPU,
# session 12; these variants have not run on the GPU before session 13)
# (MHA above 128: at 160 and 224 dK/dV by stmatrix over d / 2 = 80 / 112 columns per warpgroup; at 144 and
# 208 value by value, their halves not being multiples of stmatrix's 16 columns: plan.dkv_elementwise)
SPECS.update({
    f"gd_bf16_d{d}_{kind}{'_mha' if mha else ''}": dict(dtype="bf16", head_dim=d, mask={"kind": kind}, allow_gqa=not mha)
    for d, kind, mha in [(16, "none", 0), (32, "causal", 0), (48, "none", 0), (80, "causal", 0), (112, "none", 0),
                         (144, "causal", 1), (160, "none", 1), (176, "causal", 0), (208, "none", 1),
                         (224, "causal", 1), (240, "none", 0)]
})
# session 13's coverage audit: plan combinations no GPU test had run (the S = Q·Kᵀ layout at d128 without
# Sᵀ; a chunked mask with determinism and MHA; kv_stages 1 / tile_n 96; the dQ hand-off above d128 with
# GQA; tile_n 192 with the causal bit mask's second word; d256 window + softcap with the hand-off and
# poly-exp; ping-pong and intra-warpgroup overlap off with window / chunked / softcap)
_W = {"kind": "sliding_window", "left": 100, "right": 20}
_C96 = {"kind": "chunked", "chunk_size": 96}
SPECS.update({
    "gp_bf16_d128_chunked_det_mha_pp0_kv1": dict(dtype="bf16", head_dim=128, mask=_C96, allow_gqa=False,
                                                 deterministic=True,
                                                 pipeline={"ping_pong": False, "kv_stages": 1, "tile_n": 96}),
    "gp_fp16_d128_window_softcap_noswap_plain": dict(dtype="fp16", head_dim=128, mask=_W, softcap=20.0,
                                                     pipeline={"bwd_swap_ab": False, "intra_wg_overlap": False,
                                                               "rescale_threshold": 14.0}),
    "gp_bf16_d192_128_causal_det_gqa_handoff": dict(dtype="bf16", head_dim=192, head_dim_v=128,
                                                    mask={"kind": "causal"}, deterministic=True,
                                                    pipeline={"bwd_dq_atomic": False, "tile_n": 64, "kv_stages": 3}),
    "gp_bf16_d64_causal_det_mha_swap_atomic_n192": dict(dtype="bf16", head_dim=64, mask={"kind": "causal"},
                                                        allow_gqa=False, deterministic=True,
                                                        pipeline={"bwd_dq_atomic": True, "tile_m": 128, "tile_n": 192,
                                                                  "kv_stages": 4}),
    "gp_bf16_d256_window_softcap_gqa_handoff_poly": dict(dtype="bf16", head_dim=256, mask=_W, softcap=20.0,
                                                         pipeline={"bwd_dq_atomic": False,
                                                                   "poly_exp": {"share": 0.25, "degree": 3}}),
})
SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, kv_heads)
    (2, 128, 128, 4, 4),
    (1, 113, 203, 4, 2),
    (1, 255, 1000, 4, 1),
    (3, 1, 1, 2, 2),
    (1, 1000, 255, 2, 2),  # causal: the first 745 rows see no key
    (1, 300, 300, 6, 3),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_built: dict = {}


def _package(name):
    if name not in _built:
        _built[name] = fa4gen.build(dict(name=name, targets=["sm90"], backward=True, **SPECS[name]))
    return _built[name]


@pytest.fixture(scope="module", autouse=True)
def _kernels_compiled_ahead(request):
    """The selected tests' kernels, compiled in parallel processes before the first test (conftest)."""
    precompile_selected(request, _package)


def _resolved(name):
    return dict(SPECS[name], mask=SPECS[name].get("mask", {"kind": "none"}))


def _semantics(spec, window, chunk):
    mask = spec["mask"]
    sem = dict(softcap=spec.get("softcap", 0.0))
    if mask["kind"] == "sliding_window":
        sem["window"] = window or (mask["left"], mask["right"])
    elif mask["kind"] == "chunked":
        sem["chunk"] = chunk or mask["chunk_size"]
    else:
        sem["causal"] = mask["kind"] == "causal"
    return sem


def _budget(low, ref, softcap):
    # the golden check's rule (fa4gen.golden.tolerance.grad_budget): 2x the low-precision error + an
    # atol for fp32 summation-order noise + one input-dtype ulp at the largest gradient (+ softcap's)
    return grad_budget(ref, low, low.dtype, softcap=softcap)


def _poison(*tensors):
    """NaN-filled blocks of these tensors' sizes, freed: the caching allocator hands them to the
    backward's dq, dk, dv allocations."""
    junk = [torch.full_like(t, float("nan")) for t in tensors]
    del junk


def _inputs(spec, b, s_q, s_k, h, h_kv, gen, *, bhsd_q=False):
    dtype = DTYPES[spec["dtype"]]
    d, dv = spec["head_dim"], spec.get("head_dim_v", spec["head_dim"])
    if not spec.get("allow_gqa", True):
        h_kv = h
    if bhsd_q:  # q as a transposed view of a (b, h, s, d) tensor: strided, last dim contiguous
        q = torch.randn(b, h, s_q, d, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
    else:
        q = torch.randn(b, s_q, h, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(b, s_k, h_kv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(b, s_k, h_kv, dv, device="cuda", dtype=dtype, generator=gen)
    return [t.requires_grad_() for t in (q, k, v)]


def _check_backward(name, pkg, spec, shapes):
    """Every shape's dq, dk, dv against the fp32 reference (odd shapes take the call's own window / chunk and an
    LSE gradient; the second a transposed q)."""
    kind = spec["mask"]["kind"]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
    for i, (b, s_q, s_k, h, h_kv) in enumerate(shapes):
        kwargs = {}
        if i % 2 and kind == "sliding_window":
            kwargs["window"] = (37, 5)
        if i % 2 and kind == "chunked":
            kwargs["chunk_size"] = 64
        q, k, v = _inputs(spec, b, s_q, s_k, h, h_kv, gen, bhsd_q=i == 1)
        out, lse = pkg.attention(q, k, v, return_lse=True, **kwargs)
        dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
        dlse = torch.randn(lse.shape, device="cuda", generator=gen) if i % 2 else None  # the LSE's gradient
        outputs, grads = ([out, lse], [dout, dlse]) if dlse is not None else ([out], [dout])
        _poison(q, k, v)
        torch.autograd.backward(outputs, grads)
        torch.cuda.synchronize()
        sem = _semantics(spec, kwargs.get("window"), kwargs.get("chunk_size"))
        ref = attention_ref_grads(q, k, v, dout, dlse=dlse, **sem)
        low = attention_ref_grads(q, k, v, dout, dlse=dlse, upcast=False, **sem)
        where = f"{name} shape={(b, s_q, s_k, h, h_kv)} {kwargs} dlse={dlse is not None}"
        for g_name, t, r, lo in zip(("dq", "dk", "dv"), (q, k, v), ref, low):
            g = t.grad
            assert g is not None and g.shape == t.shape and g.dtype == t.dtype, f"{where}: {g_name}"
            assert torch.isfinite(g).all(), f"{where}: {g_name} has unwritten or non-finite elements"
            err = (g.float() - r).abs().max().item()
            budget = _budget(lo, r, sem["softcap"])
            assert err <= budget, f"{where}: {g_name} max error {err:.3g} > budget {budget:.3g}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_backward_matches_reference(name, monkeypatch):
    pkg, spec = _package(name), _resolved(name)
    # which backward each case runs (allow_gqa, the spec default, holds two or three: see the end)
    picked, pick = [], pkg._forward.backward_plan

    def recording(arch, h, h_kv, batch=0, seqlen_k=0):
        plan = pick(arch, h, h_kv, batch, seqlen_k)
        picked.append((h, h_kv, plan["module"]))
        return plan

    monkeypatch.setattr(pkg._forward, "backward_plan", recording)
    _check_backward(name, pkg, spec, SHAPES)
    # allow_gqa (the spec default) holds two backwards: the MHA shapes ran bwd_sm90_mha (dK/dV stored from the
    # CTA), the GQA / MQA ones bwd_sm90 (fp32 dK/dV workspaces: these shapes launch fewer CTAs than the head-loop
    # kernel bwd_sm90_gqa takes); without it every shape runs bwd_sm90
    mha = spec.get("allow_gqa", True)
    assert len(picked) == len(SHAPES)
    assert [m for _, _, m in picked] == ["bwd_sm90_mha" if mha and h == h_kv else "bwd_sm90" for h, h_kv, _ in picked]
    assert any(m == "bwd_sm90" for _, _, m in picked) and (not mha or any(m == "bwd_sm90_mha" for _, _, m in picked))


# the specs that hold the head-loop GQA backward (allow_gqa, neither deterministic nor varlen, dQ through buffers)
HEAD_LOOP_SPECS = sorted(n for n, s in SPECS.items() if s.get("allow_gqa", True) and not s.get("deterministic")
                         and not s.get("varlen") and not s.get("pipeline", {}).get("bwd_dq_atomic")
                         and max(s["head_dim"], s.get("head_dim_v", s["head_dim"])) <= 128)


@pytest.mark.parametrize("name", HEAD_LOOP_SPECS)
def test_gqa_head_loop_backward_matches_reference(name):
    """bwd_sm90_gqa pinned (one CTA per kv head runs its group's q heads: MHA, groups of 2 and MQA in SHAPES) on
    every shape, against the fp32 reference."""
    pkg, spec = _package(name), _resolved(name)
    assert "bwd_sm90_gqa" in [p["module"] for p in pkg._forward.kernel_plans("sm90")]
    with pkg._forward.pinned("bwd_sm90_gqa"):
        _check_backward(name, pkg, spec, SHAPES)


def test_gqa_calls_with_enough_ctas_run_the_head_loop_backward(monkeypatch):
    """A GQA call of at least min_kv_ctas CTAs (key blocks x kv heads x batch) runs bwd_sm90_gqa end to end, one
    below it bwd_sm90; both against the reference."""
    name = "gb_bf16_d128_causal_gqa"
    pkg, spec = _package(name), _resolved(name)
    loop = pkg._forward.bwd_gqa_plans["sm90"]
    picked, pick = [], pkg._forward.backward_plan

    def recording(arch, h, h_kv, batch=0, seqlen_k=0):
        plan = pick(arch, h, h_kv, batch, seqlen_k)
        picked.append(plan["module"])
        return plan

    monkeypatch.setattr(pkg._forward, "backward_plan", recording)
    s_k = 4 * loop["tile_n"]  # 4 key blocks x 8 kv heads: min_kv_ctas needs the batch below
    b = -(-loop["min_kv_ctas"] // (4 * 8))
    _check_backward(name, pkg, spec, [(b, s_k, s_k, 32, 8), (b - 1, s_k, s_k, 32, 8)])
    assert picked == ["bwd_sm90_gqa", "bwd_sm90"]


def test_stride_zero_output_gradient_and_partial_requires_grad():
    """out.sum().backward() hands the backward a stride-0 dout; only q requires grad here."""
    name = "gb_bf16_d128_causal_gqa"
    pkg, spec = _package(name), _resolved(name)
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = _inputs(spec, 2, 200, 333, 4, 2, gen)
    k, v = k.detach(), v.detach()
    pkg.attention(q, k, v).sum().backward()
    assert k.grad is None and v.grad is None
    dout = torch.ones(2, 200, 4, 128, device="cuda", dtype=torch.bfloat16)
    ref = attention_ref_grads(q, k, v, dout, causal=True)[0]
    low = attention_ref_grads(q, k, v, dout, causal=True, upcast=False)[0]
    err = (q.grad.float() - ref).abs().max().item()
    assert err <= _budget(low, ref, 0.0), f"dq max error {err:.3g}"


def _assert_repeated_and_close(name, spec, runs, q, k, v, dout, dlse=None):
    """The deterministic backward's check: every run's (dq, dk, dv) bitwise equal to the first run's, and the
    first within the fp32 reference's budget (`_budget`) for the same dout (and dlse, when the LSE is
    differentiated)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for i, grads in enumerate(runs[1:], 1):
        for g_name, first, again in zip(("dq", "dk", "dv"), runs[0], grads):
            assert torch.equal(first, again), f"{name}: {g_name} of run {i} differs from run 0"
    sem = _semantics(spec, None, None)
    ref = attention_ref_grads(q, k, v, dout, dlse=dlse, **sem)
    low = attention_ref_grads(q, k, v, dout, dlse=dlse, upcast=False, **sem)
    for g_name, g, r, lo in zip(("dq", "dk", "dv"), runs[0], ref, low):
        err = (g.float() - r).abs().max().item()
        assert err <= _budget(lo, r, sem["softcap"]), f"{name}: {g_name} max error {err:.3g}"


@pytest.mark.parametrize("name, shape", [
    ("gb_bf16_d128_none_det_gqa", (2, 1000, 1000, 8, 2)),  # dQ and the GQA dK/dV through semaphores
    ("gb_bf16_d64_causal_softcap_det_mha", (2, 777, 1024, 4, 4)),  # dQ through semaphores
    ("gb_fp16_d128_none_det_mha", (2, 1000, 1000, 4, 4)),  # 80-row Sᵀ steps, the masked dS index
    ("gb_bf16_d256_causal_det_gqa_dqatomic", (2, 1000, 1000, 8, 2)),  # dQ adds from registers, in turns
])
def test_deterministic_backward_is_bitwise_reproducible(name, shape):
    pkg, spec = _package(name), _resolved(name)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = _inputs(spec, *shape, gen)
    out, lse = pkg.attention(q, k, v, return_lse=True)
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
    dlse = torch.randn(lse.shape, device="cuda", generator=gen)
    runs = [torch.autograd.grad([out, lse], [q, k, v], [dout, dlse], retain_graph=True) for _ in range(10)]
    _assert_repeated_and_close(name, spec, runs, q, k, v, dout, dlse)


@pytest.mark.parametrize("name, shape", [
    ("gb_bf16_d192_128_causal_det_mha", (2, 2048, 2048, 16, 16)),  # the dQ warp's hand-off, 64 x 96 tiles
    ("gb_bf16_d192_128_causal_det_mha", (2, 1900, 2304, 16, 16)),  # more keys than queries, a partial query block
    ("gb_bf16_d256_causal_det_gqa_dqatomic", (2, 1280, 1280, 16, 4)),  # the turn warp (two passes per key block)
])
def test_deterministic_causal_grid_with_its_last_group_first_to_last(name, shape):
    """A causal deterministic grid large enough that its last group of pairs adds first to last
    (schedule.det_tail_ascending: two or more groups, DET_TAIL_UP_CTAS CTAs or more in the last) while the
    others add last to first: bitwise reproducible over 10 runs and within the budget of the fp32 reference.
    The shape is checked to reach that path with the host's group arithmetic (the grid's pow2_group of the
    pairs, at most the query rows' L2 fit and L2_MAX_GROUP)."""
    from fa4gen.device import schedule

    pkg, spec = _package(name), _resolved(name)
    b, s_q, s_k, h, h_kv = shape
    plan = next(p for p in pkg._forward.kernel_plans("sm90") if p["module"] == "bwd_sm90")
    num_n = -(-s_k // plan["tile_n"])
    d, dv, width = spec["head_dim"], spec.get("head_dim_v", spec["head_dim"]), 2  # both specs bf16
    limit = min(max(schedule.L2_KV_BYTES // ((d + dv) * width + d * 4) // s_q, 1), schedule.L2_MAX_GROUP)
    pairs = b * h
    group = max(g for g in (1, 2, 4, 8, 16) if g <= limit and pairs % g == 0)
    assert pairs // group >= 2 and group * num_n >= schedule.DET_TAIL_UP_CTAS, (pairs, group, num_n)
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = _inputs(spec, *shape, gen)
    out = pkg.attention(q, k, v)
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
    runs = [torch.autograd.grad(out, [q, k, v], dout, retain_graph=True) for _ in range(10)]
    _assert_repeated_and_close(name, spec, runs, q, k, v, dout)


# the persistent backwards (plan scheduler "persistent": MHA without a mask, or causal at head dims up to 64, Sᵀ,
# neither deterministic nor varlen)
PERSISTENT_SPECS = ["gb_bf16_d128_none_mha", "gb_fp16_d64_none_mha", "gb_bf16_d96_none_mha", "gb_fp16_d64_causal_mha"]


def test_overlapped_dq_conversion_replays_in_a_cuda_graph():
    """The persistent no-mask backward with its dQ conversion launched as a programmatic dependent (plan
    dq_post_overlap) captured in a CUDA graph, as torch.compile's reduce-overhead mode and whole-step capture do:
    the capture keeps the launch attribute as a programmatic edge, and every replay on new inputs gives gradients
    within the golden budget of the fp32 reference (more tiles than SMs, so the last round is partial)."""
    name = "gb_bf16_d128_none_mha"
    pkg, spec = _package(name), _resolved(name)
    assert pkg._forward.bwd_plans["sm90"]["dq_post_overlap"]
    b, s, h = 4, 1000, 16  # 4 x 16 x 8 = 512 key-block tiles
    gen = torch.Generator(device="cuda").manual_seed(72)
    static = _inputs(spec, b, s, s, h, h, gen)
    dout = torch.randn(b, s, h, spec["head_dim"], device="cuda", dtype=static[0].dtype, generator=gen)
    side = torch.cuda.Stream()  # warm up off the capturing stream (torch's rule for graph capture)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pkg.attention(*static).backward(dout)
    torch.cuda.current_stream().wait_stream(side)
    for t in static:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pkg.attention(*static).backward(dout)
    sem = _semantics(spec, None, None)
    for seed in range(3):
        fresh = _inputs(spec, b, s, s, h, h, torch.Generator(device="cuda").manual_seed(100 + seed))
        with torch.no_grad():
            for t, f in zip(static, fresh):
                t.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        ref = attention_ref_grads(*fresh, dout, **sem)
        low = attention_ref_grads(*fresh, dout, upcast=False, **sem)
        for g_name, t, r, lo in zip(("dq", "dk", "dv"), static, ref, low):
            err = (t.grad.float() - r).abs().max().item()
            budget = _budget(lo, r, sem["softcap"])
            assert err <= budget, f"replay {seed}: {g_name} max error {err:.3g} > budget {budget:.3g}"


# one CTA per (key block, head, batch) with the overlapped dQ conversion (the MHA twin of an allow_gqa spec): causal
# in head groups, a window and a chunked mask with key blocks fastest
GRID_OVERLAP_SPECS = ["gb_bf16_d128_causal_gqa", "gp_fp16_d128_window_softcap_noswap_plain", "gb_bf16_d64_chunked_gqa"]


@pytest.mark.parametrize("name", GRID_OVERLAP_SPECS)
def test_overlapped_dq_conversion_on_the_grid(name, monkeypatch):
    """The grid backward (one CTA per key block) with its dQ conversion launched as a programmatic dependent (plan
    dq_post_overlap): the conversion may launch only once the last main-kernel CTAs are placed, then takes the SMs
    they leave and waits per (batch, head) for the count of landed key blocks. Calls of several waves (512 CTAs and
    more on 132 SMs, partial last key blocks and query tiles, key blocks that no query reaches at s_k > s_q) give
    gradients within the golden budget of the fp32 reference, the call's own window / chunk included."""
    pkg, spec = _package(name), _resolved(name)
    op = pkg._forward
    picked, pick = [], op.backward_plan

    def recording(arch, h, h_kv, batch=0, seqlen_k=0):
        plan = pick(arch, h, h_kv, batch, seqlen_k)
        picked.append(plan)
        return plan

    monkeypatch.setattr(op, "backward_plan", recording)
    _check_backward(name, pkg, spec, [(4, 1000, 1000, 16, 16), (2, 700, 1900, 12, 12), (3, 1500, 999, 8, 8)])
    assert [(p["module"], p["scheduler"], p["dq_post_overlap"]) for p in picked] == [
        ("bwd_sm90_mha", "grid", True)] * 3


@pytest.mark.parametrize("name", PERSISTENT_SPECS)
def test_persistent_backward_strides_over_many_tiles(name, monkeypatch):
    """SHAPES hold fewer (key block, head, batch) tiles than the persistent grid's CTAs, so each CTA runs one; here
    every CTA runs several: calls of more tiles than the GPU has SMs, and small calls again with the CTA count held at
    3 (K / V reloaded per tile once the last tile's dK / dV have left their buffers, the Q / dO rings, the dQ hand-off
    and its claims carried across tiles of other heads and batches; partial last key blocks and query tiles).
    The dQ conversion overlaps the main kernel (plan dq_post_overlap): with 3 CTAs, or 1, most SMs are free from
    the start, so its CTAs are placed at once and wait on their (batch, head)'s count of landed key blocks while
    the main kernel's few CTAs add into dQ pair by pair (causal: in the paired order, pairs out of order)."""
    pkg, spec = _package(name), _resolved(name)
    op = pkg._forward
    assert op.bwd_plans["sm90"]["scheduler"] == "persistent"
    assert op.bwd_plans["sm90"]["dq_post_overlap"]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()) + 1)
    runs = [(None, (4, 1000, 777, 8, 8)), (None, (2, 300, 2000, 16, 16)),
            (3, (1, 77, 130, 4, 4)), (3, (3, 256, 384, 2, 2)), (3, (2, 1, 300, 3, 3)), (1, (2, 200, 500, 3, 3))]
    device = torch.cuda.current_device()
    for ctas, (b, s_q, s_k, h, h_kv) in runs:
        if ctas is not None:
            op.persistent_ctas(op.bwd_plans["sm90"], torch.device("cuda", device))  # the SM count, cached
            monkeypatch.setitem(op._sm_count_by_device, device, ctas)
        tiles = -(-s_k // op.bwd_plans["sm90"]["tile_n"]) * h * b
        launched = op.persistent_ctas(op.bwd_plans["sm90"], torch.device("cuda", device))
        assert tiles > launched, (tiles, launched)  # several tiles per CTA
        q, k, v = _inputs(spec, b, s_q, s_k, h, h_kv, gen)
        out = pkg.attention(q, k, v)
        dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
        _poison(q, k, v)
        out.backward(dout)
        torch.cuda.synchronize()
        sem = _semantics(spec, None, None)
        ref = attention_ref_grads(q, k, v, dout, **sem)
        low = attention_ref_grads(q, k, v, dout, upcast=False, **sem)
        where = f"{name} shape={(b, s_q, s_k, h, h_kv)} ctas={ctas or 'SMs'}"
        for g_name, t, r, lo in zip(("dq", "dk", "dv"), (q, k, v), ref, low):
            g = t.grad
            assert g is not None and torch.isfinite(g).all(), f"{where}: {g_name} has unwritten or non-finite elements"
            err = (g.float() - r).abs().max().item()
            budget = _budget(lo, r, sem["softcap"])
            assert err <= budget, f"{where}: {g_name} max error {err:.3g} > budget {budget:.3g}"

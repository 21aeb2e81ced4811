"""GPU numerics of every generated SM90 forward variant (skipped without a Hopper GPU).

Tolerance rule (FlashAttention's): the kernel's max abs error against an fp32 reference must be
at most 2x the error of the same attention computed in the input precision (scores and P rounded
to bf16/fp16, what PyTorch's own low-precision attention does) plus 1e-5. The output is poisoned
with NaN before every call (passed as `out=`), and the LSE buffer is poisoned through the caching
allocator, so unwritten elements fail.
"""

import contextlib
import importlib
import json
import zlib
from pathlib import Path

import pytest
import torch

import fa4gen
from conftest import precompile_selected
from fa4gen.api.runtime import spread_ctas
from fa4gen.reference import attention_ref

ROOT = Path(__file__).resolve().parents[1]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")]

GENERATED = sorted(  # batched specs (varlen ones: tests/test_gpu_varlen.py and the golden suite)
    p.name for p in (ROOT / "generated").iterdir()
    if (p / "spec.lock.json").exists() and "sm90" in (p / "spec.lock.json").read_text()
    and not json.loads((p / "spec.lock.json").read_text())["spec"]["varlen"]
)
# Variants specs/ does not cover: fp16, head dims 96/256 without masks, switches off/on.
EXTRA = {
    "x_fp16_d128_causal": dict(dtype="fp16", head_dim=128, mask={"kind": "causal"}, return_lse=True),
    "x_bf16_d256_none": dict(dtype="bf16", head_dim=256, return_lse=True),
    "x_fp16_d96_window": dict(dtype="fp16", head_dim=96, mask={"kind": "sliding_window", "left": 100, "right": 20},
                              return_lse=True),
    "x_bf16_d64_causal_plain": dict(dtype="bf16", head_dim=64, mask={"kind": "causal"}, return_lse=True,
                                    pipeline={"ping_pong": False, "rescale_threshold": 0.0}),
    "x_bf16_d128_poly_all": dict(dtype="bf16", head_dim=128, return_lse=True,
                                 pipeline={"poly_exp": {"share": 1.0, "degree": 3}, "rescale_threshold": 4.0}),
    "x_fp16_d192_128_chunked": dict(dtype="fp16", head_dim=192, head_dim_v=128, mask={"kind": "chunked", "chunk_size": 96},
                                    return_lse=True, softcap=20.0),
    # a masked d <= 64 spec's second, 192-row forward for long calls with a window and softcap in fp16
    # (test_long_calls_run_the_192_row_kernel; session 13's coverage audit: no test call had reached one)
    "x_fp16_d64_window_softcap": dict(dtype="fp16", head_dim=64, softcap=20.0, return_lse=True,
                                      mask={"kind": "sliding_window", "left": 300, "right": 40}),
    # (192, 128) with a sliding window (its own auto tile_n: 96), fp32 LSE and GQA
    "x_bf16_d192_128_window": dict(dtype="bf16", head_dim=192, head_dim_v=128, allow_gqa=True, return_lse=True,
                                   mask={"kind": "sliding_window", "left": 100, "right": 20}),
    # head dims 129-192 run 96-key blocks since session 48: d192 with a mask and softcap
    "x_bf16_d192_causal_softcap": dict(dtype="bf16", head_dim=192, mask={"kind": "causal"}, softcap=30.0,
                                       return_lse=True),
    # head dims 208 / 240: the producer takes 40 registers, the consumers 232 (their forwards spilled at 24)
    "x_bf16_d208_chunked_softcap": dict(dtype="bf16", head_dim=208, softcap=20.0, return_lse=True,
                                        mask={"kind": "chunked", "chunk_size": 96}),
    "x_fp16_d240_window": dict(dtype="fp16", head_dim=240, return_lse=True,
                               mask={"kind": "sliding_window", "left": 100, "right": 20}),
    # the persistent forward (no mask, O in its own buffer) with GQA, softcap and head dim 96
    "x_bf16_d96_none_gqa_softcap": dict(dtype="bf16", head_dim=96, softcap=30.0, allow_gqa=True, return_lse=True),
    # ... with both switches off (the plain loop releases Q after its last P·V), 128 rows, 160 keys per block
    "x_bf16_d64_none_plain": dict(dtype="bf16", head_dim=64, return_lse=True,
                                  pipeline={"ping_pong": False, "intra_wg_overlap": False, "tile_m": 128, "tile_n": 160}),
    # the masked persistent forward with both switches off
    "x_bf16_d128_chunked_plain": dict(dtype="bf16", head_dim=128, return_lse=True, mask={"kind": "chunked", "chunk_size": 96},
                                      pipeline={"ping_pong": False, "intra_wg_overlap": False}),
    # the persistent forward at head dims 144 / 160 (96-key blocks since session 48; without a mask only)
    "x_bf16_d160_none_gqa": dict(dtype="bf16", head_dim=160, allow_gqa=True, return_lse=True),
    "x_fp16_d144_none": dict(dtype="fp16", head_dim=144, return_lse=True),
    # pipeline.q_stages 1: the persistent forward with one Q buffer (auto takes two up to d128 since session 49;
    # 192 rows without a mask; masked, 128 rows)
    "x_bf16_d64_none_q1": dict(dtype="bf16", head_dim=64, return_lse=True, pipeline={"q_stages": 1}),
    "x_fp16_d128_causal_q1": dict(dtype="fp16", head_dim=128, allow_gqa=True, return_lse=True, mask={"kind": "causal"},
                                  pipeline={"q_stages": 1}),
    # a masked d64 spec with a chunked mask and softcap, no LSE: its 192-row kernel for long calls kept 12 LDL/STL
    # until the rows' chunk starts moved out of the key-block loop (session 49; test_long_calls_run_the_192_row_kernel)
    "x_bf16_d64_chunked_softcap": dict(dtype="bf16", head_dim=64, softcap=20.0,
                                       mask={"kind": "chunked", "chunk_size": 96}),
}
SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, kv_heads)
    (2, 128, 128, 4, 4),
    (2, 113, 203, 4, 2),
    (1, 300, 257, 6, 1),
    (3, 1, 1, 2, 2),
    (1, 250, 100, 2, 2),
    (1, 64, 700, 4, 4),
    (1, 1000, 1000, 2, 1),
]


def _package(name: str):
    if name in EXTRA:
        return fa4gen.build(dict(name=name, targets=["sm90"], **EXTRA[name]))
    return importlib.import_module(f"generated.{name}")


@pytest.fixture(scope="module", autouse=True)
def _kernels_compiled_ahead(request):
    """The selected tests' kernels, compiled in parallel processes before the first test (conftest)."""
    precompile_selected(request, _package, directions=("fwd",))


def _setup(name: str, seed_offset: int = 0):
    """(package, lock, spec, torch dtype, head_dim, head_dim_v, a CUDA generator seeded from the name)."""
    pkg = _package(name)
    lock = json.loads((Path(pkg.__file__).parent / "spec.lock.json").read_text())
    spec = lock["spec"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec["dtype"]]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()) + seed_offset)
    return pkg, lock, spec, dtype, spec["head_dim"], spec["head_dim_v"], gen


def _semantics(lock: dict, window, chunk):
    mask = lock["spec"]["mask"]
    kind = mask["kind"]
    if kind == "sliding_window":
        left, right = window if window is not None else (mask["left"], mask["right"])
        return dict(window=(-1 if left is None else left, -1 if right is None else right))
    if kind == "chunked":
        return dict(chunk=chunk or mask["chunk_size"])
    return dict(causal=kind == "causal")


def _poisoned_empty_lse(shape):
    # Reuse a NaN-filled block from the caching allocator for the kernel's LSE buffer.
    junk = torch.full(shape, float("nan"), device="cuda", dtype=torch.float32)
    del junk


@pytest.mark.parametrize("name", GENERATED + sorted(EXTRA))
def test_forward_matches_reference(name):
    pkg, lock, spec, dtype, d, dv, gen = _setup(name)
    kind = spec["mask"]["kind"]
    for b, s_q, s_k, h, h_kv in SHAPES:
        if not spec["allow_gqa"] and h != h_kv:
            h_kv = h
        window = (37, 5) if kind == "sliding_window" else None
        chunk = 64 if kind == "chunked" else None
        for call_window, call_chunk in ((None, None), (window, chunk)):
            q = torch.randn(b, s_q, h, d, device="cuda", dtype=dtype, generator=gen)
            k = torch.randn(b, s_k, h_kv, d, device="cuda", dtype=dtype, generator=gen)
            v = torch.randn(b, s_k, h_kv, dv, device="cuda", dtype=dtype, generator=gen)
            out = torch.full((b, s_q, h, dv), float("nan"), device="cuda", dtype=dtype)
            kwargs = {}
            if call_window is not None:
                kwargs["window"] = call_window
            if call_chunk is not None:
                kwargs["chunk_size"] = call_chunk
            want_lse = spec["return_lse"]
            _poisoned_empty_lse((b, h, s_q))
            res = pkg.attention(q, k, v, out=out, return_lse=want_lse, **kwargs)
            lse = res[1] if want_lse else None
            torch.cuda.synchronize()
            sem = _semantics(lock, call_window, call_chunk)
            _assert_matches(q, k, v, out, lse, spec["softcap"], sem, f"{name} shape={(b, s_q, s_k, h, h_kv)} {kwargs}")


@contextlib.contextmanager
def _recording_launches(op):
    """The modules the calls inside the block launch (op._functions also holds earlier tests' kernels)."""
    launched = []
    real = op.function
    op.function = lambda plan, *a, **kw: launched.append(plan["module"]) or real(plan, *a, **kw)
    try:
        yield launched
    finally:
        del op.function


def _assert_matches(q, k, v, out, lse, softcap, sem, where):
    ref, ref_lse = attention_ref(q, k, v, softcap=softcap, **sem)
    low, _ = attention_ref(q, k, v, softcap=softcap, upcast=False, **sem)
    err = (out.float() - ref).abs().max().item()
    budget = 2 * (low.float() - ref).abs().max().item() + 1e-5
    assert not torch.isnan(out).any(), f"{where}: unwritten or NaN output"
    assert err <= budget, f"{where}: max error {err:.3g} > budget {budget:.3g}"
    if lse is not None:
        assert torch.equal(lse.isinf(), ref_lse.isinf()), f"{where}: LSE -inf rows differ"
        fin = ~ref_lse.isinf()
        # fp32 statistics from the same inputs: differences come from ex2/lg2.approx (~2^-22
        # relative) and summation order, far below 1e-3.
        assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-3, rtol=1e-4), f"{where}: LSE mismatch"


@pytest.mark.parametrize("name", ["vit_encoder", "x_bf16_d128_poly_all", "x_bf16_d96_none_gqa_softcap", "x_bf16_d64_none_plain",
                                  "llama3_8b", "mistral_7b", "llama4_chunked", "x_fp16_d128_causal", "x_fp16_d96_window",
                                  "x_bf16_d128_chunked_plain", "llama32_1b", "x_fp16_d64_window_softcap",
                                  "x_bf16_d160_none_gqa", "x_fp16_d144_none", "x_bf16_d64_none_q1",
                                  "x_fp16_d128_causal_q1"])
def test_persistent_forward_strides_over_many_tiles(name):
    """SHAPES have fewer query tiles than the persistent grid's CTAs, so each CTA runs one; here every CTA
    runs several (Q's buffer, O's buffer and the K/V stages cycle over tiles of other heads and batches),
    with a partial last query tile, a partial last key block and GQA. Calls from PERSISTENT_MAX_SEQLEN_Q
    query rows on (d64 without a mask: PERSISTENT_MAX_SEQLEN_Q_192) run the one-CTA-per-tile twin
    (fwd_sm90_long; masked d64 specs: their 192-row kernel from LONG_SEQLEN_Q), unless the call's chunks or sliding
    window are short (PERSISTENT_CHUNK_KEYS / PERSISTENT_WINDOW_KEYS; d64: LONG_CHUNK_KEYS / LONG_WINDOW_KEYS): those
    stay on the persistent forward, here the long calls with chunks of 96 keys or a window of 301. Masked specs stride over units of
    two query tiles (j and num_m - 1 - j; chunked calls whose chunks hold whole tiles and end in a partial one split
    each pair's tiles, schedule.chunk_ramp); seqlen_k below seqlen_q leaves causal rows without keys (bottom-right)."""
    from fa4gen.plan.sm90 import PERSISTENT_CTAS, PERSISTENT_MAX_SEQLEN_Q_192

    pkg, lock, spec, dtype, d, dv, gen = _setup(name, 1)
    op = pkg._forward
    (long_plan,) = op.long_plans["sm90"]
    long_q = long_plan["min_seqlen_q"]
    assert long_q <= PERSISTENT_MAX_SEQLEN_Q_192, long_q
    kind = spec["mask"]["kind"]
    masked = kind != "none"
    shapes = [(4, 1000, 777, 16, 4), (3, 2048, 1500, 12, 12), (3, long_q - 1, 300, 8, 1), (1, long_q, 333, 4, 1)]
    if masked:  # an odd tile count (a unit holding the middle tile alone), seqlen_k > seqlen_q, one tile per pair
        shapes += [(6, 600, 450, 12, 4), (8, 1100, 1300, 16, 4), (64, 100, 1000, 4, 1)]
    # run-time windows / chunks, one per shape (the kernel's arguments: no recompile)
    calls = {"sliding_window": [dict(window=w) for w in ((37, 5), (0, 0), (300, -1), (-1, 20))],
             "chunked": [dict(chunk_size=c) for c in (96, 64, 200)]}.get(kind, [{}])
    calls = [calls[i % len(calls)] for i in range(len(shapes))]
    if kind == "sliding_window" and long_plan.get("min_window_keys"):
        # a long call with a short window: the persistent forward at a length its twin would otherwise take
        shapes.append((1, long_q + 100, long_q, 4, 1))
        calls.append(dict(window=(300, 0)))
    if kind == "chunked":
        # chunks of whole query tiles with a partial last chunk: the persistent order splits each pair's tiles
        # (schedule.chunk_ramp; the calls above have chunks off the tiles, which keep the order without a split)
        split = [((4, 1000, 1000, 16, 4), 384), ((3, 2048, 3584, 12, 12), 1536)]
        shapes += [shape for shape, _ in split]
        calls += [dict(chunk_size=c) for _, c in split]
    for i, (b, s_q, s_k, h, h_kv) in enumerate(shapes):
        if not spec["allow_gqa"]:
            h_kv = h
        kwargs = calls[i]
        plan = op.forward_plan("sm90", s_q, kwargs.get("window"), kwargs.get("chunk_size"))
        long_call = s_q >= long_q
        # windows / chunks: only wide ones (d64's 192-row kernel: LONG_WINDOW_KEYS / LONG_CHUNK_KEYS; a 128-row
        # persistent forward's twin: PERSISTENT_WINDOW_KEYS / PERSISTENT_CHUNK_KEYS)
        if long_call and long_plan.get("min_window_keys"):
            left, right = kwargs.get("window", (spec["mask"].get("left"), spec["mask"].get("right")))
            keys = (kwargs.get("chunk_size", spec["mask"].get("chunk_size")) if kind == "chunked"
                    else float("inf") if min(left, right) < 0 else left + right + 1)
            long_call = keys >= long_plan["min_window_keys"]
        want = ("fwd_sm90_long", long_plan["scheduler"]) if long_call else ("fwd_sm90", "persistent")
        assert (plan["module"], plan["scheduler"]) == want, (s_q, plan["module"], plan["scheduler"])
        if not long_call:
            num_m = -(-s_q // plan["tile_m"])
            work = (num_m + 1) // 2 * h * b if masked else num_m * h * b  # units of two tiles / tiles
            # (masked: more tiles than CTAs, so paired; a long call that a short window or chunk keeps on the
            # persistent forward may have fewer)
            assert work > PERSISTENT_CTAS or s_q >= long_q, (s_q, work)
            if kind == "chunked" and i >= len(shapes) - 2:  # the split calls do split
                from fa4gen.device import schedule

                ramp = schedule.chunk_ramp(kwargs["chunk_size"], s_q, s_k, num_m, h * b, plan["tile_m"])
                assert 0 < ramp < num_m, (s_q, s_k, kwargs, ramp)
        q = torch.randn(b, s_q, h, d, device="cuda", dtype=dtype, generator=gen)
        k = torch.randn(b, s_k, h_kv, d, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(b, s_k, h_kv, dv, device="cuda", dtype=dtype, generator=gen)
        out = torch.full((b, s_q, h, dv), float("nan"), device="cuda", dtype=dtype)
        _poisoned_empty_lse((b, h, s_q))
        with _recording_launches(op) as launched:
            res = pkg.attention(q, k, v, out=out, return_lse=spec["return_lse"], **kwargs)
        torch.cuda.synchronize()
        assert launched == [want[0]], launched
        lse = res[1] if spec["return_lse"] else None
        sem = _semantics(lock, kwargs.get("window"), kwargs.get("chunk_size"))
        _assert_matches(q, k, v, out, lse, spec["softcap"], sem, f"{name} shape={(b, s_q, s_k, h, h_kv)} {kwargs}")


@pytest.mark.parametrize("name", ["vit_encoder", "x_bf16_d64_none_q1"])
def test_rows128_twin_runs_the_lengths_that_pad_192_row_tiles_worst(name):
    """d <= 64 without a mask: calls whose seqlen_q lies in the plan's seqlen_q_ranges (1-128, 193-256; ViT-B/16's
    197 tokens; ViT-L/14-336's 577 runs 192 rows since session 59) run the 128-row persistent twin
    fwd_sm90_rows128, the others the 192-row forward; both against the reference, with more tiles than CTAs,
    partial tiles and s_k != s_q."""
    pkg, lock, spec, dtype, d, dv, gen = _setup(name, 3)
    op = pkg._forward
    (twin,) = op.range_plans["sm90"]
    assert twin["module"] == "fwd_sm90_rows128" and twin["tile_m"] == 128 and op.plans["sm90"]["tile_m"] == 192
    assert [tuple(r) for r in twin["seqlen_q_ranges"]] == [(1, 128), (193, 256)]
    shapes = [(8, 197, 197, 12, 12), (3, 577, 577, 16, 16), (2, 640, 700, 8, 8), (2, 641, 500, 8, 8),
              (16, 100, 300, 8, 8), (64, 1, 64, 4, 4), (4, 512, 512, 8, 8), (4, 192, 150, 8, 8), (4, 193, 193, 8, 8)]
    for b, s_q, s_k, h, h_kv in shapes:
        want = "fwd_sm90_rows128" if any(lo <= s_q <= hi for lo, hi in twin["seqlen_q_ranges"]) else "fwd_sm90"
        q = torch.randn(b, s_q, h, d, device="cuda", dtype=dtype, generator=gen)
        k = torch.randn(b, s_k, h_kv, d, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(b, s_k, h_kv, dv, device="cuda", dtype=dtype, generator=gen)
        out = torch.full((b, s_q, h, dv), float("nan"), device="cuda", dtype=dtype)
        _poisoned_empty_lse((b, h, s_q))
        with _recording_launches(op) as launched:
            res = pkg.attention(q, k, v, out=out, return_lse=spec["return_lse"])
        torch.cuda.synchronize()
        assert launched == [want], (s_q, launched)
        lse = res[1] if spec["return_lse"] else None
        _assert_matches(q, k, v, out, lse, spec["softcap"], _semantics(lock, None, None),
                        f"{name} shape={(b, s_q, s_k, h, h_kv)}")


@pytest.mark.parametrize("name", ["vit_encoder", "llama3_8b", "mistral_7b", "llama32_1b"])
def test_persistent_forward_on_fewer_sms(name):
    """The persistent forward launches one CTA per SM of the call's GPU (the API passes the count): a GPU
    with fewer SMs than an H200 (an H100 PCIe's 114, an H20's 78, a MIG slice's 16 or 1) runs the same kernel
    with fewer CTAs, each striding over more tiles — and, masked, pairing tiles from a smaller tile count on."""
    pkg, lock, spec, dtype, d, dv, gen = _setup(name, 2)
    op = pkg._forward
    index = torch.cuda.current_device()
    sem = _semantics(lock, None, None)
    real_launch, passed = op._launch, []
    op._launch = lambda fn, device, args: passed.append(args[-1]) or real_launch(fn, device, args)
    op._calls.clear()  # (a replayable launch of an earlier test would hold another count)
    try:
        # (16 SMs: 96 tiles of d128, two blocks of units then a tail of 32 tiles; 50 tiles with an odd num_m, all
        # of them tail: four snake rounds, the last partial)
        for sms, (b, s_q, s_k, h, h_kv) in ((114, (2, 700, 900, 8, 2)), (78, (3, 1000, 777, 16, 4)),
                                            (16, (2, 1500, 1500, 4, 1)), (16, (2, 600, 600, 5, 5)),
                                            (1, (1, 333, 500, 4, 4))):
            if not spec["allow_gqa"]:
                h_kv = h
            op._sm_count_by_device[index] = sms
            q = torch.randn(b, s_q, h, d, device="cuda", dtype=dtype, generator=gen)
            k = torch.randn(b, s_k, h_kv, d, device="cuda", dtype=dtype, generator=gen)
            v = torch.randn(b, s_k, h_kv, dv, device="cuda", dtype=dtype, generator=gen)
            out = torch.full((b, s_q, h, dv), float("nan"), device="cuda", dtype=dtype)
            with _recording_launches(op) as launched:
                pkg.attention(q, k, v, out=out)
            torch.cuda.synchronize()
            # (vit_encoder's 600 rows run its 128-row twin, persistent as well)
            plan = op.forward_plan("sm90", s_q)
            assert launched == [plan["module"]] and plan["scheduler"] == "persistent", (launched, plan["module"])
            assert launched[0] in ("fwd_sm90", "fwd_sm90_rows128"), launched
            # the kernel's last run-time argument: its CTA count (a 192-row forward whose idle warpgroups skip a
            # partial last tile: the count coprime to the tiles per sequence, runtime.spread_ctas)
            want = sms
            if plan["skip_idle_warpgroups"] and plan["mask_kind"] == "none":
                want = spread_ctas(sms, s_q, plan["tile_m"], b * h)
            assert passed[-1] == want, (passed, sms, want)
            _assert_matches(q, k, v, out, None, spec["softcap"], sem, f"{name} {sms} SMs shape={(b, s_q, s_k, h, h_kv)}")
    finally:  # (and the replayable launches, which hold the count they ran with)
        del op._launch
        op._sm_count_by_device.pop(index, None)
        op._calls.clear()


@pytest.mark.parametrize("name, dtype", [("llama32_1b", torch.bfloat16), ("x_fp16_d64_window_softcap", torch.float16),
                                         ("x_bf16_d64_chunked_softcap", torch.bfloat16)])
def test_long_calls_run_the_192_row_kernel(name, dtype):
    """A masked d64 spec (tile_m auto) holds two forwards: calls from LONG_SEQLEN_Q query rows on run the
    192-row one (fwd_sm90_long), shorter ones the 128-row one; both against the reference, with seqlen_k on
    both sides of seqlen_q (bottom-right aligned masks), GQA 4:1. A sliding window of fewer than
    LONG_WINDOW_KEYS keys per row (the window spec's own, 341) runs the 128-row persistent forward at every
    length: long calls with it, and with a wider run-time window on the 192-row kernel; so do chunks shorter than
    LONG_CHUNK_KEYS (the chunked spec's own, 96)."""
    from fa4gen.plan.sm90 import LONG_CHUNK_KEYS, LONG_SEQLEN_Q, LONG_WINDOW_KEYS

    pkg = _package(name)
    op = pkg._forward
    lock = json.loads((Path(pkg.__file__).parent / "spec.lock.json").read_text())
    softcap = lock["spec"]["softcap"]
    windowed = lock["spec"]["mask"]["kind"] == "sliding_window"
    chunked = lock["spec"]["mask"]["kind"] == "chunked"
    wide = (LONG_WINDOW_KEYS + 200, 40) if windowed else None  # the 192-row kernel's calls
    wide_chunk = LONG_CHUNK_KEYS + 128 if chunked else None
    gen = torch.Generator(device="cuda").manual_seed(7)
    cases = [(LONG_SEQLEN_Q, LONG_SEQLEN_Q, "fwd_sm90_long", wide), (LONG_SEQLEN_Q + 77, 2500, "fwd_sm90_long", wide),
             (LONG_SEQLEN_Q + 300, LONG_SEQLEN_Q - 5, "fwd_sm90_long", wide), (LONG_SEQLEN_Q - 1, 3000, "fwd_sm90", wide)]
    if windowed:  # the spec's window (300, 40): 341 keys per row
        cases += [(LONG_SEQLEN_Q + 77, 2500, "fwd_sm90", None), (3 * LONG_SEQLEN_Q + 5, 3 * LONG_SEQLEN_Q, "fwd_sm90", None),
                  (2 * LONG_SEQLEN_Q, 2 * LONG_SEQLEN_Q + 9, "fwd_sm90", (LONG_WINDOW_KEYS - 2, 0))]
    chunks = [wide_chunk] * len(cases)
    if chunked:  # the spec's chunk (96 keys), and a run-time one just below the bound, on the 128-row forward
        cases += [(LONG_SEQLEN_Q + 77, 2500, "fwd_sm90", None), (3 * LONG_SEQLEN_Q + 5, 3 * LONG_SEQLEN_Q, "fwd_sm90", None)]
        chunks += [None, LONG_CHUNK_KEYS - 512]
    for (s_q, s_k, module, window), chunk in zip(cases, chunks):
        q = torch.randn(1, s_q, 8, 64, device="cuda", dtype=dtype, generator=gen)
        k = torch.randn(1, s_k, 2, 64, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(1, s_k, 2, 64, device="cuda", dtype=dtype, generator=gen)
        out = torch.full_like(q, float("nan"))
        assert op.forward_plan("sm90", s_q, window, chunk)["module"] == module
        with _recording_launches(op) as launched:
            pkg.attention(q, k, v, out=out, **({"window": window} if window is not None else {}),
                          **({"chunk_size": chunk} if chunk is not None else {}))
        torch.cuda.synchronize()
        assert launched == [module], launched
        _assert_matches(q, k, v, out, None, softcap, _semantics(lock, window, chunk),
                        f"{name} {module} s_q={s_q} s_k={s_k} window={window} chunk={chunk}")

"""Reference stage: exact attention against a literal per-row definition, its mask semantics,
fully masked rows, varlen packing, and the low-precision path that sets the error budget."""

from __future__ import annotations

import math

import pytest
import torch

from fa4gen.reference import attention_ref, attention_ref_varlen, error_budget, mask_semantics, visible


def _rows_by_definition(q, k, v, *, scale, causal=False, window=None, chunk=None, softcap=0.0):
    """Attention one row at a time, straight from the definitions, in fp64 Python loops."""
    b, s_q, h, _ = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    out = torch.zeros(b, s_q, h, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b, h, s_q), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // h_kv)
            for i in range(s_q):
                pos = i + s_k - s_q
                keys = []
                for j in range(s_k):
                    ok = True
                    if causal or chunk:
                        ok &= j <= pos
                    if chunk:
                        ok &= j >= max(pos, 0) // chunk * chunk
                    if window is not None:
                        left, right = window
                        ok &= left is None or left < 0 or j >= pos - left
                        ok &= right is None or right < 0 or j <= pos + right
                    if ok:
                        keys.append(j)
                if not keys:
                    continue
                logits = []
                for j in keys:
                    s = float(q[bi, i, hi].double() @ k[bi, j, kv].double()) * scale
                    logits.append(softcap * math.tanh(s / softcap) if softcap else s)
                top = max(logits)
                w = [math.exp(x - top) for x in logits]
                total = sum(w)
                lse[bi, hi, i] = top + math.log(total)
                for wj, j in zip(w, keys):
                    out[bi, i, hi] += wj / total * v[bi, j, kv].double()
    return out, lse


MASKS = [
    dict(),
    dict(causal=True),
    dict(window=(3, 0)),
    dict(window=(2, 4)),
    dict(window=(-1, 1)),
    dict(window=(None, 0)),
    dict(chunk=5),
    dict(softcap=2.0),
    dict(causal=True, softcap=5.0),
]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()) or "none")
@pytest.mark.parametrize("s_q, s_k", [(7, 7), (5, 11), (11, 5), (1, 9)])
def test_matches_the_definition(mask, s_q, s_k):
    gen = torch.Generator().manual_seed(s_q * 100 + s_k)
    q = torch.randn(2, s_q, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, s_k, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, s_k, 2, 6, generator=gen, dtype=torch.float64)
    out, lse = attention_ref(q, k, v, softmax_scale=0.3, **mask)
    want, want_lse = _rows_by_definition(q, k, v, scale=0.3, **mask)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(lse.isinf(), want_lse.isinf())
    torch.testing.assert_close(lse[~lse.isinf()], want_lse[~want_lse.isinf()], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kw",
    [dict(causal=True), dict(window=(0, 0)), dict(window=(2, 0)), dict(chunk=3), dict(window=(-1, 0))],
)
def test_fully_masked_rows_are_zero_with_lse_minus_inf(kw):
    # seqlen_q > seqlen_k: the first rows sit at negative key positions and see nothing.
    q = torch.randn(1, 9, 2, 8, dtype=torch.bfloat16)
    k = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    v = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    ok = visible(9, 4, **kw)
    empty = ~ok.any(dim=1)
    assert empty.any()
    for upcast in (True, False):
        out, lse = attention_ref(q, k, v, upcast=upcast, **kw)
        assert not out.isnan().any() and not lse.isnan().any()
        assert (out[:, empty] == 0).all()
        assert (lse[:, :, empty] == -math.inf).all()
        assert torch.isfinite(lse[:, :, ~empty]).all()


def test_no_keys_at_all():
    q = torch.randn(2, 5, 2, 8, dtype=torch.float16)
    k = torch.randn(2, 0, 2, 8, dtype=torch.float16)
    out, lse = attention_ref(q, k, k)
    assert out.shape == (2, 5, 2, 8) and (out == 0).all()
    assert lse.shape == (2, 2, 5) and (lse == -math.inf).all()


def test_nan_inputs_are_not_hidden():
    q = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    q[0, 2, 0, 3] = math.nan
    out, _ = attention_ref(q, q, q)
    assert out.isnan().any()


def test_defaults_and_dtypes():
    q = torch.randn(1, 6, 2, 16, dtype=torch.bfloat16)
    out, lse = attention_ref(q, q, q)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64  # exact on the CPU
    out32, _ = attention_ref(q, q, q, dtype=torch.float32)  # the old keyword still works
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), out, rtol=1e-5, atol=1e-6)
    low, low_lse = attention_ref(q, q, q, upcast=False)
    assert low.dtype == torch.bfloat16 and low_lse.dtype == torch.float32
    scaled, _ = attention_ref(q, q, q, softmax_scale=1 / 4)  # the default is head_dim ** -0.5
    torch.testing.assert_close(scaled, out, rtol=0, atol=0)


def test_low_precision_error_is_small_but_not_zero():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 64, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    exact, _ = attention_ref(q, k, v, causal=True)
    low, _ = attention_ref(q, k, v, causal=True, upcast=False)
    budget = error_budget(low, exact)
    assert 1e-4 < budget < 0.1
    assert error_budget(exact.to(torch.bfloat16), exact) < budget  # rounding O alone is inside it
    assert error_budget(low[:, :0], exact[:, :0], atol=3e-5) == 3e-5


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(3, 1)), dict(chunk=4), dict(softcap=3.0)])
def test_varlen_is_attention_per_sequence(kw):
    gen = torch.Generator().manual_seed(1)
    lq, lk = [5, 1, 0, 9], [7, 0, 3, 9]  # an empty query sequence and one with no keys
    q = torch.randn(sum(lq), 4, 8, generator=gen, dtype=torch.float16)
    k = torch.randn(sum(lk), 2, 8, generator=gen, dtype=torch.float16)
    v = torch.randn(sum(lk), 2, 8, generator=gen, dtype=torch.float16)
    out, lse = attention_ref_varlen(q, k, v, _cu(lq), _cu(lk), **kw)
    assert out.shape == (sum(lq), 4, 8) and lse.shape == (4, sum(lq))
    q0 = k0 = 0
    for a, b in zip(lq, lk):
        o, l = attention_ref(q[None, q0:q0 + a], k[None, k0:k0 + b], v[None, k0:k0 + b], **kw)
        torch.testing.assert_close(out[q0:q0 + a], o[0], rtol=0, atol=0)
        torch.testing.assert_close(lse[:, q0:q0 + a], l[0], rtol=0, atol=0)
        q0, k0 = q0 + a, k0 + b
    rows_without_keys = slice(5, 6)  # the second sequence has 1 query and 0 keys
    assert (out[rows_without_keys] == 0).all() and (lse[:, rows_without_keys] == -math.inf).all()


def test_varlen_seqused_k():
    gen = torch.Generator().manual_seed(2)
    lq, lk, used = [4, 6], [8, 8], [3, 0]
    q = torch.randn(sum(lq), 2, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(lk), 2, 8, generator=gen, dtype=torch.float64)
    out, lse = attention_ref_varlen(q, k, k, _cu(lq), _cu(lk), seqused_k=torch.tensor(used), causal=True)
    want, _ = attention_ref(q[None, :4], k[None, :3], k[None, :3], causal=True)
    torch.testing.assert_close(out[:4], want[0])
    assert (out[4:] == 0).all() and (lse[:, 4:] == -math.inf).all()


@pytest.mark.parametrize(
    "cu_q, cu_k, used, message",
    [
        ([0, 5, 3], [0, 4, 8], None, "cu_seqlens_q: must be non-decreasing"),
        ([0, 3, 8], [0, 6, 4], None, "cu_seqlens_k: must be non-decreasing"),
        ([1, 3, 8], [0, 4, 8], None, "cu_seqlens_q: must start at 0"),
        ([0, 3, 7], [0, 4, 8], None, "cu_seqlens_q: last entry must equal the packed length 8"),
        ([0, 8], [0, 4, 8], None, "cu_seqlens_k: expected 2 entries"),
        ([0, 3, 8], [0, 4, 8], [5, 1], "seqused_k: entry 0 must be in [0, 4]"),
        ([0, 3, 8], [0, 4, 8], [1], "seqused_k: expected 2 entries"),
    ],
)
def test_varlen_rejects_bad_cu_seqlens(cu_q, cu_k, used, message):
    q, k = torch.zeros(8, 2, 8), torch.zeros(8, 2, 8)
    seqused = None if used is None else torch.tensor(used)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        attention_ref_varlen(q, k, k, torch.tensor(cu_q), torch.tensor(cu_k), seqused_k=seqused)


def test_mask_semantics_from_plans():
    base = dict(softcap=0.0, causal=False, local=False, chunked=False, window_left=-1, window_right=-1, chunk_size=0)
    assert mask_semantics(base) == dict(softcap=0.0, causal=False)
    assert mask_semantics({**base, "causal": True, "softcap": 30.0}) == dict(softcap=30.0, causal=True)
    local = {**base, "local": True, "window_left": 4095, "window_right": 0}
    assert mask_semantics(local) == dict(softcap=0.0, window=(4095, 0))
    assert mask_semantics(local, window=(37, 5)) == dict(softcap=0.0, window=(37, 5))
    chunked = {**base, "chunked": True, "chunk_size": 8192}
    assert mask_semantics(chunked) == dict(softcap=0.0, chunk=8192)
    assert mask_semantics(chunked, chunk_size=64) == dict(softcap=0.0, chunk=64)

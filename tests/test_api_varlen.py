"""The varlen API without CUDA: a `varlen: true` spec's `attention` takes packed sequences
(flash_attn_varlen_func conventions), and every bad varlen argument is named before anything is
launched (on the CPU the checks run up to "expected a CUDA tensor", which comes after them)."""

from __future__ import annotations

import inspect
import re
import sys

import pytest
import torch

import fa4gen
from fa4gen.api.runtime import Packed

SPEC = {"name": "varlen_probe", "targets": ["sm90"], "dtype": "bf16", "head_dim": 64, "varlen": True,
        "return_lse": True, "mask": {"kind": "causal"}}


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    before = set(sys.modules)
    mp = pytest.MonkeyPatch()
    mp.setenv("FA4GEN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield fa4gen.build(dict(SPEC))
    mp.undo()
    for mod in set(sys.modules) - before:
        if mod.startswith("fa4gen_pkg_"):
            del sys.modules[mod]


def _packed(tq=10, tk=12, h=4, h_kv=2, d=64, dtype=torch.bfloat16):
    return (torch.zeros(tq, h, d, dtype=dtype), torch.zeros(tk, h_kv, d, dtype=dtype),
            torch.zeros(tk, h_kv, d, dtype=dtype))


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


GOOD = dict(cu_seqlens_q=_i32([0, 4, 10]), cu_seqlens_k=_i32([0, 6, 12]))


def test_signature_has_the_varlen_arguments(pkg):
    params = inspect.signature(pkg.attention).parameters
    assert list(params) == ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "seqused_k",
                            "max_seqlen_k", "softmax_scale", "return_lse", "out"]
    assert all(params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in list(params)[3:])
    assert pkg._forward.plans["sm90"]["varlen"] is True
    assert "flash_attn_varlen_func" in pkg.attention.__doc__


def test_a_well_formed_call_reaches_the_device_check(pkg):
    with pytest.raises(ValueError, match="^q: expected a CUDA tensor"):
        pkg.attention(*_packed(), **GOOD, max_seqlen_q=6)


BAD = [
    (dict(), lambda: _packed(), "cu_seqlens_q: spec varlen_probe is varlen: pass cu_seqlens_q and cu_seqlens_k"),
    (dict(cu_seqlens_q=_i32([0, 10])), lambda: _packed(), "cu_seqlens_k: spec varlen_probe is varlen"),
    (dict(GOOD), lambda: tuple(t[None] for t in _packed()), "q: expected 3 dims (total, heads, head_dim)"),
    (dict(cu_seqlens_q=[0, 4, 10], cu_seqlens_k=GOOD["cu_seqlens_k"]), _packed, "cu_seqlens_q: expected a torch.Tensor"),
    (dict(cu_seqlens_q=GOOD["cu_seqlens_q"].long(), cu_seqlens_k=GOOD["cu_seqlens_k"]), _packed,
     "cu_seqlens_q: expected a 1-D int32 tensor"),
    (dict(cu_seqlens_q=_i32([[0, 10]]), cu_seqlens_k=GOOD["cu_seqlens_k"]), _packed,
     "cu_seqlens_q: expected a 1-D int32 tensor"),
    (dict(cu_seqlens_q=_i32([0]), cu_seqlens_k=_i32([0])), _packed, "cu_seqlens_q: expected batch + 1 >= 2"),
    (dict(cu_seqlens_q=GOOD["cu_seqlens_q"], cu_seqlens_k=_i32([0, 12])), _packed,
     "cu_seqlens_k: expected 3 entries like cu_seqlens_q"),
    (dict(GOOD, seqused_k=_i32([1, 2, 3])), _packed, "seqused_k: expected 2 entries"),
    (dict(GOOD, max_seqlen_q=-1), _packed, "max_seqlen_q: expected None or an int"),
    (dict(GOOD, max_seqlen_q=True), _packed, "max_seqlen_q: expected None or an int"),
    (dict(GOOD), lambda: (_packed()[0], _packed()[1], _packed(tk=11)[2]), "v: expected total_k 12 rows like k"),
    (dict(GOOD), lambda: (_packed(h=3)[0],) + _packed()[1:], "k: kv heads (2) must divide q heads (3)"),
    (dict(GOOD, out=torch.zeros(10, 4, 32, dtype=torch.bfloat16)), _packed, "out: expected shape (10, 4, 64)"),
]


@pytest.mark.parametrize("kwargs, tensors, message", BAD)
def test_bad_varlen_arguments_are_named(pkg, kwargs, tensors, message):
    with pytest.raises((ValueError, TypeError), match="^" + re.escape(message)):
        pkg.attention(*tensors(), **kwargs)


def test_a_batched_spec_refuses_varlen_arguments():
    with pytest.raises(ValueError, match="^cu_seqlens_q: spec x was built without varlen"):
        Packed.check("x", False, _i32([0, 1]), None, None, None)
    with pytest.raises(ValueError, match="^seqused_k: spec x was built without varlen"):
        Packed.check("x", False, None, None, None, _i32([1]))


def test_resolve_checks_values_and_takes_the_longest_sequence():
    p = Packed.check("x", True, _i32([0, 4, 4, 10]), _i32([0, 6, 6, 12]), None, _i32([6, 0, 3]))
    p.resolve(10, 12)
    assert p.max_seqlen_q == 6
    given = Packed.check("x", True, _i32([0, 4, 10]), _i32([0, 6, 12]), 3, None)
    given.resolve(999, 999)  # the caller vouches: no read-back, no check
    assert given.max_seqlen_q == 3
    for cu_q, cu_k, used, message in [
        ([0, 4, 9], [0, 6, 12], None, "cu_seqlens_q: last entry must equal the packed length 10"),
        ([0, 6, 4, 10], [0, 6, 6, 12], None, "cu_seqlens_q: must be non-decreasing"),
        ([0, 4, 10], [1, 6, 12], None, "cu_seqlens_k: must start at 0"),
        ([0, 4, 10], [0, 6, 12], [7, 1], "seqused_k: entry 0 must be in [0, 6]"),
    ]:
        p = Packed.check("x", True, _i32(cu_q), _i32(cu_k), None, None if used is None else _i32(used))
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            p.resolve(10, 12)


def test_backward_launches_the_callers_sequence_tensors():
    """With max_seqlen_q the forward takes the sequence tensors unchecked (no device sync, as
    flash_attn_varlen_func); its kernels clamp each sequence into the packed tensors, which overlapping
    or negative entries survive. The backward numbers every sequence's tiles back to back into buffers of
    ceil(total / tile) + batch tiles, which such values would overrun: its kernels read them monotone
    (tests/test_varlen_schedule.py checks that reading against the buffers), so the runtime launches the
    caller's tensors as they are, checked or not — no sanitised copy (three torch operations per backward)."""
    total = 1024
    for values in ([0, 1024, 0, 1024], [5, 3, 2000, -1], [0, 100, 100, 1024]):
        p = Packed.check("x", True, _i32(values), _i32(values), 1024, None)
        p.resolve(total, total)  # the caller vouched: nothing read back
        assert not p.checked
        cu_q, cu_k, used = p.backward_tensors()
        assert cu_q is p.cu_q and cu_k is p.cu_k and used is cu_k  # no seqused_k: cu_seqlens_k stands in, unread
        assert cu_q.tolist() == values
    ok = [0, 100, 100, 1024]
    p = Packed.check("x", True, _i32(ok), _i32(ok), 1024, _i32([3, 0, 9]))
    assert p.backward_tensors()[2].tolist() == [3, 0, 9]
    p = Packed.check("x", True, _i32(ok), _i32(ok), None, None)
    p.resolve(total, total)
    assert p.checked and p.backward_tensors()[0] is p.cu_q


def test_postprocess_spare_tiles_zero_every_padding_row_once():
    """The backward allocates its gradients uninitialised; rows after the last sequence (unchecked values
    with padding) are zeroed by ConvertChunks' spare tiles (fa4gen/device/sm90.py): a tile is spare when
    tile_of puts it past the last sequence's end, spare j of `grid - owned` zeroes tile_m-row blocks j,
    j + spares, ... from that end. Over monotone sequence values (what the backward launches), every grid of
    ceil(total / tile_m) + batch tiles has a spare tile, and the spares cover the padding exactly once; values
    that are not (unchecked: overlapping, past the end) too, the padding then starting where the kernel's
    monotone reading ends them (`query_tile_sequence`, `monotone_end`)."""
    import random

    from fa4gen.emulate.tiling import monotone_end, query_tile_sequence, sequence_bounds, tile_of, tiles_before

    rng = random.Random(5)
    for _ in range(300):
        tile_m = rng.choice([64, 80, 128])
        batch = rng.randint(1, 40)
        lengths = [rng.choice([0, 1, tile_m - 1, tile_m, tile_m + 1, rng.randint(0, 700)]) for _ in range(batch)]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        total = cu[-1] + rng.choice([0, 1, tile_m - 1, tile_m, 3 * tile_m + 5, rng.randint(0, 2000)])
        grid = -(-total // tile_m) + batch
        owned = tiles_before(cu, batch, total, tile_m)
        zeroed = []
        for tile in range(grid):
            seq, m_block = tile_of(cu, batch, total, tile, tile_m, False)
            offset, seqlen = sequence_bounds(cu, seq, total)
            spare = m_block * tile_m >= seqlen
            assert spare == (tile >= owned), (cu, total, tile)
            if spare:
                j, spares = tile - owned, grid - owned
                for r0 in range(offset + seqlen + j * tile_m, total, spares * tile_m):
                    zeroed += [r for r in range(r0, r0 + tile_m) if r < total]
        assert grid > owned, (cu, total)
        assert sorted(zeroed) == list(range(cu[-1], total)), (cu, total)
        # the same, as the kernel reads the caller's values (valid ones as they are; others monotone)
        raw = cu if rng.random() < 0.5 else [rng.randint(-5, total + 50) for _ in cu]
        end = monotone_end(raw, batch, total)
        zeroed_raw = []
        owned = query_tile_sequence(raw, batch, total, 0, tile_m)[2]
        for tile in range(grid):
            _, _, _, offset, seqlen = query_tile_sequence(raw, batch, total, tile, tile_m)
            if tile >= owned:
                assert offset + seqlen == end
                j, spares = tile - owned, grid - owned
                for r0 in range(end + j * tile_m, total, spares * tile_m):
                    zeroed_raw += [r for r in range(r0, r0 + tile_m) if r < total]
        assert sorted(zeroed_raw) == list(range(end, total)), (raw, total)


def _recording(pkg, monkeypatch):
    """The package's launches recorded (device checks and arch stubbed, the kernel a no-op on CPU tensors), and
    its full checks (validate) counted."""
    op, seen = pkg._forward, {"validate": 0, "launches": []}
    validate = op.validate

    def counted(*a, **kw):
        seen["validate"] += 1
        return validate(*a, **kw)

    monkeypatch.setattr(op, "_check_devices", lambda device, named: None)
    monkeypatch.setattr(op, "arch_for", lambda device: "sm90")
    monkeypatch.setattr(op, "validate", counted)
    monkeypatch.setattr(op, "function", lambda plan: plan["module"])
    monkeypatch.setattr(op, "_launch", lambda fn, device, args: seen["launches"].append((fn, list(args))))
    return seen


def _same_launch(a, b) -> bool:
    """Two recorded launches pass the same kernel, tensors of the same shapes, strides and dtypes (the inputs
    and sequence tensors the same storage) and the same run-time arguments."""
    (fa, xs), (fb, ys) = a, b
    if fa != fb or len(xs) != len(ys):
        return False
    for x, y in zip(xs, ys):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if (x.shape, x.stride(), x.dtype) != (y.shape, y.stride(), y.dtype):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def test_a_repeated_unchecked_packed_call_replays_the_launch(pkg, monkeypatch):
    """Packed calls whose values the caller vouches for (max_seqlen_q given, no read-back) take the signature
    cache as batched ones do (ForwardOp._replay): the second call of a signature skips every check and
    launches exactly what the full path launched (the inputs and the call's own sequence tensors, one batch of
    extent 1), and anything the checks depend on — the sequence tensors' shapes, dtypes, the maxima, seqused_k,
    an input's shape — misses it. Calls without max_seqlen_q (their values checked every call) and
    non-contiguous sequence tensors (launched as copies) never use it; a bad sequence tensor is still named."""
    seen = _recording(pkg, monkeypatch)
    q, k, v = _packed()
    kw = dict(GOOD, max_seqlen_q=6)
    out, lse = pkg.attention(q, k, v, return_lse=True, **kw)
    assert seen["validate"] == 1 and len(pkg._forward._calls) == 1
    # new sequence values of the same shape, new inputs: the replay launches the call's own tensors
    cu_q, cu_k = _i32([0, 3, 10]), _i32([0, 7, 12])
    q2, k2, v2 = _packed()
    out2, lse2 = pkg.attention(q2, k2, v2, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6)
    assert seen["validate"] == 1
    first, again = seen["launches"]
    assert _same_launch(first, again)
    tensors = again[1]
    assert [t.data_ptr() for t in tensors[:3]] == [t.data_ptr() for t in (q2, k2, v2)]
    assert tensors[3].data_ptr() == out2.data_ptr() and tensors[4].data_ptr() == lse2.data_ptr()
    assert tensors[5] is cu_q and tensors[6] is cu_k and tensors[7] is cu_k  # no seqused_k: cu_k stands in
    assert out2.shape == out.shape and lse2.shape == lse.shape and out2.data_ptr() != out.data_ptr()
    # without return_lse: its own key; then the scratch LSE
    pkg.attention(q, k, v, **kw)
    pkg.attention(q, k, v, **kw)
    assert seen["validate"] == 2
    # what the checks depend on changes: the full path again
    misses = [
        dict(GOOD, max_seqlen_q=7),
        dict(GOOD, max_seqlen_q=6, max_seqlen_k=12),
        dict(cu_seqlens_q=_i32([0, 4, 8, 10]), cu_seqlens_k=_i32([0, 6, 9, 12]), max_seqlen_q=6),
        dict(GOOD, max_seqlen_q=6, seqused_k=_i32([5, 6])),
    ]
    for i, m in enumerate(misses):
        pkg.attention(q, k, v, return_lse=True, **m)
        assert seen["validate"] == 3 + i, m
    pkg.attention(*_packed(tq=11), return_lse=True, **kw)
    assert seen["validate"] == 7
    # a bad value of a cached signature's type is still refused by name: True is not an int here
    with pytest.raises(ValueError, match="^max_seqlen_q: expected None or an int"):
        pkg.attention(q, k, v, return_lse=True, **dict(GOOD, max_seqlen_q=True))
    with pytest.raises(TypeError, match="^cu_seqlens_q: expected a 1-D int32 tensor"):
        pkg.attention(q, k, v, return_lse=True, cu_seqlens_q=GOOD["cu_seqlens_q"].long(),
                      cu_seqlens_k=GOOD["cu_seqlens_k"], max_seqlen_q=6)
    # checked calls (values read back every call) and strided sequence tensors: the full path every time
    n = seen["validate"]
    for _ in range(2):
        pkg.attention(q, k, v, return_lse=True, **GOOD)
    strided = _i32([0, 9, 4, 9, 10, 9])[::2]
    for _ in range(2):
        pkg.attention(q, k, v, return_lse=True, cu_seqlens_q=strided, cu_seqlens_k=GOOD["cu_seqlens_k"],
                      max_seqlen_q=6)
    assert seen["validate"] == n + 4


def test_a_repeated_packed_training_call_skips_the_checks(tmp_path, monkeypatch):
    """A packed call that records autograd, with max_seqlen_q given, keeps its checks' verdict per signature
    (ForwardOp._grad_calls): the second call goes straight to AttentionFunction with the Packed that
    Packed.check would have made (the call's own tensors and maxima, unresolved); a refused call (grad without a
    backward) is refused every time."""
    from fa4gen.api import runtime

    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path / "cache"))
    train = fa4gen.build(dict(SPEC, name="varlen_probe_bwd", backward=True))
    op = train._forward
    seen = _recording(train, monkeypatch)
    applied = []

    def fake_apply(op_, q, k, v, scale, window, chunk_size, packed):
        applied.append((scale, packed))
        return torch.zeros(q.shape[0], q.shape[1], 64), torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(runtime.AttentionFunction, "apply", fake_apply)
    q, k, v = (t.requires_grad_() for t in _packed())
    for cu_q in (GOOD["cu_seqlens_q"], _i32([0, 2, 10])):
        train.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=GOOD["cu_seqlens_k"], max_seqlen_q=8)
    assert seen["validate"] == 1 and len(op._grad_calls) == 1
    (s1, p1), (s2, p2) = applied
    assert s1 == s2 == pytest.approx(64 ** -0.5)
    assert p2.cu_q.tolist() == [0, 2, 10] and p2.cu_k is GOOD["cu_seqlens_k"] and p2.seqused_k is None
    assert (p2.max_seqlen_q, p2.max_seqlen_k, p2.checked) == (8, None, False) == (p1.max_seqlen_q, None, p1.checked)
    # no backward in the spec: refused by name on every call, never kept
    probe = fa4gen.build(dict(SPEC))
    seen = _recording(probe, monkeypatch)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="requires grad but this spec has no backward"):
            probe.attention(q, k, v, **GOOD, max_seqlen_q=8)
    assert seen["validate"] == 2 and not probe._forward._grad_calls

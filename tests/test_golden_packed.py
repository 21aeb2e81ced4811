"""Golden checks of `varlen: true` variants on the CPU (fa4gen.golden.packed): each case becomes a
packed batch of mixed-length sequences; the emulator and the reference run per sequence; the
forward's and the backward's GPU check logic runs against CPU stand-ins for the package (a correct
one passes, a broken one fails), as tests/test_golden_cli.py does for batched backward variants. The GPU side is the same code
with the real package (`fa4gen test` on a Hopper GPU)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

import fa4gen
from fa4gen.emulate import Algorithm, emulate_forward
from fa4gen.golden import emulator_vs_reference, kernel_numerics, load_variant, packed
from fa4gen.golden.backward import backward_numerics
from fa4gen.reference import attention_ref, attention_ref_varlen, mask_semantics

SPEC = {"name": "golden_packed_probe", "targets": ["sm90"], "dtype": "bf16", "head_dim": 64, "varlen": True,
        "backward": True, "deterministic": True, "mask": {"kind": "sliding_window", "left": 50, "right": 0}}


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    before = set(sys.modules)
    root = tmp_path_factory.mktemp("packed")
    mp = pytest.MonkeyPatch()
    mp.setenv("FA4GEN_CACHE_DIR", str(root / "cache"))
    pkg = fa4gen.build(dict(SPEC), out_dir=root / "pkgs")
    yield load_variant(root / "pkgs" / pkg.__name__.split(".")[-1])
    mp.undo()
    for mod in set(sys.modules) - before:
        if mod.startswith("fa4gen_pkg_") or mod.startswith("golden_packed"):
            del sys.modules[mod]


def _plans(variant):
    return {p["direction"]: p for p in variant.plans}


@pytest.mark.parametrize("shape", [(1, 300, 257, 6, 1), (3, 1, 1, 2, 2), (2, 113, 203, 4, 2)])
def test_packed_cases_are_mixed_length_sequences(variant, shape):
    plan = _plans(variant)["fwd"]
    lens_q, lens_k = packed.packed_lengths(shape)
    assert len(lens_q) == len(lens_k) == shape[0] + 1 and min(lens_q + lens_k) >= 1
    assert lens_q[0] == shape[1] and lens_k[0] == shape[2]
    q, k, v, seq = packed.case_inputs(plan, shape, seed=1)
    assert q.shape == (sum(lens_q), shape[3], 64) and k.shape == v.shape == (sum(lens_k), shape[4], 64)
    assert seq["cu_seqlens_q"].tolist()[-1] == sum(lens_q) and seq["cu_seqlens_k"].dtype == torch.int32
    assert packed.lse_shape(q, seq) == (shape[3], sum(lens_q))
    batched = dict(plan, varlen=False)
    bq, _, _, bseq = packed.case_inputs(batched, shape, seed=1)
    assert bseq == {} and bq.shape == (shape[0], shape[1], shape[3], 64)


def test_packed_emulator_and_reference_are_per_sequence(variant):
    plan = _plans(variant)["fwd"]
    algo = Algorithm.from_plan(plan)
    q, k, v, seq = packed.case_inputs(plan, (2, 113, 203, 4, 2), seed=3)
    out, lse = packed.emulate(q, k, v, algo, seq)
    ref, ref_lse = packed.reference(q, k, v, seq, **mask_semantics(plan))
    cq, ck = seq["cu_seqlens_q"].tolist(), seq["cu_seqlens_k"].tolist()
    for i in range(len(cq) - 1):
        qs, ks, vs = q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]], v[None, ck[i]:ck[i + 1]]
        o, l_ = emulate_forward(qs, ks, vs, algo)
        assert torch.equal(out[cq[i]:cq[i + 1]], o[0]) and torch.equal(lse[:, cq[i]:cq[i + 1]], l_[0])
        r, _ = attention_ref(qs, ks, vs, **mask_semantics(plan))
        assert torch.equal(ref[cq[i]:cq[i + 1]], r[0])
    assert ref_lse.shape == lse.shape


def test_emulator_check_runs_packed(variant):
    row = emulator_vs_reference(variant, _plans(variant)["fwd"])
    assert row.status == "pass", row.detail
    assert row.detail.startswith("14 cases")  # 7 shapes x (the spec's window, a run-time one)


def _stand_in(plan, *, forget_window=False):
    """The varlen package's attention() on the CPU: the low-precision per-sequence reference, through
    autograd (inside the budget by construction), or with the window forgotten (outside it)."""

    def attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, return_lse=False, window=None, chunk_size=None):
        sem = mask_semantics(plan, window=window, chunk_size=chunk_size)
        if forget_window:
            sem = dict(softcap=sem["softcap"])
        out, lse = attention_ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, upcast=False, **sem)
        return (out, lse) if return_lse else out

    return SimpleNamespace(attention=attention)


def test_backward_check_runs_packed_and_catches_a_wrong_mask(variant):
    plan = _plans(variant)["bwd"]
    variant._module = _stand_in(plan)
    grads, repeat = backward_numerics(variant, plan, device="cpu", shapes=[(1, 113, 203, 4, 2), (3, 1, 1, 2, 2)],
                                      repeat_shape=(1, 70, 90, 2, 1))
    assert grads.status == "pass", grads.detail
    assert repeat.status == "pass", repeat.detail
    variant._module = _stand_in(plan, forget_window=True)
    (grads, _) = backward_numerics(variant, plan, device="cpu", shapes=[(1, 113, 203, 4, 2)],
                                   repeat_shape=(1, 70, 90, 2, 1))
    assert grads.failed and "budget" in grads.detail


def _forward_stand_in(plan, *, drop_last_row=False):
    """The varlen package's forward on the CPU: the emulator of its own plan, written into `out=` (so
    kernel vs emulator is bit-exact and kernel vs reference is inside the budget), or with the packed
    output's last row left unwritten (NaN, as a kernel that stops at a sequence boundary would)."""
    algo = Algorithm.from_plan(plan)

    def attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, out, return_lse=False, window=None, chunk_size=None):
        kw = {k_: v_ for k_, v_ in (("window", window), ("chunk_size", chunk_size)) if v_ is not None}
        emu, lse = packed.emulate(q, k, v, algo, dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k), **kw)
        out.copy_(emu)
        if drop_last_row:
            out[-1] = float("nan")
        return (out, lse) if return_lse else out

    return SimpleNamespace(attention=attention)


def test_forward_kernel_check_runs_packed_and_catches_an_unwritten_row(variant):
    plan = _plans(variant)["fwd"]
    shapes = [(1, 113, 203, 4, 2), (3, 1, 1, 2, 2)]
    variant._module = _forward_stand_in(plan)
    ref, emu, emu_ref = kernel_numerics(variant, plan, shapes=shapes, device="cpu")
    assert (ref.status, emu.status, emu_ref.status) == ("pass", "pass", "pass"), (ref.detail, emu.detail)
    assert ref.detail.startswith("4 cases")  # 2 shapes x (the spec's window, a run-time one)
    variant._module = _forward_stand_in(plan, drop_last_row=True)
    ref, _, _ = kernel_numerics(variant, plan, shapes=shapes, device="cpu")
    assert ref.failed and "NaN" in ref.detail

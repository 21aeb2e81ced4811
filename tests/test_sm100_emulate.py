"""Algorithm choices of the SM100 plans, emulated on the CPU against exact attention.

The SM100 forward computes, per row, what fa4gen.emulate models for the SM90 forward with the same
plan fields: a CTA's rows (tile_m = 128 x Q tiles) visit the CTA's key blocks (tile_n wide) last
first; masks, the online softmax with its rescale threshold and the poly-exp columns come from the
same shared helpers; P is rounded to the input dtype before P·V; O / l and the LSE at the end. A Q
tile only masks the blocks its own 128 rows need, which leaves every value as masking the whole CTA
tile would. The poly-exp columns agree too: in both fragment layouts a thread's column c of its
(row, col) view is tile column 2q + (c % 2) + 8 (c // 2) for its quad lane q (checked below against
fa4gen.emulate.tiling and, for the 16x256b fragment, in tests/test_sm100_layouts.py).

fa4gen.emulate refuses sm100 plans by name (it is written for the SM90 kernel), so the algorithm is
built here from the plan's fields; the comparison uses fa4gen.golden's cases and tolerances.
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib

import pytest

torch = pytest.importorskip("torch")

from fa4gen.emulate import Algorithm, emulate_forward  # noqa: E402
from fa4gen.emulate import tiling  # noqa: E402
from fa4gen.golden import tolerance  # noqa: E402
from fa4gen.golden.checks import CASE_SHAPES, cases, make_inputs  # noqa: E402
from fa4gen.plan import plan_kernels  # noqa: E402
from fa4gen.reference import attention_ref, mask_semantics  # noqa: E402
from fa4gen.spec import spec_from_dict  # noqa: E402

SPECS = [
    dict(head_dim=hd, head_dim_v=hv, mask=mask, pipeline=pipe, softcap=cap)
    for (hd, hv), mask, (pipe, cap) in itertools.product(
        [(64, 64), (128, 128), (192, 128), (256, 256)],
        [{"kind": "none"}, {"kind": "causal"}, {"kind": "sliding_window", "left": 100, "right": 0},
         {"kind": "chunked", "chunk_size": 256}],
        [({}, 0.0), ({"poly_exp": {"share": 0.15, "degree": 3}}, 30.0), ({"rescale_threshold": 0.0}, 0.0)],
    )
]


def _algorithm(plan) -> Algorithm:
    fields = {f.name for f in dataclasses.fields(Algorithm)}
    values = {k: getattr(plan, k) for k in fields if k not in ("arch", "dtype")}
    values["poly_coeffs"] = tuple(float(c) for c in plan.poly_coeffs)
    return Algorithm(arch=plan.arch, dtype=getattr(torch, plan.torch_dtype), **values)


@pytest.mark.parametrize("d", SPECS, ids=lambda d: f"d{d['head_dim']}_{d['head_dim_v']}_{d['mask']['kind']}_{len(d['pipeline'])}")
def test_sm100_plan_algorithm_matches_exact_attention(d):
    spec = spec_from_dict({"name": "emu", "targets": ["sm100"], "dtype": "bf16", "return_lse": True, **d})
    (plan,) = plan_kernels(spec, "sm100")
    algo = _algorithm(plan)
    assert algo.tile_m == 128 * plan.q_tiles and algo.tile_n == plan.tile_n
    lock_plan = plan.to_dict()
    for case in cases(lock_plan, CASE_SHAPES[:4]):
        seed = zlib.crc32(repr((d, case)).encode())
        q, k, v = make_inputs(lock_plan, case, seed=seed)
        out, lse = emulate_forward(q, k, v, algo, **case.kwargs())
        sem = mask_semantics(lock_plan, window=case.window, chunk_size=case.chunk_size)
        exact, exact_lse = attention_ref(q, k, v, **sem)
        low, _ = attention_ref(q, k, v, upcast=False, **sem)
        assert tolerance.against_reference(out, exact, low).ok, case
        assert tolerance.lse_against_reference(lse, exact_lse).ok, case


@pytest.mark.parametrize("tile_n", [64, 128])
def test_poly_columns_are_the_16x256b_view_columns(tile_n):
    """Column c of a thread's (row, col) view in the 16x256b fragment (c = bit + 2 R + 8 CB, tile column
    2q + bit + 8 R + 32 CB) maps to the same view index as in the WGMMA fragment the emulator models."""
    for q in range(4):
        for cb in range(tile_n // 32):
            for r in range(4):
                for bit in range(2):
                    col = 2 * q + bit + 8 * r + 32 * cb
                    assert tiling.fragment_column(col) == bit + 2 * r + 8 * cb

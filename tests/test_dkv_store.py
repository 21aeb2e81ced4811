"""Device layouts, sm90 backward: the MHA dK/dV tiles go from the consumers' fp32 accumulators to shared
memory (then a TMA store) — by stmatrix 16 columns at a time where each warpgroup's half of the head dim
is a whole number of those tiles, else value by value at the fragment's coordinates
(`plan.dkv_elementwise`, head dims 144/176/208/240: the stmatrix tiles ran past the (64, d) tile there,
session 12). The value-by-value store is right only if the two warpgroups' accumulator fragments cover
the (tile_n, head_dim) tile exactly once; traced here for all 256 threads on the CPU (static layouts).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.compile
cute = pytest.importorskip("cutlass.cute")

import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass import BFloat16, Float32  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode  # noqa: E402

from fa4gen.compile.aot import target_arch  # noqa: E402
from fa4gen.plan import plan_kernels  # noqa: E402
from fa4gen.spec import spec_from_dict  # noqa: E402

ODD = (144, 176, 208, 240)


def _bwd_plan(d: int, gqa: bool = False, mask: str = "none"):
    spec = dict(name="dkv", targets=["sm90"], dtype="bf16", head_dim=d, mask={"kind": mask}, allow_gqa=gqa,
                backward=True)
    # (with allow_gqa the GQA kernel, not its MHA-call twin)
    return next(p for p in plan_kernels(spec_from_dict(spec), "sm90") if p.direction == "bwd" and not p.mha_only)


@pytest.mark.parametrize("d", range(16, 257, 16))
def test_elementwise_store_exactly_where_stmatrix_does_not_fit(d):
    plan = _bwd_plan(d)
    fits = plan.tile_n != 64 or (d // 2) % 16 == 0 or plan.dkv_transposed
    assert plan.dkv_elementwise == (not fits), d
    assert plan.dkv_elementwise == (d in ODD), d
    assert not _bwd_plan(d, gqa=True).dkv_elementwise  # GQA: fp32 accumulators, no stmatrix


def _trace(d: int, tile_n: int, seen: list) -> None:
    """Every thread's accumulator coordinates in the template's dK GEMM at tile_n 64: two warpgroups side
    by side over the head dim (DKV_ATOMS (1, 2, 1)), each (64, d / 2)."""
    mma = sm90_utils.make_trivial_tiled_mma(
        BFloat16, BFloat16, OperandMajorMode.MN, OperandMajorMode.MN, Float32, (1, 2, 1), (64, d // 2)
    )
    for tid in range(256):
        part = mma.get_slice(tid).partition_C(cute.make_identity_tensor((tile_n, d)))
        seen.extend(tuple(int(x) for x in part[i]) for i in range(cute.size(part)))


@pytest.mark.parametrize("d", ODD)
def test_fragments_cover_the_dkv_tile_once(d):
    plan = _bwd_plan(d, mask="causal")
    assert (plan.tile_n, plan.dkv_elementwise) == (64, True)
    seen: list = []

    @cute.jit
    def host():
        _trace(d, plan.tile_n, seen)

    with target_arch("sm_90a"):
        cute.compile(host)
    assert len(seen) == plan.tile_n * d
    assert set(seen) == {(r, c) for r in range(plan.tile_n) for c in range(d)}

"""Device helpers, sm90: the backward's fragment-order dQ chunks, checked thread by thread on the CPU.

The consumer warpgroups store their dQ accumulators as flat chunks (`sm90.chunk_copy`), the dQ warp adds
chunks into global memory as they are, and `sm90.ConvertChunks` puts every value back at its (row,
column). That is right only if, for every thread and accumulator element i:
  * the chunk view sends element i of thread t to float 512 (i // 4) + 4 t + i % 4 (128-bit stores,
    consecutive lanes on consecutive 16 bytes), the order the postprocess reads back;
  * the coordinate of element i in the two-warpgroup dQ GEMM the main kernel runs (atoms and DQ_N from
    `sm90.dq_split`) equals the coordinate the postprocess gives it: the one-warpgroup (64, DQ_N)
    fragment's, shifted by `sm90.chunk_origin` of the thread's warpgroup;
  * `sm90.chunk_position` puts element (r, c) of a chunk where the GEMM computed it — transposed back
    for dQᵀ (80-row tiles: head-dim rows, query columns) — inside the (tile_m, head_dim) tile;
  * a warpgroup's chunk covers its (64, DQ_N) share exactly once.
The layouts are static, so tracing on the CPU evaluates every coordinate exactly (sampled threads: all
of warp 0 and of the last warp, and every 5th thread).
"""

from __future__ import annotations

import itertools

import pytest

pytestmark = pytest.mark.compile
cute = pytest.importorskip("cutlass.cute")

import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass import BFloat16, Float32  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode  # noqa: E402

from fa4gen.compile.aot import target_arch  # noqa: E402
from fa4gen.device import sm90  # noqa: E402

THREADS = sorted(set(range(32)) | set(range(224, 256)) | set(range(0, 256, 5)))


def _coords(part):
    return [tuple(int(x) for x in part[i]) for i in range(cute.size(part))]


def _check(head_dim: int, tile_m: int, seen: dict):
    atoms, dq_n = sm90.dq_split(head_dim, tile_m)
    mma = lambda a, n: sm90_utils.make_trivial_tiled_mma(  # noqa: E731
        BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32, a, (64, n)
    )
    two, one = mma(atoms, dq_n), mma((1, 1, 1), dq_n)
    chunk = cute.make_identity_tensor((64 * dq_n,))
    for tid in THREADS:
        w, t = tid // 128, tid % 128
        out_tile = (head_dim, tile_m) if sm90.dq_transposed(tile_m) else (tile_m, head_dim)
        main = _coords(two.get_slice(tid).partition_C(cute.make_identity_tensor(out_tile)))
        post = _coords(one.get_slice(t).partition_C(cute.make_identity_tensor((64, dq_n))))
        r0, c0 = sm90.chunk_origin(w, tile_m, dq_n)
        assert len(main) == len(post) == 64 * dq_n // 128
        assert main == [(r + r0, c + c0) for r, c in post], (head_dim, tile_m, tid)
        view = sm90.chunk_view(chunk, t)
        offsets = [int(view[i][0] if isinstance(view[i], tuple) else view[i]) for i in range(cute.size(view))]
        assert offsets == [512 * (i // 4) + 4 * t + i % 4 for i in range(len(post))], (head_dim, tile_m, tid)
        positions = [tuple(int(x) for x in sm90.chunk_position(w, r, c, tile_m, dq_n)) for r, c in post]
        assert all(0 <= q < tile_m and 0 <= col < head_dim for q, col in positions)
        # dQ's (query, column) is the GEMM output's coordinate, transposed back for dQᵀ
        assert positions == [(c, r) if sm90.dq_transposed(tile_m) else (r, c) for r, c in main]
        seen[(head_dim, tile_m, w)].update(zip(offsets, positions))


def _planned_pairs() -> list[tuple[int, int]]:
    """Every (head dim, tile_m) the sm90 planner gives a backward: head dims 16-256 in steps of 16 and
    (192, 128), each mask class, softcap, GQA, the Sᵀ switch."""
    from fa4gen.plan import PlanError, plan_kernels
    from fa4gen.spec import spec_from_dict

    dims = [(d, d) for d in range(16, 257, 16)] + [(192, 128)]
    masks = [{"kind": "none"}, {"kind": "causal"}, {"kind": "sliding_window", "left": 64, "right": 0}]
    pairs = set()
    for (d, dv), mask, softcap, gqa, swap in itertools.product(dims, masks, (0.0, 20.0), (False, True),
                                                               ("auto", True, False)):
        spec = dict(name="pp", targets=["sm90"], dtype="bf16", head_dim=d, head_dim_v=dv, mask=mask,
                    softcap=softcap, allow_gqa=gqa, backward=True, pipeline={"bwd_swap_ab": swap})
        try:
            plans = plan_kernels(spec_from_dict(spec), "sm90")
        except (PlanError, ValueError):
            continue  # a combination the planner refuses with a named error
        pairs.update((p.head_dim, p.tile_m) for p in plans if p.direction == "bwd")
    return sorted(pairs)


PLANNED = _planned_pairs()


def test_the_sweep_sees_every_tile_kind():
    # 128-row (d <= 64), 64-row and the 80-row dQᵀ tile all occur
    assert {t for _, t in PLANNED} >= {64, 80, 128} and (128, 80) in PLANNED


@pytest.mark.parametrize("head_dim, tile_m", PLANNED)
def test_two_chunks_tile_the_dq_block_exactly(head_dim, tile_m):
    """The two warpgroups' (64, DQ_N) chunks cover the block's (tile_m, head_dim) dQ once: as many floats,
    and every chunk inside it (a dQᵀ at head dim 112 once ran its second warpgroup past K and its chunk
    into the next head's accumulator)."""
    _, dq_n = sm90.dq_split(head_dim, tile_m)
    assert 2 * 64 * dq_n == tile_m * head_dim, (head_dim, tile_m, dq_n)
    rows, cols = (head_dim, tile_m) if sm90.dq_transposed(tile_m) else (tile_m, head_dim)
    for w in (0, 1):
        r0, c0 = sm90.chunk_origin(w, tile_m, dq_n)
        assert r0 + 64 <= rows and c0 + dq_n <= cols, (head_dim, tile_m, w)


@pytest.mark.parametrize("head_dim, tile_m", PLANNED)
def test_dq_chunk_round_trip(head_dim, tile_m):
    seen = {(head_dim, tile_m, w): set() for w in (0, 1)}

    @cute.jit
    def host():
        _check(head_dim, tile_m, seen)

    with target_arch("sm_90a"):
        cute.compile(host)
    # the sampled threads' offsets and coordinates are each taken once (no two elements share a slot)
    for pairs in seen.values():
        assert len({o for o, _ in pairs}) == len({rc for _, rc in pairs}) == len(pairs) > 0


@pytest.mark.parametrize("head_dim, tile_m", PLANNED)
def test_plan_sizes_the_dq_buffers_as_the_kernel_splits_dq(head_dim, tile_m):
    """The plan's shared-memory budget (`bwd_dq_cols`) and the kernel's chunk width (`sm90.dq_split`) are
    two spellings of one rule (the plan cannot import the device module); they must agree."""
    from fa4gen.plan.model import bwd_dq_cols

    assert sm90.dq_split(head_dim, tile_m)[1] == bwd_dq_cols(head_dim, tile_m)


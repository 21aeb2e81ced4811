"""The deterministic backward above d128 (dQ from the consumers' registers) keeps its turns off the
consumer warpgroups: compiled for sm_90a on the CPU, its per-block MMA loops issue the dQ reductions
but no semaphore poll (ATOMG) and no gpu-scope fence (MEMBAR.*.GPU; the loop's CTA-scope one orders
P/dS in shared memory) — the turn warp does both. With the poll and the
release in the consumers the deterministic d256 backward ran 14-21% slower on the H200 (docs/PERF.md,
session 10)."""

import pytest

pytestmark = pytest.mark.compile

pytest.importorskip("cutlass")
from conftest import backward_block_loops, backward_main_sass  # noqa: E402
from fa4gen.compile.sass import find_nvdisasm, loops  # noqa: E402

if find_nvdisasm() is None:
    pytest.skip("nvdisasm not installed (needed for the SASS)", allow_module_level=True)

SPEC = dict(name="tw_d256_causal_det", targets=["sm90"], dtype="bf16", head_dim=256, mask={"kind": "causal"},
            backward=True, deterministic=True, allow_gqa=False)


@pytest.fixture(scope="module")
def bwd_sass(tmp_path_factory):
    return backward_main_sass(SPEC, tmp_path_factory.mktemp("turn_warp"), "tw_gen")


def test_consumer_loops_neither_poll_nor_fence(bwd_sass):
    plan, sass = bwd_sass
    assert plan.dq_atomic and plan.deterministic
    # S, dP (over the head dims), dQ (over the keys), dV, dK (over the query rows): one block's HGMMAs
    block_loops = backward_block_loops(plan, sass)
    # causal: the masked and the mask-free run (the shortest two; the first key block's dQ stores, placed
    # out of line by ptxas, branch back into a run, which the loop finder reads as one more, longer loop)
    assert len(block_loops) >= 2
    block_loops = block_loops[:2]
    for body in block_loops:
        assert any("RED" in line and ".ADD" in line for line in body)  # the dQ adds are the consumers'
        assert not any("ATOMG" in line or ("MEMBAR" in line and ".GPU" in line) for line in body)
    # ... and the turn warp polls and fences
    assert any("ATOMG" in line for line in sass.splitlines())
    assert any("MEMBAR" in line and ".GPU" in line for line in sass.splitlines())


def test_turn_warp_reads_the_next_turn_early_and_fences_once(bwd_sass):
    """The turn warp's per-block loop (no HGMMA; it waits at the dQ barriers and passes the turn) reads the
    next block's counter before waiting for this block's adds (a relaxed ATOMG, no L1 invalidation of its
    own, ahead of the BAR.SYNC), and passes the turn after a single gpu-scope MEMBAR: the pass's own
    fence is also the acquire for that early read."""
    _, sass = bwd_sass
    turn_loops = [body for body in loops(sass)
                  if not any("HGMMA" in line for line in body)
                  and any("BAR.SYNC" in line for line in body) and any("REDG" in line and ".S32" in line for line in body)]
    assert len(turn_loops) == 1, len(turn_loops)
    body = turn_loops[0]
    first_sync = next(i for i, line in enumerate(body) if "BAR.SYNC" in line)
    early = [i for i, line in enumerate(body[:first_sync]) if "ATOMG" in line]
    assert early, "no counter read before the wait for the adds"
    assert not any("CCTL" in line for line in body[early[-1]:first_sync])  # relaxed: no acquire here
    pass_at = next(i for i, line in enumerate(body) if "REDG" in line and ".S32" in line)
    assert sum("MEMBAR" in line and ".GPU" in line for line in body[first_sync:pass_at]) == 1

"""Device helpers: the grouped CTA orders of `fa4gen.device.schedule`, evaluated on the CPU — the causal
backward's (`head_grouped`) and the masked forward's (`longest_first_grouped`, with its L2 group size).

With Python integers the helpers' arithmetic runs at trace time, so a one-thread kernel compiled for
sm_90a checks the exact index map: every (block, head-batch pair) once, groups of `group` pairs in
turn, blocks in order inside a group with the pairs fastest (so each group, the last above all, ends on
its shortest causal CTAs), partial last groups included.
"""

from __future__ import annotations

import itertools

import pytest

pytestmark = pytest.mark.compile
pytest.importorskip("cutlass.cute")

from conftest import trace_in_kernel  # noqa: E402
from fa4gen.device import schedule  # noqa: E402

CASES = [(16, 128, 8), (4, 10, 33), (64, 6, 2), (5, 7, 3), (1, 1, 1), (3, 2, 5)]  # (num_n, num_hb, group)


def _check(num_n: int, num_hb: int, group: int):
    seen = [tuple(int(x) for x in schedule.head_grouped(t, num_n, num_hb, group)) for t in range(num_n * num_hb)]
    assert sorted(seen) == sorted((n, hb) for n in range(num_n) for hb in range(num_hb)), (num_n, num_hb, group)
    for g0 in range(0, num_hb, group):  # each group's CTAs are consecutive, key blocks ascending, pairs fastest
        pairs = list(range(g0, min(g0 + group, num_hb)))
        start = g0 * num_n
        block = seen[start: start + len(pairs) * num_n]
        assert block == [(n, hb) for n in range(num_n) for hb in pairs], (num_n, num_hb, group, g0)


def test_head_grouped_order():
    trace_in_kernel(lambda: [_check(*case) for case in CASES], "sm_90a")


FWD_CASES = [(64, 32, 8), (16, 64, 16), (5, 7, 3), (1, 1, 1)]  # (num_m, num_hb, group)


def _check_fwd(num_m: int, num_hb: int, group: int):
    seen = [tuple(int(x) for x in schedule.longest_first_grouped(t, num_m, num_hb, group))
            for t in range(num_m * num_hb)]
    assert sorted(seen) == sorted((m, hb) for m in range(num_m) for hb in range(num_hb)), (num_m, num_hb, group)
    for g0 in range(0, num_hb, group):  # each group consecutive, the last (longest) query tile first, pairs fastest
        pairs = list(range(g0, min(g0 + group, num_hb)))
        block = seen[g0 * num_m: g0 * num_m + len(pairs) * num_m]
        assert block == [(m, hb) for m in reversed(range(num_m)) for hb in pairs], (num_m, num_hb, group, g0)


def test_det_tail_ascending_rule():
    """The deterministic causal grid's first-to-last groups (schedule.det_tail_ascending): the last of two or more
    groups, when it holds DET_TAIL_UP_CTAS CTAs or more; the rule tests/test_det_schedule.py simulates."""
    from test_det_schedule import tail_rule

    def check():
        for groups, group, num_n in itertools.product((1, 2, 3, 5), (1, 4, 16), (1, 15, 16, 17, 64, 86)):
            for z in range(groups):
                want = int(tail_rule(z, groups, group, num_n, schedule.DET_TAIL_UP_CTAS))
                assert int(schedule.det_tail_ascending(z, groups, group, num_n)) == want, (z, groups, group, num_n)
    trace_in_kernel(check, "sm_90a")


def test_forward_longest_first_grouped_order():
    """The masked forward's CTA order (schedule.longest_first_grouped) and its L2 group size: 50 MB of K/V
    per group (flash-attn-4's figure), one to L2_MAX_GROUP pairs, no Int32 overflow for long sequences."""
    def check():
        for case in FWD_CASES:
            _check_fwd(*case)
        assert int(schedule.l2_group(8192, 512)) == 12  # d128 bf16 K+V: 4 MB per pair
        assert int(schedule.l2_group(8192, 1024)) == 6  # d256: 8 MB
        assert int(schedule.l2_group(2048, 1024)) == 16  # 2 MB: 25 fit, capped at L2_MAX_GROUP
        assert int(schedule.l2_group(1 << 20, 1024)) == 1  # 1 GB per pair: still one
        assert int(schedule.l2_group(1 << 30, 1024)) == 1

    trace_in_kernel(check, "sm_90a")


def _grid_order(num_blocks: int, heads: int, batch: int, group: int) -> list[tuple[int, int]]:
    """(blockIdx.y, pair) of every CTA of a (group, num_blocks, pairs // group) grid in launch order
    (x fastest), the pair decoded by schedule.grouped_pair as the kernels do."""
    order = []
    for z in range((heads * batch) // group):
        for y in range(num_blocks):
            for x in range(group):
                head, b = (int(v) for v in schedule.grouped_pair(x, z, group, heads))
                order.append((y, b * heads + head))
    return order


def _check_grid(num_blocks: int, heads: int, batch: int, limit: int):
    """The grouped grids (SM90 forward's masked CTAs, the causal and deterministic backward's) launch their
    CTAs in head_grouped's order with a group that divides the pairs: the order the CPU test above checks."""
    num_hb = heads * batch
    group = int(schedule.pow2_group(num_hb, limit))
    assert num_hb % group == 0 and group & (group - 1) == 0 and 1 <= group <= max(1, min(limit, 16))
    expected = [tuple(int(v) for v in schedule.head_grouped(t, num_blocks, num_hb, group))
                for t in range(num_blocks * num_hb)]
    assert _grid_order(num_blocks, heads, batch, group) == expected, (num_blocks, heads, batch, limit)


def _check_deterministic(num_n: int, heads: int, batch: int, limit: int, kv_group: int):
    """The deterministic backward's launch order (grouped grid, key blocks reversed): every CTA a CTA
    waits for — the same pair's next key block (dQ turns go last key block first) and, with GQA, the
    same key block of the previous query head of its KV group (dK/dV turns) — launches earlier, so a
    waiting CTA never holds an SM its predecessor needs."""
    group = int(schedule.pow2_group(heads * batch, limit))
    index = {(num_n - 1 - y, hb): t for t, (y, hb) in enumerate(_grid_order(num_n, heads, batch, group))}
    assert len(index) == num_n * heads * batch
    for (n, hb), t in index.items():
        if n + 1 < num_n:
            assert index[(n + 1, hb)] < t, (num_n, heads, batch, group, n, hb)
        if (hb % heads) % kv_group:
            assert index[(n, hb - 1)] < t, (num_n, heads, batch, group, n, hb)


def test_grouped_grids_launch_in_head_grouped_order():
    def check():
        assert [int(schedule.pow2_group(n, lim)) for n, lim in
                ((256, 12), (256, 100), (24, 16), (15, 16), (6, 3), (32, 1), (1, 16))] == [8, 16, 8, 1, 2, 1, 1]
        for case in [(8, 16, 16, 25), (64, 16, 2, 12), (5, 3, 2, 4), (7, 6, 1, 16), (1, 1, 1, 16), (3, 12, 3, 3)]:
            _check_grid(*case)
        for case in [(128, 8, 2, 3, 1), (32, 16, 8, 16, 4), (5, 6, 1, 4, 2), (7, 3, 3, 16, 3), (1, 4, 1, 1, 2)]:
            _check_deterministic(*case)
        assert int(schedule.l2_group(8192, (256 + 256) * 2 + 256 * 4)) == 3  # d256 s8k: 16 MB per pair

    trace_in_kernel(check, "sm_90a")


@pytest.mark.parametrize("head_dim, head_dim_v, tile_n", [(64, 64, 128), (128, 128, 128), (192, 128, 96),
                                                          (256, 256, 64)])
def test_causal_backward_groups_hold_about_one_wave(head_dim, head_dim_v, tile_n):
    """The causal backward's pair groups (longest key blocks first within a group) hold the power of two of pairs
    nearest one wave of 132 CTAs in ratio, on the FA grid's shapes (16k tokens x 16 heads, s512-16k). The floor
    of 132 / key blocks it took until session 39 made the (192, 128) tile's groups (96-key blocks: 11, 22, 43,
    86 per pair) as small as 86 CTAs, so each group's longest CTAs started late; tools/sim_schedules.py `groups`
    models what that cost. Read from the rendered module, so the constant the kernel uses is the one checked."""
    import math
    import re

    from fa4gen.builder import render_spec
    from fa4gen.spec import spec_from_dict

    # (up to head dim 128 the causal MHA backward is persistent since session 67, its tiles in
    # schedule.paired_tile's order: the GQA kernel (bwd_sm90 of an allow_gqa spec) keeps this grid there)
    spec = spec_from_dict(dict(name="lpt_groups", targets=["sm90"], dtype="bf16", head_dim=head_dim,
                               head_dim_v=head_dim_v, mask={"kind": "causal"}, backward=True,
                               allow_gqa=head_dim <= 128))
    pkg, plans, _ = render_spec(spec, "t")
    bwd = next(p for p in plans if p.direction == "bwd" and p.module == "bwd_sm90")
    assert bwd.scheduler == "grid"
    assert bwd.tile_n == tile_n
    code = pkg.files["bwd_sm90.py"]
    ctas = int(re.search(r"^LPT_GROUP_CTAS = (\d+)$", code, re.MULTILINE).group(1))
    assert "schedule.pow2_group(num_hb, cutlass.max(LPT_GROUP_CTAS // num_n, Int32(1)))" in code

    def check():
        for seqlen in (512, 1024, 2048, 4096, 8192, 16384):
            num_n = -(-seqlen // tile_n)
            if num_n > 132:  # one pair's key blocks already fill a wave
                continue
            num_hb = 16 * (16384 // seqlen)
            group = int(schedule.pow2_group(num_hb, max(ctas // num_n, 1)))
            wave = 132 / num_n  # pairs per wave
            if wave >= 16:  # L2_MAX_GROUP caps it
                assert group == 16, (seqlen, group)
                continue
            assert wave / math.sqrt(2) <= group <= wave * math.sqrt(2), (seqlen, num_n, group)

    trace_in_kernel(check, "sm_90a")

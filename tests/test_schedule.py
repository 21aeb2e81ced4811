"""Device helpers: the grouped CTA orders of `fa4gen.device.schedule`, evaluated on the CPU — the causal
backward's (`head_grouped`) and the masked forward's (`longest_first_grouped`, with its L2 group size).

With Python integers the helpers' arithmetic runs at trace time, so a one-thread kernel compiled for
sm_90a checks the exact index map: every (block, head-batch pair) once, groups of `group` pairs in
turn, blocks in order inside a group with the pairs fastest (so each group, the last above all, ends on
its shortest causal CTAs), partial last groups included.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.compile
cute = pytest.importorskip("cutlass.cute")

from fa4gen.compile.aot import target_arch  # noqa: E402
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


def _trace(check):
    """Run `check` (plain Python over the helpers) while tracing a one-warp kernel compiled for sm_90a."""
    @cute.kernel
    def kernel():
        check()

    @cute.jit
    def host():
        kernel().launch(grid=(1, 1, 1), block=(32, 1, 1))

    with target_arch("sm_90a"):
        cute.compile(host)


def test_head_grouped_order():
    _trace(lambda: [_check(*case) for case in CASES])


FWD_CASES = [(64, 32, 8), (16, 64, 16), (5, 7, 3), (1, 1, 1)]  # (num_m, num_hb, group)


def _check_fwd(num_m: int, num_hb: int, group: int):
    seen = [tuple(int(x) for x in schedule.longest_first_grouped(t, num_m, num_hb, group))
            for t in range(num_m * num_hb)]
    assert sorted(seen) == sorted((m, hb) for m in range(num_m) for hb in range(num_hb)), (num_m, num_hb, group)
    for g0 in range(0, num_hb, group):  # each group consecutive, the last (longest) query tile first, pairs fastest
        pairs = list(range(g0, min(g0 + group, num_hb)))
        block = seen[g0 * num_m: g0 * num_m + len(pairs) * num_m]
        assert block == [(m, hb) for m in reversed(range(num_m)) for hb in pairs], (num_m, num_hb, group, g0)


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

    _trace(check)

"""Device helpers, sm100: the TMEM fragment facts the SM100 forward relies on, checked thread by thread.

The layouts are static, so tracing a kernel on the CPU evaluates every coordinate exactly. For each of
the 128 threads of a warpgroup and key tiles of 64 and 128 columns:
  * the 16x256b score fragment, seen through `quad_rows_cols`, is a (row, col) grid: one row per view
    row, one column per view column; a thread holds 4 rows (r, r+8, r+16, r+24) of its warp's 32 lanes;
  * the 4 lanes of a quad hold the same rows, in the same order, and together every column of them —
    the premise of the shared softmax helpers' quad reductions;
  * word w of chunk (rb, cb) of the 16x128b P store holds exactly the scores 2w and 2w+1 of chunk
    (rb, cb) of the score fragment (same row, columns 2c and 2c+1 of the packed P);
  * the correction warps' 16x256b O fragment gives a thread the same rows in the same order as its
    softmax twin's score fragment (the row statistics travel thread to thread);
  * the 32x32b statistics scratch of thread t is TMEM lane t;
  * a Q tile's TMEM view at a run-time tile index addresses the plan's column for that tile.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.compile
cute = pytest.importorskip("cutlass.cute")

from cutlass import Float32  # noqa: E402

from conftest import trace_in_kernel  # noqa: E402
from fa4gen.device import schedule
from fa4gen.device import sm100 as bw  # noqa: E402

LANE = 1 << 16  # TMEM address: lane in the upper half-word


def _coords(part):
    return [tuple(int(x) for x in part[i]) for i in range(cute.size(part))]


def _check_thread(base, t: int, tile_n: int):
    s_view = bw.tmem_view(base, 0, tile_n)
    _, _, s_c = bw.score_load(s_view, t)
    rc = bw.quad_rows_cols(s_c)
    n_rows, n_cols = cute.size(rc, mode=[0]), cute.size(rc, mode=[1])
    assert (n_rows, n_cols) == (bw.ROWS_PER_THREAD, tile_n // 4)
    rows = [int(rc[r, 0][0]) for r in range(n_rows)]
    cols = [int(rc[0, c][1]) for c in range(n_cols)]
    for r in range(n_rows):
        for c in range(n_cols):
            assert tuple(int(x) for x in rc[r, c]) == (rows[r], cols[c])
    warp, lane = divmod(t, 32)
    assert rows == [32 * warp + lane // 4 + 8 * k for k in range(4)]
    # P: word w of chunk (rb, cb) = scores 2w, 2w+1 of chunk (rb, cb)
    _, _, p_c = bw.p_store(bw.tmem_view(base, 0, tile_n // 2), t)
    assert cute.size(p_c, mode=[1]) == cute.size(s_c, mode=[1]) and cute.size(p_c, mode=[2]) == cute.size(s_c, mode=[2])
    for rb in range(cute.size(s_c, mode=[1])):
        for cb in range(cute.size(s_c, mode=[2])):
            scores = _coords(s_c[None, rb, cb])
            words = _coords(p_c[None, rb, cb])
            assert len(scores) == 2 * len(words)
            for w, (row, col2) in enumerate(words):
                assert scores[2 * w] == (row, 2 * col2) and scores[2 * w + 1] == (row, 2 * col2 + 1)
    # O (16-column chunks in the correction warps): same rows, same order
    _, _, _, _, o_c = bw.o_copies(bw.tmem_view(base, 0, 16), t)
    o_rc = bw.quad_rows_cols(o_c)
    assert [int(o_rc[r, 0][0]) for r in range(cute.size(o_rc, mode=[0]))] == rows
    # statistics scratch: lane t, 16 columns
    _, _, st_part, st_shape = bw.stats_copies(bw.tmem_view(base, 0, 16), t)
    assert cute.size(st_shape) == 16
    return rows, cols


def _check_tile(tile_n: int):
    base = cute.make_tensor(
        cute.make_ptr(Float32, 0, cute.AddressSpace.tmem),
        cute.make_layout(((128, tile_n), 1, 1), stride=((LANE, 1), 0, 0)),
    )
    owners = {}
    for t in range(128):
        rows, cols = _check_thread(base, t, tile_n)
        for r in rows:
            owners.setdefault(r, []).append((t, cols))
    assert sorted(owners) == list(range(128))
    # every thread's columns are thread 0's shifted by one amount: the premise of mask.apply_mask's
    # coords0 (compile-time columns of thread 0 + a per-thread shift), shared with SM90
    cols0 = owners[0][0][1]
    for held in owners.values():
        for _, cols in held:
            assert [c - cols[0] for c in cols] == [c - cols0[0] for c in cols0]
    for r, held in owners.items():
        lanes = [t for t, _ in held]
        assert len(lanes) == 4 and lanes[0] % 4 == 0 and lanes == list(range(lanes[0], lanes[0] + 4)), r
        assert sorted(c for _, cols in held for c in cols) == list(range(tile_n)), r
    # a Q tile's view at a run-time index: tile 1 starts tile_n columns after tile 0
    view = bw.tile_view(base, (0, tile_n), tile_n, 1)
    assert view.layout == bw.tmem_view(base, tile_n, tile_n).layout


@pytest.mark.parametrize("tile_n", [64, 128])
def test_tmem_fragments(tile_n):
    trace_in_kernel(lambda: _check_tile(tile_n), "sm_100a", threads=128)


def _check_scheduler():
    num_m, heads, batch = 5, 3, 2
    every = sorted((m, h, b) for m in range(num_m) for h in range(heads) for b in range(batch))
    for longest_first, group in ((False, 1), (True, 6), (True, 4)):
        seen = [tuple(int(x) for x in schedule.tile_coords(t, num_m, heads, batch, group, longest_first_order=longest_first))
                for t in range(num_m * heads * batch)]
        assert sorted(seen) == every
        if longest_first:  # the first group's pairs (head fastest), each with its last query tile first
            first = min(group, heads * batch)
            assert seen[:first] == [(num_m - 1, hb % heads, hb // heads) for hb in range(first)]
            assert [m for m, _, _ in seen[first: 2 * first]] == [num_m - 2] * first
        else:  # a (head, batch)'s query tiles are consecutive
            assert seen[:num_m] == [(m, 0, 0) for m in range(num_m)]
    # with the SM90 forward's groups (pow2_group of the L2 fit) the order is exactly the SM90 grid's launch
    # order — blockIdx (pair in group x fastest, query tile y reversed, group z), decoded by grouped_pair —
    # so what the H200 runs is what the SM100 scheduler walks
    for num_m, heads, batch, fit in ((5, 3, 4, 16), (3, 4, 2, 4), (4, 6, 1, 3), (2, 5, 3, 16)):
        num_hb = heads * batch
        group = int(schedule.pow2_group(num_hb, fit))
        sm100 = [tuple(int(x) for x in schedule.tile_coords(t, num_m, heads, batch, group, longest_first_order=True))
                 for t in range(num_m * num_hb)]
        sm90 = []
        for z in range(num_hb // group):
            for y in range(num_m):
                for x in range(group):
                    head, b = schedule.grouped_pair(x, z, group, heads)
                    sm90.append((num_m - 1 - y, int(head), int(b)))
        assert sm100 == sm90, (num_m, heads, batch, fit)


def _check_paired_units():
    for num_m, heads, batch in ((4, 3, 2), (5, 2, 3), (1, 4, 1), (2, 1, 1), (7, 1, 2), (3, 5, 7), (9, 15, 1)):
        every = sorted((m, h, b) for m in range(num_m) for h in range(heads) for b in range(batch))
        tiles = num_m * heads * batch
        # more tiles than CTAs pairs them; as many or fewer leaves one tile per CTA
        assert int(schedule.pairs_for(num_m, heads, batch, tiles)) == 0
        assert int(schedule.pairs_for(num_m, heads, batch, tiles - 1)) == 1
        for sms in sorted({1, 2, 3, 4, 5, 7, 16, 104, max(tiles - 1, 1), tiles, tiles + 3}):
            pairs = int(schedule.pairs_for(num_m, heads, batch, sms))
            # the host's grid, and each CTA's loop over paired_schedule's iterations
            grid = min(int(schedule.paired_units(tiles, pairs)), sms)
            seen, loads = [], []
            for cta in range(grid):
                iterations, *sched = (int(x) for x in schedule.paired_schedule(cta, grid, tiles, num_m, heads * batch))
                got = [tuple(int(x) for x in schedule.paired_tile(k, cta, grid, num_m, heads, sched))
                       for k in range(iterations)]
                seen += got
                loads.append(sum(m + 1 for m, _, _ in got))  # causal: tile m sees about m + 1 key blocks
                if not pairs:
                    assert len(got) == 1  # one tile per CTA
                # the head: units of two tiles that together see num_m + 1 blocks, a (head, batch) pair's j and
                # num_m - 1 - j, or two pairs' middle tiles
                head_iters = sched[0]
                assert head_iters % 2 == 0 and head_iters <= len(got)
                for n in range(head_iters // 2):
                    (m0, h0, b0), (m1, h1, b1) = got[2 * n], got[2 * n + 1]
                    assert m0 + m1 == num_m - 1, (num_m, heads, batch, sms, got)
                    assert (h0, b0) == (h1, b1) or 2 * m0 == num_m - 1, (num_m, sms, got)
                # the tail: at most 4 tiles (fewer than 4 x grid tiles over grid CTAs)
                assert len(got) - head_iters <= 4, (num_m, heads, batch, sms, got)
            # every (m_block, head, batch) once
            assert sorted(seen) == every, (num_m, heads, batch, sms)
            # balanced: no CTA above the mean by more than the longest tile (num_m blocks)
            assert max(loads) <= sum(loads) / grid + num_m, (num_m, heads, batch, sms, loads)
    # the order Z: per (head, batch) pair the longest, the shortest, the next longest, ..., the middle last
    # (first, for a pair starting on an odd position)
    sched = (2, 0, 0, 0, 0)  # two head iterations: the first block of an order with at least 4 x ctas tiles
    assert [int(schedule.paired_tile(i % 2, i // 2, 5, 5, 2, sched)[0]) for i in range(10)] == [4, 0, 3, 1, 2, 2, 4, 0, 3, 1]


def _window_cost(m, cut):
    """A sliding window's query tile m: 1, 2, ..., cut key blocks over the tiles its window cuts, cut + 1 past them."""
    return min(m, cut) + 1


def _check_paired_ramp():
    for num_m, heads, batch in ((4, 3, 2), (5, 2, 3), (1, 4, 1), (7, 1, 2), (3, 5, 7), (9, 15, 1), (12, 6, 2)):
        every = sorted((m, h, b) for m in range(num_m) for h in range(heads) for b in range(batch))
        tiles = num_m * heads * batch
        for sms in sorted({1, 3, 7, 16, 33, max(tiles - 1, 1), tiles, tiles + 3}):
            pairs = int(schedule.pairs_for(num_m, heads, batch, sms))
            grid = min(int(schedule.paired_units(tiles, pairs)), sms)
            for cut in range(num_m + 1):
                # window_ramp's parity rule (the full part even), then window_ramp itself at the matching window
                ramp = cut + ((num_m - cut) & heads * batch & 1)
                left = cut * 128 - 5 if 0 < cut < num_m else (-1 if cut == num_m else 0)
                assert int(schedule.window_ramp(left, 0, num_m * 128, num_m * 128, num_m, heads * batch, 128)) == ramp
                # an unbounded right side: the order without a ramp
                assert int(schedule.window_ramp(left, -1, num_m * 128, num_m * 128, num_m, heads * batch, 128)) == num_m
                seen, loads = [], []
                for cta in range(grid):
                    iterations, *sched = (int(x) for x in schedule.paired_schedule(cta, grid, tiles, num_m, heads * batch,
                                                                                   ramp=ramp))
                    got = [tuple(int(x) for x in schedule.paired_tile(k, cta, grid, num_m, heads, sched, ramp=ramp))
                           for k in range(iterations)]
                    if ramp == num_m:  # the order without a ramp
                        plain_iterations, *plain = (int(x) for x in schedule.paired_schedule(cta, grid, tiles, num_m,
                                                                                             heads * batch))
                        assert got == [tuple(int(x) for x in schedule.paired_tile(k, cta, grid, num_m, heads, plain))
                                       for k in range(plain_iterations)], (num_m, heads, batch, sms)
                    # the head's units: two full tiles, or two ramp tiles j and ramp - 1 - j (or two middle ones)
                    for n in range(sched[0] // 2):
                        (m0, h0, b0), (m1, h1, b1) = got[2 * n], got[2 * n + 1]
                        assert (m0 >= ramp) == (m1 >= ramp), (num_m, heads, batch, sms, ramp, got)
                        if m0 < ramp:
                            assert m0 + m1 == ramp - 1, (num_m, sms, ramp, got)
                    assert len(got) - sched[0] <= 4, (num_m, heads, batch, sms, ramp, got)
                    seen += got
                    loads.append(sum(_window_cost(m, cut) for m, _, _ in got))
                assert sorted(seen) == every, (num_m, heads, batch, sms, ramp)
                # balanced: no CTA above the mean by more than two full tiles (a unit)
                assert max(loads) <= sum(loads) / grid + 2 * (cut + 1), (num_m, heads, batch, sms, ramp, loads)


def _chunk_cost(m, per):
    """A chunked mask's query tile m, `per` tiles a chunk: (m mod per) + 1 key blocks."""
    return m % per + 1


def _check_paired_chunk_ramp():
    for num_m, heads, batch in ((4, 3, 2), (5, 2, 3), (7, 1, 2), (3, 5, 7), (9, 15, 1), (12, 6, 2), (11, 3, 1)):
        every = sorted((m, h, b) for m in range(num_m) for h in range(heads) for b in range(batch))
        tiles = num_m * heads * batch
        for per in range(1, num_m + 2):
            whole = num_m // per * per
            split = 0 < whole < num_m and not (whole & heads * batch & 1)
            ramp = num_m - whole if split else num_m
            assert int(schedule.chunk_ramp(per * 128, num_m * 128, num_m * 128, num_m, heads * batch, 128)) == ramp
            # a chunk that is not a multiple of the tile, or chunk boundaries off the query tiles': no ramp
            assert int(schedule.chunk_ramp(per * 128 + 64, num_m * 128, num_m * 128, num_m, heads * batch, 128)) == num_m
            assert int(schedule.chunk_ramp(per * 128, num_m * 128, num_m * 128 + 128, num_m, heads * batch,
                                           128)) == (num_m if per > 1 else ramp)
            assert int(schedule.chunk_ramp(per * 128, num_m * 128, num_m * 128 - 128, num_m, heads * batch, 128)) == num_m
            # whole chunks of keys ahead of the queries keep the split (decode-style shift by a chunk multiple)
            assert int(schedule.chunk_ramp(per * 128, num_m * 128, num_m * 128 + 2 * per * 128, num_m, heads * batch,
                                           128)) == ramp
            for sms in sorted({1, 3, 7, 16, 33, max(tiles - 1, 1), tiles, tiles + 3}):
                pairs = int(schedule.pairs_for(num_m, heads, batch, sms))
                grid = min(int(schedule.paired_units(tiles, pairs)), sms)
                seen, loads = [], []
                for cta in range(grid):
                    iterations, *sched = (int(x) for x in schedule.paired_schedule(cta, grid, tiles, num_m, heads * batch,
                                                                                   ramp=ramp))
                    got = [tuple(int(x) for x in schedule.paired_tile(k, cta, grid, num_m, heads, sched, ramp=ramp,
                                                                       ramp_high=True))
                           for k in range(iterations)]
                    # the head's units: two tiles of whole chunks j / whole - 1 - j, or two of the partial chunk
                    for n in range(sched[0] // 2):
                        (m0, h0, b0), (m1, h1, b1) = got[2 * n], got[2 * n + 1]
                        low = num_m - ramp
                        assert (m0 >= low) == (m1 >= low), (num_m, heads, batch, sms, ramp, got)
                        if split:
                            assert _chunk_cost(m0, per) + _chunk_cost(m1, per) == (
                                ramp + 1 if m0 >= low else per + 1), (num_m, per, sms, got)
                    assert len(got) - sched[0] <= 4, (num_m, heads, batch, sms, ramp, got)
                    seen += got
                    loads.append(sum(_chunk_cost(m, per) for m, _, _ in got))
                assert sorted(seen) == every, (num_m, heads, batch, sms, per)
                if split:  # balanced: no CTA above the mean by more than a unit of whole-chunk tiles
                    assert max(loads) <= sum(loads) / grid + per + 1, (num_m, heads, batch, sms, per, loads)


def test_paired_units_with_a_chunk_ramp_cover_every_tile_once():
    """The chunked order (paired_schedule / paired_tile with chunk_ramp's `ramp` and ramp_high: every pair's whole
    chunks first in the order Z over them, then its last, partial chunk in units of its own): every query tile once,
    head units costing per + 1 (whole chunks) or ramp + 1 (the partial one) key blocks, no CTA above the mean by more
    than a unit; chunk_ramp gives no ramp where the chunk boundaries are off the tiles'."""
    trace_in_kernel(_check_paired_chunk_ramp, "sm_90a")


def test_paired_units_with_a_window_ramp_cover_every_tile_once():
    """The sliding-window order (paired_schedule / paired_tile with window_ramp's `ramp`: the full tiles first, then the
    ramp tiles in units of their own): every query tile once whatever the window cuts, head units of two full tiles or
    two ramp tiles j / ramp - 1 - j, at most four tail tiles, no CTA's window cost above the mean by more than a unit,
    and ramp = num_m exactly the order without one."""
    trace_in_kernel(_check_paired_ramp, "sm_90a")


def test_paired_units_cover_every_tile_once():
    """fa4gen.device.schedule's paired order (the SM90 masked persistent forward's work order): over every
    CTA's loop every query tile runs once, each CTA runs units of two tiles whose causal cost is num_m + 1
    key blocks and then at most four tiles of the longest-first tail, and no CTA's load exceeds the mean by
    more than the longest tile; one tile per CTA when there are no more tiles than CTAs."""
    trace_in_kernel(_check_paired_units, "sm_90a")


def test_tile_scheduler_index_math():
    """fa4gen.device.schedule.tile_coords (the SM100 forward's grouped longest-first order) visits every
    (m_block, head, batch) once, in the planned order, and with pow2_group's groups in the SM90 grid's order."""

    trace_in_kernel(_check_scheduler, "sm_100a")

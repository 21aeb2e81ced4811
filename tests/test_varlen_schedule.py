"""The varlen forward's tile numbering (fa4gen/device/varlen.py: tile_of, mirrored line for line in
fa4gen/emulate/tiling.py): over a grid of ceil(total / tile_m) + sequences tiles, every query tile
(sequence, m_block < ceil(len / tile_m)) is produced exactly once, in sequence order, and every other
grid tile maps past the end of a sequence (it computes and stores nothing) and is numbered at or past
the owned tile count that tile_of_owned returns (the kernels' CTAs there leave at once)."""

import random

import pytest

from fa4gen.emulate import tiling


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


CASES = [
    [1000],
    [0],
    [0, 0, 5],
    [128, 1, 300, 0, 77],
    [128] * 33,  # exactly one tile each, across a 32-sequence chunk boundary
    [1] * 70,
]
rng = random.Random(3)
CASES += [[rng.choice([0, 1, 63, 64, 65, 127, 128, 129, rng.randint(0, 3000)]) for _ in range(rng.randint(1, 100))]
          for _ in range(40)]


@pytest.mark.parametrize("lengths", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("tile_m", [128, 192])
@pytest.mark.parametrize("descending", [False, True])
def test_every_query_tile_exactly_once(lengths, tile_m, descending):
    cu, b = _cu(lengths), len(lengths)
    total = cu[-1]
    grid = -(-total // tile_m) + b
    want = {(s, m) for s, n in enumerate(lengths) for m in range(-(-n // tile_m))}
    got, order = [], []
    for t in range(grid):
        s, m, owned = tiling.tile_of_owned(cu, b, total, t, tile_m, descending)
        assert (s, m) == tiling.tile_of(cu, b, total, t, tile_m, descending)
        assert 0 <= s < b
        # the kernels leave at once where t >= owned (varlen.leave_if_spare): exactly the tiles with no rows
        assert owned == tiling.tiles_before(cu, b, total, tile_m) <= grid
        assert (t >= owned) == (m * tile_m >= lengths[s]), (t, owned, s, m)
        if m * tile_m < lengths[s]:
            got.append((s, m))
            order.append(s)
    assert sorted(got) == sorted(want) and len(got) == len(want)
    for s in range(b):  # the packed tile of (s, m) - the deterministic backward's semaphore index - is unique
        assert tiling.tiles_before(cu, s, total, tile_m) == sum(-(-n // tile_m) for n in lengths[:s])
    assert len({tiling.tiles_before(cu, s, total, tile_m) + m for s, m in got}) == len(got)
    assert order == sorted(order)  # sequence by sequence, in launch order
    if descending:
        for s in set(order):  # within a sequence, the last (most keys under a causal mask) block first
            ms = [m for (x, m) in got if x == s]
            assert ms == sorted(ms, reverse=True)


def test_malformed_offsets_stay_inside_the_packed_tensor():
    cu = [0, 50, 20, 400, 90]  # decreasing, past the end
    for seq in range(4):
        off, n = tiling.sequence_bounds(cu, seq, 100)
        assert 0 <= off <= 100 and 0 <= n and off + n <= 100


@pytest.mark.parametrize("lengths", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("heads", [1, 3])
def test_the_backwards_one_scan_finds_what_the_separate_lookups_do(lengths, descending, heads):
    """The packed backward's prologue (`key_tile_sequence`: one linear CTA index over (sequence, head, key tile),
    decoded by the key-tile scan with each lane's query bounds and seqused_k loaded beside its key bounds)
    against the lookups it replaces, on the sequence values made monotone (`monotone_values`: what the kernel
    reads the caller's values as): tile_of_owned over the key tiles, the sequence's bounds, and tiles_before
    over the query tiles. Every (sequence, head, key tile) gets exactly one CTA; one head's key tiles of one
    sequence are consecutive CTAs in tile_of's order; heads of one sequence follow each other (the GQA dK/dV
    turns and the deterministic dQ turns wait only for CTAs launched earlier); every spare CTA comes after every
    owning one. Queries and keys packed differently (cross-attention), seqused_k on and off, malformed offsets
    too (they are clamped, not checked)."""
    rng = random.Random(len(lengths) * 7 + descending)
    b = len(lengths)
    cu_k = _cu(lengths)
    cu_q = _cu([rng.choice([0, 1, 80, 81, rng.randint(0, 700)]) for _ in lengths])
    if rng.random() < 0.2:  # not monotone, past the end: the runtime's unchecked values
        cu_q = [rng.randint(-5, cu_q[-1] + 5) for _ in cu_q]
    total_q, total_k = max(cu_q[-1], 1), cu_k[-1]
    if rng.random() < 0.3:  # keys overlapping, decreasing, past the end too
        cu_k = [rng.randint(-5, total_k + 300) for _ in cu_k]
    used = [rng.randint(-3, n + 3) for n in lengths]
    tile_n, tile_m = 128, 80
    grid = (-(-total_k // tile_n) + b) * heads
    mq, mk = tiling.monotone_values(cu_q, b, total_q), tiling.monotone_values(cu_k, b, total_k)
    for seqused in (None, used):
        seen, order = set(), []
        for cta in range(grid):
            got = tiling.key_tile_sequence(cu_q, cu_k, seqused, b, total_q, total_k, cta, heads, tile_n, tile_m,
                                           descending)
            s, n_block, head, key_tile, owned = got[:5]
            if cta >= owned * heads:  # spare: the CTA leaves, its other values unused
                continue
            assert tiling.tile_of_owned(mk, b, total_k, key_tile, tile_n, descending) == (s, n_block, owned)
            assert 0 <= head < heads and (s, head, key_tile) not in seen
            seen.add((s, head, key_tile))
            order.append((s, head, key_tile))
            oq, lq = tiling.sequence_bounds(mq, s, total_q)
            ok, lk = tiling.sequence_bounds(mk, s, total_k)
            lk = lk if seqused is None else min(max(seqused[s], 0), lk)
            assert got[5:] == (oq, lq, ok, lk, tiling.tiles_before(mq, s, total_q, tile_m)), (cta, s)
        owned = tiling.tile_of_owned(mk, b, total_k, 0, tile_n, descending)[2]
        assert len(order) == owned * heads  # every (key tile, head) once, all before the spare CTAs
        assert order == sorted(order)  # sequence, then head, then key tile: consecutive in tile_of's order


def test_the_backwards_monotone_reading_keeps_every_tile_inside_its_buffers():
    """The backward takes the caller's sequence values unchecked (max_seqlen_q given) and its kernels read them
    monotone (`monotone_chunk`): m_0 = 0, each entry clamped into [0, total], the running maximum. The raw
    values [0, T, 0, T] would number tile 31 of a 19-tile buffer (a review's finding); read monotone, the query
    tiles (`query_tile_sequence`: the preprocess and the dQ conversion) and key tiles (`key_tile_sequence`) of
    any values stay within ceil(total / tile) + batch, every sequence's rows within [0, total], back to back
    from 0, and the padding after the last sequence starts at `monotone_end`. Valid values read as they are."""
    rng = random.Random(11)
    fixed = [[0, 1024, 0, 1024], [0, 1024, -7, 1024], [5, 3, 2000, -1], [0, 300, 200, 100], [0, 100, 200, 300]]
    assert tiling.tiles_before(fixed[0], 3, 1024, 64) > -(-1024 // 64) + 3  # the raw reading overruns
    cases = [(v, 1024) for v in fixed]
    for _ in range(150):
        batch = rng.randint(1, 70)
        total = rng.randint(1, 3000)
        cases.append(([rng.randint(-50, total + 200) for _ in range(batch + 1)], total))
    for values, total in cases:
        batch = len(values) - 1
        m = tiling.monotone_values(values, batch, total)
        assert m[0] == 0 and all(a <= b <= total for a, b in zip(m, m[1:]))
        assert tiling.monotone_end(values, batch, total) == m[-1]
        for tile_m in (64, 80, 128):
            grid = -(-total // tile_m) + batch
            rows = 0
            for tile in range(grid):
                seq, m_block, owned, offset, seqlen = tiling.query_tile_sequence(values, batch, total, tile, tile_m)
                assert owned < grid  # a spare tile always exists: the dQ conversion's padding zeros need one
                assert (seq, m_block, owned) == tiling.tile_of_owned(m, batch, total, tile, tile_m, False)
                if tile >= owned:  # spare: the last sequence's end, for the padding rows after it
                    assert (offset, seqlen) == (m[-1], 0)
                    continue
                assert (offset, seqlen) == (m[seq], m[seq + 1] - m[seq]) and 0 <= m_block * tile_m < seqlen
                rows += min(tile_m, seqlen - m_block * tile_m)
            assert rows == m[-1]  # every row of [0, m_n) in exactly one owned tile
        valid = sorted(min(max(v, 0), total) for v in values)
        valid[0] = 0
        assert tiling.monotone_values(valid, batch, total) == valid

"""The backward's query-block range per key block (mask.m_block_range) is the exact dual of the
forward's key-block range per query block (mask.n_block_range): the deterministic backward orders
dQ additions by it, so a mismatch would hang a CTA or drop a contribution. Checked exhaustively on
small shapes through the emulator's line-for-line mirror (fa4gen/emulate/tiling.py)."""

import itertools

import pytest

from fa4gen.emulate import tiling
from fa4gen.reference import visible

MASKS = [
    dict(causal=False, local=False, chunked=False, window=(-1, -1), chunk=1),
    dict(causal=True, local=False, chunked=False, window=(-1, -1), chunk=1),
    *[dict(causal=False, local=True, chunked=False, window=w, chunk=1)
      for w in [(0, 0), (3, -1), (-1, 5), (17, 2), (1, 40), (70, 0)]],
    *[dict(causal=False, local=False, chunked=True, window=(-1, -1), chunk=c) for c in (1, 5, 16, 64, 1000)],
]


def _visits(seqlen_q, seqlen_k, tile_m, tile_n, m):
    kw = dict(causal=m["causal"], local=m["local"], chunked=m["chunked"])
    left, right = m["window"]
    n_blocks = -(-seqlen_k // tile_n)
    m_blocks = -(-seqlen_q // tile_m)
    fwd = set()
    for mb in range(m_blocks):
        bounds = tiling.tile_bounds(mb, tile_m, seqlen_q, seqlen_k, left, right, m["chunk"], **kw)
        n_min, n_max = tiling.n_block_range(bounds, tile_n)
        fwd |= {(mb, nb) for nb in range(n_min, n_max)}
    bwd = set()
    for nb in range(n_blocks):
        m_min, m_max = tiling.m_block_range(nb, tile_n, tile_m, seqlen_q, seqlen_k, left, right, m["chunk"], **kw)
        assert 0 <= m_min <= m_max <= m_blocks
        bwd |= {(mb, nb) for mb in range(m_min, m_max)}
    return fwd, bwd


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"c{int(m['causal'])}w{m['window']}k{m['chunk'] if m['chunked'] else 0}")
def test_m_block_range_is_the_dual_of_n_block_range(mask):
    for seqlen_q, seqlen_k in itertools.product((1, 7, 64, 65, 130, 200), (1, 9, 64, 100, 257)):
        for tile_m, tile_n in ((64, 128), (64, 64), (16, 32)):
            fwd, bwd = _visits(seqlen_q, seqlen_k, tile_m, tile_n, mask)
            assert fwd == bwd, (seqlen_q, seqlen_k, tile_m, tile_n)
            # and both are exactly the (query block, key block) pairs with a visible key
            vis = visible(seqlen_q, seqlen_k, causal=mask["causal"],
                          window=mask["window"] if mask["local"] else None,
                          chunk=mask["chunk"] if mask["chunked"] else None)
            truth = {(i // tile_m, j // tile_n) for i, j in vis.nonzero().tolist()}
            assert bwd == truth, (seqlen_q, seqlen_k, tile_m, tile_n)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"c{int(m['causal'])}w{m['window']}k{m['chunk'] if m['chunked'] else 0}")
def test_key_bounds_invert_row_bounds(mask):
    """The backward masks its transposed tiles per key (mask.key_bounds); the forward per query row
    (mask.row_bounds). Both must describe the same visible set, for chunk sizes up to seqlen_k (the
    API clamps larger ones, which give the same mask)."""
    kw = dict(causal=mask["causal"], local=mask["local"], chunked=mask["chunked"])
    left, right = mask["window"]
    for seqlen_k in (1, 5, 64, 130):
        chunk = min(mask["chunk"], seqlen_k)
        for pos in range(-70, seqlen_k + 70):
            lo, hi = tiling.row_bounds(pos, seqlen_k, left, right, chunk, **kw)
            for key in range(seqlen_k + 3):
                klo, khi = tiling.key_bounds(key, seqlen_k, left, right, chunk, **kw)
                assert (lo <= key < hi) == (klo <= pos < khi), (seqlen_k, pos, key)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"c{int(m['causal'])}w{m['window']}k{m['chunk'] if m['chunked'] else 0}")
def test_m_mask_phases_leave_out_only_fully_visible_blocks(mask):
    """The backward drops the mask code from the query blocks in [m_lo, m_hi): every real (query,
    key) pair of such a block and key block must be visible. Also checks the runs are ordered."""
    kw = dict(causal=mask["causal"], local=mask["local"], chunked=mask["chunked"])
    left, right = mask["window"]
    for seqlen_q, seqlen_k in itertools.product((1, 7, 64, 65, 130, 200), (1, 9, 64, 100, 257)):
        chunk = min(mask["chunk"], seqlen_k)
        vis = visible(seqlen_q, seqlen_k, causal=mask["causal"], window=mask["window"] if mask["local"] else None,
                      chunk=chunk if mask["chunked"] else None)
        for tile_m, tile_n in ((64, 128), (64, 64), (16, 32)):
            for nb in range(-(-seqlen_k // tile_n)):
                m_min, m_max = tiling.m_block_range(nb, tile_n, tile_m, seqlen_q, seqlen_k, left, right, chunk, **kw)
                m_lo, m_hi = tiling.m_mask_phases(nb, m_min, m_max, tile_n, tile_m, seqlen_q, seqlen_k, left, right,
                                                  chunk, **kw)
                assert m_min <= m_lo <= m_hi <= m_max
                for mb in range(m_lo, m_hi):
                    block = vis[mb * tile_m:(mb + 1) * tile_m, nb * tile_n:(nb + 1) * tile_n]
                    assert bool(block.all()), (seqlen_q, seqlen_k, tile_m, tile_n, nb, mb)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"c{int(m['causal'])}w{m['window']}k{m['chunk'] if m['chunked'] else 0}")
def test_transposed_mask_limits_do_not_wrap(mask):
    """mask.apply_mask_by_key turns each key's [lo, hi) into tile-local query offsets in Int32
    (mask.relative_bounds). Open sides are +-2**31 sentinels, so the offsets must be clamped before
    subtracting: unclamped, causal with seqlen_q > seqlen_k wrapped and masked every query (found on
    the H200: dq off by 1.9 at seqlen_q 1000, seqlen_k 255). Same test as the key-space one, per offset."""
    kw = dict(causal=mask["causal"], local=mask["local"], chunked=mask["chunked"])
    left, right = mask["window"]
    for seqlen_q, seqlen_k in ((1000, 255), (255, 1000), (64, 64), (3, 2**20), (2**20, 3)):
        chunk = min(mask["chunk"], seqlen_k)
        pos_shift = seqlen_k - seqlen_q
        for row_offset in sorted({0, 64, (seqlen_q // 64) * 64, max(seqlen_q - 64, 0)}):
            base = pos_shift + row_offset
            for key in sorted({0, 1, seqlen_k // 2, seqlen_k - 1, seqlen_k}):
                klo, khi = tiling.key_bounds(key, seqlen_k, left, right, chunk, **kw)
                lo, hi = tiling.relative_bounds(klo, khi, base)
                for q in range(64):
                    assert (lo <= q < hi) == (klo <= base + q < khi), (seqlen_q, seqlen_k, row_offset, key, q)


def test_causal_bit_mask_keeps_exactly_the_columns_below_the_limit():
    """mask.apply_mask with an upper bound only (causal): a row keeps a prefix of the thread's fragment
    columns (thread 0's view: 0, 1, 8, 9, 16, 17, ...), taken from one Int32 bit mask per 32 columns
    (`kept_prefix`, `prefix_bits`; element c kept iff bit c % 32 of its word is set, read as on the GPU
    with `bit_set`: an AND with a constant). It must keep exactly the columns the per-element compare keeps."""
    for n_cols in (16, 20, 32, 44, 64):
        cols = [8 * (c // 2) + c % 2 for c in range(n_cols)]
        for limit in range(-40, cols[-1] + 20):
            keep = tiling.kept_prefix(limit, n_cols)
            for c, col in enumerate(cols):
                bits = tiling.prefix_bits(keep - 32 * (c // 32))
                assert tiling.bit_set(bits, c % 32) == (col < limit), (n_cols, limit, c)


def test_transposed_causal_bit_mask_keeps_exactly_the_queries_the_compare_keeps():
    """mask.apply_mask_by_key, causal only: a key row keeps a suffix of the thread's query columns
    (thread 0's view 0, 1, 8, 9, ...), taken from one Int32 bit mask per 32 columns: ~prefix_bits of the
    dropped prefix (`dropped_prefix`: the columns below lo, or all for a key past seqlen_k). It must keep
    exactly what the per-element compare on the relative bounds keeps."""
    kw = dict(causal=True, local=False, chunked=False)
    for n_cols in (16, 20, 32, 64):
        cols = [8 * (c // 2) + c % 2 for c in range(n_cols)]
        for seqlen_q, seqlen_k in ((128, 128), (1000, 255), (40, 300)):
            for base in (seqlen_k - seqlen_q + off for off in (-200, -64, 0, 37, 64, 300)):
                for key in range(0, seqlen_k + 3, 7):
                    klo, khi = tiling.key_bounds(key, seqlen_k, -1, -1, 1, **kw)
                    lo, hi = tiling.relative_bounds(klo, khi, base)
                    drop = tiling.dropped_prefix(lo, hi, n_cols)
                    for c, q in enumerate(cols):
                        bits = ~tiling.prefix_bits(drop - 32 * (c // 32))
                        assert tiling.bit_set(bits, c % 32) == (lo <= q < hi), (n_cols, seqlen_q, seqlen_k, base, key, c)



def test_bit_set_reads_every_bit_of_an_int32_as_the_shift_does():
    """mask.bit_set (an AND with a constant, -2**31 for the sign bit) agrees with the arithmetic shift the
    masks read their bits with before, on every bit position of words with and without the sign bit."""
    words = [0, -1, 1, -2**31, 2**31 - 1, 0x55555555, -0x55555556, 0x0F0F0F0F, -12345678, 987654321]
    for w in words:
        for k in range(32):
            assert tiling.bit_set(w, k) == bool((w >> k) & 1), (w, k)

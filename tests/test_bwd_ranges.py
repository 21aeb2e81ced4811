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

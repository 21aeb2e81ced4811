"""Decoding helpers shared by the (192, 128) timeline scripts of sessions 81 / 82 (per_key_block.py, per_lead.py):
the pair-group size of the traced grid (the kernel's power-of-two group of (batch, head) pairs up to a limit that
divides the pair count) and the query blocks a key block visits (64-row query tiles, 96-key tiles, bench_fwd.py's
16384 tokens and 10 heads)."""
import math
import sys

sys.path.insert(0, '.')
from fa4gen.emulate.tiling import m_block_range  # noqa: E402


def pair_group(seqlen: int, limit: int) -> int:
    """The largest power of two <= limit (<= 16) that divides the (batch, head) pair count of the grid cell."""
    pairs = (16384 // seqlen) * 10
    g = 1
    for k in range(1, 5):
        size = 1 << k
        if limit >= size and pairs % size == 0:
            g = max(g, size)
    return g


def det_group(seqlen: int) -> int:
    """The deterministic grid's group: the pairs whose dQ rows fit the L2 budget (1408 bytes a query row), <= 16."""
    return pair_group(seqlen, min(max((50 * 1024 * 1024 // 1408) // seqlen, 1), 16))


def query_blocks(n: int, seqlen: int, causal: bool) -> int:
    """Query blocks key block n visits."""
    if not causal:
        return math.ceil(seqlen / 64)
    lo, hi = m_block_range(n, 96, 64, seqlen, seqlen, -1, -1, 0, causal=True, local=False, chunked=False)
    return hi - lo

"""Device helpers: attention masks as per-row column bounds (SM90 and SM100 share these).

Conventions are flash_attn's, bottom-right aligned: query row i sits at key position
i + (seqlen_k - seqlen_q). Every mask is a half-open column range [lo, hi) per row:
  seqlen only      lo = 0,                      hi = seqlen_k
  causal           hi = pos + 1
  sliding window   lo = pos - left, hi = pos + right + 1   (either side may be unbounded)
  chunked          lo = chunk start of pos,     hi = pos + 1
Which bounds exist is fixed at compile time; their values (window sizes, chunk size) are
run-time arguments, so one kernel serves every window. The same bounds, per tile, give the
key-block range a query tile must visit (`n_block_range`).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

NO_BOUND = -1  # run-time value meaning "unbounded" for a window side


@cute.jit
def row_bounds(
    pos: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    window_right: Int32,
    chunk: Int32,
    *,
    causal: cutlass.Constexpr[bool],
    local: cutlass.Constexpr[bool],
    chunked: cutlass.Constexpr[bool],
):
    """[lo, hi) of the keys visible from key-space position `pos` (may be empty)."""
    lo = Int32(0)
    hi = seqlen_k
    if cutlass.const_expr(causal or chunked):
        hi = cutlass.min(hi, pos + 1)
    if cutlass.const_expr(chunked):
        lo = cutlass.max(pos, 0) // chunk * chunk
    if cutlass.const_expr(local):
        if window_right >= 0:
            hi = cutlass.min(hi, pos + window_right + 1)
        if window_left >= 0:
            lo = cutlass.max(lo, pos - window_left)
    return lo, hi


@cute.jit
def apply_mask(
    s: cute.Tensor,
    coords: cute.Tensor,
    row_offset: Int32,
    col_offset: Int32,
    seqlen_k: Int32,
    pos_shift: Int32,
    window_left: Int32,
    window_right: Int32,
    chunk: Int32,
    *,
    causal: cutlass.Constexpr[bool],
    local: cutlass.Constexpr[bool],
    chunked: cutlass.Constexpr[bool],
):
    """Set masked scores to -inf. `s` and `coords` are (row, col) views of one tile;
    row_offset/col_offset place the tile; pos_shift = seqlen_k - seqlen_q."""
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        pos = coords[r, 0][0] + row_offset + pos_shift
        lo, hi = row_bounds(
            pos, seqlen_k, window_left, window_right, chunk,
            causal=causal, local=local, chunked=chunked,
        )
        lo = lo - col_offset
        hi = hi - col_offset
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            col = coords[0, c][1]
            if col >= hi or col < lo:
                s[r, c] = -Float32.inf


@cute.jit
def n_block_range(
    m_block: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    seqlen_q: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    window_right: Int32,
    chunk: Int32,
    *,
    causal: cutlass.Constexpr[bool],
    local: cutlass.Constexpr[bool],
    chunked: cutlass.Constexpr[bool],
):
    """[n_min, n_max) key blocks that hold any visible key for query rows of `m_block`."""
    shift = seqlen_k - seqlen_q
    first_pos = m_block * tile_m + shift
    last_pos = cutlass.min(m_block * tile_m + tile_m, seqlen_q) - 1 + shift
    lo, _ = row_bounds(
        first_pos, seqlen_k, window_left, window_right, chunk,
        causal=causal, local=local, chunked=chunked,
    )
    _, hi = row_bounds(
        last_pos, seqlen_k, window_left, window_right, chunk,
        causal=causal, local=local, chunked=chunked,
    )
    n_min = cutlass.max(lo, 0) // tile_n
    n_max = (hi + tile_n - 1) // tile_n
    n_max = cutlass.max(n_max, n_min)
    return n_min, n_max


@cute.jit
def tile_needs_mask(
    n_block: Int32,
    m_block: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    seqlen_q: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    window_right: Int32,
    chunk: Int32,
    *,
    causal: cutlass.Constexpr[bool],
    local: cutlass.Constexpr[bool],
    chunked: cutlass.Constexpr[bool],
) -> cutlass.Boolean:
    """True unless every row of the tile sees every column of key block `n_block`."""
    shift = seqlen_k - seqlen_q
    first_pos = m_block * tile_m + shift
    last_pos = m_block * tile_m + tile_m - 1 + shift
    col_lo = n_block * tile_n
    col_hi = col_lo + tile_n
    lo_last, _ = row_bounds(
        last_pos, seqlen_k, window_left, window_right, chunk,
        causal=causal, local=local, chunked=chunked,
    )
    _, hi_first = row_bounds(
        first_pos, seqlen_k, window_left, window_right, chunk,
        causal=causal, local=local, chunked=chunked,
    )
    # lo and hi never decrease with the row, so the first row has the smallest hi and the last
    # row the largest lo.
    needs = col_hi > hi_first or col_lo < lo_last
    return needs

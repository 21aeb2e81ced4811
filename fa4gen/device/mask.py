"""Device helpers: attention masks as per-row column bounds (SM90 and SM100 share these).

Conventions are flash_attn's, bottom-right aligned: query row i sits at key position
i + (seqlen_k - seqlen_q). Every mask is a half-open column range [lo, hi) per row:
  seqlen only      lo = 0,                      hi = seqlen_k
  causal           hi = pos + 1
  sliding window   lo = pos - left, hi = pos + right + 1   (either side may be unbounded)
  chunked          lo = chunk start of pos,     hi = pos + 1
Which bounds exist is fixed at compile time; their values (window sizes, chunk size) are
run-time arguments, so one kernel serves every window. The same bounds, per tile, give the
key-block range a query tile must visit (`tile_bounds`, `n_block_range`).
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
def tile_bounds(
    m_block: Int32,
    tile_m: cutlass.Constexpr[int],
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
    """(lo, hi) of the first and of the last valid query row of `m_block`, computed once per tile.

    lo and hi never decrease with the row, so the first row has the smallest lo and hi and the
    last row the largest. Rows past seqlen_q are never stored, so they are left out.
    """
    shift = seqlen_k - seqlen_q
    first_pos = m_block * tile_m + shift
    last_pos = cutlass.min(m_block * tile_m + tile_m, seqlen_q) - 1 + shift
    lo_first, hi_first = row_bounds(
        first_pos, seqlen_k, window_left, window_right, chunk, causal=causal, local=local, chunked=chunked
    )
    lo_last, hi_last = row_bounds(
        last_pos, seqlen_k, window_left, window_right, chunk, causal=causal, local=local, chunked=chunked
    )
    return lo_first, hi_first, lo_last, hi_last


@cute.jit
def n_block_range(bounds, tile_n: cutlass.Constexpr[int]):
    """[n_min, n_max) key blocks that hold any key visible from the tile's rows."""
    lo_first, _, _, hi_last = bounds
    n_min = cutlass.max(lo_first, 0) // tile_n
    n_max = cutlass.max((hi_last + tile_n - 1) // tile_n, n_min)
    return n_min, n_max


@cute.jit
def tile_needs_mask(bounds, n_block: Int32, tile_n: cutlass.Constexpr[int]) -> cutlass.Boolean:
    """True unless every row of the tile sees every column of key block `n_block`."""
    _, hi_first, lo_last, _ = bounds
    return (n_block + 1) * tile_n > hi_first or n_block * tile_n < lo_last


@cute.jit
def mask_phases(bounds, n_min: Int32, n_max: Int32, tile_n: cutlass.Constexpr[int]):
    """Split the key blocks after the first one, [n_min, n_max - 1), into three descending runs:
    [n_hi, n_max - 1) need the right-side mask (diagonal / window right edge / seqlen_k),
    [n_lo, n_hi) need no mask at all, [n_min, n_lo) need the left-side mask (window / chunk start).
    Returns (n_hi, n_lo), so the main loop can drop the mask code from its middle run."""
    _, hi_first, lo_last, _ = bounds
    last = cutlass.max(n_max - 1, n_min)
    # block b needs the right mask iff (b + 1) * tile_n > hi_first, i.e. b >= floor(hi_first / tile_n)
    n_hi = cutlass.min(cutlass.max(hi_first // tile_n, n_min), last)
    # block b needs the left mask iff b * tile_n < lo_last, i.e. b < ceil(lo_last / tile_n)
    n_lo = cutlass.min(cutlass.max((lo_last + tile_n - 1) // tile_n, n_min), n_hi)
    return n_hi, n_lo


@cute.jit
def m_block_range(
    n_block: Int32,
    tile_n: cutlass.Constexpr[int],
    tile_m: cutlass.Constexpr[int],
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
    """[m_min, m_max) query blocks with a row that sees any key of `n_block` (the backward's loop).

    The dual of `n_block_range`: query block m is in this range exactly when `n_block` is in
    n_block_range(tile_bounds(m)) (a row's visible keys form one interval that moves right with the
    row, so both sides describe "some row of the tile sees some key of the block")."""
    shift = seqlen_k - seqlen_q
    first_col = n_block * tile_n
    last_col = cutlass.min(first_col + tile_n, seqlen_k) - 1
    # first row whose hi exceeds first_col: hi = pos + 1 (causal/chunked) or pos + right + 1 (window)
    first_pos = shift  # row 0
    if cutlass.const_expr(causal or chunked):
        first_pos = first_col
    if cutlass.const_expr(local):
        if window_right >= 0:
            first_pos = first_col - window_right
    # last row whose lo is at most last_col: lo = pos - left (window) or the chunk start of pos
    last_pos = seqlen_q - 1 + shift
    if cutlass.const_expr(chunked):
        last_pos = cutlass.min(last_pos, (last_col // chunk + 1) * chunk - 1)
    if cutlass.const_expr(local):
        if window_left >= 0:
            last_pos = cutlass.min(last_pos, last_col + window_left)
    first_row = cutlass.max(first_pos - shift, 0)
    last_row = cutlass.min(last_pos - shift, seqlen_q - 1)
    m_min = first_row // tile_m
    m_max = cutlass.max(last_row // tile_m + 1, m_min)
    if last_row < first_row:
        m_max = m_min
    return m_min, m_max

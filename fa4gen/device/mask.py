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


def keep_or_ninf(x: Float32, keep) -> Float32:
    """x where `keep`, else -inf, as one select op. A conditional expression on a run-time value traces an
    if-region per element (with the load of x inside it), which the MLIR passes carry as a region until
    LLVM / ptxas turn it into the same predicated FSEL: more ops and trace time for the same SASS."""
    if isinstance(keep, bool):
        return x if keep else -Float32.inf
    return Float32(cutlass.select_(keep, x, -Float32.inf))


def ninf_or_keep(drop, x: Float32) -> Float32:
    """-inf where `drop`, else x (`keep_or_ninf` with the predicate's other sense, which ptxas keeps)."""
    if isinstance(drop, bool):
        return -Float32.inf if drop else x
    return Float32(cutlass.select_(drop, -Float32.inf, x))


def bit_set(bits: Int32, k: int):
    """Whether bit k (0..31, known at trace time) of `bits` is set, as one AND with a constant."""
    return (bits & Int32((1 << k) if k < 31 else -(1 << 31))) != 0


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
    coords0: cute.Tensor = None,
    chunk_lo: list = None,
):
    """Set masked scores to -inf. `s` and `coords` are (row, col) views of one tile;
    row_offset/col_offset place the tile; pos_shift = seqlen_k - seqlen_q.

    `coords0`: thread 0's coordinates of the same partition (an MMA fragment, where every thread's
    columns are thread 0's shifted by one amount). Its columns are compile-time constants, so each
    row's limits absorb this thread's shift once and every element costs one compare against an
    immediate (two with a window's or chunk's lower bound); without it, each element's column is a
    run-time value (the SM90 causal diagonal loop measured 866 instructions against 514 unmasked that
    way, ptxas recomputing exponentials for the registers the columns held; 643 with coords0). The
    SM100 forward calls it without: there, coords0 made the chunked d128 softmax loop spill and
    recompute exponentials (CPU SASS, session 4), although its score fragment has the property
    (tests/test_sm100_layouts.py).

    With an upper bound only (causal) and thread 0's columns in the SM90 accumulator pattern, a row
    keeps a prefix of its columns: one bit mask per 32 columns (`kept_prefix`, `prefix_bits`) replaces
    the compare per element and ptxas unpacks it with R2P (d128 diagonal loop 622 -> 596 instructions
    on the CPU; tests/test_bwd_ranges.py checks the bits against the compare).
    """
    shift = Int32(0)
    if cutlass.const_expr(coords0 is None):
        coords0 = coords
    else:
        shift = coords[0, 0][1] - coords0[0, 0][1]
    lower = local or chunked  # otherwise lo is 0 and no column of the tile is below it
    n_cols = cute.size(s, mode=[1])
    if cutlass.const_expr(not lower and coords0 is not coords and _fragment_columns(coords0, n_cols)):
        # upper bound only, on an MMA fragment: a row keeps a prefix of its columns, so one bit mask per
        # 32 columns (kept = low bits) replaces a compare per element; ptxas unpacks it with R2P
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            pos = coords[r, 0][0] + row_offset + pos_shift
            _, hi = row_bounds(
                pos, seqlen_k, window_left, window_right, chunk,
                causal=causal, local=local, chunked=chunked,
            )
            keep = kept_prefix(hi - col_offset - shift, n_cols)
            for w in cutlass.range_constexpr((n_cols + 31) // 32):
                bits = prefix_bits(keep - 32 * w)
                for c in cutlass.range_constexpr(32 * w, min(32 * w + 32, n_cols)):
                    s[r, c] = keep_or_ninf(s[r, c], bit_set(bits, c - 32 * w))
        return
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        pos = coords[r, 0][0] + row_offset + pos_shift
        lo, hi = row_bounds(
            pos, seqlen_k, window_left, window_right, chunk,
            causal=causal, local=local, chunked=chunked and chunk_lo is None,
        )
        if cutlass.const_expr(chunked and chunk_lo is not None):
            hi = cutlass.min(hi, pos + 1)
            lo = chunk_lo[r]
        hi = hi - col_offset - shift
        lo = lo - col_offset - shift
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            col = coords0[0, c][1]
            # selects, not branches: ptxas keeps them as FSEL on a predicate
            if cutlass.const_expr(lower):
                # (a conditional expression here: the select form reorders the d256 softcap + window forward's
                # masked loop (gemma2_9b; same instructions), not yet timed on the GPU)
                s[r, c] = -Float32.inf if col >= hi or col < lo else s[r, c]
            else:
                s[r, c] = ninf_or_keep(col >= hi, s[r, c])


def chunk_starts(coords: cute.Tensor, row_offset: Int32, pos_shift: Int32, chunk: Int32) -> list:
    """Per row of `coords` (a (row, col) view), the chunk start of its key-space position: the chunked mask's
    lower bound, computed once per query tile for `apply_mask(chunk_lo=...)` instead of in every masked key block."""
    return [cutlass.max(coords[r, 0][0] + row_offset + pos_shift, 0) // chunk * chunk
            for r in range(cute.size(coords, mode=[0]))]


def _fragment_columns(coords0: cute.Tensor, n_cols: int, mode: int = 1) -> bool:
    """Whether thread 0's columns (coordinate `mode` of each: 1 = key, 0 = query for a transposed tile)
    are the SM90 accumulator's pattern 0, 1, 8, 9, 16, 17, ... (two adjacent columns every 8), known at
    trace time."""
    cols = [coords0[0, c][mode] for c in range(n_cols)]
    return all(isinstance(col, int) for col in cols) and cols == [8 * (c // 2) + c % 2 for c in range(n_cols)]


@cute.jit
def kept_prefix(limit: Int32, n_cols: cutlass.Constexpr[int]) -> Int32:
    """How many of a thread's fragment columns (tile-local 0, 1, 8, 9, ... as thread 0 sees them) lie
    below `limit`: 2 per full group of 8, plus min(limit mod 8, 2); clamped to [0, n_cols]."""
    lim = cutlass.max(limit, 0)
    return cutlass.min(2 * (lim >> 3) + cutlass.min(lim & 7, 2), n_cols)


@cute.jit
def prefix_bits(n: Int32) -> Int32:
    """The low n bits set (n <= 0: none, n >= 32: all)."""
    m = cutlass.max(cutlass.min(n, 32), 0)
    return Int32(-1) if m == 32 else (Int32(1) << m) - 1


@cute.jit
def dropped_prefix(lo: Int32, hi: Int32, n_cols: cutlass.Constexpr[int]) -> Int32:
    """How many of a thread's fragment columns (0, 1, 8, 9, ... as thread 0 sees them) a transposed
    causal tile masks for one key row whose kept queries are [lo, hi) in those indices, with hi either
    past the tile or <= lo (a key past seqlen_k): the columns below lo, or all of them."""
    return n_cols if hi <= lo else kept_prefix(lo, n_cols)


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



@cute.jit
def key_bounds(
    key: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    window_right: Int32,
    chunk: Int32,
    *,
    causal: cutlass.Constexpr[bool],
    local: cutlass.Constexpr[bool],
    chunked: cutlass.Constexpr[bool],
):
    """[lo, hi) of the key-space positions that see key `key`: the inverse of `row_bounds`
    (pos sees key  <=>  lo <= pos < hi), for kernels that hold a tile with keys as rows.
    The chunk size must be at most max(seqlen_k, 1) (the API clamps it; larger is the same mask)."""
    lo = Int32(-(2**31) + 1)
    hi = Int32(2**31 - 1)
    if cutlass.const_expr(causal or chunked):
        lo = key
    if cutlass.const_expr(chunked):
        hi = key - key % chunk + chunk  # the next chunk start
    if cutlass.const_expr(local):
        if window_right >= 0:
            lo = key - window_right
        if window_left >= 0:
            hi = key + window_left + 1
    if key >= seqlen_k:
        hi = lo
    return lo, hi


TILE_SPAN = 2**16  # more than any tile-local query index a thread holds


@cute.jit
def relative_bounds(lo: Int32, hi: Int32, base: Int32):
    """[lo, hi) in key-space positions as offsets from position `base`, both clamped to [-1, TILE_SPAN]:
    the same test for every offset in [0, TILE_SPAN), without Int32 wrap-around for open bounds
    (base + TILE_SPAN stays in range: positions are below seqlen_k, and a tensor of 2**31 - 2**16 rows
    does not fit on a GPU)."""
    first, last = base - 1, base + TILE_SPAN
    return cutlass.min(cutlass.max(lo, first), last) - base, cutlass.min(cutlass.max(hi, first), last) - base


@cute.jit
def apply_mask_by_key(
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
    coords0: cute.Tensor = None,
):
    """`apply_mask` for a transposed tile (the backward's Sᵀ = K·Qᵀ): `s` and `coords` are
    (key, query) views holding (query, key) coordinates; row_offset places the queries, col_offset
    the keys. Bounds come per key row (`key_bounds`), so a thread evaluates them once per key;
    `coords0` as in `apply_mask` (thread 0's coordinates: compile-time query offsets). Causal only: a
    key row keeps a suffix of its queries, taken from one bit mask per 32 columns (`dropped_prefix`;
    tests/test_bwd_ranges.py checks the bits against the compare)."""
    shift = Int32(0)
    if cutlass.const_expr(coords0 is None):
        coords0 = coords
    else:
        shift = coords[0, 0][0] - coords0[0, 0][0]
    # key-space position of thread 0's query index 0, shifted by this thread's offset
    base = pos_shift + row_offset + shift
    n_cols = cute.size(s, mode=[1])
    if cutlass.const_expr(causal and not local and not chunked and coords0 is not coords
                          and _fragment_columns(coords0, n_cols, mode=0)):
        # causal only, on an MMA fragment: a key row keeps a suffix of its query columns, so one bit
        # mask per 32 columns (kept = the bits above the dropped prefix) replaces a compare per element
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            lo, hi = key_bounds(
                coords[r, 0][1] + col_offset, seqlen_k, window_left, window_right, chunk,
                causal=causal, local=local, chunked=chunked,
            )
            lo, hi = relative_bounds(lo, hi, base)
            drop = dropped_prefix(lo, hi, n_cols)
            for w in cutlass.range_constexpr((n_cols + 31) // 32):
                bits = ~prefix_bits(drop - 32 * w)
                for c in cutlass.range_constexpr(32 * w, min(32 * w + 32, n_cols)):
                    s[r, c] = keep_or_ninf(s[r, c], bit_set(bits, c - 32 * w))
        return
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        lo, hi = key_bounds(
            coords[r, 0][1] + col_offset, seqlen_k, window_left, window_right, chunk,
            causal=causal, local=local, chunked=chunked,
        )
        # in tile-local query indices of thread 0 (the bounds are key-space positions), clamped to the
        # tile first: an open side (+-2**31 sentinels) minus a negative / positive base would wrap Int32
        # (causal with seqlen_q > seqlen_k masked every query)
        lo, hi = relative_bounds(lo, hi, base)
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            q = coords0[0, c][0]
            s[r, c] = ninf_or_keep(q >= hi or q < lo, s[r, c])


@cute.jit
def m_mask_phases(
    n_block: Int32,
    m_min: Int32,
    m_max: Int32,
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
    """The backward's `mask_phases`: split the query blocks [m_min, m_max) of key block `n_block` into
    [m_min, m_lo) masked (diagonal / window right edge), [m_lo, m_hi) where every query row sees every
    key of the block (no mask code), [m_hi, m_max) masked (window left edge / chunk start).
    Conservative: a block is left in a masked run unless all its rows see all its keys."""
    shift = seqlen_k - seqlen_q
    first_col = n_block * tile_n
    last_col = cutlass.min(first_col + tile_n, seqlen_k) - 1
    m_lo = m_min
    m_hi = m_max
    # right side: the block's first row must see last_col, hi = pos + 1 + right > last_col
    if cutlass.const_expr(causal or chunked or local):
        right = Int32(0)
        bounded = True
        if cutlass.const_expr(local):
            right = window_right
            bounded = window_right >= 0
        if bounded:
            need = cutlass.max(last_col - shift - right, 0)
            m_lo = cutlass.max((need + tile_m - 1) // tile_m, m_min)
    m_lo = cutlass.min(m_lo, m_max)
    # left side: the block's last row must see first_col, lo(pos_last) <= first_col
    if cutlass.const_expr(chunked or local):
        limit = Int32(0)  # the largest last-row position whose lo is <= first_col
        bounded = True
        if cutlass.const_expr(chunked):
            limit = first_col - first_col % chunk + chunk - 1
        if cutlass.const_expr(local):
            limit = first_col + window_left
            bounded = window_left >= 0
        if bounded:
            # last row of block m: m * tile_m + tile_m - 1 + shift <= limit
            y = limit - shift - tile_m + 1
            m_hi = Int32(0)
            if y >= 0:
                m_hi = y // tile_m + 1
    m_hi = cutlass.min(cutlass.max(m_hi, m_lo), m_max)
    return m_lo, m_hi

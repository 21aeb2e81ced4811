"""Emulator: the kernel's index math in plain Python — mask bounds, key-block ranges, and which
score columns a thread evaluates with the polynomial exp2.

Mirrors fa4gen/device/mask.py line for line (same names, same arguments, ints instead of Int32)
and the SM90 accumulator fragment layout of fa4gen/device/layout.py. Keep the two in step: the
emulator is only worth something if it makes the kernel's decisions, not the textbook ones.
"""

from __future__ import annotations

NO_BOUND = -1  # run-time value meaning "unbounded" for a window side


def i32(x: int) -> int:
    """x wrapped to a 32-bit signed integer, as Int32 arithmetic on the GPU wraps."""
    return (x + 2**31) % 2**32 - 2**31


def row_bounds(pos, seqlen_k, window_left, window_right, chunk, *, causal, local, chunked):
    """[lo, hi) of the keys visible from key-space position `pos` (may be empty)."""
    lo, hi = 0, seqlen_k
    if causal or chunked:
        hi = min(hi, i32(pos + 1))
    if chunked:
        lo = max(pos, 0) // chunk * chunk
    if local:
        if window_right >= 0:
            hi = min(hi, i32(pos + window_right + 1))
        if window_left >= 0:
            lo = max(lo, i32(pos - window_left))
    return lo, hi


def tile_bounds(m_block, tile_m, seqlen_q, seqlen_k, window_left, window_right, chunk, *, causal, local, chunked):
    """(lo, hi) of the first and of the last valid query row of `m_block`."""
    shift = seqlen_k - seqlen_q
    first_pos = m_block * tile_m + shift
    last_pos = min(m_block * tile_m + tile_m, seqlen_q) - 1 + shift
    kw = dict(causal=causal, local=local, chunked=chunked)
    lo_first, hi_first = row_bounds(first_pos, seqlen_k, window_left, window_right, chunk, **kw)
    lo_last, hi_last = row_bounds(last_pos, seqlen_k, window_left, window_right, chunk, **kw)
    return lo_first, hi_first, lo_last, hi_last


def n_block_range(bounds, tile_n):
    """[n_min, n_max) key blocks that hold any key visible from the tile's rows."""
    lo_first, _, _, hi_last = bounds
    n_min = max(lo_first, 0) // tile_n
    n_max = max((hi_last + tile_n - 1) // tile_n, n_min)
    return n_min, n_max



def m_block_range(n_block, tile_n, tile_m, seqlen_q, seqlen_k, window_left, window_right, chunk, *,
                  causal, local, chunked):
    """[m_min, m_max) query blocks with a row that sees any key of `n_block` (the backward's loop)."""
    shift = seqlen_k - seqlen_q
    first_col = n_block * tile_n
    last_col = min(first_col + tile_n, seqlen_k) - 1
    first_pos = shift  # row 0
    if causal or chunked:
        first_pos = first_col
    if local and window_right >= 0:
        first_pos = first_col - window_right
    last_pos = seqlen_q - 1 + shift
    if chunked:
        last_pos = min(last_pos, i32((last_col // chunk + 1) * chunk - 1))
    if local and window_left >= 0:
        last_pos = min(last_pos, last_col + window_left)
    first_row = max(first_pos - shift, 0)
    last_row = min(last_pos - shift, seqlen_q - 1)
    m_min = first_row // tile_m
    m_max = max(last_row // tile_m + 1, m_min)
    if last_row < first_row:
        m_max = m_min
    return m_min, m_max


def key_bounds(key, seqlen_k, window_left, window_right, chunk, *, causal, local, chunked):
    """[lo, hi) of the key-space positions that see `key` (the inverse of row_bounds)."""
    lo, hi = -(2**31) + 1, 2**31 - 1
    if causal or chunked:
        lo = key
    if chunked:
        hi = key - key % chunk + chunk
    if local:
        if window_right >= 0:
            lo = key - window_right
        if window_left >= 0:
            hi = key + window_left + 1
    if key >= seqlen_k:
        hi = lo
    return lo, hi


TILE_SPAN = 2**16


def kept_prefix(limit, n_cols):
    """mask.kept_prefix: how many fragment columns 0, 1, 8, 9, ... lie below `limit`, in [0, n_cols]."""
    lim = max(limit, 0)
    return min(2 * (lim >> 3) + min(lim & 7, 2), n_cols)


def prefix_bits(n):
    """mask.prefix_bits as an Int32: the low n bits set (n <= 0: none, n >= 32: all, i.e. -1)."""
    m = max(min(n, 32), 0)
    return -1 if m == 32 else i32((1 << m) - 1)


def bit_set(bits, k):
    """mask.bit_set: whether bit k (0..31) of the Int32 `bits` is set, as the AND with a constant the
    kernels use (bit 31 is the sign bit: the constant is -2**31)."""
    return (i32(bits) & ((1 << k) if k < 31 else -(1 << 31))) != 0


def dropped_prefix(lo, hi, n_cols):
    """mask.dropped_prefix: the fragment columns a transposed causal key row masks (below lo, or all)."""
    return n_cols if hi <= lo else kept_prefix(lo, n_cols)


def relative_bounds(lo, hi, base):
    """mask.relative_bounds in Int32 arithmetic: [lo, hi) as offsets from `base`, clamped."""
    first, last = i32(base - 1), i32(base + TILE_SPAN)
    return i32(min(max(lo, first), last) - base), i32(min(max(hi, first), last) - base)


def m_mask_phases(n_block, m_min, m_max, tile_n, tile_m, seqlen_q, seqlen_k, window_left, window_right, chunk, *,
                  causal, local, chunked):
    """(m_lo, m_hi): [m_min, m_lo) and [m_hi, m_max) masked, [m_lo, m_hi) mask-free (the backward's runs)."""
    shift = seqlen_k - seqlen_q
    first_col = n_block * tile_n
    last_col = min(first_col + tile_n, seqlen_k) - 1
    m_lo, m_hi = m_min, m_max
    if causal or chunked or local:
        right, bounded = 0, True
        if local:
            right, bounded = window_right, window_right >= 0
        if bounded:
            need = max(last_col - shift - right, 0)
            m_lo = max((need + tile_m - 1) // tile_m, m_min)
    m_lo = min(m_lo, m_max)
    if chunked or local:
        limit, bounded = 0, True
        if chunked:
            limit = first_col - first_col % chunk + chunk - 1
        if local:
            limit, bounded = first_col + window_left, window_left >= 0
        if bounded:
            y = limit - shift - tile_m + 1
            m_hi = y // tile_m + 1 if y >= 0 else 0
    m_hi = min(max(m_hi, m_lo), m_max)
    return m_lo, m_hi

def tile_needs_mask(bounds, n_block, tile_n) -> bool:
    """True unless every row of the tile sees every column of key block `n_block`."""
    _, hi_first, lo_last, _ = bounds
    return (n_block + 1) * tile_n > hi_first or n_block * tile_n < lo_last


def mask_phases(bounds, n_min, n_max, tile_n):
    """Split the key blocks after the first one, [n_min, n_max - 1), into three descending runs:
    [n_hi, n_max - 1) right-side masked, [n_lo, n_hi) unmasked, [n_min, n_lo) left-side masked."""
    _, hi_first, lo_last, _ = bounds
    last = max(n_max - 1, n_min)
    n_hi = min(max(hi_first // tile_n, n_min), last)
    n_lo = min(max((lo_last + tile_n - 1) // tile_n, n_min), n_hi)
    return n_hi, n_lo


def schedule(bounds, n_min, n_max, tile_n, *, causal, local, chunked) -> list[tuple[int, bool]]:
    """(key block, apply the mask?) in the order the consumer's main loop visits them.

    Last block first (the producer loads n_max - 1 - i on iteration i). With a mask: the runs of
    mask_phases, the first block always masked, the left-masked run only for windows and chunks
    (templates/sm90/_consumer.j2 `runs`). Without: only the first (possibly ragged) block masks
    the columns past seqlen_k.
    """
    if not (causal or local or chunked):
        return [(n, n == n_max - 1) for n in range(n_max - 1, n_min - 1, -1)]
    n_hi, n_lo = mask_phases(bounds, n_min, n_max, tile_n)
    blocks = [(n, True) for n in range(n_max - 1, n_hi - 1, -1)]
    blocks += [(n, False) for n in range(n_hi - 1, n_lo - 1, -1)]
    if local or chunked:
        blocks += [(n, True) for n in range(n_lo - 1, n_min - 1, -1)]
    return blocks


def fragment_column(col: int) -> int:
    """Index c of tile column `col` within its thread's row fragment on SM90.

    A WGMMA accumulator gives lane t of a quad the columns 8 * (c // 2) + 2 * t + (c % 2) for
    c in range(tile_n // 4); the (row, col) view (layout.rows_cols) enumerates them in that order.
    """
    return 2 * (col // 8) + col % 2


def poly_columns(tile_n: int, poly_every: int) -> list[bool]:
    """For each column of a key tile: is its exp2 evaluated with the polynomial?

    softmax.online_softmax_step uses the polynomial for fragment element c when
    c % poly_every == poly_every - 1 (every k-th exp2 of each thread's row), MUFU otherwise.
    """
    if poly_every <= 0:
        return [False] * tile_n
    return [fragment_column(col) % poly_every == poly_every - 1 for col in range(tile_n)]


def sequence_bounds(cu_seqlens: list[int], seq: int, total: int) -> tuple[int, int]:
    """(offset, length) of sequence `seq`, clamped into a packed tensor of `total` rows
    (fa4gen/device/varlen.py: sequence_bounds)."""
    start = min(max(cu_seqlens[seq], 0), total)
    end = min(max(cu_seqlens[seq + 1], start), total)
    return start, end - start


def tile_of(cu_seqlens: list[int], num_seqs: int, total: int, tile: int, tile_m: int,
            descending: bool) -> tuple[int, int]:
    """(sequence, m_block) of linear query tile `tile` (fa4gen/device/varlen.py: tile_of)."""
    seq, m_block, _ = tile_of_owned(cu_seqlens, num_seqs, total, tile, tile_m, descending)
    return seq, m_block


def _scan_up(counts: list[int]) -> list[int]:
    """The 32 lanes' inclusive prefix sums as the kernels' shuffle-up scan forms them: at step k lane l adds
    lane l - 2^k's value from the step before."""
    incl = list(counts)
    for step in range(5):
        incl = [incl[lane] + (incl[lane - (1 << step)] if lane >= (1 << step) else 0) for lane in range(32)]
    return incl


def _first_past(incl: list[int], base: int, tile: int) -> int | None:
    """The first lane whose running total passes `tile` (the kernels' ballot and lowest set bit), or None when
    this chunk does not hold the tile (no lane passes it, or an earlier chunk already did)."""
    hits = [base + incl[lane] > tile for lane in range(32)]
    return hits.index(True) if any(hits) and base <= tile else None


def tile_of_owned(cu_seqlens: list[int], num_seqs: int, total: int, tile: int, tile_m: int,
                  descending: bool) -> tuple[int, int, int]:
    """(sequence, m_block, tiles the sequences own) of linear query tile `tile` (fa4gen/device/varlen.py:
    tile_of_owned), with the kernel's 32-lane chunks, warp prefix sums and first-lane ballot spelled out."""
    seq, m_block, base = num_seqs - 1, tile, 0
    for j in range(0, num_seqs, 32):
        counts = [0] * 32
        for lane in range(32):
            if j + lane < num_seqs:
                _, length = sequence_bounds(cu_seqlens, j + lane, total)
                counts[lane] = (length + tile_m - 1) // tile_m
        incl = _scan_up(counts)
        first = _first_past(incl, base, tile)
        if first is not None:
            local = tile - base - (incl[first] - counts[first])
            seq = j + first
            m_block = counts[first] - 1 - local if descending else local
        base += incl[31]
    return seq, m_block, base


def tiles_before(cu_seqlens: list[int], seq: int, total: int, tile_m: int) -> int:
    """Sequence `seq`'s first tile number in tile_of's numbering (fa4gen/device/varlen.py)."""
    return sum((sequence_bounds(cu_seqlens, i, total)[1] + tile_m - 1) // tile_m for i in range(seq))


def _scan_max(values: list[int]) -> list[int]:
    """The 32 lanes' inclusive running maxima as the kernels' shuffle-up scan forms them."""
    out = list(values)
    for step in range(5):
        out = [max(out[lane], out[lane - (1 << step)]) if lane >= (1 << step) else out[lane] for lane in range(32)]
    return out


def monotone_chunk(cu_seqlens: list[int], j: int, num_seqs: int, total: int, carry: int):
    """fa4gen/device/varlen.py `monotone_chunk`: the 32 lanes' (start, length) of sequences j + lane with the
    sequence values read monotone (m_0 = 0, m_i = max(m_{i-1}, cu_seqlens[i] clamped into [0, total])), and
    m_{j+32}; `carry` is m_j."""
    ends = [min(max(cu_seqlens[j + lane + 1], 0), total) if j + lane < num_seqs else 0 for lane in range(32)]
    ends = [max(e, carry) for e in _scan_max(ends)]
    starts = [carry] + ends[:31]
    return [(a, b - a) for a, b in zip(starts, ends)], ends[31]


def monotone_values(cu_seqlens: list[int], num_seqs: int, total: int) -> list[int]:
    """m_0..m_num_seqs, the sequence values as the backward's kernels read them (what the runtime's sanitised
    copy held before session 29: the first 0, each entry clamped into [0, total], the running maximum)."""
    m = [0]
    for v in cu_seqlens[1:num_seqs + 1]:
        m.append(max(m[-1], min(max(v, 0), total)))
    return m


def monotone_end(cu_seqlens: list[int], num_seqs: int, total: int) -> int:
    """fa4gen/device/varlen.py `monotone_end`: m_num_seqs."""
    return max([0] + [min(max(v, 0), total) for v in cu_seqlens[1:num_seqs + 1]])


def query_tile_sequence(cu_seqlens: list[int], num_seqs: int, total: int, tile: int, tile_m: int) -> tuple:
    """fa4gen/device/varlen.py `query_tile_sequence`: (seq, m_block, owned, offset, seqlen) of linear query
    tile `tile`, the sequence values read monotone, chunk by chunk as the kernels scan them."""
    seq, m_block, base, carry, offset, seqlen = num_seqs - 1, tile, 0, 0, 0, 0
    for j in range(0, num_seqs, 32):
        lanes, next_carry = monotone_chunk(cu_seqlens, j, num_seqs, total, carry)
        counts = [(n + tile_m - 1) // tile_m for _, n in lanes]
        incl = _scan_up(counts)
        first = _first_past(incl, base, tile)
        if first is not None:
            m_block = tile - base - (incl[first] - counts[first])
            seq = j + first
            offset, seqlen = lanes[first]
        base += incl[31]
        carry = next_carry
    if base <= tile:
        offset = carry
    return seq, m_block, base, offset, seqlen


def key_tile_sequence(cu_q: list[int], cu_k: list[int], seqused_k: list[int] | None, num_seqs: int, total_q: int,
                      total_k: int, cta: int, heads: int, tile_n: int, tile_m: int, descending: bool) -> tuple:
    """(seq, n_block, head, key_tile, owned, offset_q, seqlen_q, offset_k, seqlen_k, q_tile0) of linear backward
    CTA `cta` as fa4gen/device/varlen.py's `key_tile_sequence` finds them in one scan: each lane holds its
    sequence's key and query bounds, both read monotone (`monotone_chunk`; seqused_k: None = not used),
    inclusive prefix sums of both tile counts, the first lane whose (tiles so far) x heads passes `cta`, the
    head and key tile from the CTA's rank in that sequence's block, its values shuffled out and the query tiles
    before it as the exclusive prefix."""
    seq, n_block, head, key_tile, base, q_base, carry_q, carry_k = num_seqs - 1, cta, 0, cta, 0, 0, 0, 0
    found = (0, 0, 0, 0, 0)
    for j in range(0, num_seqs, 32):
        q_lanes, next_q = monotone_chunk(cu_q, j, num_seqs, total_q, carry_q)
        k_lanes, next_k = monotone_chunk(cu_k, j, num_seqs, total_k, carry_k)
        lanes = []
        for lane, ((oq, lq), (ok, lk)) in enumerate(zip(q_lanes, k_lanes)):
            used = 0 if j + lane >= num_seqs else lk if seqused_k is None else min(max(seqused_k[j + lane], 0), lk)
            lanes.append((oq, lq, ok, lk, used))
        counts = [(lk + tile_n - 1) // tile_n for _, _, _, lk, _ in lanes]
        q_counts = [(lq + tile_m - 1) // tile_m for _, lq, _, _, _ in lanes]
        incl, q_incl = _scan_up(counts), _scan_up(q_counts)
        hits = [(base + incl[lane]) * heads > cta for lane in range(32)]
        if any(hits) and base * heads <= cta:
            first = hits.index(True)
            before = base + incl[first] - counts[first]
            head, local = divmod(cta - before * heads, counts[first])
            key_tile = before + local
            seq = j + first
            n_block = counts[first] - 1 - local if descending else local
            oq, lq, ok, _, used = lanes[first]
            found = (oq, lq, ok, used, q_base + q_incl[first] - q_counts[first])
        base += incl[31]
        q_base += q_incl[31]
        carry_q, carry_k = next_q, next_k
    return (seq, n_block, head, key_tile, base) + found

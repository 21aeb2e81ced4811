"""Device helpers for packed variable-length sequences (spec `varlen: true`).

Packed tensors hold every sequence's rows back to back: (total, heads, dim), sequence i at rows
cu_seqlens[i] : cu_seqlens[i + 1]. A TMA box that starts inside one sequence can run past its end
into the next one: harmless for loads that the mask discards, wrong for stores (they would overwrite
the next sequence's output) and for keys past seqused_k (unused cache slots may hold NaN, and 0·NaN
poisons P·V). So every packed tensor gets a *bounded* view in which the rows past a sequence's end
are out of bounds for TMA — loads read zeros there, stores drop them — with no per-sequence
descriptor and no change to the base pointer:

  the row mode (stride s) gets extent SPAN = 2^30, and two trailing modes are added, of strides
  W = 2^34 - s and s. Row r of the sequence at `offset` with `length` rows is addressed as
  (SPAN - length + r, ..., SPAN, offset + length):
      (SPAN - length + r)·s + SPAN·W + (offset + length)·s = (offset + r)·s + SPAN·2^34,
  and SPAN·2^34 = 2^64 vanishes in TMA's 64-bit address arithmetic. TMA's bounds check on the row
  mode (< SPAN) is exactly r < length.

Triton's ragged TMA tensors use this two-extra-mode form (written here for fa4gen). A one-extra-
mode variant that moves the base pointer back by SPAN rows instead faults on TMA *loads* (the moved
pointer must be mapped memory; measured here: an illegal address on the H200), so it is not used.
The view takes a tensor of at most 3 modes (TMA addresses 5).

Per-sequence bounds are read from cu_seqlens and clamped to the packed extents, so malformed
offsets cannot reach memory outside the tensors (the runtime validates them on the host unless the
caller passes max_seqlen_q and takes responsibility, as flash_attn_varlen_func does).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import nvvm
from cutlass.cutlass_dsl import dsl_user_op

SPAN = 2**30  # extent of the bounded row mode: a sequence's rows sit at [SPAN - length, SPAN)
WRAP = 2**64 // SPAN  # SPAN * WRAP elements is 0 modulo 2^64 bytes, whatever the element size
ENDS = 2**31 - 1  # extent of the two extra modes


def bounded_view(t: cute.Tensor, mode: int) -> cute.Tensor:
    """`t` (at most 3 modes) with `mode`, its packed sequence-row mode, bounded per sequence by
    `sequence_rows`."""
    assert cute.rank(t) <= 3, "a bounded view adds two modes; TMA takes at most 5"
    row_stride = t.stride[mode]
    shape = tuple(SPAN if i == mode else t.shape[i] for i in range(cute.rank(t))) + (ENDS, ENDS)
    stride = t.stride + (WRAP - row_stride, row_stride)
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


@cute.jit
def sequence_rows(view: cute.Tensor, offset: Int32, length: Int32, mode: cutlass.Constexpr[int]) -> cute.Tensor:
    """The rows [offset, offset + length) of a bounded view (or of its TMA coordinate tensor), as a
    tensor of the original rank whose row `r` is row offset + r of the packed tensor and whose rows
    at or past `length` are out of bounds."""
    rank = cute.rank(view)
    picked = view[(None,) * (rank - 2) + (SPAN, offset + length)]
    return cute.domain_offset(tuple(SPAN - length if i == mode else None for i in range(rank - 2)), picked)


@cute.jit
def sequence_bounds(cu_seqlens: cute.Tensor, seq: Int32, total: Int32):
    """(offset, length) of sequence `seq` in a packed tensor of `total` rows, clamped into it."""
    start = cutlass.min(cutlass.max(cu_seqlens[seq], 0), total)
    end = cutlass.min(cutlass.max(cu_seqlens[seq + 1], start), total)
    return start, end - start


@cute.jit
def sequence(cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor, seqused_k: cute.Tensor, seq: Int32,
             total_q: Int32, total_k: Int32, use_seqused: Int32):
    """(offset_q, seqlen_q, offset_k, seqlen_k) of sequence `seq`: its rows in the packed q and k
    tensors, clamped into them, the key count cut to seqused_k[seq] when `use_seqused` is set."""
    offset_q, seqlen_q = sequence_bounds(cu_seqlens_q, seq, total_q)
    offset_k, seqlen_k = sequence_bounds(cu_seqlens_k, seq, total_k)
    return offset_q, seqlen_q, offset_k, used_length(seqused_k, seq, seqlen_k, use_seqused)


@cute.jit
def used_length(seqused: cute.Tensor, seq: Int32, length: Int32, use: Int32) -> Int32:
    """The key count of sequence `seq`: seqused[seq] when `use` is set (clamped to its cu_seqlens
    length), else the full length."""
    used = length
    if use != 0:
        used = cutlass.min(cutlass.max(seqused[seq], 0), length)
    return used


@cute.jit
def tile_of(cu_seqlens: cute.Tensor, num_seqs: Int32, total: Int32, tile: Int32,
            tile_m: cutlass.Constexpr[int], descending: cutlass.Constexpr[bool]):
    """(sequence, m_block) of linear query tile `tile` of a packed batch: sequence i owns
    ceil(len_i / tile_m) consecutive tile numbers after those of sequences < i, so a grid of
    ceil(total / tile_m) + num_seqs tiles covers every sequence with no per-sequence padding and no
    host read-back. With `descending`, a sequence's tiles come last block first (longest-first for
    causal / windowed masks). Tiles past the last sequence give (num_seqs - 1, a block past its end).
    `tile_of_owned` also returns how many tiles the sequences own."""
    seq, m_block, _ = tile_of_owned(cu_seqlens, num_seqs, total, tile, tile_m, descending)
    return seq, m_block


@cute.jit
def _warp_inclusive_sum(x: Int32, use_max: cutlass.Constexpr[bool] = False) -> Int32:
    """Lane l's sum (`use_max`: maximum) of lanes 0..l's x: five shuffle-up steps, lane l combining lane
    l - 2^k's running value."""
    lane = cute.arch.lane_idx()
    for step in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(x, 1 << step)
        if lane >= (1 << step):
            if cutlass.const_expr(use_max):
                x = cutlass.max(x, up)
            else:
                x = x + up
    return x


@cute.jit
def _lowest_lane(hits) -> Int32:
    """The lowest lane set in a non-zero ballot."""
    return cute.arch.popc((hits & (0 - hits)) - 1)


@cute.jit
def _owner_lane(incl: Int32, base: Int32, tile: Int32) -> Int32:
    """The first lane whose running total (`base` + its inclusive prefix `incl`) passes `tile`, or 32 when
    this chunk does not hold the tile (no lane passes it, or an earlier chunk already did): warp-uniform."""
    hits = cute.arch.vote_ballot_sync(base + incl > tile)
    first = Int32(32)
    if hits != 0:
        if base <= tile:
            first = _lowest_lane(hits)
    return first


@cute.jit
def _clamped_end(cu_seqlens: cute.Tensor, j: Int32, num_seqs: Int32, total: Int32) -> Int32:
    """Lane l's cu_seqlens[j + l + 1] clamped into [0, total], 0 for lanes past the last sequence."""
    end = Int32(0)
    if j + cute.arch.lane_idx() < num_seqs:
        end = cutlass.min(cutlass.max(cu_seqlens[j + cute.arch.lane_idx() + 1], 0), total)
    return end


@cute.jit
def monotone_chunk(cu_seqlens: cute.Tensor, j: Int32, num_seqs: Int32, total: Int32, carry: Int32):
    """Sequences j + lane (a warp's chunk of 32) as the backward reads cu_seqlens: monotone, the values
    m_0 = 0, m_i = max(m_{i-1}, cu_seqlens[i] clamped into [0, total]), sequence i at [m_i, m_{i+1}) — valid
    values read as they are; overlapping, decreasing or negative ones (the unchecked values of a call that
    passed max_seqlen_q) can then neither number more tiles than the ceil(total / tile) + num_seqs the
    backward's buffers hold nor reach outside the packed rows. `carry` is m_j (0 for the first chunk).
    Returns each lane's (start, length) (lanes past the last sequence: empty, at the chunk's end) and m_{j+32}
    for the next chunk. One load per lane (cu_seqlens[j + lane + 1]; the start is the lane below's end)."""
    end = cutlass.max(_warp_inclusive_sum(_clamped_end(cu_seqlens, j, num_seqs, total), use_max=True), carry)
    start = cute.arch.shuffle_sync_up(end, 1)
    if cute.arch.lane_idx() == 0:
        start = carry
    return start, end - start, cute.arch.shuffle_sync(end, 31)


@cute.jit
def monotone_end(cu_seqlens: cute.Tensor, num_seqs: Int32, total: Int32) -> Int32:
    """The last sequence's end as `monotone_chunk` reads cu_seqlens: m_{num_seqs}, the largest entry after
    the first clamped into [0, total] (0 if none is positive). Every thread of a warp calls it."""
    end = Int32(0)
    for j in cutlass.range(0, num_seqs, 32, unroll=1):
        end = cutlass.max(end, _clamped_end(cu_seqlens, j, num_seqs, total))
    for step in cutlass.range_constexpr(5):
        end = cutlass.max(end, cute.arch.shuffle_sync_bfly(end, 1 << step))
    return end


@cute.jit
def tile_of_owned(cu_seqlens: cute.Tensor, num_seqs: Int32, total: Int32, tile: Int32,
                  tile_m: cutlass.Constexpr[int], descending: cutlass.Constexpr[bool]):
    """`tile_of` plus the number of tiles all sequences own (`tiles_before(num_seqs)` in
    fa4gen/emulate/tiling.py, which the scan sums anyway): (seq, m_block, owned). Grid tiles from `owned` on
    are spare (the grid is an upper bound: each sequence's partial last tile costs one of the num_seqs extra
    tiles), see `leave_if_spare`.

    Every warp scans the sequences 32 at a time: a lane's tile count, an inclusive warp prefix sum
    (shuffles), and a ballot for the first lane whose running total passes `tile`. Every thread
    calls it (the result is warp-uniform), so no shared memory or barrier is needed."""
    lane = cute.arch.lane_idx()
    seq = num_seqs - 1
    m_block = tile  # past any sequence's end unless found below
    base = Int32(0)  # tiles of the chunks already scanned
    for j in cutlass.range(0, num_seqs, 32, unroll=1):
        count = Int32(0)
        if j + lane < num_seqs:
            _, length = sequence_bounds(cu_seqlens, j + lane, total)
            count = (length + tile_m - 1) // tile_m
        incl = _warp_inclusive_sum(count)
        hits = cute.arch.vote_ballot_sync(base + incl > tile)
        if hits != 0:
            if base <= tile:  # only the chunk holding the tile (earlier chunks passed it already)
                first = _lowest_lane(hits)
                before = cute.arch.shuffle_sync(incl - count, first)
                local = tile - base - before
                seq = j + first
                if cutlass.const_expr(descending):
                    local = cute.arch.shuffle_sync(count, first) - 1 - local
                m_block = local
        base = base + cute.arch.shuffle_sync(incl, 31)
    return seq, m_block, base


@cute.jit
def query_tile_sequence(cu_seqlens: cute.Tensor, num_seqs: Int32, total: Int32, tile: Int32,
                        tile_m: cutlass.Constexpr[int]):
    """The backward's `tile_of_owned` (ascending) with the sequence's rows: (seq, m_block, owned, offset,
    seqlen) of linear query tile `tile`, cu_seqlens read monotone (`monotone_chunk`: the backward's
    preprocess and dQ conversion take the caller's tensors unchecked, as its main kernel does). A tile past
    every sequence gives (num_seqs - 1, a block past its end, owned, the last sequence's end, 0)."""
    seq = num_seqs - 1
    m_block = tile
    base = Int32(0)  # tiles of the chunks already scanned
    carry = Int32(0)  # the sequence values' running maximum (m_j)
    offset = Int32(0)
    seqlen = Int32(0)
    for j in cutlass.range(0, num_seqs, 32, unroll=1):
        start, length, next_carry = monotone_chunk(cu_seqlens, j, num_seqs, total, carry)
        count = (length + tile_m - 1) // tile_m
        incl = _warp_inclusive_sum(count)
        first = _owner_lane(incl, base, tile)
        if first < 32:
            m_block = tile - base - cute.arch.shuffle_sync(incl - count, first)
            seq = j + first
            offset = cute.arch.shuffle_sync(start, first)
            seqlen = cute.arch.shuffle_sync(length, first)
        base = base + cute.arch.shuffle_sync(incl, 31)
        carry = next_carry
    if base <= tile:
        offset = carry
    return seq, m_block, base, offset, seqlen


@dsl_user_op
def nvvm_exit(*, loc=None, ip=None):
    """PTX `exit`: the issuing thread ends (LLVM's llvm.nvvm.exit)."""
    nvvm.exit(loc=loc, ip=ip)


@cute.jit
def leave_if_spare(tile: Int32, owned: Int32):
    """End the whole CTA when its linear tile is spare (`tile` >= `owned`, from `tile_of_owned`): it owns
    no rows, so it has nothing to load, compute or store. Call it before any barrier or shared-memory
    set-up, with a CTA-uniform tile (every thread leaves together, so no mbarrier waits on an arrival that
    never comes). Spare CTAs otherwise ran the whole prologue and epilogue on an empty range: 32 sequences
    of 512 tokens at tile 128 make 32 of every 160 tiles per head spare."""
    if tile >= owned:
        nvvm_exit()


@cute.jit
def key_tile_sequence(cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor, seqused_k: cute.Tensor, num_seqs: Int32,
                      total_q: Int32, total_k: Int32, cta: Int32, heads: Int32, use_seqused: Int32,
                      tile_n: cutlass.Constexpr[int], tile_m: cutlass.Constexpr[int],
                      descending: cutlass.Constexpr[bool]):
    """A packed backward CTA's (key tile, head) and everything it needs of its sequence, from one scan whose loads
    all go out together: (seq, n_block, head, key_tile, owned, offset_q, seqlen_q, offset_k, seqlen_k, q_tile0).

    The grid is one linear index `cta` over (sequence, head, key tile of the sequence), the key tile fastest:
    sequence s, which owns count_s key tiles of `tile_n` rows after the `before_s` tiles of the sequences before
    it, takes the CTAs [before_s * heads, (before_s + count_s) * heads), head h of it the count_s CTAs from
    before_s * heads + h * count_s. So one head's key tiles of one sequence launch side by side (they read the same
    query rows, dO, LSE and D: shared in L2) and every CTA from `owned * heads` on is spare (the grid is an upper
    bound, ceil(total_k / tile_n) + num_seqs tiles per head): those launch after every CTA that owns keys, where
    with the heads in blockIdx.y each head's spare tiles took an SM in every wave. (flash-attn-4's varlen
    scheduler numbers its tiles sequence by sequence with the heads inside too.) `key_tile` is the tile's number
    in `tile_of_owned`'s key-tile numbering (before_s + the tile's rank in its sequence): unique per (sequence,
    key block), the GQA dK/dV semaphore's index; `n_block` is that rank, last first with `descending`; `owned`
    the key tiles all sequences own; then `sequence(...)` of s and its first query tile (the query tiles, of
    `tile_m` rows, of the sequences before it).

    Both cu_seqlens are read monotone (`monotone_chunk`: the backward takes the caller's values unchecked). As
    in `tile_of_owned`, every warp scans the sequences 32 at a time; each lane loads its sequence's key and
    query ends (and seqused_k) at once, so the CTA waits for memory once before its first TMA load, where a
    scan followed by loads of the sequence found waited twice (one CTA per SM: that wait was exposed in every
    wave; the session 28 profile of 32 x 512 tokens put the packed backward 30 us behind the dense one, its extra
    instructions in this prologue). The owner lane's values are shuffled to the warp; the query tiles before it
    are an exclusive prefix sum beside the key tiles' one. `heads` * (tiles + num_seqs) must stay below 2**31
    (the runtime refuses larger calls)."""
    lane = cute.arch.lane_idx()
    seq = num_seqs - 1
    n_block = cta  # past any sequence's end unless found below
    head = Int32(0)
    key_tile = cta
    base = Int32(0)  # key tiles of the chunks already scanned
    q_base = Int32(0)  # query tiles of the chunks already scanned
    offset_q = Int32(0)
    seqlen_q = Int32(0)
    offset_k = Int32(0)
    seqlen_k = Int32(0)
    q_tile0 = Int32(0)
    carry_q = Int32(0)  # the sequence values' running maxima (monotone_chunk)
    carry_k = Int32(0)
    for j in cutlass.range(0, num_seqs, 32, unroll=1):
        oq, lq, next_q = monotone_chunk(cu_seqlens_q, j, num_seqs, total_q, carry_q)
        ok, lk, next_k = monotone_chunk(cu_seqlens_k, j, num_seqs, total_k, carry_k)
        used = Int32(0)
        if j + lane < num_seqs:
            used = used_length(seqused_k, j + lane, lk, use_seqused)
        count = (lk + tile_n - 1) // tile_n
        q_count = (lq + tile_m - 1) // tile_m
        incl = _warp_inclusive_sum(count)
        q_incl = _warp_inclusive_sum(q_count)
        first = _owner_lane(incl * heads, base * heads, cta)  # in CTAs: each key tile has `heads`
        if first < 32:
            before = base + cute.arch.shuffle_sync(incl - count, first)
            owner_count = cute.arch.shuffle_sync(count, first)
            rank = cta - before * heads  # in [0, owner_count * heads)
            head = rank // owner_count
            local = rank - head * owner_count
            key_tile = before + local
            seq = j + first
            if cutlass.const_expr(descending):
                local = owner_count - 1 - local
            n_block = local
            offset_q = cute.arch.shuffle_sync(oq, first)
            seqlen_q = cute.arch.shuffle_sync(lq, first)
            offset_k = cute.arch.shuffle_sync(ok, first)
            seqlen_k = cute.arch.shuffle_sync(used, first)
            q_tile0 = q_base + cute.arch.shuffle_sync(q_incl - q_count, first)
        base = base + cute.arch.shuffle_sync(incl, 31)
        q_base = q_base + cute.arch.shuffle_sync(q_incl, 31)
        carry_q = next_q
        carry_k = next_k
    return seq, n_block, head, key_tile, base, offset_q, seqlen_q, offset_k, seqlen_k, q_tile0

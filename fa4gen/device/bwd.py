"""Device helpers of the backward pass: its pre/postprocess kernels and the semaphores of the
deterministic mode. Arch-neutral (plain loads/stores and atomics), so every backward family shares them.

Preprocess, per query row:  D = rowsum(dO * O) - dLSE     (fp32; dLSE is the LSE's own gradient)
                            LSE2 = LSE * log2(e), +inf for rows that saw no key (LSE = -inf)
so the main kernel forms P = exp2(S * scale_log2 - LSE2) (0 for those rows) and dS = P * (dP - D).
Postprocess: dst = src * scale in the output dtype (dQ from its fp32 accumulator, GQA dK/dV).

Both walk rows of a (batch, seqlen, heads, dim) tensor: a quad of 4 lanes per row, each lane
taking every fourth 8-element (16-byte) chunk, 64 rows per 256-thread CTA. The preprocess zeroes the
CTA's rows of the dQ accumulator (contiguous) in 16-byte chunks spread over all its threads, unless the main
kernel stores each dQ chunk's first value itself (`zero_dq=False`: the claim flags below, or the
deterministic hand-off's turn 0).
"""

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa4gen.device import softmax, varlen

LOG2_E = math.log2(math.e)
# 64 rows (quads of 4 lanes) per 256-thread CTA: half the CTAs of 32-row ones (flash-attn-4's preprocess
# takes 128 rows per 256 threads and ran 68-70 us against our 73-88 us at s1k-2k, session 9)
THREADS = 256
ROWS_PER_CTA = THREADS // 4
VEC = 8


def _chunk(t: cute.Tensor, c):
    """The c-th 8-element chunk of a row view."""
    return cute.local_tile(t, (VEC,), (c,))


def _row_grid(t: cute.Tensor):
    """The grid over the rows of a (batch, seqlen, heads, dim) tensor: (row blocks, heads, batch)."""
    return (cute.ceil_div(t.shape[1], ROWS_PER_CTA), t.shape[2], t.shape[0])


@cute.jit
def _thread_row():
    """(batch, head, row, lane of the row's quad) of this thread: 4 lanes per row, ROWS_PER_CTA rows per CTA."""
    tidx, _, _ = cute.arch.thread_idx()
    blk, head, batch = cute.arch.block_idx()
    return batch, head, blk * ROWS_PER_CTA + tidx // 4, tidx % 4


class Preprocess:
    """D and LSE2 of every query row (one launch before the main backward kernel; both (batch, heads,
    s_pad) with the rows past seqlen_q, up to whole query tiles, set to 0 / +inf); unless `zero_dq` is
    False it also zeroes the fp32 dQ accumulator, so no separate fill runs before the main kernel. The
    accumulator is (batch, heads, n) with n a multiple of head_dim and n / head_dim >= seqlen_q (its tiles
    padded, in whatever order the main kernel keeps them): the grid covers n / head_dim rows of head_dim
    floats.

    `mSem` (the non-deterministic claim flags or the deterministic turn counters, one int32 per query tile of
    `tile_m` rows: (batch, heads, tiles), or None) is zeroed here too, so the runtime allocates it without a
    fill of its own (a `torch.zeros` was a launch and ~9 us of host time per backward on the H200, session 28):
    the main kernel, launched after this one on the same stream, reads it from zero as before."""

    def __init__(self, head_dim_v: int, head_dim: int, zero_dq: bool = True, tile_m: int = 0,
                 count_slot: bool = False):
        self.head_dim_v = head_dim_v
        self.head_dim = head_dim
        # False: the main kernel stores each query tile's first dQ chunks (the deterministic hand-off)
        self.zero_dq = zero_dq
        self.tile_m = tile_m  # the query tile of mSem's entries (needed only with mSem)
        # mSem ends in one more entry per (batch, head): its count of landed key blocks (sm90.ConvertChunks' overlap)
        self.count_slot = count_slot

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mSem: Optional[cute.Tensor], stream):
        acc_rows = mdQacc.shape[2] // self.head_dim
        self.kernel(mO, mdO, mLSE, mdLSE, mLSE2, mD, mdQacc, mSem).launch(
            grid=(cute.ceil_div(acc_rows, ROWS_PER_CTA), mO.shape[2], mO.shape[0]), block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: cute.Tensor,
               mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mSem: Optional[cute.Tensor]):
        batch, head, row, lane4 = _thread_row()
        blk, _, _ = cute.arch.block_idx()
        first = blk * ROWS_PER_CTA
        if cutlass.const_expr(mSem is not None):
            _zero_tile_flags(mSem, batch, head, first, self.tile_m)
            if cutlass.const_expr(self.count_slot):
                tidx, _, _ = cute.arch.thread_idx()
                if blk == 0 and tidx == 0:
                    cute.arch.store(landed_count(mSem, batch, head), Int32(0))
        rows = cutlass.min(mdQacc.shape[2] // self.head_dim - first, ROWS_PER_CTA)
        zero = (mdQacc, batch, head, first, rows, self.head_dim, ROWS_PER_CTA) if self.zero_dq else None
        _preprocess_row(self.head_dim_v, mO, mdO, mLSE, mdLSE, mLSE2, mD, batch, head, row, row, row < mO.shape[1],
                        lane4, 0, zero)


class PreprocessVarlen(Preprocess):
    """`Preprocess` for packed sequences whose LSE2 / D / dQ accumulator rows are padded per query tile
    (sequence i's tiles numbered after those of the sequences before it, cu_seqlens read monotone by
    `varlen.query_tile_sequence`):
    one CTA per (tile, head), ROWS_PER_CTA rows per pass; a tile's rows past its sequence get 0 / +inf."""

    def __init__(self, head_dim_v: int, head_dim: int, tile_m: int, zero_dq: bool = True):
        super().__init__(head_dim_v, head_dim, zero_dq, tile_m)

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mCuQ: cute.Tensor,
                 mSem: Optional[cute.Tensor], stream):
        tiles = mLSE2.shape[2] // self.tile_m
        self.kernel_tiles(mO, mdO, mLSE, mdLSE, mLSE2, mD, mdQacc, mCuQ, mSem).launch(
            grid=(tiles, mO.shape[2], 1), block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel_tiles(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: cute.Tensor,
                     mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mCuQ: cute.Tensor,
                     mSem: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        tile, head, _ = cute.arch.block_idx()
        total = mO.shape[1]
        seq, m_block, owned, offset, seqlen = varlen.query_tile_sequence(
            mCuQ, cute.size(mCuQ.shape[0]) - 1, total, tile, self.tile_m
        )
        # a spare tile (past every sequence) has no rows: nobody reads its LSE2 / D rows or accumulator chunks,
        # nor its mSem entry (no key block reaches it; the dQ conversion's spare tiles only zero rows)
        varlen.leave_if_spare(tile, owned)
        if cutlass.const_expr(mSem is not None):
            if tidx == 0:
                mSem[0, head, tile] = Int32(0)
        rows = cutlass.min(mdQacc.shape[2] // self.head_dim - tile * self.tile_m, self.tile_m)
        for p in cutlass.range_constexpr((self.tile_m + ROWS_PER_CTA - 1) // ROWS_PER_CTA):
            i = ROWS_PER_CTA * p + tidx // 4
            r = m_block * self.tile_m + i
            # rows past the tile (80-row tiles) write nothing: i >= tile_m makes dst point past the
            # accumulators' rows only when it is the last tile, so both are guarded
            dst = tile * self.tile_m + i
            if i >= self.tile_m:
                dst = mLSE2.shape[2]
            # the tile's accumulator rows (a contiguous run of tile_m rows) are zeroed in the first pass
            zero = None
            if cutlass.const_expr(p == 0 and self.zero_dq):
                zero = (mdQacc, 0, head, tile * self.tile_m, rows, self.head_dim, self.tile_m)
            _preprocess_row(self.head_dim_v, mO, mdO, mLSE, mdLSE, mLSE2, mD, 0, head, offset + r, dst,
                            r < seqlen and i < self.tile_m, tidx % 4, 4, zero)


@cute.jit
def _zero_tile_flags(mSem: cute.Tensor, batch: Int32, head: Int32, first: Int32, tile_m: cutlass.Constexpr[int]):
    """Zero the (batch, head) entries of mSem (one per query tile of tile_m rows) whose tile starts within
    rows [first, first + ROWS_PER_CTA): thread i takes the i-th such tile. The dense grid's row blocks cover
    every tile's first row (the accumulator holds whole tiles), so each entry is zeroed by exactly one CTA."""
    tidx, _, _ = cute.arch.thread_idx()
    tile = (first + tile_m - 1) // tile_m + tidx
    if tidx < ROWS_PER_CTA // tile_m + 1:
        if tile * tile_m < first + ROWS_PER_CTA:
            if tile < mSem.shape[2]:
                mSem[batch, head, tile] = Int32(0)


@cute.jit
def _zero_rows(mdQacc: cute.Tensor, batch: Int32, head: Int32, first: Int32, rows: Int32,
               head_dim: cutlass.Constexpr[int], count: cutlass.Constexpr[int]):
    """Zero rows [first, first + rows) of the (batch, head) fp32 dQ accumulator (rows <= count; all threads
    of the CTA call it): the rows are one contiguous run of floats, which the CTA's threads cover in
    16-byte chunks, thread t taking chunks t, t + THREADS, ..., so every warp store writes 512 contiguous
    bytes (a quad per row wrote 16 of every 32 bytes per store, the other half by the next one)."""
    tidx, _, _ = cute.arch.thread_idx()
    # row `first` as a head_dim tile keeps the 16-byte alignment visible; the run is count rows from there
    run = cute.make_tensor(cute.local_tile(mdQacc[batch, head, None], (head_dim,), (first,)).iterator,
                           cute.make_layout(count * head_dim))
    zeros = cute.make_rmem_tensor((4,), Float32)
    zeros.fill(0.0)
    for j in cutlass.range_constexpr((count * head_dim // 4 + THREADS - 1) // THREADS):
        c = tidx + THREADS * j
        if c * 4 < rows * head_dim:
            cute.autovec_copy(zeros, cute.local_tile(run, (4,), (c,)))


@cute.jit
def _load_chunks(o_row: cute.Tensor, do_row: cute.Tensor, ro: list, rdo: list, lane4: Int32, first: Int32,
                 head_dim_v: cutlass.Constexpr[int]):
    """A lane's 16-byte chunks first, first + 1, ... (len(ro) of them; chunk i of the lane is row chunk
    lane4 + 4 i) of O and dO into ro / rdo; chunks past the row are skipped."""
    for i in cutlass.range_constexpr(len(ro)):
        c = lane4 + 4 * (first + i)
        if c < head_dim_v // VEC:
            cute.autovec_copy(_chunk(o_row, c), ro[i])
            cute.autovec_copy(_chunk(do_row, c), rdo[i])


@cute.jit
def _dot_chunks(ro: list, rdo: list, lane4: Int32, first: Int32, head_dim_v: cutlass.Constexpr[int],
                acc: Float32) -> Float32:
    """acc + the fp32 dot product of the chunks `_load_chunks` loaded with the same arguments."""
    for i in cutlass.range_constexpr(len(ro)):
        if lane4 + 4 * (first + i) < head_dim_v // VEC:
            vo = ro[i].load().to(Float32)
            vdo = rdo[i].load().to(Float32)
            for e in cutlass.range_constexpr(VEC):
                acc += vo[e] * vdo[e]
    return acc


@cute.jit
def _preprocess_row(head_dim_v: cutlass.Constexpr[int], mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                    mdLSE: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor, batch: Int32, head: Int32,
                    src: Int32, dst: Int32, valid, lane4: Int32, in_flight: cutlass.Constexpr[int], zero=None):
    """One query row, by the 4 lanes of a quad (all of a warp's lanes must call it: the row sum
    shuffles): if `valid`, D and LSE2 of packed row `src` into `dst`, else (the padding to whole
    tiles) D = 0 and LSE2 = +inf there. `zero`: None, or `_zero_rows`'s arguments after the thread's
    first loads are issued (all threads of the CTA must then call this).

    Every load of a group is issued before the first FMA uses one, LSE / dLSE with the first group: with
    the loads inside the FMA loop, ptxas issued two chunks, waited, then the next (three DRAM round trips
    per thread at d128, four with LSE read after the row sum; CPU SASS, session 19). `in_flight`: chunks
    of O and dO per lane and group, 0 = all: all eight at head dim 256 spilled a register in the varlen
    preprocess, whose tile lookup holds more live values (CPU SASS)."""
    acc = Float32(0.0)
    lse = Float32(0.0)
    dlse = Float32(0.0)
    chunks = (head_dim_v // VEC + 3) // 4  # per lane
    group = chunks if in_flight == 0 or in_flight > chunks else in_flight
    o_row = mO[batch, src, head, None]
    do_row = mdO[batch, src, head, None]
    ro = [cute.make_rmem_tensor((VEC,), mO.element_type) for _ in range(group)]
    rdo = [cute.make_rmem_tensor((VEC,), mO.element_type) for _ in range(group)]
    if valid:
        lse = mLSE[batch, head, src]
        dlse = mdLSE[batch, head, src]
        _load_chunks(o_row, do_row, ro, rdo, lane4, 0, head_dim_v)
    # the zeroing stores (when asked for) and LSE2 leave here, between the loads and the FMAs: ptxas does not
    # move a load past a store that may alias it, so every load of the group stays ahead of the row sum (with
    # no store there it sank them into the FMA loop: a DRAM round trip per chunk pair; CPU SASS, sessions 19-20)
    if cutlass.const_expr(zero is not None):
        _zero_rows(*zero)
    if (valid or dst < mLSE2.shape[2]) and lane4 == 0:
        mLSE2[batch, head, dst] = _lse2(lse, valid)
    if valid:
        acc = _dot_chunks(ro, rdo, lane4, 0, head_dim_v, acc)
        # the other groups (varlen above head dim 128) in a loop kept rolled: with every group in line, ptxas
        # hoisted the second group's loads and the fp16 d256 varlen preprocess spilled 4 registers (CPU SASS)
        for g in cutlass.range(1, (chunks + group - 1) // group, unroll=1):
            _load_chunks(o_row, do_row, ro, rdo, lane4, g * group, head_dim_v)
            acc = _dot_chunks(ro, rdo, lane4, g * group, head_dim_v, acc)
    acc = softmax.quad_sum(acc)  # every lane of the warp takes part in the shuffles
    if valid and lane4 == 0:
        mD[batch, head, dst] = acc - dlse
    elif dst < mLSE2.shape[2] and lane4 == 0:
        # the padding to whole query tiles (read by tile in the Sᵀ backward): no query there, P = 0
        mD[batch, head, dst] = Float32(0.0)


@cute.jit
def _lse2(lse: Float32, valid) -> Float32:
    """LSE2 of a row: LSE * log2(e); +inf for a row that saw no key (LSE = -inf) and for the padding to
    whole query tiles (`valid` False), so P = exp2(S * scale - LSE2) = 0 there."""
    lse2 = Float32.inf
    if valid and lse != -Float32.inf:
        lse2 = lse * LOG2_E
    return lse2


class Convert:
    """dst = (src * scale).to(dst dtype), fp32 accumulators to the gradient tensors."""

    def __init__(self, dim: int):
        self.dim = dim

    @cute.jit
    def __call__(self, src: cute.Tensor, dst: cute.Tensor, scale: Float32, stream):
        self.kernel(src, dst, scale).launch(grid=_row_grid(src), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor, scale: Float32):
        batch, head, row, lane4 = _thread_row()
        if row < src.shape[1]:
            s_row = src[batch, row, head, None]
            d_row = dst[batch, row, head, None]
            for i in cutlass.range_constexpr((self.dim // VEC + 3) // 4):
                c = lane4 + 4 * i
                if c < self.dim // VEC:
                    rs = cute.make_rmem_tensor((VEC,), Float32)
                    cute.autovec_copy(_chunk(s_row, c), rs)
                    rd = cute.make_rmem_tensor((VEC,), dst.element_type)
                    rd.store((rs.load() * scale).to(dst.element_type))
                    cute.autovec_copy(rd, _chunk(d_row, c))


@cute.jit
def element_ptr(t: cute.Tensor, coord):
    """Pointer to one element of a global tensor (for atomics)."""
    return t.iterator + cute.crd2idx(coord, t.layout)


@cute.jit
def held_view(view: cute.Tensor, base: cute.Tensor) -> cute.Tensor:
    """`view` (a slice of `base`) rebuilt on an element offset from `base` that ptxas keeps in a
    register: the offset goes through a shuffle to the thread itself, which ptxas cannot recompute, so a
    loop that reads the view no longer rematerializes the slice (block ids, strides from the parameter
    space: ~25 instructions per load site and iteration in the backward). The offset is an Int32: the
    LSE-sized tensors this serves hold under 2**31 elements on any GPU (each element comes with at least
    five bf16 rows of head_dim >= 16 and an fp32 dQ row)."""
    off = Int32((view.iterator.toint() - base.iterator.toint()) // (base.element_type.width // 8))
    return cute.make_tensor(base.iterator + cute.arch.shuffle_sync(off, cute.arch.lane_idx()), view.layout)


@cute.jit
def wait_turn(counter, turn: Int32):
    """Spin (one thread) until the counter at `counter` reads `turn`; acquire ordering, so what the
    previous holders wrote before their `pass_turn` is visible after this returns."""
    seen = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")
    while seen != turn:
        seen = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")


@cute.jit
def wait_turn_at_least(counter, turn: Int32):
    """Spin (one thread) until the counter at `counter` reads `turn` or more (acquire ordering): for
    counters that several holders of one turn advance one by one, each waiting for the same value."""
    seen = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")
    while seen < turn:
        seen = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")


def landed_count(mSem: cute.Tensor, batch, head):
    """Pointer to (batch, head)'s count of key blocks whose dQ adds have landed: the entry after the pair's claim
    flags (the runtime allocates q_tiles + 1 per pair with plan.dq_post_overlap). The preprocess zeroes it, the
    main kernel's dQ warp adds one per key block (`pass_turn`), sm90.ConvertChunks waits on it (`wait_count`)."""
    return element_ptr(mSem, (batch, head, mSem.shape[2] - 1))


@cute.jit
def wait_count(counter, count: Int32):
    """Spin (one thread) until the counter at `counter` reads `count` or more, by acquire loads: for a count
    that many CTAs poll at once (the dQ conversion's per-(batch, head) count of landed key blocks), where
    atomics would queue at the counter's L2 slice beside the main kernel's claims."""
    seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    while seen < count:
        seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")


@cute.jit
def peek_turn(counter) -> Int32:
    """The counter at `counter` now (one thread, relaxed: no ordering of its own). A caller that acts on
    the value must issue an acquire (or acq_rel) fence after this read and before what depends on it."""
    return cute.arch.atomic_add(counter, Int32(0), sem="relaxed", scope="gpu")


@cute.jit
def pass_turn(counter, count: cutlass.Constexpr[int] = 1):
    """Hand the counter on by `count` holders (one thread): a gpu-scope acq_rel fence, then a relaxed add.
    The fence orders what this CTA wrote before (the dQ adds, seen by this thread through a barrier or a
    bulk-copy wait) ahead of the add — one MEMBAR, where a fence and a release add took two — and it is
    also the acquire for a turn read earlier by `peek_turn`."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.red(counter, Int32(count), op="add", dtype=Int32, sem="relaxed", scope="gpu")


# A query tile's dQ claim flag (the non-deterministic hand-off): 0 while no key block has reached the tile, the
# number of key blocks that claimed it while its first stores (both dQ chunks) are in flight, and CLAIM_LANDED
# more once they have landed. Key blocks per tile stay far below it (< 2**25 at int32 sequence lengths), so the
# sum fits.
CLAIM_LANDED = 1 << 30


@cute.jit
def claim(flag) -> Int32:
    """Claim a query tile's dQ (one thread); returns the flag before the claim: 0 when this key block is the
    first to reach the tile (it then stores its dQ chunks and calls `release`), CLAIM_LANDED or more when
    those first stores have landed (add at once: the claim is an acquire, the pair of `release`), else they
    are in flight (wait with `wait_landed`, then add)."""
    return cute.arch.atomic_add(flag, Int32(1), sem="acquire", scope="gpu")


@cute.jit
def release(flag):
    """The first stores of a claimed tile have landed (their bulk copies waited for): let the others add."""
    pass_turn(flag, CLAIM_LANDED)


@cute.jit
def wait_landed(flag):
    """Spin (one thread) until the tile's first stores have landed (acquire): an add issued before them would
    be overwritten."""
    wait_turn_at_least(flag, Int32(CLAIM_LANDED))


__all__ = ["CLAIM_LANDED", "Convert", "Preprocess", "PreprocessVarlen", "claim", "element_ptr", "held_view",
           "landed_count", "pass_turn", "peek_turn", "release", "wait_landed", "wait_turn", "wait_turn_at_least"]

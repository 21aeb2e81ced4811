"""Device helpers specific to Hopper kernels: TMA partitioning, mbarrier pipeline creation and the
backward's fragment-order dQ chunks.

Kept out of the templates so that every generated SM90 kernel wires the same, tested pieces.
"""

import dataclasses
import math
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.memory import SmemAllocator

from fa4gen.device import bwd, varlen


def tma_split(atom: cute.CopyAtom, s: cute.Tensor, g: cute.Tensor):
    """(smem view, gmem view) of a TMA copy between a staged smem buffer and a tiled gmem tensor."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2))


@dataclasses.dataclass(frozen=True)
class TryFirstTmaPipeline(pipeline.PipelineTmaAsync):
    """`PipelineTmaAsync` whose consumer wait polls the stage's full barrier once (mbarrier.try_wait) before
    it waits: CUTLASS's wait is a retry loop of try_wait with a 10 ms suspend-time hint, which ptxas compiles to
    TRYWAIT then, on a miss, NANOSLEEP.SYNCS in the hot loop; with the poll first the loop's fast path is one
    TRYWAIT and a branch, the hinted wait out of line (flash-attn-4's SM90 forward waits this way:
    `consumer_wait(state, consumer_try_wait(state))`). A caller's own token is used as given."""

    @dsl_user_op
    def consumer_wait(self, state, try_wait_token=None, *, loc=None, ip=None):
        if try_wait_token is None:
            try_wait_token = self.consumer_try_wait(state, loc=loc, ip=ip)
        super().consumer_wait(state, try_wait_token, loc=loc, ip=ip)


def tma_pipeline(mbar, stages: int, nbytes: int, consumer_warps: int) -> pipeline.PipelineTmaAsync:
    """A TMA-fed pipeline: one producer thread arms each stage for `nbytes`; every consumer warp
    releases it once. Barrier init is deferred: the caller fences and syncs once for all pipelines.
    Its consumer waits poll first (`TryFirstTmaPipeline`)."""
    made = pipeline.PipelineTmaAsync.create(
        barrier_storage=mbar.data_ptr(),
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=nbytes,
        defer_sync=True,
    )
    return TryFirstTmaPipeline(*(getattr(made, f.name) for f in dataclasses.fields(made)))


# -- the backward's dQ hand-off in fragment order --------------------------------------------------
# A warpgroup's fp32 dQ tile (64 x DQ_N, a WGMMA accumulator) leaves the consumer as it sits in the
# registers: thread t's values 4v..4v+3 go to floats 512 v + 4 t of a flat "chunk" (one 128-bit store
# each, consecutive lanes on consecutive 16 bytes: no bank conflict, one base register). The dQ warp
# adds the chunk into global memory with one bulk reduce, so the global accumulator holds every tile as
# such a chunk; `ConvertChunks` puts the values back at their (row, column) when it writes dQ. Without
# the hand-off (`reduce_chunk`), each thread adds its vectors to the same global positions itself.
CHUNK_THREADS = 128
CHUNK_VEC = 4  # fp32 per 128-bit store


def consumer_wait(pipe, state):
    """`pipe.consumer_wait(state)` as a module function: inside a kernel's dynamic branch CuTe-DSL counts an object
    whose method the branch calls as written there and threads it through the branch's yields (trace time); an
    argument is only read (the persistent forward's guarded steps, templates/sm90/_steps.j2)."""
    pipe.consumer_wait(state)


def consumer_release(pipe, state):
    """`pipe.consumer_release(state)` as a module function (see consumer_wait)."""
    pipe.consumer_release(state)


def dq_transposed(tile_m: int) -> bool:
    """Whether the backward computes dQᵀ = Kᵀ·dSᵀ (head-dim rows, query columns): when tile_m is not a
    multiple of 64, the WGMMA row granule (80-row tiles)."""
    return tile_m % 64 != 0


def dq_split(head_dim: int, tile_m: int) -> tuple[tuple[int, int, int], int]:
    """(WGMMA atom layout, DQ_N) of the backward's dQ GEMM over two consumer warpgroups, each holding a
    (64, DQ_N) fp32 chunk: dQ by query rows (64 each, DQ_N = head_dim) when tile_m is 128; dQᵀ by
    head-dim rows (64 each, DQ_N = tile_m) when `dq_transposed`; else dQ by columns (DQ_N = head_dim / 2)."""
    if tile_m == 128:
        return (2, 1, 1), head_dim
    if dq_transposed(tile_m):
        if head_dim != 128:  # two warpgroups of 64 head-dim rows: any other head dim reads past K
            raise ValueError(f"dQᵀ (tile_m {tile_m}) splits head-dim rows 64 per warpgroup: head dim 128 only, got {head_dim}")
        return (2, 1, 1), tile_m
    return (1, 2, 1), head_dim // 2


def chunk_origin(w, tile_m: int, dq_n: int):
    """(row, column) in the dQ GEMM's output tile — (tile_m, head_dim), or (head_dim, tile_m) for dQᵀ —
    where warpgroup w's (64, DQ_N) chunk starts."""
    return (64 * w, 0) if tile_m == 128 or dq_transposed(tile_m) else (0, dq_n * w)


def chunk_position(w, r, c, tile_m: int, dq_n: int):
    """(query row in the tile, head-dim column) of element (r, c) of warpgroup w's chunk."""
    r0, c0 = chunk_origin(w, tile_m, dq_n)
    return (c + c0, r + r0) if dq_transposed(tile_m) else (r + r0, c + c0)


def chunk_copy() -> cute.TiledCopy:
    """The tiled copy between a warpgroup's accumulator and a flat chunk (see above)."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(atom, cute.make_layout(CHUNK_THREADS), cute.make_layout(CHUNK_VEC))


@cute.jit
def chunk_view(chunk: cute.Tensor, t) -> cute.Tensor:
    """Thread t's share of a flat chunk (its 128-bit vectors), in accumulator order."""
    return chunk_copy().get_slice(t).partition_D(chunk)


def _bulk_s2g(instruction: str, gmem: cute.Pointer, smem: cute.Pointer, nbytes: int, loc, ip):
    """One bulk asynchronous shared -> global operation `instruction [gmem], [smem], nbytes;`."""
    llvm.inline_asm(
        None,
        [gmem.llvm_ptr, smem.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), Int32(nbytes).ir_value(loc=loc, ip=ip)],
        f"{instruction} [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def reduce_add_bulk(gmem: cute.Pointer, smem: cute.Pointer, nbytes: int, *, loc=None, ip=None):
    """gmem[0:nbytes] += smem[0:nbytes] as fp32, one bulk asynchronous reduce (one thread issues it;
    completion through the bulk async-groups: cp_async_bulk_commit_group / wait_group)."""
    _bulk_s2g("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32", gmem, smem, nbytes, loc, ip)


@dsl_user_op
def store_bulk(gmem: cute.Pointer, smem: cute.Pointer, nbytes: int, *, loc=None, ip=None):
    """gmem[0:nbytes] = smem[0:nbytes], one bulk asynchronous copy (one thread issues it; completion
    through the same bulk async-groups as `reduce_add_bulk`)."""
    _bulk_s2g("cp.async.bulk.global.shared::cta.bulk_group", gmem, smem, nbytes, loc, ip)


def _global_v4(instruction: str, gmem: cute.Pointer, values, loc, ip):
    """One 128-bit global operation `instruction [gmem], {4 fp32 values};` (16-byte aligned)."""
    llvm.inline_asm(
        None,
        [gmem.llvm_ptr] + [Float32(x).ir_value(loc=loc, ip=ip) for x in values],
        f"{instruction} [$0], {{$1, $2, $3, $4}};",
        "l,f,f,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def reduce_add_v4(gmem: cute.Pointer, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None):
    """gmem[0:4] += (a, b, c, d) in fp32, one vector reduction in global memory (no return value;
    16-byte aligned; relaxed, gpu scope: visible to the kernels that run after this one)."""
    _global_v4("red.global.add.v4.f32", gmem, (a, b, c, d), loc, ip)


@dsl_user_op
def store_v4(gmem: cute.Pointer, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None):
    """gmem[0:4] = (a, b, c, d) in fp32, one 128-bit global store (16-byte aligned)."""
    _global_v4("st.global.v4.f32", gmem, (a, b, c, d), loc, ip)


def _chunk_view(acc: cute.Tensor, chunk: cute.Pointer, t):
    """Thread t's values of a warpgroup's fp32 accumulator `acc`, flat, and the address of its first 16 bytes
    in the flat global chunk at `chunk` (fragment order: values 4v..4v+3 at floats 512 v + 4 t, as
    `chunk_copy` stores them; consecutive lanes on consecutive 16 bytes)."""
    flat = cute.make_tensor(acc.iterator, cute.make_layout(cute.size(acc)))
    return flat, chunk + CHUNK_VEC * t  # then constant offsets: immediates in the addresses


def _write_chunk(write, flat: cute.Tensor, mine: cute.Pointer):
    """One 128-bit `write` (`reduce_add_v4` or `store_v4`) per 4 values of `_chunk_view`'s share (traced
    inline: not a jit function, so a plain Python loop, unrolled as range_constexpr is)."""
    for v in range(cute.size(flat) // CHUNK_VEC):
        write(
            mine + CHUNK_THREADS * CHUNK_VEC * v,
            flat[CHUNK_VEC * v], flat[CHUNK_VEC * v + 1], flat[CHUNK_VEC * v + 2], flat[CHUNK_VEC * v + 3],
        )


@cute.jit
def store_or_reduce_chunk(acc: cute.Tensor, chunk: cute.Pointer, t, store: Int32):
    """`reduce_chunk`, or with `store` nonzero (block-uniform: the first key block of a tile's order in
    the deterministic backward) the same positions stored instead of added: one branch around each form's
    run of 128-bit operations."""
    flat, mine = _chunk_view(acc, chunk, t)
    if store != 0:
        _write_chunk(store_v4, flat, mine)
    else:
        _write_chunk(reduce_add_v4, flat, mine)


@cute.jit
def reduce_chunk(acc: cute.Tensor, chunk: cute.Pointer, t):
    """Add thread t's share of a warpgroup's fp32 accumulator `acc` into the flat global chunk at
    `chunk` in fragment order (`_chunk_view`): one 128-bit reduction each."""
    _write_chunk(reduce_add_v4, *_chunk_view(acc, chunk, t))


@dsl_user_op
def load_bulk(smem: cute.Pointer, gmem: cute.Pointer, nbytes: int, mbar: cute.Pointer, *, loc=None, ip=None):
    """smem[0:nbytes] = gmem[0:nbytes], one bulk asynchronous copy (one thread issues it) completing as
    transaction bytes on the mbarrier `mbar` (whose expected count must include nbytes). Both addresses
    16-byte aligned, nbytes a multiple of 16."""
    llvm.inline_asm(
        None,
        [
            smem.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
            gmem.llvm_ptr,
            Int32(nbytes).ir_value(loc=loc, ip=ip),
            mbar.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
        ],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


class ConvertChunks:
    """dQ = scale * its fp32 accumulator, which holds every (tile_m x head_dim) query tile as two chunks
    (one per consumer warpgroup, `dq_split` / `chunk_position`) in fragment order.
    One CTA of 2 warpgroups per (tile, head, batch); with `varlen`, tiles are numbered over the packed
    sequences and the row offsets come from cu_seqlens as `varlen.query_tile_sequence` reads them (monotone,
    as the backward's other kernels do: the caller's values go in unchecked).
    The chunks are read with 128-bit loads; the converted values go to their (row, column) in a
    shared-memory tile (rows padded by 16 bytes: the fragment's scattered 2-byte stores stay free of
    bank conflicts), which then leaves with 128-bit row-contiguous stores (`staged`). Head dims whose
    16-byte row vectors do not tile 256 threads evenly (e.g. 80) store element by element instead.
    `mSem` (the deterministic hand-off's per-tile turn counters, the non-deterministic one's per-tile claim
    flags, or None): tiles whose counter is 0 were never written (no key block reaches them) and give dQ = 0.
    Varlen: the grid's tiles past the last sequence (there is always at least one: the grid is an upper
    bound) zero dQ's rows after the last sequence, which no tile owns, and with `mdK` / `mdV` / `mCuK` (the
    MHA backward's gradients, which the main kernel writes sequence by sequence) dK's and dV's rows after
    the last key sequence: a packed tensor may end in rows no sequence covers (the padding of static
    shapes), and their gradient is 0, with no fill of the whole tensor before the launch.
    `overlap` (the MHA backward with the claim, plan.dq_post_overlap): launched with programmatic dependent
    launch, so its CTAs take the SMs that the main kernel's last CTAs (or its persistent loop's last, partial
    round) leave idle while those run; a CTA waits (thread 0, acquire) until its (batch, head)'s count of landed key blocks, mSem's
    last entry, reaches `key_blocks`, instead of for the whole main kernel. The main kernel never waits for
    this one, so a CTA placed early only spins on an SM that has no main-kernel CTA left; the grid's last CTA
    waits for the main kernel's end (griddepcontrol.wait) before it exits."""

    def __init__(self, dtype, head_dim: int, tile_m: int, varlen: bool, overlap: bool = False):
        self.overlap = overlap
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.dq_n = dq_split(head_dim, tile_m)[1]
        self.varlen = varlen
        vecs = head_dim // 8  # 16-byte vectors per dQ row
        self.row_threads = math.gcd(vecs, 32)  # threads along a row (a power of two dividing the warp)
        self.staged = head_dim % 8 == 0 and tile_m % (2 * CHUNK_THREADS // self.row_threads) == 0
        self.row_pitch = head_dim + 8  # elements per shared-memory row

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mdQ: cute.Tensor, scale: Float32, mCuQ: Optional[cute.Tensor],
                 mSem: Optional[cute.Tensor], stream, mdK: Optional[cute.Tensor] = None,
                 mdV: Optional[cute.Tensor] = None, mCuK: Optional[cute.Tensor] = None, key_blocks: Int32 = 0):
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32, (1, 1, 1), (64, self.dq_n)
        )
        tiles = mAcc.shape[2] // (self.tile_m * self.head_dim)
        smem = self.tile_m * self.row_pitch * (self.dtype.width // 8) if cutlass.const_expr(self.staged) else 0
        self.kernel(mAcc, mdQ, mCuQ, mSem, tiled_mma, scale, mdK, mdV, mCuK, Int32(key_blocks)).launch(
            grid=(tiles, mAcc.shape[1], mAcc.shape[0]), block=[2 * CHUNK_THREADS, 1, 1], smem=smem, stream=stream,
            use_pdl=self.overlap,
        )

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mdQ: cute.Tensor, mCuQ: Optional[cute.Tensor], mSem: Optional[cute.Tensor],
               tiled_mma: cute.TiledMma, scale: Float32, mdK: Optional[cute.Tensor], mdV: Optional[cute.Tensor],
               mCuK: Optional[cute.Tensor], key_blocks: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        tile, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.overlap):
            # every key block of this (batch, head) has counted its dQ adds as landed (the count's release pairs
            # with this acquire); the barrier carries the order to the CTA's other threads
            if tidx == 0:
                bwd.wait_count(bwd.landed_count(mSem, batch, head), key_blocks)
            cute.arch.sync_threads()
        if cutlass.const_expr(self.varlen):
            total = mdQ.shape[1]
            num_seqs = cute.size(mCuQ.shape[0]) - 1
            seq, m_block, owned, offset, seqlen = varlen.query_tile_sequence(mCuQ, num_seqs, total, tile, self.tile_m)
            if tile >= owned:
                # a tile past the last sequence (seq is the last one): spare tile j of `spares` zeroes the
                # rows after the last sequence, tile_m rows at a time, striding by the spares. It owns no dQ
                # rows, so it reads nothing of the accumulator: the grid is an upper bound (a sequence's
                # partial last tile costs it one tile), and 32 sequences of 512 tokens at tile_m 128 leave 32
                # spare tiles per head beside 128 owned ones, whose chunk reads were 25% more DRAM traffic
                j, spares = tile - owned, cute.arch.grid_dim()[0] - owned
                zero_rows_after(mdQ[batch, None, head, None], offset + seqlen, j, spares, self.tile_m, tidx)
                if cutlass.const_expr(mdK is not None):
                    if head < mdK.shape[2]:
                        k_end = varlen.monotone_end(mCuK, num_seqs, mdK.shape[1])
                        zero_rows_after(mdK[batch, None, head, None], k_end, j, spares, self.tile_m, tidx)
                        zero_rows_after(mdV[batch, None, head, None], k_end, j, spares, self.tile_m, tidx)
            else:
                self.convert(mAcc, mdQ, mSem, tiled_mma, scale, tile, head, batch, offset, seqlen, m_block, tidx)
        else:
            self.convert(mAcc, mdQ, mSem, tiled_mma, scale, tile, head, batch, Int32(0), mdQ.shape[1], tile, tidx)
        if cutlass.const_expr(self.overlap):
            # the grid's last CTA ends only once the main kernel has (and its memory operations are visible): so
            # this grid never completes before the main kernel, and whatever the stream runs next (reading dK /
            # dV, which the main kernel's last tiles store) is ordered after both, not only after this one. One
            # CTA, dispatched last, so the wait holds no slot another CTA of this grid could use
            nx, ny, nz = cute.arch.grid_dim()
            if tile == nx - 1 and head == ny - 1 and batch == nz - 1:
                cute.arch.griddepcontrol_wait()

    @cute.jit
    def convert(self, mAcc: cute.Tensor, mdQ: cute.Tensor, mSem: Optional[cute.Tensor], tiled_mma: cute.TiledMma,
                scale: Float32, tile: Int32, head: Int32, batch: Int32, offset: Int32, seqlen: Int32, m_block: Int32,
                tidx: Int32):
        """Tile `tile`'s chunks of the accumulator to dQ rows offset + m_block * tile_m... of its sequence
        (seqlen rows)."""
        w, t = tidx // CHUNK_THREADS, tidx % CHUNK_THREADS
        chunk_size = 64 * self.dq_n
        acc = mAcc[batch, head, None]
        # chunks start at multiples of 64 x DQ_N floats: re-typed as 16-byte aligned, so the reads are 128-bit
        start = acc.iterator + (tile * 2 + w) * chunk_size
        start = cute.make_ptr(Float32, start.toint(), cute.AddressSpace.gmem, assumed_align=16)
        src = chunk_copy().get_slice(t).partition_S(cute.make_tensor(start, cute.make_layout(chunk_size)))
        vals = cute.make_rmem_tensor(src.shape, Float32)
        cute.autovec_copy(src, vals)
        if cutlass.const_expr(mSem is not None):
            # the hand-offs store a tile's first chunks instead of zeroing the accumulator: a tile no key
            # block reached (its turn counter or claim flag still 0) holds what was allocated, its dQ is 0
            if mSem[batch, head, tile] == 0:
                vals.fill(0.0)
        coords = tiled_mma.get_slice(t).partition_C(cute.make_identity_tensor((64, self.dq_n)))
        if cutlass.const_expr(self.staged):
            sdQ = SmemAllocator().allocate_tensor(
                self.dtype, cute.make_layout((self.tile_m, self.head_dim), stride=(self.row_pitch, 1)), 16
            )
            for i in cutlass.range_constexpr(cute.size(vals)):
                r, c = coords[i]
                row, col = chunk_position(w, r, c, self.tile_m, self.dq_n)
                sdQ[row, col] = (vals[i] * scale).to(self.dtype)
            cute.arch.sync_threads()
            store_rows(sdQ, mdQ[batch, None, head, None], offset + m_block * self.tile_m,
                       seqlen - m_block * self.tile_m, tidx, self.row_threads)
        else:
            for i in cutlass.range_constexpr(cute.size(vals)):
                r, c = coords[i]
                row, col = chunk_position(w, r, c, self.tile_m, self.dq_n)
                row = m_block * self.tile_m + row
                if row < seqlen:
                    mdQ[batch, offset + row, head, col] = (vals[i] * scale).to(mdQ.element_type)


@cute.jit
def zero_rows_after(mT: cute.Tensor, first: Int32, j: Int32, step: Int32, rows: cutlass.Constexpr[int], tidx):
    """Zero the rows from `first` on of mT ((seqlen, width), unit column stride), `rows` at a time: this CTA's
    2 * CHUNK_THREADS threads take blocks j, j + step, ... of them, 16 bytes per thread per store (width a
    multiple of 8; else an element each)."""
    width = cute.size(mT, mode=[1])
    vec = 8 if width % 8 == 0 else 1
    zeros = cute.make_rmem_tensor((vec,), mT.element_type)
    zeros.fill(0.0)
    for r0 in cutlass.range(first + j * rows, mT.shape[0], step * rows, unroll=1):
        for e in cutlass.range(tidx, rows * (width // vec), 2 * CHUNK_THREADS, unroll=1):
            r = r0 + e // (width // vec)
            if r < mT.shape[0]:
                cute.autovec_copy(zeros, cute.local_tile(mT[r, None], (vec,), (e % (width // vec),)))


@cute.jit
def store_rows(sT: cute.Tensor, mT: cute.Tensor, first_row: Int32, rows: Int32, tidx, row_threads: cutlass.Constexpr[int]):
    """Rows [0, min(rows, tile rows)) of the shared-memory tile sT (tile rows x head dim) to mT's rows
    first_row... ((seqlen, head dim), unit column stride), 16 bytes per thread per store: 2 * CHUNK_THREADS
    threads, `row_threads` of them along a row."""
    tile_rows, width = cute.size(sT, mode=[0]), cute.size(sT, mode=[1])
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), sT.element_type, num_bits_per_copy=128)
    copy = cute.make_tiled_copy_tv(
        atom,
        cute.make_layout((2 * CHUNK_THREADS // row_threads, row_threads), stride=(row_threads, 1)),
        cute.make_layout((1, 8)),
    )
    thr = copy.get_slice(tidx)
    gT = cute.local_tile(cute.domain_offset((first_row, 0), mT), (tile_rows, width), (0, 0))
    src = thr.partition_S(sT)
    dst = thr.partition_D(gT)
    where = thr.partition_S(cute.make_identity_tensor((tile_rows, width)))
    frag = cute.make_rmem_tensor(src[None, 0, 0].shape, sT.element_type)
    for m in cutlass.range_constexpr(cute.size(src, mode=[1])):
        if where[0, m, 0][0] < rows:
            for k in cutlass.range_constexpr(cute.size(src, mode=[2])):
                cute.autovec_copy(src[None, m, k], frag)
                cute.copy(atom, frag, dst[None, m, k])

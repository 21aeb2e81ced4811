"""Device helpers specific to the SM100 (Blackwell) forward: TMEM views and copies, the P and row-statistics
hand-offs through TMEM, and the tile scheduler's index math.

Scores and O live in tensor memory (TMEM: 128 lanes x 512 columns of 32 bits; lane = row of a 128-row
tile). The softmax and correction warps read them with the `16x256b` tcgen05.ld shape, which gives every
thread four rows (r0, r0+8, r0+16, r0+24) and a quarter of each row's columns, each row spread over the
4 lanes of a quad: the same ownership as a WGMMA accumulator. That is what lets the shared
fa4gen.device.softmax helpers (quad reductions) and fa4gen.device.mask run unchanged on TMEM data;
`quad_rows_cols` is the (row, col) view they take. P goes back with the `16x128b` tcgen05.st shape,
whose 32-bit word w of a chunk holds exactly the converted scores 2w and 2w+1 of the same chunk of the
`16x256b` load (tests/test_sm100_layouts.py checks this for every thread).
"""

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.tcgen05 as tcgen05
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from fa4gen.device import mask, softmax

ROWS = 128  # TMEM lanes = rows of one Q tile
ROWS_PER_THREAD = 4
# The softmax's polynomial exp2 (poly_exp) on Blackwell's packed fp32 ops (FFMA2 / FADD2, sm_100+), two columns per
# instruction, each lane rounded as the scalar form the SM90 kernels run: the same values the H200 tests
# (softmax.online_softmax_step's packed_poly). Only where it adds no spill: the register pairs the packed ops need cost
# the softmax warps registers. A CPU census of 312 poly-exp SM100 variants (head dims 64 / 128 / (192, 128), four masks,
# softcap, varlen, 2-CTA, LSE, every 3rd / 4th / 7th column emulated; docs/PERF.md session 51) found main spilling in
# 53 and packing everywhere spilling in 37 more (with a softcap or every 3rd / 4th column at head dims <= 128, and the
# (192, 128) 2-CTA ones) while curing 14; with every 5th column or sparser at head dims <= 128 it adds none. The
# scale-and-shift and the O rescale in packed pairs made the softmax / correction warps spill (sessions 25 and 51)
PACKED_POLY = True
PACKED_POLY_MIN_EVERY = 5
PACKED_POLY_MAX_HEAD_DIM = 128


def packed_poly(poly_every: int, head_dim: int) -> bool:
    """Whether the softmax step evaluates its polynomial exp2s in packed pairs (see PACKED_POLY); `head_dim`: the larger
    of the kernel's two."""
    return PACKED_POLY and poly_every >= PACKED_POLY_MIN_EVERY and head_dim <= PACKED_POLY_MAX_HEAD_DIM


# --- TMEM views ---------------------------------------------------------------------------------


def tmem_view(base: cute.Tensor, column: int, cols: int) -> cute.Tensor:
    """A (128, cols) fp32 view of TMEM starting at `column` of the allocation `base` points at.

    `base` is an MMA accumulator fragment ((128, N), 1, 1) placed at the allocation start; its lane
    stride is reused, so the view addresses exactly what the MMA writes.
    """
    lane_stride = base.layout.stride[0][0]
    return cute.make_tensor(base.iterator + column, cute.make_layout((ROWS, cols), stride=(lane_stride, 1)))


def tile_view(base: cute.Tensor, columns: tuple, cols: int, q_tile) -> cute.Tensor:
    """The (128, cols) TMEM view of Q tile `q_tile` (a run-time warpgroup index), given the plan's
    evenly spaced per-tile start columns; the spacing stays static, so the view keeps its alignment."""
    step = columns[1] - columns[0] if len(columns) > 1 else cols
    assert all(c == columns[0] + i * step for i, c in enumerate(columns)), columns
    lane_stride = base.layout.stride[0][0]
    layout = cute.make_layout((ROWS, cols, len(columns)), stride=(lane_stride, 1, step))
    return cute.make_tensor(base.iterator + columns[0], layout)[None, None, q_tile]


def per_tile(ptr, layout: cute.Layout, columns: tuple, unit: int = 1) -> cute.Tensor:
    """A tensor over all Q tiles: `layout` at each of the plan's evenly spaced TMEM `columns` (in units of
    `unit` elements per 32-bit column), indexed by a run-time Q tile in the last mode. Run-time indexing
    keeps the MMA warp from holding every tile's addresses in registers."""
    step = (columns[1] - columns[0]) if len(columns) > 1 else 0
    assert all(c == columns[0] + i * step for i, c in enumerate(columns)), columns
    stages = cute.make_layout(len(columns), stride=step * unit)
    return cute.make_tensor(ptr + columns[0] * unit, cute.append(layout, stages))


def tmem_copy(op, tmem: cute.Tensor, thread: Int32, *, load: bool):
    """(tiled copy, TMEM partition, coordinate partition) of `thread` (0..127 in its warpgroup)."""
    tiled = tcgen05.make_tmem_copy(cute.make_copy_atom(op, Float32), tmem)
    thr = tiled.get_slice(thread)
    coords = cute.make_identity_tensor(tmem.shape)
    if cutlass.const_expr(load):
        return tiled, thr.partition_S(tmem), thr.partition_D(coords)
    return tiled, thr.partition_D(tmem), thr.partition_S(coords)


def score_load(tmem_s: cute.Tensor, thread: Int32):
    """16x256b loads of a (128, tile_n) score tile, 32 columns per instruction."""
    return tmem_copy(tcgen05.Ld16x256bOp(tcgen05.Repetition.x4), tmem_s, thread, load=True)


def score_coords(s_load: cute.TiledCopy, thread: Int32, tile_n: int) -> cute.Tensor:
    """(row, col) tile coordinates of the scores `thread` loads, as a (row, col) view. Built per key block
    from an opaque thread index: the 4 x tile_n / 4 coordinates are cheap to recompute and would otherwise
    be kept in registers across the whole key loop."""
    coords = s_load.get_slice(opaque(thread)).partition_D(cute.make_identity_tensor((ROWS, tile_n)))
    return quad_rows_cols(coords)


def p_store(tmem_p: cute.Tensor, thread: Int32):
    """16x128b stores of P, 16-bit pairs packed in 32-bit words: (128, tile_n / 2) words."""
    return tmem_copy(tcgen05.St16x128bOp(tcgen05.Repetition.x4), tmem_p, thread, load=False)


def o_copies(tmem_o: cute.Tensor, thread: Int32):
    """16x256b load and store of one (128, chunk) slice of O: (load, store, load part, store part, coords)."""
    rep = tcgen05.Repetition(tmem_o.shape[1] // 8)
    load, src, coords = tmem_copy(tcgen05.Ld16x256bOp(rep), tmem_o, thread, load=True)
    store, dst, _ = tmem_copy(tcgen05.St16x256bOp(rep), tmem_o, thread, load=False)
    return load, store, src, dst, coords


def stats_copies(tmem_stats: cute.Tensor, thread: Int32):
    """32x32b load and store of a thread's private (lane, STATS columns) scratch: (load, store, TMEM
    part, register shape). Lane = thread, so the thread with the same index in the other warpgroup
    (same TMEM sub-partition) reads back exactly what this one wrote."""
    rep = tcgen05.Repetition(tmem_stats.shape[1])
    load, part, coords = tmem_copy(tcgen05.Ld32x32bOp(rep), tmem_stats, thread, load=True)
    store, _, _ = tmem_copy(tcgen05.St32x32bOp(rep), tmem_stats, thread, load=False)
    return load, store, part, coords.shape


def restage(layout: cute.ComposedLayout, stage_elems: int) -> cute.ComposedLayout:
    """A staged shared-memory layout with its stage stride set to `stage_elems` elements, so that K and V
    (whose tiles may differ in size) take turns in the stages of one ring."""
    outer = layout.outer
    staged = cute.make_layout((*outer.shape[:-1], outer.shape[-1]), stride=(*outer.stride[:-1], stage_elems))
    return cute.make_composed_layout(layout.inner, 0, staged)


def column_chunk(tmem: cute.Tensor, chunk: int, cols: int) -> cute.Tensor:
    """Columns [chunk * cols, (chunk + 1) * cols) of a (128, N) TMEM view."""
    return cute.make_tensor(tmem.iterator + chunk * cols, cute.make_layout((ROWS, cols), stride=tmem.layout.stride))


# --- register views -----------------------------------------------------------------------------


@cute.jit
def quad_rows_cols_layout(frag: cute.Layout) -> cute.Layout:
    """(((2c, 2r, R), 1), RB, CB) -> ((2r, RB), (2c, R, CB)): a (row, col) view of a 16x256b fragment."""
    v = frag.shape[0][0]
    vs = frag.stride[0][0]
    return cute.make_layout(
        ((v[1], frag.shape[1]), (v[0], v[2], frag.shape[2])),
        stride=((vs[1], frag.stride[1]), (vs[0], vs[2], frag.stride[2])),
    )


def quad_rows_cols(t: cute.Tensor) -> cute.Tensor:
    """The (row, col) view of a 16x256b-shaped tensor (registers or coordinates): same elements."""
    return cute.make_tensor(t.iterator, quad_rows_cols_layout(t.layout))


# --- P and row statistics through TMEM ----------------------------------------------------------


@cute.jit
def store_p(s: cute.Tensor, dtype: cutlass.Constexpr, p_copy: cute.TiledCopy, p_tmem: cute.Tensor,
            p_coords: cute.Tensor):
    """Round the probabilities `s` (a 16x256b fragment) to `dtype` and store them as P, 32 columns at
    a time, so that only one chunk of 16-bit values is live besides the scores. Chunk (rb, cb) of the
    16x256b fragment, packed in pairs, is chunk (rb, cb) of the 16x128b store, word for word."""
    for rb in cutlass.range_constexpr(cute.size(s, mode=[1])):
        for cb in cutlass.range_constexpr(cute.size(s, mode=[2])):
            chunk = s[None, rb, cb]
            half = cute.make_rmem_tensor(chunk.shape, dtype)
            half.store(chunk.load().to(dtype))
            words = cute.make_tensor(cute.recast_ptr(half.iterator, dtype=Float32), p_coords[None, rb, cb].shape)
            cute.copy(p_copy, words, p_tmem[None, rb, cb])


@cute.jit
def pack_stats(rows: softmax.RowState, regs: cute.Tensor):
    """Row scale, row max and this thread's partial row sum of its 4 rows -> 12 scratch registers."""
    for r in cutlass.range_constexpr(ROWS_PER_THREAD):
        regs[r] = rows.row_scale[r]
        regs[ROWS_PER_THREAD + r] = rows.row_max[r]
        regs[2 * ROWS_PER_THREAD + r] = rows.row_sum[r]


@cute.jit
def unpack_stats(regs: cute.Tensor, rows: softmax.RowState):
    """The inverse of pack_stats, into the correction thread's RowState (same rows, same quad)."""
    for r in cutlass.range_constexpr(ROWS_PER_THREAD):
        rows.row_scale[r] = regs[r]
        rows.row_max[r] = regs[ROWS_PER_THREAD + r]
        rows.row_sum[r] = regs[2 * ROWS_PER_THREAD + r]


@cute.jit
def warp_needs_rescale(rows: softmax.RowState) -> cutlass.Boolean:
    """The shared conditional-rescale decision (softmax.warp_needs_rescale), taken before any O column
    is loaded from TMEM."""
    return softmax.warp_needs_rescale(rows, ROWS_PER_THREAD)


@cute.jit
def rescale_o(o_tmem: cute.Tensor, thread: Int32, rows: softmax.RowState, chunk: cutlass.Constexpr[int]):
    """O rows *= row scale in TMEM (softmax.rescale_rows on each `chunk` of columns)."""
    for c in cutlass.range_constexpr(o_tmem.shape[1] // chunk):
        load, store, src, dst, coords = o_copies(column_chunk(o_tmem, c, chunk), thread)
        regs = cute.make_rmem_tensor(coords.shape, Float32)
        cute.copy(load, src, regs)
        cute.arch.fence_view_async_tmem_load()
        softmax.rescale_rows(quad_rows_cols(regs), rows, vote=False)
        cute.copy(store, regs, dst)


def o_rows(o_tmem: cute.Tensor, thread: Int32, chunk: cutlass.Constexpr[int]) -> cute.Tensor:
    """The (row, col) coordinates of this thread's first `chunk`-column slice of O (its rows, for the LSE store)."""
    return quad_rows_cols(o_copies(column_chunk(o_tmem, 0, chunk), thread)[4])


@cute.jit
def o_epilogue(o_tmem: cute.Tensor, thread: Int32, inv: cute.Tensor, sO: cute.Tensor,
               dtype: cutlass.Constexpr, chunk: cutlass.Constexpr[int]):
    """Normalize O `chunk` columns at a time by the row factors `inv` (softmax.row_normalizers, reduced once per
    tile), round it to `dtype` and write it into the (128, head_dim_v) shared-memory tile `sO`."""
    for c in cutlass.range_constexpr(o_tmem.shape[1] // chunk):
        load, _, src, _, coords = o_copies(column_chunk(o_tmem, c, chunk), thread)
        regs = cute.make_rmem_tensor(coords.shape, Float32)
        cute.copy(load, src, regs)
        cute.arch.fence_view_async_tmem_load()
        softmax.scale_rows(quad_rows_cols(regs), inv)
        out = cute.make_rmem_tensor(coords.shape, dtype)
        out.store(regs.load().to(dtype))
        to_smem = cute.make_tiled_copy_D(sm100_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, dtype, Float32, load), load)
        thr = to_smem.get_slice(thread)
        cute.copy(to_smem, thr.retile(out), thr.partition_D(cute.local_tile(sO, (ROWS, chunk), (0, c))))


@cute.jit
def store_lse(mLSE: cute.Tensor, lse: cute.Tensor, rows_cols: cute.Tensor, batch: Int32, head: Int32,
              row0: Int32, seqlen_q: Int32):
    """LSE of the thread's rows -> mLSE[batch, head, row], written by the quad lane holding column 0."""
    if rows_cols[0, 0][1] == 0:
        for r in cutlass.range_constexpr(ROWS_PER_THREAD):
            row = row0 + rows_cols[r, 0][0]
            if row < seqlen_q:
                mLSE[batch, head, row] = lse[r]


# --- ordering, pipelines and scheduling ----------------------------------------------------------


@dsl_user_op
def fence_before_sync(*, loc=None, ip=None):
    """tcgen05.fence::before_thread_sync: this thread's finished tcgen05 loads/stores are ordered before
    the barrier arrive that follows (another role then issues MMAs or TMEM accesses on them)."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC, loc=loc, ip=ip)


@dsl_user_op
def fence_after_sync(*, loc=None, ip=None):
    """tcgen05.fence::after_thread_sync: tcgen05 operations after a barrier wait are ordered after what
    the arriving threads did before their arrive."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC, loc=loc, ip=ip)


@dsl_user_op
def opaque(value: Int32, *, loc=None, ip=None) -> Int32:
    """`value`, through a move the compiler cannot see through: what is derived from it inside a loop
    body is recomputed there instead of being hoisted out and kept in registers across iterations."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(value).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


def tma_split(atom: cute.CopyAtom, s: cute.Tensor, g: cute.Tensor):
    """(staged smem view, gmem view) of a TMA copy; `g` is partitioned by the MMA (A or B operand)."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 3), cute.group_modes(g, 0, 3))


def load_stage(pipe, state: pipeline.PipelineState, atom: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor,
               nbytes: int):
    """Acquire stage `state` of `pipe` for `nbytes` TMA bytes and copy `src` into it (the caller advances
    `state`: a loop-carried state must be rebound in the loop body itself)."""
    pipe.producer_acquire(state, expected_tx=nbytes)
    cute.copy(atom, src, dst[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state))


def accumulate_variants(make_tiled_mma):
    """(tiled MMA that overwrites its accumulator, tiled MMA that adds to it), built once by the caller:
    setting the field inside the MMA warp's loops would make every loop carry the MMA atom's state."""
    init, acc = make_tiled_mma(), make_tiled_mma()
    init.set(tcgen05.Field.ACCUMULATE, False)
    acc.set(tcgen05.Field.ACCUMULATE, True)
    return init, acc


@cute.jit
def issue_mma(mmas, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, accumulate):
    """acc (+)= a·b over the K blocks of one tile (tcgen05 MMAs, issued by the MMA warp). `mmas` is
    accumulate_variants(...); `accumulate` (Python or run-time bool) applies to the first K block."""
    init, add = mmas
    for k in cutlass.range_constexpr(cute.size(a, mode=[2])):
        if cutlass.const_expr(k > 0 or accumulate is True):
            cute.gemm(add, acc, a[None, None, k], b[None, None, k], acc)
        elif cutlass.const_expr(accumulate is False):
            cute.gemm(init, acc, a[None, None, k], b[None, None, k], acc)
        else:
            if accumulate:
                cute.gemm(add, acc, a[None, None, k], b[None, None, k], acc)
            else:
                cute.gemm(init, acc, a[None, None, k], b[None, None, k], acc)


def stage(stages: int, index, phase: Int32) -> pipeline.PipelineState:
    """The pipeline state of a stage chosen by the caller (a Q tile's own stage) at `phase`."""
    return pipeline.PipelineState(stages, Int32(0), Int32(index), phase)


@cute.jit
def key_blocks(bounds, tile_n: cutlass.Constexpr[int]):
    """[n_min, n_max) key blocks of a CTA's rows (fa4gen.device.mask), never empty: a tile whose rows see
    no key runs one fully masked block (its rows end with O = 0, LSE = -inf), so every role takes the
    same number of pipeline steps per tile."""
    n_min, n_max = mask.n_block_range(bounds, tile_n)
    return n_min, cutlass.max(n_max, n_min + 1)


__all__ = [
    "ROWS",
    "PACKED_POLY",
    "PACKED_POLY_MAX_HEAD_DIM",
    "PACKED_POLY_MIN_EVERY",
    "ROWS_PER_THREAD",
    "accumulate_variants",
    "column_chunk",
    "fence_after_sync",
    "fence_before_sync",
    "issue_mma",
    "key_blocks",
    "load_stage",
    "o_copies",
    "o_epilogue",
    "o_rows",
    "opaque",
    "p_store",
    "pack_stats",
    "packed_poly",
    "per_tile",
    "quad_rows_cols",
    "quad_rows_cols_layout",
    "rescale_o",
    "restage",
    "score_coords",
    "score_load",
    "stage",
    "stats_copies",
    "store_lse",
    "store_p",
    "tile_view",
    "tma_split",
    "tmem_copy",
    "tmem_view",
    "unpack_stats",
    "warp_needs_rescale",
]

"""Device helpers: the online-softmax row update and its finalization (SM90 and SM100 share these).

Scores live in fp32 registers as a (row, col) view. The running row max is kept in raw score
units; everything exponential happens in the exp2 domain (score * scale_log2). A row's max is
only moved when it grows by more than `threshold` (exp2 domain) — otherwise the stale max is
kept, exponentials may exceed 1 by at most 2**threshold, and the final division by the row sum
makes the result exact anyway. threshold = 0 moves the max whenever it grows (classic FA2).
Each row is shared by a quad of 4 neighbouring lanes, so reductions finish with 2 butterfly shuffles.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa4gen.device import polyexp


@cute.jit
def quad_max(x: Float32) -> Float32:
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def quad_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1)


class RowState:
    """Per-thread softmax statistics of the rows a thread holds (fp32 registers)."""

    def __init__(self, row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor):
        self.row_max = row_max  # running max, raw score units (-inf until a row sees a key)
        self.row_sum = row_sum  # this thread's partial sum of exp2 values
        self.row_scale = row_scale  # last step's O rescale factor per row

    @staticmethod
    def create(n_rows: int) -> "RowState":
        state = RowState(*(cute.make_rmem_tensor((n_rows,), Float32) for _ in range(3)))
        state.row_max.fill(-Float32.inf)
        state.row_sum.fill(0.0)
        return state


@cute.jit
def apply_softcap(s: cute.Tensor, pre: Float32):
    """s = tanh(s * pre); the cap itself is folded into scale_log2 by the caller."""
    for e in cutlass.range_constexpr(cute.size(s)):
        s[e] = cute.math.tanh(s[e] * pre, fastmath=True)


@cute.jit
def mask_columns(s: cute.Tensor, coords: cute.Tensor, limit: Int32):
    """-inf for columns at or past `limit` (tile-local): the ragged last key block."""
    for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
        if coords[0, c][1] >= limit:
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                s[r, c] = -Float32.inf


@cute.jit
def online_softmax_step(
    s: cute.Tensor,
    rows: RowState,
    scale_log2: Float32,
    *,
    threshold: cutlass.Constexpr[float],
    poly_every: cutlass.Constexpr[int],
    poly_coeffs: cutlass.Constexpr[tuple],
    is_first: cutlass.Constexpr[bool] = False,
    packed_poly: cutlass.Constexpr[bool] = False,
):
    """Turn scores `s` (row, col view, fp32) into unnormalized probabilities in place.

    Updates the running max and partial sums in `rows` and leaves in `rows.row_scale` the factor
    by which the caller must rescale its O rows (1.0 when the max was kept).
    `poly_every` = k > 0 evaluates every k-th exp2 of a row with the FMA polynomial instead of MUFU.
    `is_first` (the first key block of a tile) skips the rescale bookkeeping: nothing to rescale yet.
    `packed_poly` (sm_100+): the polynomial exp2s two at a time (`polyexp.exp2_poly2`, Blackwell's packed fp32
    ops), the same values as the scalar form's.
    """
    row_max, row_sum, row_scale = rows.row_max, rows.row_sum, rows.row_scale
    n_cols = cute.size(s, mode=[1])
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        # the row's scores read once (each tensor index costs trace time and ops the passes must fold)
        row = [s[r, c] for c in range(n_cols)]  # a comprehension is unrolled at trace time
        # four independent max chains (short dependency chains), seeded with the running max
        lanes = row[:min(4, n_cols)]
        if cutlass.const_expr(not is_first):
            lanes[0] = cute.arch.fmax(lanes[0], row_max[r])
        for c in cutlass.range_constexpr(len(lanes), n_cols):
            lanes[c % 4] = cute.arch.fmax(lanes[c % 4], row[c])
        tile_max = lanes[0]
        for j in cutlass.range_constexpr(1, len(lanes)):
            tile_max = cute.arch.fmax(tile_max, lanes[j])
        new_max = quad_max(tile_max)  # includes the running max
        scale = Float32(1.0)
        cur_max = new_max
        old_max = new_max
        if cutlass.const_expr(not is_first):
            old_max = row_max[r]
        if cutlass.const_expr(not is_first and threshold > 0):
            cur_max = old_max
            # -inf -> finite gives +inf > threshold (move); -inf -> -inf gives NaN (keep).
            if (new_max - old_max) * scale_log2 > threshold:
                scale = cute.math.exp2((old_max - new_max) * scale_log2, fastmath=True)
                cur_max = new_max
        row_max[r] = cur_max
        max_scaled = cur_max * scale_log2
        if cur_max == -Float32.inf:
            max_scaled = Float32(0.0)
        if cutlass.const_expr(not is_first and threshold <= 0):
            # threshold 0 (always rescale): the max always moves (new_max includes the old one), so no compare and
            # select stands between the row max and the exponentials; the factor comes from the guarded max_scaled
            # in one FFMA: 1 where the max stayed (up to the rounding of max_scaled, a factor O and the sum share,
            # so it cancels in the normalization), 0 after a row that saw no key yet (old max -inf; its O and sum
            # are 0), never NaN
            scale = cute.math.exp2(old_max * scale_log2 - max_scaled, fastmath=True)
        acc = Float32(0.0)
        if cutlass.const_expr(not is_first):
            acc = row_sum[r] * scale
        poly = [c for c in range(n_cols) if poly_every > 0 and c % poly_every == poly_every - 1]
        acc = _exp2_row(s, r, row, scale_log2, max_scaled, poly, poly_coeffs, acc, packed_poly)
        row_sum[r] = acc
        row_scale[r] = scale


def _exp2_row(s: cute.Tensor, r: int, row: list, scale_log2: Float32, max_scaled: Float32, poly: list,
              coeffs: tuple, acc: Float32, packed: bool) -> Float32:
    """`online_softmax_step`'s exp2s of row r: 2**(x * scale_log2 - max_scaled) into s[r, :], the columns `poly` by
    the FMA polynomial and the rest on MUFU; returns the row sum, added in column order. With `packed` (sm_100+) the
    polynomial columns go in pairs through `polyexp.exp2_poly2` (the same values), the columns up to each pair's
    second one at a time, so that no more than one pair's span is formed ahead of its use (at share 0.5 that and a
    whole row at once spilled alike, 14 registers at d128: sm100.packed_poly starts at every 5th column)."""
    pairs = [(poly[i], poly[i + 1]) for i in range(0, len(poly) - 1, 2)] if packed else []
    done = 0
    for a, b in pairs + [(None, len(row) - 1)]:
        ps = {}
        if a is not None:
            ps[a], ps[b] = polyexp.exp2_poly2(row[a] * scale_log2 - max_scaled, row[b] * scale_log2 - max_scaled,
                                              coeffs)
        for c in range(done, b + 1):
            if c not in ps:
                x = row[c] * scale_log2 - max_scaled
                ps[c] = polyexp.exp2_poly(x, coeffs) if c in poly else cute.math.exp2(x, fastmath=True)
            s[r, c] = ps[c]
            acc = acc + ps[c]
        done = b + 1
    return acc


@cute.jit
def rescale_rows(o: cute.Tensor, rows: RowState, *, vote: cutlass.Constexpr[bool]):
    """O rows *= row_scale (o is a (row, col) view). With `vote`, the warp skips the multiply
    unless one of its rows moved its max (conditional rescaling: the common case is none)."""
    row_scale = rows.row_scale
    if cutlass.const_expr(vote):
        if warp_needs_rescale(rows, cute.size(o, mode=[0])):
            scale_rows(o, row_scale)
    else:
        scale_rows(o, row_scale)


@cute.jit
def warp_needs_rescale(rows: RowState, n_rows: cutlass.Constexpr[int]) -> cutlass.Boolean:
    """The conditional-rescale decision, uniform over the warp: did any of the warp's rows (this
    thread's first `n_rows`) move its max in the last step? Callers that must fetch O first (TMEM on
    sm100) take it before loading anything."""
    row_scale = rows.row_scale
    smallest = row_scale[0]  # factors are <= 1, and exactly 1 when a row kept its max
    for r in cutlass.range_constexpr(1, n_rows):
        smallest = cute.arch.fmin(smallest, row_scale[r])
    return cute.arch.vote_any_sync(smallest < Float32(1.0))


@cute.jit
def scale_rows(o: cute.Tensor, row_scale: cute.Tensor):
    """o[r, c] *= row_scale[r] for a (row, col) view: the O rescale, and the SM100 epilogue's 1 / row sum per chunk."""
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        scale = row_scale[r]
        for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
            o[r, c] = o[r, c] * scale


@cute.jit
def row_normalizer(row_max: Float32, row_sum: Float32, scale_log2: Float32, lse: cute.Tensor, r: int) -> Float32:
    """One row's 1 / row sum from its max and this thread's partial sum (reduced over the quad here), with its
    natural-log LSE written to lse[r]; (0, -inf) for a row that saw no key."""
    ln2 = 0.6931471805599453
    total = quad_sum(row_sum)
    inv = Float32(0.0)
    lse[r] = -Float32.inf
    if total > Float32(0.0):
        inv = cute.arch.rcp_approx(total)
        lse[r] = (row_max * scale_log2 + cute.math.log2(total, fastmath=True)) * ln2
    return inv


@cute.jit
def row_normalizers(rows: RowState, scale_log2: Float32) -> tuple:
    """`row_normalizer` of every row of `rows`, as two register tensors (inv, lse): the quad reductions done once,
    for callers that normalize O in pieces (the SM100 correction warps, 16 columns at a time; `scale_rows`)."""
    n_rows = cute.size(rows.row_sum)
    inv = cute.make_rmem_tensor((n_rows,), Float32)
    lse = cute.make_rmem_tensor((n_rows,), Float32)
    for r in cutlass.range_constexpr(n_rows):
        inv[r] = row_normalizer(rows.row_max[r], rows.row_sum[r], scale_log2, lse, r)
    return inv, lse


@cute.jit
def finalize(o: cute.Tensor, rows: RowState, scale_log2: Float32) -> cute.Tensor:
    """Normalize O rows by their sums; return the natural-log LSE per row (-inf, and O = 0, for
    rows that saw no key). Row by row (each row's factor, then its columns), the order the SM90 epilogue's
    SASS was tuned with."""
    n_rows = cute.size(o, mode=[0])
    lse = cute.make_rmem_tensor((n_rows,), Float32)
    for r in cutlass.range_constexpr(n_rows):
        inv = row_normalizer(rows.row_max[r], rows.row_sum[r], scale_log2, lse, r)
        for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
            o[r, c] = o[r, c] * inv
    return lse

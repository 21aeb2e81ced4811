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
from cutlass import Float32

from fa4gen.device import polyexp


@cute.jit
def quad_max(x: Float32) -> Float32:
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def quad_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1)


@cute.jit
def online_softmax_step(
    s: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    row_scale: cute.Tensor,
    scale_log2: Float32,
    *,
    is_first: cutlass.Constexpr[bool],
    threshold: cutlass.Constexpr[float],
    poly_every: cutlass.Constexpr[int],
    poly_coeffs: cutlass.Constexpr[tuple],
):
    """Turn scores `s` (row, col view, fp32) into unnormalized probabilities in place.

    Updates `row_max` / `row_sum` (per-thread partial sums) and writes the factor by which the
    caller must rescale its O rows into `row_scale` (1.0 when the max was kept).
    `poly_every` = k > 0 evaluates every k-th exp2 of a row with the FMA polynomial instead of MUFU.
    """
    n_rows = cute.size(s, mode=[0])
    n_cols = cute.size(s, mode=[1])
    for r in cutlass.range_constexpr(n_rows):
        tile_max = s[r, 0]
        for c in cutlass.range_constexpr(1, n_cols):
            tile_max = cute.arch.fmax(tile_max, s[r, c])
        tile_max = quad_max(tile_max)
        old_max = row_max[r]
        new_max = tile_max
        scale = Float32(1.0)
        if cutlass.const_expr(is_first):
            row_max[r] = new_max
        else:
            new_max = cute.arch.fmax(old_max, tile_max)
            # Moves to -inf..finite give +inf > threshold; -inf..-inf gives NaN, which keeps the max.
            if (new_max - old_max) * scale_log2 > threshold:
                scale = cute.math.exp2((old_max - new_max) * scale_log2, fastmath=True)
                row_max[r] = new_max
        cur_max = row_max[r]
        max_scaled = cur_max * scale_log2
        if cur_max == -Float32.inf:
            max_scaled = Float32(0.0)
        acc = Float32(0.0)
        for c in cutlass.range_constexpr(n_cols):
            x = s[r, c] * scale_log2 - max_scaled
            if cutlass.const_expr(poly_every > 0 and c % poly_every == poly_every - 1):
                s[r, c] = polyexp.exp2_poly(x, poly_coeffs)
            else:
                s[r, c] = cute.math.exp2(x, fastmath=True)
            acc += s[r, c]
        if cutlass.const_expr(is_first):
            row_sum[r] = acc
        else:
            row_sum[r] = row_sum[r] * scale + acc
        row_scale[r] = scale


@cute.jit
def rescale_rows(o: cute.Tensor, row_scale: cute.Tensor):
    """O rows *= row_scale (o is a (row, col) view)."""
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
            o[r, c] = o[r, c] * row_scale[r]


@cute.jit
def finalize(o: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, lse: cute.Tensor, scale_log2: Float32):
    """Normalize O rows by their sums; write the natural-log LSE per row (-inf for empty rows, O = 0)."""
    ln2 = 0.6931471805599453
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        total = quad_sum(row_sum[r])
        inv = Float32(0.0)
        lse[r] = -Float32.inf
        if total > Float32(0.0):
            inv = cute.arch.rcp_approx(total)
            lse[r] = (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * ln2
        for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
            o[r, c] = o[r, c] * inv

"""Device helpers: tile-scheduler index math shared by the SM90 and SM100 kernels.

Masked specs (causal, windows, chunks) give later query tiles more key blocks; launching the
longest tiles first ("longest processing time first") shortens the tail of the grid.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def longest_first(i: Int32, num_m: Int32) -> Int32:
    """The query tile to run i-th when the last tiles are the longest: num_m - 1 - i."""
    return num_m - 1 - i


@cute.jit
def tile_coords(tile: Int32, num_m: Int32, num_heads: Int32, num_batch: Int32, group: Int32, *,
                longest_first_order: cutlass.Constexpr[bool]):
    """(m_block, head, batch) of linear work-tile index `tile`.

    Longest-first (masked specs): `longest_first_grouped` over groups of `group` (head, batch) pairs;
    with `group = pow2_group(pairs, l2_group(...))`, as the SM100 forward passes, that is exactly the order
    the SM90 forward's grid launches its CTAs in (decoded there by `grouped_pair`). Otherwise the query
    tiles of a (head, batch) are consecutive, so CTAs that run at the same time share K/V in L2.
    """
    m_block = tile % num_m
    hb = tile // num_m
    if cutlass.const_expr(longest_first_order):
        m_block, hb = longest_first_grouped(tile, num_m, num_heads * num_batch, group)
    return m_block, hb % num_heads, hb // num_heads


@cute.jit
def head_grouped(tile: Int32, num_n: Int32, num_hb: Int32, group: Int32):
    """(n_block, hb) of linear CTA index `tile` of the backward (num_n key blocks per (head, batch) pair
    hb, num_hb pairs): pairs go in groups of `group`, and within a group every pair's first key block
    comes first (key blocks ascending, pairs fastest). With a causal mask the first key blocks see the
    most query blocks, so each group — the grid's last one above all — ends on its shortest CTAs, while
    the CTAs in flight read the Q/dO of only a few pairs (L2 reuse, as consecutive key blocks do)."""
    full = group * num_n
    g = tile // full  # the last group may be partial: tile // full is still its index
    size = cutlass.min(group, num_hb - g * group)
    local = tile - g * full
    return local // size, g * group + local % size


@cute.jit
def pairs_for(num_m: Int32, num_heads: Int32, num_batch: Int32, ctas: Int32) -> Int32:
    """1 when a masked persistent forward pairs its query tiles (more tiles than CTAs), else 0: with no more
    tiles than CTAs, pairing would put two tiles on one CTA where the grid runs them side by side (a causal
    call with seqlen_k >> seqlen_q, small windows: tiles of nearly equal length, up to 2x slower paired)."""
    return cutlass.min((num_m * num_heads * num_batch) // (ctas + 1), 1)


@cute.jit
def paired_units(num_m: Int32, num_heads: Int32, num_batch: Int32, pairs: Int32) -> Int32:
    """Work units of a masked persistent forward: per (head, batch) pair, query tile j paired with tile
    num_m - 1 - j (ceil(num_m / 2) units; the middle tile alone when num_m is odd); with `pairs` 0, one
    tile per unit (num_m units, the longest first)."""
    return (num_m - pairs * (num_m // 2)) * num_heads * num_batch


@cute.jit
def paired_tiles(unit: Int32, num_m: Int32, pairs: Int32) -> Int32:
    """How many query tiles unit `unit` holds: 2, or 1 for the middle tile of an odd num_m (1 unpaired)."""
    j = unit % (num_m - pairs * (num_m // 2))
    return 1 + pairs * cutlass.min(num_m - 1 - 2 * j, 1)  # num_m - 1 - 2j: 0 for the middle tile, else >= 1


@cute.jit
def paired_tile(unit: Int32, t: Int32, num_m: Int32, num_heads: Int32, pairs: Int32):
    """(m_block, head, batch) of the t-th tile (t < paired_tiles) of unit `unit`: the longer tile first.

    With a causal mask tile m sees about m + 1 key blocks, so each pair of tiles j and num_m - 1 - j costs
    about num_m + 1 blocks: the units cost the same, and CTAs that stride over them (unit i, i + CTAs, ...)
    stay balanced without a dynamic scheduler. The units of a (head, batch) pair are consecutive, so the CTAs
    in flight share the K/V of a few pairs in L2. Windows and chunks give the tiles nearly equal lengths:
    any pairing balances those. Unpaired (`pairs` 0), unit j of a pair is its tile num_m - 1 - j."""
    per_pair = num_m - pairs * (num_m // 2)
    j = unit % per_pair
    hb = unit // per_pair
    m_block = num_m - 1 - j - t * (num_m - 1 - 2 * j)  # t = 0: num_m - 1 - j, t = 1: j
    return m_block, hb % num_heads, hb // num_heads


# bytes of L2 the longest-first forward plans to keep K/V of a group's heads in (flash-attn-4's figure
# for the H100/H200's 50 MB L2, which it measured faster than one head at a time)
L2_KV_BYTES = 50 * 1024 * 1024
# at most this many pairs per group: on the H200 (session 9, docs/PERF.md) groups of 50-200 short pairs
# (s1k-2k, d64/d128) ran 2-8% slower than one pair at a time, groups of 6-25 long ones 0-5% faster
L2_MAX_GROUP = 16


@cute.jit
def l2_group(seqlen_k: Int32, bytes_per_key: cutlass.Constexpr[int]) -> Int32:
    """(head, batch) pairs whose K and V (seqlen_k x bytes_per_key each pair) fit L2_KV_BYTES, in
    [1, L2_MAX_GROUP]. Divides the constant first, so long sequences cannot overflow Int32."""
    return cutlass.min(cutlass.max((L2_KV_BYTES // bytes_per_key) // seqlen_k, Int32(1)), Int32(L2_MAX_GROUP))


@cute.jit
def longest_first_grouped(tile: Int32, num_m: Int32, num_hb: Int32, group: Int32):
    """(m_block, hb) of linear CTA index `tile` of a masked forward: pairs in groups of `group`, inside a
    group every pair's last (longest) query tile first, pairs fastest (head_grouped, query tiles reversed)."""
    i, hb = head_grouped(tile, num_m, num_hb, group)
    return longest_first(i, num_m), hb


def pow2_group(num_hb: Int32, limit: Int32) -> Int32:
    """The largest power of two that divides num_hb, is at most `limit` and at most L2_MAX_GROUP (>= 1).

    Host-side, for grids (group, blocks, num_hb // group): blockIdx.x walks the pairs of a group
    fastest, blockIdx.y the blocks, blockIdx.z the groups — the launch order of `head_grouped` with
    groups that divide num_hb, decoded without integer division (`grouped_pair`)."""
    g = 1
    for size in [1 << k for k in range(1, L2_MAX_GROUP.bit_length())]:
        # 1 when limit >= size and size divides num_hb, else 0 (arithmetic: no branch on run-time values)
        ok = cutlass.min(limit // size, 1) * (1 - cutlass.min(num_hb % size, 1))
        g = cutlass.max(g, size * ok)
    return g


@cute.jit
def grouped_pair(x: Int32, z: Int32, group: Int32, num_heads: Int32):
    """(head, batch) of the CTA at blockIdx (x, ., z) in a grid built with `pow2_group`: pair z * group + x."""
    hb = z * group + x
    return hb % num_heads, hb // num_heads

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
def paired_units(num_tiles: Int32, pairs: Int32) -> Int32:
    """CTAs a masked persistent forward can use: one per unit of two tiles (ceil(num_tiles / 2)), or with
    `pairs` 0 one per tile. The grid's CTA count is at most this."""
    return (num_tiles + pairs) >> pairs


def _pick(flag, a, b):
    """a where flag is 1, b where it is 0 (flag an integer 0 / 1): arithmetic, so the tile mapping has no branch
    (and works on Python ints too, for the CPU tests)."""
    return b + flag * (a - b)


def _below(a, b):
    """1 when a < b, else 0 (both well inside Int32)."""
    return ((a - b) >> 31) & 1


def paired_schedule(cta: Int32, ctas: Int32, num_tiles: Int32, num_m: Int32, num_hb: Int32, ramp=None):
    """Per-CTA constants of a masked persistent forward's tile order (computed once, before the tile loop):
    (iterations, head_iters, tail_z, pre, tail_hb, tail_pairs) for `paired_tile`; with `ramp`, (iterations,
    head_iters, tail_z, pre, tail_hb, full_tiles, tail_pairs) (see below).

    The order has a head and a tail. The head is every block of 2 x ctas flat positions but the last whole one:
    in block b, CTA c runs the unit at positions 2c and 2c + 1 of the order Z (see `paired_tile`), back to back.
    The tail is the rest, the last whole block and the partial one (2 x ctas to 4 x ctas tiles, or every tile
    when there are fewer than 2 x ctas): its tiles go longest first — the rest of the (head, batch) pair the head
    ended inside (`pre` tiles, in Z order), then the whole pairs from `tail_hb` on (`tail_pairs` of them) by
    level, every pair's tile num_m - 1, then every pair's num_m - 2, ... — and are dealt to the CTAs in a snake,
    round r forwards when r is even and backwards when odd, so the CTA with the longest tile of one round gets
    the shortest of the next. Units of equal cost balance the head; the snake spreads the tail, which units
    would leave to one tile or unit per CTA (a tile model over seqlens 512-4096, 16k tokens, 132 SMs: the
    makespan over a perfect balance 1.037 -> 1.009 at d64 and 1.062 -> 1.019 at d128, worst 1.12 -> 1.03;
    a greedy longest-first tail: 1.007 / 1.015).

    `ramp` (sliding windows, from `window_ramp`, which keeps num_hb x (num_m - ramp) even, as `chunk_ramp` does;
    None otherwise): the query tiles at the start of every pair whose window the sequence start cuts, so they see
    fewer key blocks (about 1, 2, ..., ramp) than the rest, which all see the same number. Pairing tile j with num_m
    - 1 - j then makes units of unequal cost, and a stride over them leaves some CTAs the cheap units of every pair
    (tools/sim_schedules.py window: 1.18x a perfect balance at s3072 with a 1024-key window). With `ramp` the order
    is Z' = the full tiles first (pair after pair, in the order Z over each pair's num_m - ramp of them: units of
    two full tiles) and then every pair's ramp tiles in the order Z over `ramp` tiles (units j / ramp - 1 - j, each
    about one full tile's cost): each part's units cost the same, and the tail goes longest first as above, the rest
    of the full tiles before the ramp tiles' levels. `ramp` = num_m is the order without it. A chunked mask
    (`chunk_ramp`, paired_tile's `ramp_high`) uses the same split with the ramp at a pair's end: its whole chunks
    are the first part, the last, partial chunk the ramp."""
    two = 2 * ctas
    head_blocks = cutlass.max(num_tiles // two - 1, 0)
    head_iters = 2 * head_blocks
    tail_z = head_blocks * two
    if ramp is None:
        hb0 = tail_z // num_m
        s0 = tail_z - hb0 * num_m
        partial = cutlass.min(s0, 1)
        pre = partial * (num_m - s0)
    else:
        full_tiles = num_hb * (num_m - ramp)  # the first part of Z'
        z2 = cutlass.max(tail_z - full_tiles, 0)  # where the tail starts in the ramp part (0: inside the full part)
        hb0 = z2 // cutlass.max(ramp, 1)
        s0 = z2 - hb0 * ramp
        partial = cutlass.min(s0, 1)
        # in Z' order: the full part's rest, or the rest of the ramp pair the head ended inside
        pre = cutlass.max(full_tiles - tail_z, 0) + partial * (ramp - s0)
    tail_hb = hb0 + partial
    tail = num_tiles - tail_z
    rounds = tail // ctas
    left = tail - rounds * ctas  # tiles of the last, partial round
    lane = _pick(rounds & 1, ctas - 1 - cta, cta)  # this CTA's place in that round
    if ramp is None:
        return head_iters + rounds + _below(lane, left), head_iters, tail_z, pre, tail_hb, num_hb - tail_hb
    return head_iters + rounds + _below(lane, left), head_iters, tail_z, pre, tail_hb, full_tiles, num_hb - tail_hb


def _z_position(s, hb, span):
    """The query tile at position s of pair hb's stretch of the order Z over `span` tiles: span - 1, 0, span - 2, 1,
    ...; a pair that starts on an odd position of Z (odd span and odd hb) puts its middle tile first."""
    s -= hb & span & 1
    s += (s >> 31) & span  # -1 (odd start, position 0) -> span - 1: the middle tile first
    half, odd = s >> 1, s & 1
    return span - 1 - half - odd * (span - 1 - 2 * half)  # s even: span - 1 - s / 2; odd: s // 2


def window_ramp(window_left, window_right, seqlen_q, seqlen_k, num_m, num_hb, tile_m: int):
    """`ramp` for paired_schedule / paired_tile under a sliding window of `window_left` keys left and `window_right`
    right of the diagonal (-1: unbounded): the query tiles of a pair whose window the sequence start cuts (row
    m * tile_m reaches back past key 0, bottom-right aligned: ceil((left - (seqlen_k - seqlen_q)) / tile_m), at most
    num_m); all num_m (the order without a ramp) when the left side is unbounded (causal) or the right one is (the
    tiles past the ramp then cost less the later they start, not alike: not modelled). One
    more where the full part would hold an odd number of tiles (num_hb x (num_m - ramp)): the ramp part then starts
    on an even position of Z', so its units stay j / ramp - 1 - j (the extra tile is a full one, and with tile 0 it
    costs what the other ramp units cost). Arithmetic only: the same in the kernel and on Python ints."""
    unbounded = ((window_left | window_right) >> 31) & 1
    cut = cutlass.min((cutlass.max(window_left - (seqlen_k - seqlen_q), 0) + (tile_m - 1)) // tile_m, num_m)
    ramp = unbounded * num_m + (1 - unbounded) * cut
    return ramp + ((num_m - ramp) & num_hb & 1)


def chunk_ramp(chunk, seqlen_q, seqlen_k, num_m, num_hb, tile_m: int):
    """`ramp` for paired_schedule / paired_tile (with `ramp_high`) under a chunked mask of `chunk` keys: the query
    tiles of a pair's last, partial chunk. Tile m sees (m mod c) + 1 key blocks (c = chunk / tile_m tiles a chunk), so
    Z's units j / num_m - 1 - j cost alike only when num_m is a multiple of c; otherwise (a chunk of 2048 keys at
    s3072: tiles 0-15 see 1-16 blocks, 16-23 see 1-8) units cost 9 to 25 blocks and a stride over them leaves some
    CTAs the dear ones (tools/sim_schedules.py window: 1.66x a perfect balance). The order Z' then runs every pair's
    whole chunks first (Z over their w tiles: units cost c + 1) and the partial chunks' ramp = num_m - w tiles after
    them (Z over those: units cost ramp + 1). num_m (the order without a ramp) where that does not hold: a chunk not
    a multiple of tile_m, chunk boundaries off the query tiles' (seqlen_k - seqlen_q not a multiple of the chunk, or
    negative), no whole chunk or no partial one, or an odd number of whole-chunk tiles over all pairs (num_hb x w,
    with c odd: the ramp part would start on an odd position of Z'). Arithmetic only: the same in the kernel and on
    Python ints."""
    shift = seqlen_k - seqlen_q
    per = chunk // tile_m
    safe_chunk = cutlass.max(chunk, 1)
    safe_per = cutlass.max(per, 1)
    whole = num_m // safe_per * per  # w: the tiles of whole chunks
    rest = num_m - whole
    aligned = (1 - cutlass.min(chunk - per * tile_m, 1)) * (1 - ((shift >> 31) & 1)) * \
        (1 - cutlass.min(shift - shift // safe_chunk * chunk, 1))
    split = aligned * cutlass.min(whole, 1) * cutlass.min(rest, 1) * (1 - (whole & num_hb & 1))
    return _pick(split, rest, num_m)


def paired_tile(k: Int32, cta: Int32, ctas: Int32, num_m: Int32, num_heads: Int32, schedule,
                m_div=None, heads_div=None, pairs_div=None, ramp=None, full_div=None, ramp_high=False):
    """(m_block, head, batch) of the work tile CTA `cta` of a masked persistent forward runs in iteration `k` of
    its loop over `paired_schedule(...)[0]` iterations (`schedule`: the rest of that tuple; `ctas`: the grid's
    size, `paired_units` or fewer).

    The order Z: per (head, batch) pair, query tiles num_m - 1, 0, num_m - 2, 1, ... (the longest, the
    shortest, the next longest, ...), an odd num_m's middle tile last; a pair that starts on an odd position
    of Z (an odd num_m and an odd pair) puts its middle tile first instead, so it closes the unit the previous
    pair's middle tile opened. A unit is two consecutive tiles of Z (an even and an odd position): with a
    causal mask tile m sees about m + 1 key blocks, so every unit costs num_m + 1 blocks, and CTAs that stride
    over units stay balanced without a dynamic scheduler; the units of a pair are consecutive, so the CTAs in
    flight share the K/V of a few pairs in L2. The tail (`paired_schedule`) goes longest first in a snake.
    Windows and chunks give the tiles nearly equal lengths: any order balances those. A brute force over
    shapes and SM counts (tests/test_sm100_layouts.py) covers every tile once.

    No division by a run-time value per tile: the head's block and half are shifts of k, and num_m, num_heads
    and the tail's pair count divide through FastDivmod divisors the kernel makes once (`m_div`, `heads_div`,
    `pairs_div`; None: plain division, for the CPU tests). Session 16 measured the flat index's two divisions
    by the grid size per tile: d64 causal 786 instructions per tile outside the key-block loops against 719
    with this form, its tail included (CPU SASS), and 1-5% slower than session 15's nested loop at d64 (H200). The kernel passes
    the results through `cute.arch.make_warp_uniform` (a few instructions fewer per key block, CPU SASS).
    Check `tools/sass_loops.py specs/llama3_8b.yaml` after any change here.

    `ramp` (and `schedule` from paired_schedule with it): the order Z' (paired_schedule): every pair's num_m - ramp
    full tiles in the order Z over them, then every pair's ramp tiles in the order Z over those; `m_div` divides by
    `ramp` and `full_div` by num_m - ramp (at least 1). The ramp tiles are a pair's first ones (a sliding window,
    `window_ramp`), or with `ramp_high` (a compile-time choice) its last ones (a chunked mask, `chunk_ramp`)."""
    if ramp is None:
        head_iters, tail_z, pre, tail_hb, tail_pairs = schedule
        span = num_m  # every tile is in the Z order
    else:
        head_iters, tail_z, pre, tail_hb, full_tiles, tail_pairs = schedule
        span = ramp
    in_tail = 1 - _below(k, head_iters)
    r = k - head_iters
    rank = r * ctas + _pick(r & 1, ctas - 1 - cta, cta)  # the tail's order, dealt in a snake
    z = _pick(in_tail, tail_z + rank, (k >> 1) * (2 * ctas) + 2 * cta + (k & 1))
    ramp_base = 0  # the first ramp tile of a pair
    if ramp is not None:
        # Z': the full tiles first, pair after pair, in the order Z over the num_m - ramp of them; then the ramp tiles
        in_full = _below(z, full_tiles)
        full = num_m - ramp
        hb_full = z // (cutlass.max(full, 1) if full_div is None else full_div)
        m_full = _z_position(z - hb_full * full, hb_full, full)
        if ramp_high:
            ramp_base = full
        else:
            m_full += ramp
        z = cutlass.max(z - full_tiles, 0)
    if m_div is None:
        m_div = span if ramp is None else cutlass.max(span, 1)  # (ramp 0: no ramp part; never picked)
    hb = z // m_div
    m_block = _z_position(z - hb * span, hb, span) + ramp_base
    if ramp is not None:
        hb = _pick(in_full, hb_full, hb)
        m_block = _pick(in_full, m_full, m_block)
    # the tail past its partial pair: by level (longest first), the pairs in order inside a level
    by_level = in_tail * (1 - _below(rank, pre))
    j = cutlass.max(rank - pre, 0)
    level = j // (cutlass.max(tail_pairs, 1) if pairs_div is None else pairs_div)
    hb = _pick(by_level, tail_hb + j - level * tail_pairs, hb)
    m_block = _pick(by_level, ramp_base + span - 1 - level, m_block)
    batch = hb // (num_heads if heads_div is None else heads_div)
    return m_block, hb - batch * num_heads, batch


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


# A deterministic causal backward's grid (groups of (head, batch) pairs, launched group after group) adds each query
# block's dQ in a fixed key-block order. Last to first, its CTAs must launch shortest first (each waits only for CTAs
# launched before it), which ends the grid on each pair's longest key block. The last group therefore adds first to
# last and launches longest first, when there are two or more groups and the last holds this many CTAs or more: about
# two waves of a 132-SM H100 / H200. With fewer, its CTAs run side by side and the first-to-last order's wavefront
# (key block n starts its first query block once n - 1 has passed it) costs more than the tail it saves
# (tests/test_det_schedule.py's step model; the same model has the tail 2-7% shorter from this size on).
DET_TAIL_UP_CTAS = 256


@cute.jit
def det_tail_ascending(z: Int32, groups: Int32, group: Int32, num_n: Int32) -> Int32:
    """1 when the CTAs of group `z` (of `groups`, each `group` pairs x `num_n` key blocks) add first to last: the
    last group, with two or more groups and at least DET_TAIL_UP_CTAS CTAs in it; else 0. No branches."""
    last = 1 - cutlass.min(groups - 1 - z, 1)
    return cutlass.min(groups - 1, 1) * last * cutlass.min((group * num_n) // DET_TAIL_UP_CTAS, 1)


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

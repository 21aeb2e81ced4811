"""Event simulations of two scheduling questions, on the CPU (no GPU; a model, not a measurement):

`det`: the deterministic backward's dQ turns. Key-block CTAs launch in grid order onto `sms` SMs
(one CTA each); a CTA's step (one query block) takes 1 time unit (the causal diagonal block
`diag`), optionally jittered by ±`jitter`; with determinism its dQ add must also wait until the key
block before it in the query block's order has added, plus `delta` (the turn's latency). Orders:
`rev` (the kernel's: key blocks last to first, the launch in that order, (head, batch) pairs in
groups of `group`), `lpt` (causal: key block 0 first, which needs a whole group's CTAs resident),
`rot` (no mask: CTA n visits query block (t - n) mod N at step t). Prints the non-deterministic
time divided by each order's deterministic time.

`det_tail`: the same model at the FA grid's deterministic causal shapes ((192, 128) on 64 x 96 tiles, d128 on
64 x 128; s2k / s8k; the kernel's pair groups), `rev` with the grid's last group last to first (the kernel until
session 83) or first to last, launched key block 0 first (docs/patches 0001 of session 83); prints the balanced work
over `sms` divided by the makespan.

`varlen`: the varlen forward's query tiles over packed sequences of random lengths, in grid order
onto `sms` SMs; a tile's work is its key blocks (causal: up to its diagonal) plus `prologue`.
Orders: `current` (the kernel's: sequence by sequence, each longest-first, head-major), `global`
(every tile of every head sorted by work, longest first), `round_robin` (each sequence's r-th
longest tile in round r). Prints each order's makespan over a perfectly balanced one.

`persistent`: the causal forward at the FA grid's shapes (d128, 16k tokens x 16 heads, 128 x 128 tiles):
one CTA per tile launched longest-first in head groups of 16 (the grid, hardware-dispatched: greedy onto
the first free SM; per-tile overhead `grid_overhead` key blocks) against a persistent grid of `sms` CTAs
striding statically (overhead `persistent_overhead`) over either the same longest-first order or units of
two tiles j and num_m - 1 - j (fa4gen.device.schedule.paired_tile). The overheads are assumptions, not
measurements. Prints each one's makespan and its ratio to the grid's.

`paired`: the masked persistent forward's static tile orders at the FA grid's token count (16k, hidden 2048,
d64 and d128, seqlens 512-4096 by 128): session 15's nested units, its flat units to the end, and the
kernel's order (units, then a longest-first tail in a snake, from fa4gen.device.schedule itself).

`groups`: the causal non-deterministic backward's grid (one CTA per key block, a key block's work its query
tiles from the diagonal on, plus `cta_overhead` steps) at the FA grid's shapes, greedy onto `sms` SMs, with
pair groups of pow2_group(pairs, C // key blocks): C = 132 (the floor of a wave, until session 39) against
C = 186 (the power of two nearest a wave in ratio, the kernel's LPT_GROUP_CTAS). L2 traffic is not modelled.
Prints each one's group and makespan over a perfect balance. Then the deterministic backward's grid (key blocks
last to first, groups of pairs whose query rows fit L2) with the turns' waits left out: the tail its
shortest-first launch costs by itself, against the same groups longest-first.

`window`: the same masked persistent forward's order (fa4gen.device.schedule, units j / num_m - 1 - j striding over
the CTAs, then the snake tail) under sliding windows of `left` keys (right 0, seqlen_q = seqlen_k, 128 x 128 tiles,
16k tokens x 32 heads: d64's grid), a tile's work its key blocks plus `overhead`. The units pair a long tile with a
short one, which equalizes them only with a causal mask: under a window every tile past the first left / 128 costs
the same, so units differ, and when the CTA count is a multiple of the units per (head, batch) pair a CTA meets the
same unit position in every pair (132 CTAs, s3072: 12 units, 11 per stride). Prints each shape's makespan over a
perfect balance (session 55: the model's makespans times the H100's TFLOP/s of the window-1024 cells, s2560-8192, agree
within 1.6%, where the TFLOP/s spread 14%), for that order and for the ramp order (schedule.window_ramp: the tiles whose
window the sequence start cuts in units of their own, after the full tiles); then chunked masks of 512-2048 keys,
whose tiles ramp up again in every chunk (the units balance them only when a chunk's tiles divide the pair's), for
that order and for the chunks' ramp order (schedule.chunk_ramp: the last, partial chunk's tiles in units of their own,
after the whole chunks').

`bwd_causal`: the causal MHA backward (d64 / d128, the FA grid's shapes) as one CTA per key block (the grid's
order, greedy) against the persistent kernel's static order (built in session 67, landed for head dims up to 64 in
session 68: the masked persistent forward's paired order over key blocks mirrored), a key block's cost its query blocks times the per-block cost plus a
per-tile cost (session 67's fit for the grid; the persistent one bracketed). Prints both makespans.

`idle`: the persistent forward without a mask in 192-row tiles (d64's grid: 16k tokens x 32 heads), whose idle warpgroups
skip a sequence's last, partial tile, which then costs `c1` (one busy warpgroup) or `c2` (two) of a full tile (assumed,
not measured); CTA c runs tiles c, c + n, ... Prints each seqlen's makespan over a perfect balance with n = the SM
count (when n is a multiple of the tiles per sequence, a CTA meets the same query tile in every iteration) and with the
API's n (fa4gen.api.runtime.spread_ctas: the largest count coprime to them), and the time saved against the kernel
without the skip.

Run: `python3 tools/sim_schedules.py det`, `... det_tail`, `... varlen`, `... persistent`, `... paired`, `... groups`,
`... window`, `... idle` or `... bwd_causal` (docs/STATUS.md, sessions 11, 14, 39, 55 and 57, quote their output).
"""

import argparse
import heapq
import random
import statistics


def det_time(N, hb, group, causal, order, delta=0.4, sms=132, det=True, diag=0.55, jitter=0.0, rng=None,
             M=None, first=None, tail_groups=0):
    """Time until every key-block CTA of `hb` (head, batch) pairs with N key and N query blocks is done. Causal
    with M query blocks and key block n's first query block `first(n)` (default: M = N, first(n) = n), and with
    order "rev", `tail_groups` > 0: the last that many groups add first to last, launched in that order (key block
    0 first: docs/patches of session 83, fa4gen.device.schedule.det_tail_ascending)."""
    M = N if M is None else M
    first = (lambda n: n) if first is None else first
    groups = hb // group
    up = lambda pair: order == "rev" and pair // group >= groups - tail_groups  # noqa: E731
    ctas = []
    for g in range(groups):
        for y in range(N):
            for x in range(group):
                n = N - 1 - y if order == "rev" and not up(g * group) else y
                if causal:
                    ms = list(range(first(n), M))
                elif order == "rot":
                    ms = [(t - n) % N for t in range(N)]
                else:
                    ms = list(range(N))
                ctas.append((g * group + x, n, ms))
    last_key = {m: max(n for n in range(N) if first(n) <= m) for m in range(M)} if causal else {}

    def rank(pair, n, m):  # position of key block n in query block m's add order
        if causal:
            return n if up(pair) else last_key[m] - n
        if order == "rot":
            return (m + n) % N
        return N - 1 - n

    done, waiters, events = {}, {}, []
    state = {"next": 0, "free": sms, "end": 0.0}
    pos = [0] * len(ctas)

    def step(i, t):
        _, n, ms = ctas[i]
        if pos[i] == len(ms):
            heapq.heappush(events, (t, 1, i))
            return
        cost = diag if causal and ms[pos[i]] == first(n) else 1.0
        if jitter:
            cost *= rng.uniform(1 - jitter, 1 + jitter)
        heapq.heappush(events, (t + cost, 0, i))

    def launch(t):
        while state["free"] > 0 and state["next"] < len(ctas):
            state["free"] -= 1
            state["next"] += 1
            step(state["next"] - 1, t)

    def add(i, t):
        pair, n, ms = ctas[i]
        key = (pair, ms[pos[i]], rank(pair, n, ms[pos[i]]) if det else 0)
        done[key] = t
        pos[i] += 1
        step(i, t)
        for j in waiters.pop(key, []):
            add(j, t + delta)

    launch(0.0)
    while events:
        t, kind, i = heapq.heappop(events)
        state["end"] = max(state["end"], t)
        if kind == 1:
            state["free"] += 1
            launch(t)
            continue
        pair, n, ms = ctas[i]
        r = rank(pair, n, ms[pos[i]]) if det else 0
        if r > 0:
            before = done.get((pair, ms[pos[i]], r - 1))
            if before is None:
                waiters.setdefault((pair, ms[pos[i]], r - 1), []).append(i)
                continue
            add(i, max(t, before + delta))
        else:
            add(i, t)
    if state["next"] < len(ctas) or any(pos[i] < len(c[2]) for i, c in enumerate(ctas)):
        return None  # a deadlock: some CTA never got its turn
    return state["end"]


def makespan(works, sms=132):
    free = [0.0] * sms
    end = 0.0
    for w in works:
        t = heapq.heappop(free) + w
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def causal_bwd_persistent(d, seqlen, tile_m, per_block, grid_cta, persistent_tile, sms=132, tile_n=128):
    """(grid, persistent, ideal) makespans in µs of the causal MHA backward at the FA grid's shape (16k tokens,
    2048 / d heads): key block n costs its query blocks (from its diagonal on) x `per_block` plus `grid_cta` as one
    CTA per tile in the grid's order (pairs of a group fastest, key blocks ascending, groups of pow2_group(pairs,
    186 // key blocks)) greedy onto `sms` SMs, or plus `persistent_tile` as the persistent kernel's static order
    (fa4gen.device.schedule.paired_schedule / paired_tile over key blocks mirrored: its tile m is key block
    num_n - 1 - m), its grid min(units, sms) CTAs as the host makes it; ideal: the persistent work over those CTAs.
    Every tile is checked to run once."""
    from fa4gen.device import schedule

    heads, batch = 2048 // d, 16384 // seqlen
    num_n, num_m, hb = -(-seqlen // tile_n), -(-seqlen // tile_m), heads * batch
    blocks = [max(num_m - n * tile_n // tile_m, 0) for n in range(num_n)]
    group = max(g for g in (1, 2, 4, 8, 16) if g <= max(186 // num_n, 1) and hb % g == 0)
    grid = makespan([blocks[n] * per_block + grid_cta for _ in range(0, hb, group) for n in range(num_n)
                     for _ in range(group)], sms)
    tiles = num_n * hb
    ctas = min((tiles + 1) // 2, sms) if tiles > sms else tiles  # schedule.paired_units / pairs_for
    seen, span = set(), 0.0
    for cta in range(ctas):
        iterations, *sched = schedule.paired_schedule(cta, ctas, tiles, num_n, hb)
        load = 0.0
        for k in range(iterations):
            m, head, b = schedule.paired_tile(k, cta, ctas, num_n, heads, sched)
            seen.add((num_n - 1 - m, head, b))
            load += blocks[num_n - 1 - m] * per_block + persistent_tile
        span = max(span, load)
    assert len(seen) == tiles, (len(seen), tiles)
    return grid, span, (sum(blocks) * per_block + num_n * persistent_tile) * hb / ctas


def causal_bwd_groups(tile_m, tile_n, seqlen, hb, ctas_per_group, sms=132, cta_overhead=1.0):
    """(group, makespan over a perfect balance) of the causal backward's grid order (module docstring)."""
    num_m, num_n = -(-seqlen // tile_m), -(-seqlen // tile_n)
    limit = max(ctas_per_group // num_n, 1)
    group = max(g for g in (1, 2, 4, 8, 16) if g <= limit and hb % g == 0)
    works = [num_m - n * tile_n // tile_m + cta_overhead
             for g0 in range(0, hb, group) for n in range(num_n) for _ in range(min(group, hb - g0))]
    return group, makespan(works, sms) / (sum(works) / sms)


def varlen_orders(lengths, heads, causal, tile_m=128, tile_n=128, prologue=0.3):
    """The three orders' tile works (see the module docstring)."""
    per_seq = []
    for length in lengths:
        tiles = -(-length // tile_m)
        works = []
        for m in reversed(range(tiles)):  # longest first within a sequence
            keys = min((m + 1) * tile_m, length) if causal else length
            works.append(-(-keys // tile_n) + prologue)
        per_seq.append(works)
    current = [w for _ in range(heads) for seq in per_seq for w in seq]
    rounds = max((len(s) for s in per_seq), default=0)
    round_robin = [s[r] for _ in range(heads) for r in range(rounds) for s in per_seq if r < len(s)]
    return {"current": current, "global": sorted(current, reverse=True), "round_robin": round_robin}


def random_lengths(rng, lo, hi, total=16384):
    lengths, used = [], 0
    while used < total:
        length = min(rng.randint(lo, hi), total - used)
        lengths.append(length)
        used += length
    return lengths


def causal_forward_orders(seqlen, hb, group=16, tile=128, grid_overhead=1.0, persistent_overhead=0.3):
    """(grid tile works in launch order, the same order's works with the persistent overhead, paired units)."""
    num_m = seqlen // tile

    def lpt(overhead):
        works = []
        for g0 in range(0, hb, group):
            for i in range(num_m):
                works += [num_m - i + overhead] * min(group, hb - g0)  # tile num_m - 1 - i: num_m - i blocks
        return works

    units = []
    for _ in range(hb):
        for j in range((num_m + 1) // 2):
            long_m, short_m = num_m - 1 - j, j
            units.append(long_m + 1 + persistent_overhead + (short_m + 1 + persistent_overhead if short_m != long_m else 0))
    return lpt(grid_overhead), lpt(persistent_overhead), units


def static_stride(works, sms=132):
    """Makespan when CTA i takes works i, i + sms, i + 2 sms, ... (no dynamic dispatch)."""
    loads = [0.0] * sms
    for i, w in enumerate(works):
        loads[i % sms] += w
    return max(loads)


def _tile_cost(m, overhead):
    """Key blocks of causal query tile m (the diagonal block about half) plus a per-tile overhead."""
    return m + 0.55 + overhead


def paired_makespans(num_m, hb, sms=132, overhead=0.3):
    """Makespans of a masked persistent forward's static tile orders (num_m query tiles for each of hb (head,
    batch) pairs, min(units, sms) CTAs): `nested` (before session 16: each pair's units j / num_m - 1 - j, an
    odd num_m's middle tile a unit alone, CTAs striding over units), `units` (session 15's flat loop: the
    order Z in units to the end, blocks of 2 x CTAs), `kernel` (fa4gen.device.schedule.paired_schedule /
    paired_tile as the kernel runs them: units, then a longest-first tail in a snake), and `ideal` (the
    work over the CTAs)."""
    from fa4gen.device import schedule

    tiles = num_m * hb
    n = min((tiles + 1) // 2, sms) if tiles > sms else tiles
    nested_units = [[num_m - 1 - j] + ([j] if num_m - 1 - 2 * j > 0 else []) for _ in range(hb)
                    for j in range((num_m + 1) // 2)]
    nested_n = min(len(nested_units), sms)
    nested = max(sum(_tile_cost(m, overhead) for unit in nested_units[c::nested_n] for m in unit)
                 for c in range(nested_n))
    units, kernel = [], []
    for cta in range(n):
        # session 15: flat index i = cta, cta + n, ...; the mapping with units to the end (a head of every block)
        loads = 0.0
        for i in range(cta, tiles, n):
            base, rem = i // (2 * n) * 2 * n, i % (2 * n)
            t, c = rem // n, rem % n
            q = min(max(tiles - base - n, 0), n)
            z = base + min(2 * c + t, c + q)
            loads += _tile_cost(_z_tile(z, num_m), overhead)
        units.append(loads)
        iterations, *sched = schedule.paired_schedule(cta, n, tiles, num_m, hb)
        kernel.append(sum(_tile_cost(schedule.paired_tile(k, cta, n, num_m, hb, sched)[0], overhead)
                          for k in range(iterations)))
    ideal = sum(_tile_cost(m, overhead) for m in range(num_m)) * hb / n
    return {"nested": nested, "units": max(units), "kernel": max(kernel), "ideal": ideal}


def _emulated_blocks(m, seqlen, tile, left=-1, chunk=0):
    """Key blocks query tile m (tile x tile, seqlen_q = seqlen_k) visits, as the kernel's key-block range decides
    it (fa4gen.emulate.tiling, the Python mirror of fa4gen.device.mask): a causal row's keys, a window of `left`
    keys (right 0) or a chunk of `chunk` keys."""
    from fa4gen.emulate import tiling

    bounds = tiling.tile_bounds(m, tile, seqlen, seqlen, left, 0, chunk, causal=not chunk and left < 0,
                                local=left >= 0, chunked=chunk > 0)
    n_min, n_max = tiling.n_block_range(bounds, tile)
    return n_max - n_min


def window_blocks(m, seqlen, left, tile=128):
    """Key blocks query tile m visits under a window of `left` keys left of the diagonal, right 0 (None: causal),
    the diagonal block counted whole."""
    return _emulated_blocks(m, seqlen, tile, left=-1 if left is None else left)


def chunk_blocks(m, seqlen, chunk, tile=128):
    """Key blocks query tile m visits under a chunked mask of `chunk` keys: from its chunk's first key to its last
    row, the diagonal block counted whole."""
    return _emulated_blocks(m, seqlen, tile, chunk=chunk)


def window_loads(seqlen, left, heads=32, sms=132, overhead=0.3, tile=128, chunk=None, ramp_order=False):
    """Per-CTA work of the masked persistent forward's order (fa4gen.device.schedule.paired_schedule / paired_tile)
    at 16k tokens (batch 16384 // seqlen, at least 1), with the kernel's CTA count (paired units, at most `sms`), and
    the set of (m_block, head, batch) it ran (each tile once). `chunk`: a chunked mask of that many keys instead of
    the window (`left` unused). `ramp_order`: the order Z' with the window's ramp (fa4gen.device.schedule.window_ramp,
    as the SM90 forward computes it) or the chunks' (schedule.chunk_ramp), else the units j / num_m - 1 - j."""
    from fa4gen.device import schedule

    batch = max(16384 // seqlen, 1)
    num_m = -(-seqlen // tile)
    tiles = num_m * heads * batch
    pairs = min(tiles // (sms + 1), 1)  # schedule.pairs_for, in plain integers
    ctas = min(sms, (tiles + pairs) >> pairs)  # schedule.paired_units
    ramp = None
    if ramp_order and chunk is None:
        ramp = schedule.window_ramp(-1 if left is None else left, 0, seqlen, seqlen, num_m, heads * batch, tile)
    elif ramp_order:
        ramp = schedule.chunk_ramp(chunk, seqlen, seqlen, num_m, heads * batch, tile)
    loads, ran = [], []
    for cta in range(ctas):
        iterations, *sched = schedule.paired_schedule(cta, ctas, tiles, num_m, heads * batch, ramp=ramp)
        work = 0.0
        for k in range(iterations):
            tile_coords = schedule.paired_tile(k, cta, ctas, num_m, heads, sched, ramp=ramp, ramp_high=chunk is not None)
            ran.append(tile_coords)
            blocks = (window_blocks(tile_coords[0], seqlen, left, tile) if chunk is None
                      else chunk_blocks(tile_coords[0], seqlen, chunk, tile))
            work += blocks + overhead
        loads.append(work)
    return loads, ran


def _print_balance(mask, sms, ramp_order, seqlens, loads_of):
    """One line of the `window` mode: the makespan over a perfect balance (max / mean of `loads_of(seqlen)`) of each
    seqlen, their mean and the worst."""
    cells = []
    for seqlen in seqlens:
        loads = loads_of(seqlen)
        cells.append((seqlen, max(loads) / (sum(loads) / len(loads))))
    worst = max(cells, key=lambda c: c[1])
    print(f"masked persistent d64, {mask}, {sms} SMs, {'ramp order' if ramp_order else 'units j / num_m - 1 - j'}: "
          f"makespan over a perfect balance mean {statistics.mean(c[1] for c in cells):.3f}, worst {worst[1]:.3f} "
          f"(s{worst[0]}); " + " ".join(f"s{sq} {r:.3f}" for sq, r in cells))


def _z_tile(z, num_m):
    """Query tile at position z of the order Z (fa4gen.device.schedule.paired_tile's, written out)."""
    hb, r = divmod(z, num_m)
    s = r - (hb & num_m & 1)
    s += num_m if s < 0 else 0
    half, odd = s >> 1, s & 1
    return num_m - 1 - half - odd * (num_m - 1 - 2 * half)


def idle_loads(seqlen, n, c1, c2, skip=True, tile=192, tokens=16384, heads=32):
    """Per-CTA work of the `idle` mode: tile t = hb * num_m + m on CTA t mod n, a full tile 1, a last, partial one c1
    / c2 by its busy warpgroups (1 without the skip)."""
    num_m = -(-seqlen // tile)
    busy = -(-(seqlen - (num_m - 1) * tile) // 64)
    cost = {1: c1, 2: c2}.get(busy, 1.0) if skip else 1.0
    loads = [0.0] * n
    for t in range(num_m * tokens // seqlen * heads):
        loads[t % n] += cost if t % num_m == num_m - 1 else 1.0
    return loads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("which", choices=["det", "det_tail", "varlen", "persistent", "paired", "groups", "window", "idle",
                                      "bwd_causal"])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--trials", type=int, default=20)
    args = ap.parse_args(argv)
    if args.which == "det":
        rng = random.Random(1)
        for jitter in (0.0, 0.2):
            for causal in (False, True):
                for seqlen, n, hb in ((2048, 32, 64), (8192, 128, 16)):  # d256: 64-key blocks, 16k tokens x 8 heads
                    base = det_time(n, hb, 1, causal, "lpt" if causal else "rev", det=False, sms=args.sms,
                                    jitter=jitter, rng=rng)
                    cells = []
                    for group in (1, 4):
                        t = det_time(n, hb, group, causal, "rev", sms=args.sms, jitter=jitter, rng=rng)
                        cells.append(f"group {group}: {base / t:.3f}")
                    print(f"det jitter {jitter} {'causal' if causal else 'no mask'} s{seqlen}: "
                          f"non-det / det (order rev) " + ", ".join(cells))
    elif args.which == "det_tail":
        rng = random.Random(1)
        # the FA grid's deterministic causal shapes (16k tokens; (192, 128): 10 heads, 64 x 96 tiles; d128: 16 heads,
        # 64 x 128), the pairs in the groups the kernel's pow2_group of the L2 fit makes
        shapes = ((2048, 80, 16, 96), (8192, 20, 4, 96), (2048, 128, 16, 128), (8192, 32, 4, 128))
        for seqlen, hb, group, tile_n in shapes:
            m_blocks, n_blocks = seqlen // 64, -(-seqlen // tile_n)
            first = lambda n, tile_n=tile_n: n * tile_n // 64  # noqa: E731
            work = sum(m_blocks - first(n) for n in range(n_blocks)) * hb
            cells = []
            for tail in (0, 1):
                for jitter in (0.0, 0.2):
                    t = det_time(n_blocks, hb, group, True, "rev", sms=args.sms, jitter=jitter, rng=rng, M=m_blocks,
                                 first=first, tail_groups=tail)
                    cells.append(f"{'first to last' if tail else 'last to first'} jitter {jitter}: "
                                 f"{work / args.sms / t:.3f}")
            print(f"det_tail causal s{seqlen} pairs {hb} group {group} tile_n {tile_n}, the last group "
                  "(balanced work / makespan): " + "; ".join(cells))
    elif args.which == "paired":
        for d in (64, 128):
            rows = []
            for seqlen in range(512, 4097, 128):
                spans = paired_makespans(-(-seqlen // 128), 16384 // seqlen * (2048 // d), args.sms)
                rows.append((seqlen, {k: v / spans["ideal"] for k, v in spans.items() if k != "ideal"}))
            for name in ("nested", "units", "kernel"):
                worst = max(rows, key=lambda r: r[1][name])
                print(f"masked persistent d{d} causal, seqlen 512-4096: {name} mean "
                      f"{statistics.mean(r[1][name] for r in rows):.3f}x a perfect balance, worst "
                      f"{worst[1][name]:.3f} (s{worst[0]})")
    elif args.which == "window":
        for left in (None, 256, 512, 1024, 2048):
            for ramp_order in (False, True):
                seqlens = [sq for sq in range(1024, 8193, 512) if left is None or left < sq]
                _print_balance(f"{'causal' if left is None else f'window {left}'}", args.sms, ramp_order, seqlens,
                               lambda sq: window_loads(sq, left, sms=args.sms, ramp_order=ramp_order)[0])
        # chunked masks: each chunk's tiles ramp up again, which the units j / num_m - 1 - j balance only when the
        # chunk's tiles divide the pair's; the ramp order (schedule.chunk_ramp) puts the partial chunk's tiles apart
        for chunk in (512, 1024, 2048):
            for ramp_order in (False, True):
                _print_balance(f"chunks of {chunk}", args.sms, ramp_order, range(chunk + 512, 4097, 512),
                               lambda sq: window_loads(sq, None, sms=args.sms, chunk=chunk, ramp_order=ramp_order)[0])
    elif args.which == "groups":
        for name, tile_m, tile_n in (("d64", 128, 128), ("d128", 64, 128), ("(192, 128)", 64, 96), ("d256", 64, 64)):
            for seqlen in (512, 1024, 2048, 4096, 8192, 16384):
                hb = 16 * (16384 // seqlen)
                cells = [causal_bwd_groups(tile_m, tile_n, seqlen, hb, c, args.sms) for c in (132, 186)]
                print(f"causal backward {name} s{seqlen}: " + ", ".join(
                    f"C={c}: group {g} {r:.3f}x" for c, (g, r) in zip((132, 186), cells)))
        for name, tile_m, tile_n, row_bytes in (("d128", 64, 128, 256 * 2 + 128 * 4), ("(192, 128)", 64, 96,
                                                                                      320 * 2 + 192 * 4)):
            for seqlen in (1024, 4096, 16384):
                hb = 16 * (16384 // seqlen)
                num_m, num_n = -(-seqlen // tile_m), -(-seqlen // tile_n)
                fit = min(max((50 * 2**20 // row_bytes) // seqlen, 1), 16)  # schedule.l2_group
                group = max(g for g in (1, 2, 4, 8, 16) if g <= fit and hb % g == 0)
                blocks = {order: [num_m - n * tile_n // tile_m + 1 for g0 in range(0, hb, group) for n in order(num_n)
                                  for _ in range(min(group, hb - g0))] for order in (lambda k: reversed(range(k)), range)}
                shortest, longest = (makespan(w, args.sms) / (sum(w) / args.sms) for w in blocks.values())
                print(f"deterministic causal backward {name} s{seqlen} (group {group}, no turn waits): shortest-first "
                      f"{shortest:.3f}x, longest-first {longest:.3f}x a perfect balance")
    elif args.which == "idle":
        from fa4gen.api.runtime import spread_ctas

        for c1, c2 in ((0.4, 0.7), (0.6, 0.85)):
            for seqlen in (512, 1000, 1024, 1536, 2048, 2500, 3000, 4095):
                n = spread_ctas(args.sms, seqlen, 192, 16384 // seqlen * 32)
                before = max(idle_loads(seqlen, args.sms, c1, c2, skip=False))
                cells = []
                for count in (args.sms, n):
                    loads = idle_loads(seqlen, count, c1, c2)
                    cells.append(f"{count} CTAs {max(loads) / (sum(loads) / args.sms):.3f}x a balance, "
                                 f"{before / max(loads):.3f}x as fast as no skip")
                print(f"d64 no mask s{seqlen} (last tile c1 {c1}, c2 {c2}): " + "; ".join(cells))
    elif args.which == "bwd_causal":
        # session 67's d128 fit (tools/cta_cost.py): P = 6.36 us per CTA, B = 1.88 per 64-row block; d64 assumed
        # B = 2.2 (128-row blocks), P = 4.4. The persistent tile's cost with the staged epilogue is not measured:
        # the grid's P and 2 us less bracket it
        for d, tile_m, per_block, cta in ((128, 64, 1.88, 6.36), (64, 128, 2.2, 4.4)):
            for seqlen in (512, 1024, 2048, 4096, 8192):
                for tile in (cta, cta - 2.0):
                    grid, span, ideal = causal_bwd_persistent(d, seqlen, tile_m, per_block, cta, tile, args.sms)
                    print(f"d{d} causal s{seqlen}, persistent tile cost {tile:.2f} us: grid {grid:.0f} us, persistent "
                          f"{span:.0f} us ({span / ideal:.3f}x a perfect balance), grid / persistent {grid / span:.3f}")
    elif args.which == "persistent":
        for seqlen in (512, 1024, 2048, 4096, 8192):
            grid, lpt, units = causal_forward_orders(seqlen, 16384 // seqlen * 16)
            t_grid = makespan(grid, args.sms)
            t_lpt, t_pairs = static_stride(lpt, args.sms), static_stride(units, args.sms)
            ideal = sum(units) / args.sms
            print(f"causal s{seqlen}: grid {t_grid:.1f}; persistent longest-first stride {t_lpt:.1f} "
                  f"({t_lpt / t_grid:.2f}x grid); paired units {t_pairs:.1f} ({t_pairs / t_grid:.2f}x grid, "
                  f"{t_pairs / ideal:.3f}x a perfect balance)")
    else:
        rng = random.Random(0)
        for (lo, hi), d in (((128, 1024), 128), ((512, 8192), 128), ((512, 8192), 64)):
            for causal in (True, False):
                ratios = {"current": [], "global": [], "round_robin": []}
                for _ in range(args.trials):
                    orders = varlen_orders(random_lengths(rng, lo, hi), 2048 // d, causal)
                    balanced = sum(orders["current"]) / args.sms
                    for name, works in orders.items():
                        ratios[name].append(makespan(works, args.sms) / balanced)
                print(f"varlen lengths {lo}-{hi} d{d} {'causal' if causal else 'no mask'}: "
                      + ", ".join(f"{k} {statistics.mean(v):.3f}" for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

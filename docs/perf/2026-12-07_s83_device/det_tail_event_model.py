"""Session 83: an event model of the deterministic causal backward's grid (CPU; a model, not a measurement): balanced
work over 132 SMs divided by the makespan, with the last group of pairs last to first (the kernel before docs/patches
0001 of session 83) or first to last (that patch). Each step one unit (the diagonal block 0.55), a turn's latency 0.4,
optionally jittered. Run: python3 docs/perf/2026-12-07_s83_device/det_tail_event_model.py"""
import heapq
import random

def det_time(M, N, first, hb, group, tail_groups, delta=0.4, sms=132, det=True, diag=0.55, jitter=0.0, rng=None):
    """pairs of N key blocks, M query blocks; key block n covers query blocks first(n)..M-1; groups of `group` pairs
    launched group by group, in each group key blocks by y, pairs fastest. The last `tail_groups` groups run
    ascending (key block 0 first in every query block's order, launched longest first); the others descending
    (the kernel's: launched shortest first)."""
    G = hb // group
    asc = lambda pair: pair // group >= G - tail_groups
    nmax = lambda m: max(n for n in range(N) if first(n) <= m)
    ctas = []
    for g in range(G):
        for y in range(N):
            for x in range(group):
                pair = g * group + x
                n = y if asc(pair) else N - 1 - y
                ctas.append((pair, n, list(range(first(n), M))))
    def rank(pair, n, m):
        return n if asc(pair) else nmax(m) - n
    done, waiters, events = {}, {}, []
    st = {"next": 0, "free": sms, "end": 0.0, "busy": 0.0}
    pos = [0] * len(ctas)
    def step(i, t):
        _, n, ms = ctas[i]
        if pos[i] == len(ms):
            heapq.heappush(events, (t, 1, i)); return
        cost = diag if ms[pos[i]] == first(n) else 1.0
        if jitter: cost *= rng.uniform(1 - jitter, 1 + jitter)
        heapq.heappush(events, (t + cost, 0, i))
    def launch(t):
        while st["free"] > 0 and st["next"] < len(ctas):
            st["free"] -= 1; st["next"] += 1; step(st["next"] - 1, t)
    def add(i, t):
        pair, n, ms = ctas[i]
        done[(pair, ms[pos[i]], rank(pair, n, ms[pos[i]]) if det else 0)] = t
        pos[i] += 1; step(i, t)
        for j in waiters.pop((pair, ms[pos[i]-1], rank(pair, n, ms[pos[i]-1]) if det else 0), []):
            add(j, t + delta)
    launch(0.0)
    while events:
        t, kind, i = heapq.heappop(events)
        st["end"] = max(st["end"], t)
        if kind == 1:
            st["free"] += 1; launch(t); continue
        pair, n, ms = ctas[i]
        r = rank(pair, n, ms[pos[i]]) if det else 0
        if r > 0:
            before = done.get((pair, ms[pos[i]], r - 1))
            if before is None:
                waiters.setdefault((pair, ms[pos[i]], r - 1), []).append(i); continue
            add(i, max(t, before + delta))
        else:
            add(i, t)
    if st["next"] < len(ctas) or any(pos[i] < len(c[2]) for i, c in enumerate(ctas)):
        return None
    return st["end"]

rng = random.Random(1)
# (seqlen, pairs, group, tile_n): the FA grid's deterministic causal shapes (16k tokens; (192, 128): 10 heads, 64 x 96
# tiles; d128: 16 heads, 64 x 128), groups as the kernel's pow2_group of the L2 fit gives them
for seqlen, hb, group, tn in ((2048, 80, 16, 96), (8192, 20, 4, 96), (2048, 128, 16, 128), (8192, 32, 4, 128)):
    M, N = seqlen // 64, -(-seqlen // tn)
    first = lambda n, tn=tn: (n * tn) // 64
    work = sum((M - first(n)) for n in range(N)) * hb
    row = []
    for tail in (0, 1):
        for jit in (0.0, 0.2):
            t = det_time(M, N, first, hb, group, tail, jitter=jit, rng=rng)
            row.append(f"last group {'first to last' if tail else 'last to first'} jitter {jit}: {work / 132 / t:.3f}")
    print(f"s{seqlen} pairs {hb} group {group} tile_n {tn}: " + "; ".join(row))

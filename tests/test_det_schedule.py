"""The deterministic backward's dQ order, simulated: key-block CTAs launch in blockIdx order onto a
limited number of SMs (a CTA keeps its SM until it finishes), each walks its query blocks in
ascending order and, at every query block, waits for its turn on that block's semaphore before
adding its dQ tile. The kernel adds key blocks last-to-first (turn = n_end - 1 - n_block, CTAs
launched in descending key-block order; GPU-verified, docs/PERF.md); the earlier first-to-last order
(turn = n_block - n_first, ascending launch) is simulated too. Checked for both: no schedule
deadlocks whatever the number of SMs; and the causal wavefront that descending order removes.
With a causal mask the kernel's grid (groups of (head, batch) pairs, pairs fastest) takes the first-to-last
order in its last group when it has two or more: checked that it never deadlocks either and that it shortens
the grid's tail in this step model."""

import itertools

import pytest

from fa4gen.emulate import tiling

MASKS = [
    dict(causal=False, local=False, chunked=False, window=(-1, -1), chunk=1),
    dict(causal=True, local=False, chunked=False, window=(-1, -1), chunk=1),
    dict(causal=False, local=True, chunked=False, window=(100, 0), chunk=1),
    dict(causal=False, local=True, chunked=False, window=(-1, 70), chunk=1),
    dict(causal=False, local=False, chunked=True, window=(-1, -1), chunk=96),
]


def simulate(seqlen_q, seqlen_k, tile_m, tile_n, sms, mask, descending=True):
    """Steps until every CTA is done (one query block per CTA and step), or None on a deadlock."""
    kw = dict(causal=mask["causal"], local=mask["local"], chunked=mask["chunked"])
    left, right = mask["window"]
    n_blocks = -(-seqlen_k // tile_n)
    m_blocks = -(-seqlen_q // tile_m)
    n_end = {}
    for m in range(m_blocks):
        bounds = tiling.tile_bounds(m, tile_m, seqlen_q, seqlen_k, left, right, mask["chunk"], **kw)
        n_end[m] = tiling.n_block_range(bounds, tile_n)
    ctas = []  # launch order: blockIdx.x = 0, 1, ...
    for x in range(n_blocks):
        n = n_blocks - 1 - x if descending else x
        m_lo, m_hi = tiling.m_block_range(n, tile_n, tile_m, seqlen_q, seqlen_k, left, right, mask["chunk"], **kw)
        ctas.append([n, list(range(m_lo, m_hi)), descending])
    return _run(ctas, n_end, sms)


def tail_rule(z, groups, group, num_n, threshold):
    """schedule.det_tail_ascending's rule (tests/test_schedule.py checks the device helper against this)."""
    return groups >= 2 and z == groups - 1 and group * num_n >= threshold


def simulate_grid(seqlen, tile_m, tile_n, pairs, group, sms, tail_up, threshold=256):
    """The grouped causal grid: blockIdx (pair in group, y, group), x fastest, launched in that order; key block
    n = num_n - 1 - y (last to first), or, with `tail_up`, in the groups `tail_rule` picks, n = y (first to last:
    the kernel's `ascending`). Semaphores per (pair, query block)."""
    causal = MASKS[1]
    kw = dict(causal=True, local=False, chunked=False)
    n_blocks, m_blocks = -(-seqlen // tile_n), -(-seqlen // tile_m)
    groups = pairs // group
    ranges = {m: tiling.n_block_range(tiling.tile_bounds(m, tile_m, seqlen, seqlen, -1, -1, 1, **kw), tile_n)
              for m in range(m_blocks)}
    n_end = {(p, m): r for p in range(pairs) for m, r in ranges.items()}
    ctas = []
    for z in range(groups):
        up = tail_up and tail_rule(z, groups, group, n_blocks, threshold)
        for y in range(n_blocks):
            n = y if up else n_blocks - 1 - y
            m_lo, m_hi = tiling.m_block_range(n, tile_n, tile_m, seqlen, seqlen, -1, -1, causal["chunk"], **kw)
            for x in range(group):
                ctas.append([n, [(z * group + x, m) for m in range(m_lo, m_hi)], not up])
    return _run(ctas, n_end, sms)


def _run(ctas, n_end, sms):
    """Steps of CTAs [n, [query blocks], descending] launched in list order onto `sms` SMs, each adding into a
    query block's semaphore on its turn (n_end: query block -> its key-block range; descending: key blocks last
    to first, else first to last); None on a deadlock."""
    sem = {m: 0 for m in n_end}
    pending, running, steps = list(ctas), [], 0
    while pending or running:
        while pending and len(running) < sms:
            running.append(pending.pop(0))
        progressed = False
        ready = []  # decided on the semaphores as they stood at the start of the step
        for cta in list(running):
            n, todo, descending = cta
            if not todo:
                running.remove(cta)
                progressed = True
                continue
            m = todo[0]
            lo, hi = n_end[m]
            if sem[m] == ((hi - 1 - n) if descending else (n - lo)):
                ready.append(cta)
        for _, todo, _ in ready:
            sem[todo.pop(0)] += 1
            progressed = True
        steps += 1
        if not progressed:
            return None
    assert all(sem[m] == n_end[m][1] - n_end[m][0] for m in sem)  # every visitor added exactly once
    return steps


def simulate_packed(lengths_q, lengths_k, used_k, tile_m, tile_n, sms, mask):
    """The varlen kernel's order: key tiles of all sequences numbered back to back by tile_of, each
    sequence's last block first; tiles past seqused_k idle; semaphores per (sequence, query block)."""
    kw = dict(causal=mask["causal"], local=mask["local"], chunked=mask["chunked"])
    left, right = mask["window"]
    cu_k = [0]
    for n in lengths_k:
        cu_k.append(cu_k[-1] + n)
    b, total_k = len(lengths_k), cu_k[-1]
    n_end, ctas = {}, []
    for s, (s_q, s_k) in enumerate(zip(lengths_q, used_k)):
        for m in range(-(-s_q // tile_m)):
            bounds = tiling.tile_bounds(m, tile_m, s_q, s_k, left, right, mask["chunk"], **kw)
            n_end[(s, m)] = tiling.n_block_range(bounds, tile_n)
    for t in range(-(-total_k // tile_n) + b):
        s, n = tiling.tile_of(cu_k, b, total_k, t, tile_n, True)
        s_q, s_k = lengths_q[s], used_k[s]
        if n * tile_n >= s_k:
            ctas.append([n, [], True])  # idle: past the sequence's (used) keys
            continue
        m_lo, m_hi = tiling.m_block_range(n, tile_n, tile_m, s_q, s_k, left, right, mask["chunk"], **kw)
        ctas.append([n, [(s, m) for m in range(m_lo, m_hi)], True])
    return _run(ctas, n_end, sms)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"c{int(m['causal'])}w{m['window']}k{m['chunk'] if m['chunked'] else 0}")
@pytest.mark.parametrize("descending", [False, True], ids=["ascending (before)", "descending (the kernel)"])
def test_no_order_deadlocks(mask, descending):
    for (s_q, s_k), sms in itertools.product([(1000, 1000), (640, 200), (200, 900), (64, 64)], (1, 2, 3, 132)):
        assert simulate(s_q, s_k, 64, 128, sms, mask, descending=descending) is not None, (s_q, s_k, sms)


def test_descending_order_removes_the_causal_wavefront():
    """Causal, 8k x 8k, every CTA resident: ascending order makes key block n wait ~2n steps for its
    first query block; descending order lets every CTA start at once."""
    causal = MASKS[1]
    up = simulate(8192, 8192, 64, 128, 10_000, causal, descending=False)
    down = simulate(8192, 8192, 64, 128, 10_000, causal, descending=True)
    longest = 8192 // 64  # the CTA of key block 0 visits every query block
    assert down <= longest + 2
    assert up > 1.4 * longest


def test_grid_with_the_ascending_tail_never_deadlocks():
    """The causal grid with its last group first to last (threshold 0: whatever its size) on 1 to 132 SMs, partial
    and whole waves, one to four groups: no deadlock, every visitor once (checked in _run)."""
    for (seqlen, tile_n), (pairs, group), sms in itertools.product(
            [(640, 128), (1000, 96), (512, 64)], [(2, 1), (4, 2), (6, 2), (8, 8), (12, 4)], (1, 2, 3, 7, 132)):
        assert simulate_grid(seqlen, 64, tile_n, pairs, group, sms, True, threshold=0) is not None, \
            (seqlen, tile_n, pairs, group, sms)


def test_ascending_tail_where_the_kernel_takes_it():
    """The step model behind schedule.DET_TAIL_UP_CTAS: on 132 SMs the last group first to last shortens the grid
    at the (192, 128) FA-grid shapes (64 x 96 tiles; s2k: 80 pairs in groups of 16, s8k: 20 in groups of 4) and at
    d128's (64 x 128; 128 pairs / 16, 32 / 4), is never longer from DET_TAIL_UP_CTAS CTAs in the last group on,
    and is longer for small last groups (the wavefront; why the threshold exists)."""
    from fa4gen.device.schedule import DET_TAIL_UP_CTAS

    for seqlen, tile_n, pairs, group in ((2048, 96, 80, 16), (8192, 96, 20, 4), (2048, 128, 128, 16),
                                         (8192, 128, 32, 4)):
        down = simulate_grid(seqlen, 64, tile_n, pairs, group, 132, False)
        up = simulate_grid(seqlen, 64, tile_n, pairs, group, 132, True, DET_TAIL_UP_CTAS)
        assert up < 0.99 * down, (seqlen, tile_n, pairs, group, up, down)
    for seqlen, tile_n, pairs, group in itertools.product((1024, 2048, 4096), (64, 96, 128), (16, 32, 64),
                                                          (4, 8, 16)):
        n_blocks = -(-seqlen // tile_n)
        down = simulate_grid(seqlen, 64, tile_n, pairs, group, 132, False)
        up = simulate_grid(seqlen, 64, tile_n, pairs, group, 132, True, 0)
        if group * n_blocks >= DET_TAIL_UP_CTAS and pairs // group >= 2:
            assert up <= down, (seqlen, tile_n, pairs, group, up, down)
    assert simulate_grid(1024, 64, 128, 16, 4, 132, True, 0) > 1.2 * simulate_grid(1024, 64, 128, 16, 4, 132, False)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"c{int(m['causal'])}w{m['window']}k{m['chunk'] if m['chunked'] else 0}")
def test_packed_order_never_deadlocks(mask):
    packings = [
        ([128, 1, 300, 0, 77], [128, 5, 257, 40, 0], [128, 5, 257, 40, 0]),
        ([200, 129, 50], [300, 300, 300], [300, 7, 0]),
        ([700, 64, 3], [64, 700, 3], [64, 700, 3]),
    ]
    for (lq, lk, used), sms in itertools.product(packings, (1, 2, 3, 132)):
        assert simulate_packed(lq, lk, used, 64, 128, sms, mask) is not None, (lq, lk, used, sms)


@pytest.mark.parametrize("spec", [
    dict(head_dim=128, mask={"kind": "causal"}),  # the ordered hand-off (dQ warp)
    dict(head_dim=256, mask={"kind": "sliding_window", "left": 100, "right": 0}),  # the turn warp, 2 passes
    dict(head_dim=64, varlen=True, mask={"kind": "chunked", "chunk_size": 96}),  # packed query tiles
])
def test_the_kernel_takes_turns_as_simulated(spec):
    """The simulation above hard-codes the kernel's turn rule (hi - 1 - n, key blocks last-to-first; with a causal
    mask, n - lo in the CTAs whose `ascending` is 1, simulate_grid): the rendered deterministic backward must compute
    exactly that, times the passes per query block, with n_begin / n_end the key-block range (an off-by-one there
    hangs the GPU; a review found nothing tying the two together, session 13), and launch its key blocks in the
    matching order (descending: n = num_n - 1 - y; ascending: n = y)."""
    import re

    from fa4gen.builder import render_spec
    from fa4gen.spec import spec_from_dict

    full = spec_from_dict(dict(name="det_turns", targets=["sm90"], dtype="bf16", backward=True, deterministic=True,
                               **spec))
    pkg, _, _ = render_spec(full, "t")
    code = pkg.files["bwd_sm90.py"]
    turns = re.findall(r"^\s*turn = (.+)$", code, re.MULTILINE)
    causal = spec["mask"]["kind"] == "causal"
    rank = (r"n_end - 1 - n_block \+ ascending \* \(2 \* n_block \+ 1 - n_begin - n_end\)" if causal
            else r"n_end - 1 - n_block")
    assert turns and all(re.fullmatch(rf"(2 \* \()?{rank}\)?", t) for t in turns), turns
    if causal:  # n = y where ascending, else num_n - 1 - y; ascending from the shared helper
        assert "n_begin, n_end = mask.n_block_range(" in code
        assert "ascending = cute.arch.make_warp_uniform(schedule.det_tail_ascending(z, gz, gx, num_n_det))" in code
        assert "n_block = n_block + (1 - ascending) * (num_n_det - 1 - 2 * n_block)" in code
    else:
        assert "ascending" not in code
        assert re.search(r"_, n_end = mask\.n_block_range\(|n_end = cute\.ceil_div\(seqlen_k, TILE_N\)", code)

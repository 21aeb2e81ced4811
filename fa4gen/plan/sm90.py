"""Plan stage: rules that resolve a spec into an SM90 (Hopper) forward KernelPlan.

Warp roles: one producer warpgroup (its first warp issues every TMA load) and two or three consumer
warpgroups of 64 query rows each (tile_m = 128 or 192), which run S = Q·Kᵀ and O += P·V on WGMMA
with P fed from registers. Budgets checked here: shared memory per CTA (227 KB opt-in on H100/H200) and
the consumer register budget under setmaxnreg.
"""

from __future__ import annotations

from dataclasses import replace

from fa4gen.plan.model import Budget, KernelPlan, PlanError, bwd_dq_cols, bwd_stats_in_smem, problem
from fa4gen.plan.common import check_threshold, identity_fields, poly_choice, semantic_fields
from fa4gen.spec import AttentionSpec

SMEM_BUDGET = 227 * 1024
REG_FILE = 64 * 1024
REGS_PRODUCER = 24
# setmaxnreg budgets per consumer thread, by consumer warpgroup count (the register file is 64K).
REGS_CONSUMER = {2: 240, 3: 160}
# Registers a consumer thread needs besides the S/P/O fragments (addresses, row stats, loop state);
# measured from ptxas on the d128 kernel and rounded up.
REGS_OVERHEAD = 32
# Above d192, 64 keys rather than 80 (session 47, H200, same-tree A/Bs, docs/PERF.md): d256 without a mask / causal
# +6% / +8% at s512 (512 keys fill 8 blocks of 64; 7 blocks of 80 computed 560), +1-5% at s1k, +3-5% at s2k, level
# at s8k-16k; its key-block loop is 444 SASS instructions per 64 keys against 483 per 80, no LDL/STL.
# Head dims 129-192: 96 keys rather than 112 (session 48, H200, same-tree A/Bs against 112, docs/PERF.md): d192
# s512-16k with and without a causal mask, raw TFLOP/s ratio >= 1.000 in all 12 cells (geometric mean ~1.02; s1k +7%,
# causal s512 / s2k +3-4%). Padding explains s1k (96: 11 blocks = 1,056 keys, 112: 10 = 1,120), not s512 (576 / 560).
AUTO_TILE_N = {64: 128, 96: 128, 128: 128, 192: 96, 256: 64}
# pipeline.q_stages auto gives the persistent forward two Q buffers up to this head dim (measured at 64 and 128; d144,
# the one persistent head dim above with room for them, was not)
AUTO_Q_STAGES_MAX_HEAD_DIM = 128
PERSISTENT_CTAS = 132  # SMs of an H100 / H200 SXM: the compile-time stand-in for the persistent grid's size (the API
# passes the GPU's SM count at run time; any count is correct)


def _auto_tile_n(head_dim: int) -> int:
    for limit in sorted(AUTO_TILE_N):
        if head_dim <= limit:
            return AUTO_TILE_N[limit]
    return AUTO_TILE_N[256]


def _tile_n_and_regs(spec: AttentionSpec) -> tuple[int, int]:
    """(tile_n, the consumer registers per thread the forward needs: O + S + P fragments + overhead)."""
    tile_n = _auto_tile_n(spec.head_dim) if spec.pipeline.tile_n == "auto" else spec.pipeline.tile_n
    if spec.pipeline.tile_n == "auto" and (spec.head_dim, spec.head_dim_v) == (192, 128):
        # (192, 128): V's 128 columns leave room for 128 keys (flash-attn-4's tile there); with a window 96 (session
        # 49, H200, same-tree A/B against 112, causal window 1024 s2k / s8k: raw 1.027 / 1.019)
        tile_n = 96 if spec.mask.kind == "sliding_window" else 128
    return tile_n, spec.head_dim_v // 2 + tile_n // 2 + tile_n // 4 + REGS_OVERHEAD


def _three_warpgroups_fit(spec: AttentionSpec, regs: int) -> bool:
    return max(spec.head_dim, spec.head_dim_v) <= 64 and regs <= REGS_CONSUMER[3]


def plan_forward(spec: AttentionSpec, *, allow_persistent: bool = True) -> KernelPlan:
    problems = []
    p = spec.pipeline
    # auto: three consumer warpgroups (tile_m 192) for head dims <= 64 without a mask, two (128)
    # otherwise. For d64 the H200 measured 192 at +14-16% over 128 without a mask (two runs,
    # docs/perf/2026-11-29_ablation_d64*.json); with a mask it wins at long seqlens but loses at short
    # ones, so masked specs run 128 rows and get a second, 192-row kernel for long calls
    # (plan_forward_long). Above d64 the 160-register budget of three warpgroups does not hold the O
    # and S fragments (the planner refuses it with the numbers).
    tile_n, regs = _tile_n_and_regs(spec)
    # (auto also keeps 128 rows when a hand-set tile_n would not fit three warpgroups' budget)
    small = _three_warpgroups_fit(spec, regs) and spec.mask.kind == "none"
    long_kernel = _has_long_kernel(spec)
    tile_m = (192 if small else 128) if p.tile_m == "auto" else p.tile_m
    if tile_m not in (128, 192):
        problems.append(problem(
            "pipeline.tile_m",
            f"the sm90 family runs 2 or 3 consumer warpgroups of 64 rows, so tile_m must be 128, 192 or "
            f"'auto' (got {p.tile_m})",
        ))
        tile_m = 128
    num_wg = tile_m // 64
    regs_producer, regs_consumer = REGS_PRODUCER, REGS_CONSUMER[num_wg]
    if num_wg == 2 and max(spec.head_dim, spec.head_dim_v) > 192 and max(spec.head_dim, spec.head_dim_v) % 32:
        # 208 / 240: each K/V row splits into TMA boxes with a 16- or 48-column remainder, and the load loop's
        # coordinates outgrow the producer's 24 registers — 2 to 28 LDL/STL in 17 of 32 masked forwards, some
        # inside the consumers' loops (CPU sweep, session 13); 40 / 232 compiles all of them clean
        regs_producer, regs_consumer = 40, 232
    kv_stages = 2 if p.kv_stages == "auto" else p.kv_stages
    if spec.head_dim_v > spec.head_dim:
        problems.append(problem(
            "head_dim_v", f"the sm90 epilogue reuses the Q buffer for O, so head_dim_v must be <= head_dim "
            f"(got {spec.head_dim_v} > {spec.head_dim})",
        ))
    if spec.head_dim % 16 or spec.head_dim_v % 16:
        problems.append(problem(
            "head_dim", f"WGMMA consumes K in steps of 16, so sm90 needs head dims that are multiples of 16 "
            f"(got {spec.head_dim}/{spec.head_dim_v})",
        ))
    check_threshold(spec, problems)

    elem = 2
    smem = (
        tile_m * spec.head_dim * elem
        + kv_stages * tile_n * (spec.head_dim + spec.head_dim_v) * elem
        + (1 + 2 * kv_stages) * 2 * 8
    )
    # not packed, one CTA per SM strides over the query tiles when O fits a buffer of its own: the next tile's
    # Q and K/V then load while this tile finishes, instead of after the CTA exits. A masked d <= 64 spec with
    # its 192-row kernel for long calls (from LONG_SEQLEN_Q, below PERSISTENT_MAX_SEQLEN_Q) has that kernel as
    # the twin
    persistent = allow_persistent and _persistent_fits(spec, smem, tile_m, tile_n, elem)
    if persistent and spec.mask.kind != "none":
        # masked: two consumer warpgroups only (three have not been compiled or measured persistent), producer /
        # consumers at 32 / 232 registers (session 16, H200: 1-2% faster than 24 / 240 at d64 causal s640-1152)
        if num_wg == 2 and regs <= PERSISTENT_MASKED_REGS_CONSUMER:
            regs_producer, regs_consumer = PERSISTENT_MASKED_REGS_PRODUCER, PERSISTENT_MASKED_REGS_CONSUMER
        else:
            persistent = False
    if persistent:
        smem += tile_m * spec.head_dim_v * elem
    # a second Q buffer (persistent only: a one-CTA-per-tile kernel loads its Q once): the producer's next-tile Q
    # load then waits for the release of the tile before this one, not this one's, and the next tile's first K
    # load behind it goes out a block step earlier. auto: 2 where it fits at head dims <= AUTO_Q_STAGES_MAX_HEAD_DIM
    # (session 49, H200, A/B of q_stages 2 with the producer's K-before-Q order against main before both: d64 / d128,
    # no mask and causal, s512-2k: raw 1.048, +6-12% at s512, 0.998-1.122 per cell), else 1
    q_bytes = tile_m * spec.head_dim * elem
    q_fits = smem + q_bytes + 2 * 8 <= SMEM_BUDGET
    if p.q_stages == "auto":
        q_stages = 2 if persistent and q_fits and max(spec.head_dim, spec.head_dim_v) <= AUTO_Q_STAGES_MAX_HEAD_DIM else 1
    else:
        q_stages = 2 if persistent and p.q_stages == 2 else 1
    if q_stages == 2:
        if not q_fits:
            problems.append(problem(
                "pipeline.q_stages", f"a second Q buffer ({q_bytes} bytes) does not fit next to the persistent "
                f"forward's Q, {kv_stages} K/V stages and O buffer ({smem} bytes; {SMEM_BUDGET} per CTA on sm90); "
                "use 1 or lower pipeline.kv_stages / pipeline.tile_n",
            ))
            q_stages = 1
        else:
            smem += q_bytes + 2 * 8
    reg_file = 128 * regs_producer + 128 * num_wg * regs_consumer
    budgets = (
        Budget("shared memory per CTA", smem, SMEM_BUDGET, "bytes"),
        Budget("consumer registers per thread (estimate)", regs, regs_consumer, "regs"),
        Budget("register file per SM", reg_file, REG_FILE, "regs"),
    )
    if smem > SMEM_BUDGET:
        problems.append(problem(
            "pipeline", f"shared memory budget exceeded: Q {tile_m}x{spec.head_dim} + {kv_stages} "
            f"stage{'s' if kv_stages != 1 else ''} of K/V {tile_n}x({spec.head_dim}+{spec.head_dim_v}) need {smem} "
            f"bytes > {SMEM_BUDGET} (227 KB per CTA on sm90); lower pipeline.tile_n or pipeline.kv_stages",
        ))
    if regs > regs_consumer:
        problems.append(problem(
            "pipeline.tile_n", f"consumer register budget exceeded: O ({spec.head_dim_v // 2}) + S ({tile_n // 2}) + "
            f"P ({tile_n // 4}) + {REGS_OVERHEAD} = {regs} registers per thread > {regs_consumer} (the budget of "
            f"{num_wg} consumer warpgroups, set by tile_m {tile_m}); lower pipeline.tile_n or pipeline.tile_m",
        ))
    every, share, fit = poly_choice(spec, tile_n, problems)
    if problems:
        raise PlanError(f"{spec.name} [sm90]", problems)

    kind = spec.mask.kind
    ping_pong = True if p.ping_pong == "auto" else p.ping_pong
    overlap = True if p.intra_wg_overlap == "auto" else p.intra_wg_overlap
    notes = []
    if p.ping_pong == "auto":
        notes.append("ping_pong auto -> on (FA3's choice)")
    if p.intra_wg_overlap == "auto":
        notes.append("intra_wg_overlap auto -> on (FA3's choice)")
    if p.tile_m == "auto":
        notes.append(f"tile_m auto -> {tile_m} ({'3 consumer warpgroups for head dims <= 64 without a mask: +14-16% over 128 on the H200' if small else '2 consumer warpgroups'})")
    if long_kernel:
        keys = _short_mask_keys(kind, LONG_WINDOW_KEYS, LONG_CHUNK_KEYS) if persistent else 0
        notes.append(f"calls with seqlen_q >= {LONG_SEQLEN_Q} run the 192-row kernel fwd_sm90_long instead"
                     + _short_mask_unless(kind, keys))
    if persistent and not long_kernel:
        keys = _short_mask_keys(kind, PERSISTENT_WINDOW_KEYS, PERSISTENT_CHUNK_KEYS)
        bound = persistent_max_seqlen_q(tile_m, overlap, kind != "none")
        notes.append(f"calls with seqlen_q >= {bound} run fwd_sm90_long instead (one CTA per tile)"
                     f"{_short_mask_unless(kind, keys)}")
    if every:
        notes.append(f"poly_exp share {spec.pipeline.poly_exp.share} -> one in every {every} exp2 of a thread's row "
                     f"(effective share {share:.3f}); max relative error {fit.max_rel_error:.2e}")
    if persistent:
        over = ("units of two query tiles, j and the last but j (equal work with a causal mask), then the last "
                "tiles longest first"
                if kind != "none" else "the query tiles")
        notes.append(f"scheduler: persistent, one CTA per SM (the API passes the GPU's SM count: {PERSISTENT_CTAS} on an "
                     f"H100 / H200 SXM) striding over {over} (O in a buffer of "
                     "its own, so the next tile's loads overlap this tile's last P·V and epilogue)")
    if q_stages == 2:
        notes.append(f"q_stages {'auto -> ' if p.q_stages == 'auto' else ''}2: the next tile's Q loads into the second "
                     "buffer while this tile's S GEMMs read the first")
    elif p.q_stages == 2:
        notes.append("q_stages 2 asked for, 1 here: this kernel runs one CTA per query tile and loads its Q once")
    if spec.varlen:
        notes.append("varlen: query tiles of all sequences numbered back to back (grid ceil(total_q / tile_m) + "
                     "sequences); per-sequence bounded TMA views, so loads past a sequence read zeros and stores "
                     "past it are dropped")
    if num_wg == 3 and not spec.varlen and persistent and overlap:
        notes.append("idle warpgroups: in a sequence's last query tile the warpgroups without a row skip their GEMMs "
                     "and softmax block by block and keep only the handshakes (K/V stages, tensor-core turns); the API "
                     "launches a CTA count coprime to the tiles per sequence, so every CTA gets its share of those "
                     "cheaper tiles (runtime.spread_ctas)")
    if num_wg == 3 and not spec.varlen and not persistent:
        notes.append("idle warpgroups: when a sequence's last query tile has rows for warpgroup 0 only, warpgroups 1 "
                     "and 2 skip their GEMMs and softmax and only pass the K/V stages and their tensor-core turns on "
                     "(seqlen 4096 in 192-row tiles; with one idle warpgroup, seqlen 8192, all three run: that measured "
                     "slower on the H200)")
    return KernelPlan(
        **identity_fields(spec, "sm90", "sm_90a", "fwd"),
        tile_m=tile_m,
        tile_n=tile_n,
        kv_stages=kv_stages,
        q_stages=q_stages,
        num_mma_warpgroups=num_wg,
        threads=128 * (num_wg + 1),
        regs_producer=regs_producer,
        regs_consumer=regs_consumer,
        ping_pong=ping_pong,
        intra_wg_overlap=overlap,
        scheduler="persistent" if persistent else "grid_lpt" if kind in ("causal", "sliding_window", "chunked") else "grid",
        persistent_ctas=PERSISTENT_CTAS if persistent else 0,
        skip_idle_warpgroups=num_wg == 3 and not spec.varlen and (overlap or not persistent),
        **semantic_fields(spec, every, share, fit),
        budgets=budgets,
        notes=tuple(notes),
    )


# A masked head dim <= 64 spec with tile_m auto gets two forward kernels, and the API picks one per call by
# seqlen_q: 128 rows below LONG_SEQLEN_Q, 192 rows (three consumer warpgroups) from it on. H200, d64 causal,
# grid shapes (docs/PERF.md, session 4): 192 rows +7% at 4k and +14% at 16k, but -9% at 1k (short causal
# rows waste more of a 192-row diagonal tile, and there are fewer CTAs to balance). Since session 15 the 128-row
# one is persistent; same-run A/B with the threshold at 4096 instead (docs/PERF.md, session 15): the persistent
# 128-row forward -1% at 2k and -8% at 3k against the 192-row grid, so the threshold stayed. With two Q buffers in the
# persistent forward (session 49) the 128-row one took the lead below 3k: same-run A/Bs, session 50 (raw, the 128-row
# persistent kernel pinned against the 192-row one): +6.1% / +4.4% at 2048, +1.7% at 2560, -2.4% at 3072, -2.3% at
# 3584, -5.5% at 4096; the threshold moved from 2048 to 2560 (2560-3071 fall between +1.7% and -2.4%).
LONG_SEQLEN_Q = 2560
# ... unless the call's sliding window keeps every row under LONG_WINDOW_KEYS keys (left + right + 1, both sides
# bounded): then the 128-row persistent forward runs at every seqlen_q. The 192-row tile pays where rows are long
# (more rows per K/V load); a bounded window caps the keys per row while its edge tiles waste more of a 192-row
# tile (192 + window keys read for a window's worth per row, against 128 + window). Same-run A/Bs (H100, d64 causal
# windows (left, 0), the 128-row persistent kernel pinned against the 192-row one, raw): session 55, 1025 keys +14.0%
# at 2560, +0.2% at 3072, +13.6% at 3584, +10.7% at 4096, +11.6% at 8192; session 58, 2049 keys +3.9% / +1.4% at
# 4096 / 8192, 3073 keys -5.5% and 4097 keys -4.9% at 8192 (session 55: -1.6% / -7.7% at 4096 / 8192). Session 58 end
# to end against a bound of 2304: 2201 keys +0.9% / -3.8% at 4096 / 8192, so the crossover at long calls lies between
# 2049 and 2201 keys, and the bound keeps the measured gain: windows up to 2049 keys (left 2048, right 0: end to end
# against the old bound of 1280, +4.0% / +1.3%). Not for varlen specs, whose 128-row forward is not persistent (not
# measured).
LONG_WINDOW_KEYS = 2050
# ... and unless the call's chunked mask has chunks shorter than LONG_CHUNK_KEYS keys: a chunked call is causal
# attention over sequences of one chunk each (every row sees at most a chunk's keys, its chunk's causal share), so
# the causal crossover applies to the chunk's length. Same-run A/B, session 56 (H200, d64, end to end against the
# 192-row kernel): chunks of 1024 keys raw +43% / +29% / +31% at 2560 / 4096 / 8192; session 57 (H100, the 192-row
# kernel pinned against this choice): chunks of 2048 keys 0.903 / 0.909 at 4096 / 8192 (chunks of 2049-2559 keys not
# measured). Session 56's end-to-end window A/B (window 1024, H200): +17% / +12% at 2560 / 8192.
LONG_CHUNK_KEYS = LONG_SEQLEN_Q


# The persistent forward runs calls below PERSISTENT_MAX_SEQLEN_Q query rows; from there on the API
# runs the same tiles as one CTA per tile (fwd_sm90_long). H200, same-run A/B against one CTA per tile (docs/PERF.md,
# session 14): +14-16% at 512, +5-8% at 1k, +2-4% at 2k; at 4k d64 +2.5% but d128 -3%, at 16k -0.2 to -0.3%.
# Masked (session 15, causal, against the longest-first grid): d128 +14% at 512, +7% at 1k, +2% at 2k; d64 (below
# its 192-row kernel's LONG_SEQLEN_Q) +20% at 512, +13% at 1k.
PERSISTENT_MAX_SEQLEN_Q = 4096
# The 192-row persistent forward (d <= 64 without a mask), which lets a warpgroup without rows in a tile skip its
# work (session 57), runs calls up to 8192 query rows. Same-run A/Bs, session 59 (H100, d64, the persistent kernel
# pinned against the one-CTA-per-tile one, raw, two runs a side each): s4096 +3.6% / +3.6%, s5000 +0.9%, s8192
# +4.7% / +3.4%, s16384 -3.1%. d128 (128 rows) read 1.004 / 0.988 / 0.996 at 4k / 8k / 16k in the same run: its
# bound stays.
PERSISTENT_MAX_SEQLEN_Q_192 = 8193
# A masked 128-row persistent forward (d65-128, or d <= 64 with tile_m set) runs calls below 8192 query rows: its
# longest-first order of paired tiles balances a causal call's uneven tiles, which the one-CTA-per-tile grid leaves to
# the hardware's block scheduler. Session 64 (H100, tools/pin_ab.py: the two kernels pinned and alternated in one
# process, do_bench medians, L2 flushed; persistent / one CTA per tile, causal): d128 s4096 1.042 / 1.075 (two
# processes), s8192 1.023 / 1.006, s12288 1.035, s16384 0.951; d96 s4096 1.033, s8192 1.005, s12288 0.999. s8192 and
# up stay on the one-CTA kernel (within the spread there, and behind at 16k); the bound was PERSISTENT_MAX_SEQLEN_Q,
# set from calls without a mask, before.
PERSISTENT_MAX_SEQLEN_Q_MASKED = 8192
# ... and for a masked 128-row persistent forward (PERSISTENT_MAX_SEQLEN_Q_MASKED's), calls whose chunks are shorter
# than PERSISTENT_CHUNK_KEYS keys, or whose sliding window spans fewer than PERSISTENT_WINDOW_KEYS keys per row, keep
# the persistent forward at every seqlen_q, as the 192-row kernel's LONG_CHUNK_KEYS / LONG_WINDOW_KEYS rules do for
# d64. A chunked call is causal attention over one chunk at a time, so the causal bound applies to the chunk's
# length; a window of W keys gives every query tile about W keys of work, as a call of W keys without a mask, whose
# persistent gain falls from +5-8% at 1k to +2-4% at 2k and turns at 4k (session 14), so the d64 window bound is
# kept. Session 63 (H100, one pass): d128 chunks of 1024 keys ran 389 / 394 TFLOP/s at s4k / s8k on the
# one-CTA-per-tile kernel, against 480.6 for a causal s1k call (persistent; session 58, H100), the same work per tile.
# Session 64 (H100, tools/pin_ab.py, persistent / one CTA per tile, d128): chunks of 1024 keys 1.088 / 1.099 and
# window 1024 1.060 / 1.070 at s4096 / s8192 (windows of 2050+ keys at s8192 and up not measured).
PERSISTENT_CHUNK_KEYS = PERSISTENT_MAX_SEQLEN_Q_MASKED
PERSISTENT_WINDOW_KEYS = 2050


# Where the persistent forward is planned: head dims up to 160 without a mask (64/96/128 ran on the H200 in sessions 14-15; 144 and
# 160, with 112-key blocks (96 since session 48), fit Q, O and two K/V stages in shared memory and compile without LDL/STL: CPU sweep,
# session 15; d160 measured +11% at s512, +1.4% at 1k and 2k, same-run A/B, session 17; d192 and up leave no room
# for O's own buffer), and key blocks of at most 160 (a CPU spill sweep of
# hand-set tiles, session 14: with 192 keys the tile loop's state spills 16-21 LDL/STL at d64 and d128, its grid
# twin none). Masked, up to 128, the head dims measured masked persistent on the H200 (session 15's d160 masked
# persistent loops: 747 / 642 instructions per key block against the one-CTA-per-tile kernel's 609 / 529, CPU SASS;
# without a mask 559 against 509, as d128's 515 against 485).
PERSISTENT_MAX_HEAD_DIM = 160
PERSISTENT_MAX_HEAD_DIM_MASKED = 128
# masked persistent forwards: producer / consumer registers (32 x 128 + 232 x 256 of the 64K register file). Session
# 14's nested loop spilled the producer at 24; the flat loop compiles clean at 24 / 240 too, but measured 1-2% slower
# than at 32 / 232 (session 16, d64 causal s640 / 1024 / 1152, two runs each, docs/perf/2026-11-30_s16_*)
PERSISTENT_MASKED_REGS_PRODUCER = 32
PERSISTENT_MASKED_REGS_CONSUMER = 232
PERSISTENT_MAX_TILE_N = 160


def persistent_max_seqlen_q(tile_m: int, overlap: bool, masked: bool) -> int:
    """The seqlen_q from which a persistent forward of `tile_m` rows (its intra-warpgroup overlap on or off; with a
    mask or not) hands calls to its one-CTA-per-tile twin: PERSISTENT_MAX_SEQLEN_Q_192 for the 192-row kernel with
    the idle-warpgroup skip (which needs the overlap when persistent), PERSISTENT_MAX_SEQLEN_Q_MASKED for a masked
    one, PERSISTENT_MAX_SEQLEN_Q otherwise."""
    if tile_m == 192 and overlap:
        return PERSISTENT_MAX_SEQLEN_Q_192
    return PERSISTENT_MAX_SEQLEN_Q_MASKED if masked else PERSISTENT_MAX_SEQLEN_Q


def _persistent_fits(spec: AttentionSpec, smem: int, tile_m: int, tile_n: int, elem: int) -> bool:
    return (not spec.varlen
            and max(spec.head_dim, spec.head_dim_v) <= (PERSISTENT_MAX_HEAD_DIM if spec.mask.kind == "none"
                                                        else PERSISTENT_MAX_HEAD_DIM_MASKED)
            and tile_n <= PERSISTENT_MAX_TILE_N
            and smem + tile_m * spec.head_dim_v * elem <= SMEM_BUDGET)


# pipeline.rescale_threshold "auto" is 0 (always rescale, no warp vote) in the d64 spec's one-CTA-per-tile kernel for
# long calls without a mask, RESCALE_THRESHOLD_AUTO (8) everywhere else. Measured at the H100's 700 W cap, where the
# long cells run (tools/sustained_bench.py, --variant rt0:rescale_threshold=0 against the default, bf16 MHA, docs/PERF.md
# session 78): this kernel (s12288 / s16384) +1.6% / +1.4% and +1.3% in a second call; the persistent 192-row kernel
# (s8192) -1.7% and the causal d64 forwards -1.2%, so neither takes it. d128's kernels lose 2-10% without the
# threshold (session 78's settled ablation). Other head dims without a mask were not measured: they keep 8.
ALWAYS_RESCALE_LONG_HEAD_DIM = 64


def _always_rescale_long(spec: AttentionSpec) -> bool:
    return (spec.pipeline.rescale_threshold == "auto" and spec.mask.kind == "none" and spec.softcap == 0
            and spec.head_dim == spec.head_dim_v == ALWAYS_RESCALE_LONG_HEAD_DIM)


def _has_long_kernel(spec: AttentionSpec) -> bool:
    return (spec.pipeline.tile_m == "auto" and spec.mask.kind != "none"
            and _three_warpgroups_fit(spec, _tile_n_and_regs(spec)[1]))


def plan_forward_long(spec: AttentionSpec) -> KernelPlan | None:
    """The second forward kernel of a spec with `_has_long_kernel` (192 rows, for long calls) or with a persistent
    default forward (one CTA per tile, for long calls), else None."""
    if not _has_long_kernel(spec):
        default = plan_forward(spec)
        if default.scheduler != "persistent":
            return None
        bound = persistent_max_seqlen_q(default.tile_m, default.intra_wg_overlap, spec.mask.kind != "none")
        plan = plan_forward(spec, allow_persistent=False)
        note = (f"dispatch: the API runs this one-CTA-per-tile kernel for calls with seqlen_q >= "
                f"{bound}, the persistent fwd_sm90 below")
        window_keys = _short_mask_keys(spec.mask.kind, PERSISTENT_WINDOW_KEYS, PERSISTENT_CHUNK_KEYS)
        note += _short_mask_dispatch(spec.mask.kind, window_keys)
        notes = (*plan.notes, note)
        if _always_rescale_long(spec):
            plan = replace(plan, rescale_threshold=0.0)
            notes += ("rescale_threshold auto: 0 in this kernel (always rescale; measured faster here at d64 "
                      "without a mask), 8 in fwd_sm90",)
        return replace(plan, module="fwd_sm90_long", min_seqlen_q=bound, min_window_keys=window_keys,
                       notes=notes)
    p = spec.pipeline
    plan = plan_forward(spec.model_copy(update={"pipeline": p.model_copy(update={"tile_m": 192})}), allow_persistent=False)
    note = (f"dispatch: the API runs this 192-row kernel for calls with seqlen_q >= {LONG_SEQLEN_Q} (the longest "
            f"sequence when packed), fwd_sm90 (128 rows) below")
    window_keys = _window_bound(spec)
    note += _short_mask_dispatch(spec.mask.kind, window_keys)
    return replace(plan, module="fwd_sm90_long", min_seqlen_q=LONG_SEQLEN_Q, min_window_keys=window_keys,
                   notes=(*plan.notes, note))


def _window_bound(spec: AttentionSpec) -> int:
    """The 192-row kernel's dispatch bound on the keys a row spans for a sliding-window (LONG_WINDOW_KEYS) or
    chunked (LONG_CHUNK_KEYS) spec whose 128-row forward is persistent (0: none; the window and the chunk size are
    call arguments, so the bound applies to the call's)."""
    bound = _short_mask_keys(spec.mask.kind, LONG_WINDOW_KEYS, LONG_CHUNK_KEYS)
    if not bound or plan_forward(spec).scheduler != "persistent":
        return 0
    return bound


def _short_mask_keys(kind: str, window_keys: int, chunk_keys: int) -> int:
    """A long-call kernel's min_window_keys for a mask `kind`: `window_keys` for sliding windows, `chunk_keys` for
    chunks, 0 (every call) otherwise."""
    return {"sliding_window": window_keys, "chunked": chunk_keys}.get(kind, 0)


def _short_mask_unless(kind: str, keys: int) -> str:
    """The default forward's note on which long calls stay with it (empty without a bound)."""
    if not keys:
        return ""
    if kind == "chunked":
        return f", unless their chunks are shorter than {keys} keys"
    return f", unless their sliding window spans fewer than {keys} keys per row"


def _short_mask_dispatch(kind: str, keys: int) -> str:
    """The long-call kernel's dispatch note on the calls that run fwd_sm90 instead (empty without a bound)."""
    if not keys:
        return ""
    if kind == "chunked":
        return f", and for calls whose chunks are shorter than {keys} keys fwd_sm90 at every seqlen_q"
    return (f", and for calls whose sliding window spans fewer than {keys} keys per row (left + right + 1) "
            f"fwd_sm90 at every seqlen_q")


# d <= 64 without a mask runs 192-row tiles, which compute more rows per second than 128-row ones (+14-16% at full tiles,
# session 14) but pad a call whose seqlen_q fills its last tile poorly. Session 49 on the H200, d64 (fa4gen at 128 /
# 192 rows, TFLOP/s of the true rows): s197 193.0 / 141.7 (two 192-row tiles compute 384 rows, two 128-row ones 256),
# s577 335.6 / 311.9 (768 / 640); session 47, s512: 0.975 (576 / 512). So the per-row rate of 192 over 128 is ~1.10-1.18,
# and a call ran 128 rows where 192's padded rows exceed 128's by more than ROWS128_RATE: seqlen_q 1-128, 193-256 and
# 577-640 below PERSISTENT_MAX_SEQLEN_Q (ViT-B/16's 197 tokens and ViT-L/14-336's 577 among them). Session 50 (same-run
# A/B, 128 rows against the 192-row kernel): s512 / s1k, which 192 rows pad by 12.5%, 0.994 / 0.996, s1536 (no padding)
# 0.906; the twin against 192 rows: s197 1.381, s577 1.078, s640 1.045, s100 1.344 (raw). Break-even near 12.5%: the rate stays.
# Since session 57 the 192-row kernel's warpgroups without rows in a sequence's last tile skip their work, so a last
# tile of 1-64 rows costs about three quarters of a full one instead of a whole one. Session 59 (H100, same-run A/Bs,
# the 192-row kernel pinned against the twin, raw): s197 0.873 (the twin still wins where the partial tile is one of
# two), s577 1.032 / 1.016 and s640 1.044 / 1.044 (one of four: the 192-row kernel wins). So the twin keeps the
# lengths of at most two 192-row tiles (ROWS128_MAX_SEQLEN_Q): 1-128 and 193-256.
ROWS128_RATE = 1.15
ROWS128_MAX_SEQLEN_Q = 384


def rows128_ranges(limit: int = 0, rate: float = ROWS128_RATE) -> tuple[tuple[int, int], ...]:
    """The inclusive seqlen_q ranges below `limit` (default: up to ROWS128_MAX_SEQLEN_Q) where 128-row tiles, at
    `rate` times the per-row cost of 192-row ones, take less time: ceil(s / 128) * 128 * rate < ceil(s / 192) * 192."""
    out: list[list[int]] = []
    for s in range(1, limit or ROWS128_MAX_SEQLEN_Q + 1):
        if -(-s // 128) * 128 * rate < -(-s // 192) * 192:
            if out and out[-1][1] == s - 1:
                out[-1][1] = s
            else:
                out.append([s, s])
    return tuple((a, b) for a, b in out)


def plan_forward_rows128(spec: AttentionSpec) -> KernelPlan | None:
    """The 128-row persistent twin of a default 192-row persistent forward (d <= 64, no mask, tile_m auto, not
    packed) for the calls whose seqlen_q pads 192-row tiles worst (rows128_ranges), else None."""
    if spec.pipeline.tile_m != "auto" or spec.varlen:
        return None
    default = plan_forward(spec)
    if default.tile_m != 192 or default.scheduler != "persistent":
        return None
    plan = plan_forward(spec.model_copy(update={"pipeline": spec.pipeline.model_copy(update={"tile_m": 128})}))
    if plan.scheduler != "persistent":
        return None
    ranges = rows128_ranges()
    shown = ", ".join(f"{a}-{b}" for a, b in ranges)
    note = (f"dispatch: the API runs this 128-row kernel for calls with seqlen_q in {shown} (calls of at most "
            f"{ROWS128_MAX_SEQLEN_Q} rows, where 192-row tiles would compute more than {ROWS128_RATE}x its padded "
            "rows), fwd_sm90 (192 rows) otherwise")
    return replace(plan, module="fwd_sm90_rows128", seqlen_q_ranges=ranges, notes=(*plan.notes, note))


# Backward: one CTA per (key block, q head, batch); two consumer warpgroups of 64 query rows each split
# S/dP and dQ by columns and dK/dV by key rows (tile_n 128) or by head-dim columns (tile_n 64).
REGS_BWD_OVERHEAD = 16


# (Q stages, dO stages, P/dS stages, dQ buffers) of the backward, most preferred first: the first that
# fits the shared memory (and leaves GQA's dK/dV room in the dQ buffers) is taken
BWD_STAGE_ORDER = ((2, 2, 2, 2), (2, 2, 1, 2), (2, 2, 2, 1), (2, 1, 2, 2), (2, 1, 2, 1), (2, 2, 1, 1), (2, 1, 1, 1),
                   (1, 1, 2, 2), (1, 1, 1, 2), (1, 1, 1, 1))


def _bwd_smem(spec: AttentionSpec, tile_m: int, tile_n: int, swap: bool, q_stages: int, do_stages: int,
              pds_stages: int, dq_buffers: int) -> int:
    d, dv, elem = spec.head_dim, spec.head_dim_v, 2
    pds_buffers = 1 if swap else 2  # with Sᵀ, P stays in registers: only dS in smem
    return (
        q_stages * tile_m * d * elem  # Q
        + do_stages * tile_m * dv * elem  # dO
        + tile_n * (d + dv) * elem  # K, V (reused for dK, dV in the epilogue)
        + pds_stages * pds_buffers * tile_m * tile_n * elem  # (P,) dS
        + dq_buffers * 64 * bwd_dq_cols(d, tile_m) * 4  # warpgroup dQ chunks in fp32, bulk-reduced
        + (2 * q_stages * tile_m * 4 if bwd_stats_in_smem(d, dv, swap) else 0)  # LSE2/D per Q stage (bulk-copied with Q)
        + (2 * q_stages + 2 * do_stages + 2) * 8  # mbarriers
    )


# deterministic / non-deterministic backward throughput on the H200 grid (MHA, bf16, 16k tokens per cell,
# seqlen 512-16k, docs/PERF.md), per head-dim class: the head dims measured, then (low, high, session) with a
# causal mask and without one
DET_COST = {
    "d <= 64": ((64, 64), (0.952, 0.992, 36), (0.947, 1.002, 36)),
    "d <= 128": ((128, 128), (0.933, 0.967, 36), (0.965, 0.997, 37)),
    "(192, 128)": ((192, 128), (0.828, 0.972, 40), (0.891, 0.966, 40)),
    "d > 128": ((256, 256), (0.912, 1.001, 28), (0.913, 0.964, 27)),
}


def _det_cost(spec: AttentionSpec) -> str:
    """The deterministic backward's measured cost for the spec's head dims and mask, as a plan note."""
    d, dv = spec.head_dim, spec.head_dim_v
    cls = ("(192, 128)" if (d, dv) == (192, 128) else "d <= 64" if max(d, dv) <= 64
           else "d <= 128" if max(d, dv) <= 128 else "d > 128")
    dims, causal, none = DET_COST[cls]
    masked = spec.mask.kind != "none"
    lo, hi, session = causal if masked else none
    where = ("with a causal mask" + ("" if spec.mask.kind == "causal" else f" ({spec.mask.kind} not measured)")
             if masked else "without a mask")
    measured = "measured" if (d, dv) == dims else f"measured at d{dims[0]}"
    return (f"{measured} {lo:.3f}-{hi:.3f}x of the non-deterministic backward {where} (H200 grid: MHA, bf16, "
            f"seqlen 512-16k; session {session}, docs/PERF.md)")


def plan_backward_mha(spec: AttentionSpec) -> KernelPlan | None:
    """The second SM90 backward of a spec with backward and allow_gqa: the allow_gqa: false kernel, which the API
    runs for MHA calls (as many K/V heads as query heads). Without it those calls took the GQA kernel, whose dK/dV
    go through fp32 workspaces (zeroed per call), atomic adds and a postprocess: on the H200 (session 38,
    docs/PERF.md) that backward ran at 0.64-0.95x the MHA kernel's speed on MHA calls (d64 / d128, s1k / s4k)."""
    if not (spec.backward and spec.allow_gqa):
        return None
    plan = plan_backward(spec.model_copy(update={"allow_gqa": False}))
    note = ("dispatch: the API runs this kernel for calls with as many K/V heads as query heads (dK/dV stored "
            "straight from the CTA), bwd_sm90 (GQA: dK/dV summed in fp32 workspaces) for the others")
    return replace(plan, module="bwd_sm90_mha", mha_only=True, notes=(*plan.notes, note))


# The GQA backward with a group's q heads in one CTA (bwd_sm90_gqa) runs calls with at least this many CTAs (key blocks
# x kv heads x batch): two waves of the H100 / H200's 132 SMs. Below, the fp32-workspace backward's CTA per q head
# keeps the SMs busy (an MQA call at batch 1, s2k, d128: 16 CTAs with the head loop, 512 without). Session 66's A/B
# (H100) read the head loop 1.01-1.21x the fp32-workspace kernel at 512-1,024 CTAs; the bound itself is not measured.
GQA_HEAD_LOOP_MIN_CTAS = 2 * PERSISTENT_CTAS


def plan_backward_gqa(spec: AttentionSpec) -> KernelPlan | None:
    """The third SM90 backward of a spec with backward and allow_gqa (not varlen, not deterministic): the MHA
    kernel's plan with its loops run once per q head of a kv head's group in one CTA (gqa_head_loop), which stores
    dK/dV straight from registers. The API runs it for GQA / MQA calls with at least GQA_HEAD_LOOP_MIN_CTAS CTAs."""
    if not (spec.backward and spec.allow_gqa) or spec.varlen or spec.deterministic:
        return None
    # one CTA per (key block, kv head, batch) on the grid: the persistent MHA loop is not built with the head loop
    plan = plan_backward(spec.model_copy(update={"allow_gqa": False}), allow_persistent=False, allow_dq_overlap=False)
    if plan.dq_atomic:  # dQ added from the consumers' registers: not built with the head loop
        return None
    note = (f"dispatch: the API runs this kernel for GQA / MQA calls with at least {GQA_HEAD_LOOP_MIN_CTAS} CTAs (key "
            "blocks x kv heads x batch): one CTA per (key block, kv head) runs its group's q heads in turn and stores "
            "dK/dV from registers; bwd_sm90 (a CTA per q head, dK/dV summed in fp32 workspaces) below")
    return replace(plan, module="bwd_sm90_gqa", allow_gqa=True, gqa_head_loop=True,
                   min_kv_ctas=GQA_HEAD_LOOP_MIN_CTAS, notes=(*plan.notes, note))


def plan_backward(spec: AttentionSpec, *, allow_persistent: bool = True, masked_persistent: bool = False,
                  allow_dq_overlap: bool = True) -> KernelPlan | None:
    """The SM90 backward (preprocess, main dQ/dK/dV kernel, postprocess) of a spec with backward: true.
    allow_persistent=False keeps one CTA per tile where the persistent loop would be planned (the GQA head-loop
    kernel, built and measured on the grid). masked_persistent=True plans the causal kernel persistent also where its
    staged epilogue has barriers (d80-d128), which measured slower than one CTA per tile (session 68): for
    tools/bwd_timeline.py --persistent, to measure that kernel; never set by a build. allow_dq_overlap=False keeps
    the dQ conversion after the main kernel (the GQA head-loop kernel, whose count would be per q head of a group)."""
    if not spec.backward:
        return None
    problems = []
    d, dv = spec.head_dim, spec.head_dim_v
    if d % 16 or dv % 16:
        problems.append(problem(
            "head_dim", f"WGMMA consumes K in steps of 16, so the sm90 backward needs head dims that are multiples "
            f"of 16 (got {d}/{dv})",
        ))
    # dK/dV accumulators (tile_n x d per CTA) must fit next to S, dP: 64 key rows per warpgroup up to
    # d 128, 32 (by head-dim halves) above. With 64 key rows per warpgroup the kernel computes Sᵀ and
    # dPᵀ (keys as WGMMA rows), so each warpgroup holds the Pᵀ/dSᵀ rows its dV/dK rows need: they feed
    # those GEMMs from registers (FA3's choice), and only dS goes through shared memory (for dQ).
    tile_n = 128 if max(d, dv) <= 128 else 64
    # head dims <= 64 leave room for 128 query rows per step (64 per warpgroup: S, dP and dQ split by
    # rows), which halves the per-step overheads and the smem traffic per flop (FA3 does the same)
    # (with Sᵀ too, flash-attn-4's d64 tile: Sᵀ/dPᵀ 64 x 128 per warpgroup next to 32 + 32 dK/dV registers;
    # its statistics come through shared memory, bulk-copied with Q; with softcap the Sᵀ loop's extra
    # P·(1 - tanh²) factor spilled at 128 rows: 64 there)
    # Sᵀ with P/dS in registers: by default for head dims <= 128 (FA3's / flash-attn-4's choice). On the
    # H200 (session 7, docs/PERF.md), against S with P and dS through shared memory: d128 +5-14% (80-row
    # steps without a mask), d64 +6-11% (128-row steps), varlen +4-22%. Not at d <= 64 with softcap:
    # there Sᵀ takes 64-row steps (128 spilled), which measured 0.904x S with 128 rows (H200, session 21) and
    # 0.922x (H100, session 55), although that S loop spills registers in 20 of 32 such variants (CPU census)
    swap = spec.pipeline.bwd_swap_ab is True or (
        spec.pipeline.bwd_swap_ab == "auto" and max(d, dv) <= 128 and not (max(d, dv) <= 64 and spec.softcap)
    )
    tile_m = 128 if max(d, dv) <= 64 and not (swap and spec.softcap) else 64
    dkv_t = (d, dv) == (192, 128) and not swap and not spec.allow_gqa
    if (d, dv) == (192, 128) and not swap and spec.deterministic and not dkv_t:
        # (192, 128) deterministic GQA: 128 query rows per step next to 64 keys (S, dP, dQ split by rows;
        # dK/dV by head-dim halves: 64 x 96 + 64 x 64 fp32 per warpgroup), so each key block waits for half
        # as many query-block turns. On the H200 (session 10, docs/PERF.md) +10-31% deterministic, but
        # 0-2.7% slower without determinism (all four cells), which keeps 64 rows there
        tile_m = 128
    # (192, 128) without GQA: flash-attn-4's tile, 64 query rows x 96 keys, with dK and dV computed
    # transposed (dKᵀ = Qᵀ·dS, dVᵀ = dOᵀ·P: head dims on WGMMA's M, each warpgroup 48 keys: 192 x 48 +
    # 128 x 48 fp32, 120 registers), since 96 key rows do not split into 64-row WGMMA tiles. On the H200
    # (session 11, docs/PERF.md): +7-13% over 64 x 64 without determinism, +16-20% over 128 x 64 with it
    # (det/non-det 0.88-0.95); GQA keeps its tiles (fp32 dK/dV staging by key rows)
    if dkv_t:
        tile_n = 96
    if swap and spec.mask.kind == "none" and not spec.softcap and max(d, dv) == 128:
        # 80 query rows per step (flash-attn-4's / FA3's d128 tile without a mask): the per-step chain
        # (waits, barriers, the dQ hand-off) serves 25% more rows; dQ is computed transposed (dQᵀ =
        # Kᵀ·dSᵀ) since WGMMA rows come in 64s: 64 head-dim rows per warpgroup, so exactly head dim 128
        # (at 112 the second warpgroup's rows ran past K, session 12). It fits the registers only with the per-query
        # statistics in shared memory (bulk-copied with Q); softcap's extra
        # factor (P·(1 - tanh²) in bf16) spilled 5 registers in the loop (CPU SASS), so 64 rows there
        tile_m = 80
    if swap and tile_n != 128:
        problems.append(problem(
            "pipeline.bwd_swap_ab", f"Sᵀ in registers needs 64 key rows per warpgroup, i.e. head dims <= 128 "
            f"(got {d}/{dv})",
        ))
    # without GQA, dK/dV go to shared memory by stmatrix, 16 columns at a time over each warpgroup's half of
    # the head dim: at 144/176/208/240 the half (72/88/104/120) is not a multiple of 16 (the stores ran past
    # the tile, CPU trace, session 12), so there each value goes to its fragment coordinates instead, as
    # the dKᵀ/dVᵀ tile's do (once per CTA)
    dkv_ew = not spec.allow_gqa and not dkv_t and tile_n == 64 and bool((d // 2) % 16 or (dv // 2) % 16)
    # GQA dK/dV leave through the dQ buffers: a warpgroup's fp32 share (64 rows x d, or d/2 with tile_n 64)
    accum_bytes = 64 * max(d, dv) // (1 if tile_n == 128 else 2) * 4 if spec.allow_gqa else 0
    # dQ added from the consumers' registers by vector reductions (no hand-off buffer, no dQ warp): by
    # default above d 128, where the hand-off gets one buffer shared in turns next to one dO stage —
    # the d256 profile (session 8, docs/PERF.md) spent most stalls waiting for dO and for that buffer.
    # With deterministic: true a turn warp (producer warp 1) waits for the query block's turn and passes
    # it once both consumer warpgroups have issued their adds; on the H200 (session 10) that is 14-21%
    # faster than the consumers taking the turn themselves at d256 (which was itself 0-10% ahead of the
    # ordered hand-off, session 9), but still 1-7% slower than the hand-off at d128, so auto takes it
    # above d 128 there too. Except (192, 128) on the 64 x 96 dKᵀ/dVᵀ tile: there the hand-off fits two
    # dQ buffers next to 2 Q / 2 dO stages (P/dS 1; flash-attn-4's configuration), and on the H200
    # (session 11) it ran +12-15% without determinism, +3-6% with it
    atomic = spec.pipeline.bwd_dq_atomic is True or (
        spec.pipeline.bwd_dq_atomic == "auto" and max(d, dv) > 128 and not dkv_t
    )
    order, fallback = BWD_STAGE_ORDER, (1, 1, 1, 2)  # (nothing fits: the smem budget check reports it)
    if atomic:  # no dQ buffers: GQA's dK/dV epilogue stages its fp32 tiles in the Q buffers, free by then
        order, fallback = tuple(dict.fromkeys(s[:3] + (0,) for s in BWD_STAGE_ORDER)), (2, 1, 1, 0)

    def staging(s) -> int:  # bytes the GQA epilogue can stage a warpgroup's fp32 dK/dV share in
        return s[0] * tile_m * d * 2 if atomic else s[3] * 64 * bwd_dq_cols(d, tile_m) * 4

    stages = next(
        (s for s in order if _bwd_smem(spec, tile_m, tile_n, swap, *s) <= SMEM_BUDGET and staging(s) >= accum_bytes),
        fallback,
    )
    smem = _bwd_smem(spec, tile_m, tile_n, swap, *stages)
    # dK, dV, S, dP fragments + row statistics (per query column with Sᵀ) + addresses; a floor, not a
    # bound: ptxas decides, and the SASS tests check that no backward kernel spills
    # LSE2/D through shared memory where bwd_stats_in_smem (bulk-copied with Q); S holds its rows' in registers
    stats = 2 if swap else 4
    regs = (tile_n * (d + dv) + 2 * tile_m * tile_n) // 256 + stats + REGS_BWD_OVERHEAD
    budgets = (
        Budget("shared memory per CTA", smem, SMEM_BUDGET, "bytes"),
        Budget("consumer registers per thread (estimate)", regs, REGS_CONSUMER[2], "regs"),
        Budget("register file per SM", 128 * REGS_PRODUCER + 256 * REGS_CONSUMER[2], REG_FILE, "regs"),
    )
    if smem > SMEM_BUDGET:
        problems.append(problem("head_dim", f"the backward needs {smem} bytes of shared memory > {SMEM_BUDGET}"))
    if regs > REGS_CONSUMER[2]:
        problems.append(problem("head_dim", f"the backward needs ~{regs} registers per thread > {REGS_CONSUMER[2]}"))
    check_threshold(spec, problems)
    if problems:
        raise PlanError(f"{spec.name} [sm90 backward]", problems)
    every, share, fit = poly_choice(spec, tile_n, [])
    q_stages, do_stages, pds_stages, dq_buffers = stages
    notes = [
        f"backward tiles: {tile_m} query rows x {tile_n} keys per step; stages Q {q_stages}, dO {do_stages}, "
        f"{'dS' if swap else 'P/dS'} {pds_stages}, dQ buffers {dq_buffers} (the most that fit {SMEM_BUDGET} bytes)",
        ("Sᵀ = K·Qᵀ: Pᵀ and dSᵀ feed dV and dK from registers" + ("; dQᵀ = Kᵀ·dSᵀ (80 query rows)" if tile_m % 64 else ""))
        if swap else
        (f"S = Q·Kᵀ ({tile_n} keys per step): P and dS feed dV and dK from shared memory"
         + ("; dKᵀ = Qᵀ·dS and dVᵀ = dOᵀ·P (head dims on WGMMA's M, 48 keys per warpgroup), stored transposed"
            if dkv_t else "")),
        "LSE2 / D per query row: " + ("bulk-copied with each Q stage into shared memory" if bwd_stats_in_smem(d, dv, swap)
                                      else "read from global memory per block (the registers of this tile are at "
                                           "the edge: see fa4gen.plan.model.bwd_stats_in_smem)"),
        "dQ: fp32 tiles in fragment order, "
        + ("added into global memory from the consumers' registers (red.global.add.v4.f32, no hand-off buffer"
           + ("; a turn warp waits for the query block's turn and passes it after the adds" if spec.deterministic else "") + "), "
           if atomic else "reduced into global memory by bulk reduce (cp.reduce.async.bulk), ")
        + "put in place by the postprocess",
    ]
    if not swap and max(d, dv) <= 64 and spec.softcap and spec.pipeline.bwd_swap_ab == "auto":
        notes.append("bwd_swap_ab auto -> S = Q·Kᵀ in 128-row steps: with softcap at head dims <= 64 this loop spills "
                     "registers in most variants (LDL/STL in the SASS) and still measured 8% faster than the spill-free "
                     "Sᵀ form in 64-row steps (bwd_swap_ab: true; session 55, docs/PERF.md)")
    if spec.allow_gqa:
        notes.append("GQA (allow_gqa): each query head's dK/dV are added in fp32 into its K/V head's workspace "
                     "(zeroed per call) and converted by the postprocess; the API runs this kernel for calls with "
                     "fewer K/V heads than query heads, and bwd_sm90_mha (dK/dV stored straight from the CTA) for "
                     "the others")
    if spec.varlen:
        notes.append("varlen: key tiles of all sequences numbered back to back; bounded TMA views for every packed "
                     "tensor, so no workspace is padded per sequence and keys past seqused_k get zero gradients")
    # the claim needs key blocks that reach a query tile one after another, as a causal, windowed or chunked
    # mask staggers them (key block n starts at the query tile of its diagonal); without a mask the kernel
    # staggers them the same way (key block n starts at its diagonal's query tile and wraps around; varlen:
    # n counted within its sequence, the wrap at that sequence's tile count). Unstaggered, every key
    # block of a head reached query tile 0 at once and waited for one store (d128 s2048: main kernel 1298 us
    # vs flash-attn-4's 1049, the backward 0.86x of flash-attn-4 where the zeroing preprocess gave 0.98x;
    # H200, session 21). dQ from registers (atomic) keeps the zeroing preprocess: its claim, a claim warp
    # holding the consumers at each block's dQ writes, slowed the d256 main kernel by more than the
    # preprocess saves (sessions 22 and 23, two forms, both rejected: docs/PERF.md)
    claim = not spec.deterministic and not atomic
    if claim:
        notes.append(
            "dQ claim: the first key block to reach a query tile claims it (an atomic add on a flag per tile) "
            "and stores its dQ chunks (bulk copies); the others add once those stores have landed, so the "
            "preprocess leaves the fp32 accumulator unzeroed and the postprocess gives tiles no key block "
            "reaches dQ = 0" + ("; without a mask each key block starts at its diagonal's query tile and wraps "
                                "around, so the key blocks of a head reach each tile one after another"
                                if spec.mask.kind == "none" else "")
        )
    if spec.deterministic:
        notes.append(
            "deterministic: each dQ tile (and, with GQA, each dK/dV tile) is added in a fixed order through a "
            "semaphore per tile, key blocks last to first"
            + (" (first to last in the grid's last group of (head, batch) pairs when it is large enough, "
               "fa4gen.device.schedule.det_tail_ascending: its CTAs then launch longest first)"
               if spec.mask.kind == "causal" and not spec.varlen else "")
            + ("" if atomic else " (the first of them stores its dQ chunks, so the preprocess leaves the fp32 "
               "accumulator unzeroed and the postprocess gives the tiles no key block reaches dQ = 0)")
            + "; cost: a CTA waits for the key blocks after it on every query block — " + _det_cost(spec)
            + ("" if not atomic else
               "; above d128 both add dQ from registers (pipeline.bwd_dq_atomic; a turn warp waits for the query "
               "block's turn and passes it after the adds)"
               if max(d, dv) > 128 else
               "; with dQ from registers forced at d128, 0.86-0.88x (H200, session 10; the hand-off's 0.90-0.95x "
               "in the same call is faster there)")
        )
    # persistent: one CTA per SM loops over the (key block, head, batch) tiles, so a tile's set-up (the CTA's launch,
    # barrier set-up, the first Q / dO loads) overlaps the previous tile's end (its dK / dV epilogue, its last dQ
    # adds landing) instead of leaving the SM's tensor cores idle between CTAs. From session 44's main-kernel times
    # (d64 without a mask, H200) that per-CTA cost is ~3.9 us beside ~2.2 us per query block: 30% of an s512 CTA.
    # First built for the Sᵀ MHA kernels without a mask (every tile the same work, so tiles go round-robin), neither
    # deterministic nor varlen, dQ through the hand-off with the claim (session 66: +0.9% at s512-2k, +3.7-4.0% at s8k;
    # docs/STATUS.md "Where to start" item 1)
    # Causal too (session 67's docs/patches, GPU-run in session 68), in the masked persistent forward's causal order
    # mirrored, where its staged epilogue has no barrier (head dims <= 64; see the plan's end)
    persistent = (swap and spec.mask.kind in ("none", "causal") and not spec.varlen and not spec.deterministic
                  and not spec.allow_gqa and claim and allow_persistent)
    if persistent:
        notes.append(f"persistent: {PERSISTENT_CTAS} CTAs at compile time (the GPU's SM count at run time) loop over "
                     + ("the (key block, head, batch) tiles round-robin, key blocks fastest"
                        if spec.mask.kind == "none" else
                        "the (key block, head, batch) tiles in the masked persistent forward's causal order over key "
                        "blocks mirrored (schedule.paired_tile: units of a pair's longest and shortest key block, which "
                        "cost alike, then a longest-first tail)")
                     + "; K / V reloaded per tile")
    fields = semantic_fields(spec, every, share, fit)
    fields.update(poly_every=0, poly_share=0.0, rescale_threshold=0.0)  # the backward uses the saved LSE
    plan = KernelPlan(
        **identity_fields(spec, "sm90", "sm_90a", "bwd"),
        tile_m=tile_m,
        tile_n=tile_n,
        kv_stages=1,
        num_mma_warpgroups=2,
        threads=384,
        regs_producer=REGS_PRODUCER,
        regs_consumer=REGS_CONSUMER[2],
        ping_pong=False,
        intra_wg_overlap=False,
        scheduler="persistent" if persistent else "grid",
        persistent_ctas=PERSISTENT_CTAS if persistent else 0,
        **fields,
        budgets=budgets,
        notes=tuple(notes),
        deterministic=spec.deterministic,
        q_stages=q_stages,
        do_stages=do_stages,
        pds_stages=pds_stages,
        dq_buffers=dq_buffers,
        dq_atomic=atomic,
        dq_claim=claim,
        dkv_accum=spec.allow_gqa,
        swap_sdp=swap,
        dkv_transposed=dkv_t,
        dkv_elementwise=dkv_ew,
        smem_bytes=smem,
    )
    if persistent and spec.mask.kind != "none" and not plan.dkv_staging.phases:
        # masked: a tile without query blocks loads no K / V, so its dK / dV (zeros) may not go out through K's and V's
        # buffers while the next tile's K / V land there; without room for them elsewhere, one CTA per tile
        plan = replace(plan, scheduler="grid", persistent_ctas=0, notes=plan.notes[:-1])
    elif persistent and spec.mask.kind != "none" and not plan.dkv_staging.stage0 and not masked_persistent:
        # causal, dK / dV staged from the first dS stage (d80-d128: dV in the dQ buffers behind the dQ warp's drained
        # barrier, and a barrier after the stores before the next tile writes dS): one CTA per tile. Session 68
        # (H100, A/B against the grid kernel): d128 causal s512 / 1k / 2k / 8k raw 0.924 / 0.975 / 0.970 / 0.975,
        # while d64 (stage 1, no barrier) gained 1.103 / 1.083 / 1.045 / 1.027. Traced at d128 s512, the persistent
        # tile spent 4.5 us in that epilogue (grid 2.1) and 11.4 us in its blocks (grid 10.2), against the 2.7 us of
        # prologue and K / V wait it saved (tools/bwd_timeline.py; docs/PERF.md session 68)
        plan = replace(plan, scheduler="grid", persistent_ctas=0, notes=plan.notes[:-1])
    elif persistent:
        plan = replace(plan, notes=plan.notes + (_staging_note(plan.dkv_staging),))
        plan = _second_kv_stage(plan)
    if plan.dq_claim and not spec.varlen and not spec.allow_gqa and allow_dq_overlap:
        plan = _dq_post_overlap(plan)
    return plan


def _dq_post_overlap(plan: KernelPlan) -> KernelPlan:
    """The dQ conversion overlapping the main kernel's end (plan dq_post_overlap): every MHA backward with the
    claim (non-deterministic, dQ through the hand-off), neither varlen nor GQA. The conversion's CTAs, launched as
    programmatic dependents once every main-kernel CTA has started, wait for their (batch, head)'s count of
    landed key blocks instead of for the grid's end, and take only SMs the main kernel has left (no room beside
    one of its CTAs). Each schedule completes its pairs about in the conversion's (head, batch) order:
    - persistent without a mask: tiles round-robin with key blocks fastest, so a pair's key blocks run as
      consecutive tiles and by the partial last round every pair but the last few is complete (16k tokens at
      hidden 2048: 4,096 tiles at d64, 2,048 at d128, on 132 SMs leave 4 / 68 SMs busy); the idle SMs wait
      ~10 us at d64 s512, ~36 us at s2k (3.0-4.0% of the main kernel's span, session 71's timelines) while the
      conversion (~49 us, DRAM-bound) waited for all of it (session 72, H100: +3.0% raw at s512-2k);
    - the causal grid (d > 64): pairs in head groups about a wave wide, longest key blocks first, so every group
      but the last is complete once the last CTAs are placed (which is when the dependents may launch), and the
      SMs its shortest CTAs free take the conversion of the earlier groups;
    - the causal persistent loop (d <= 64): pairs in the masked forward's paired order, which completes them out
      of order in its tail; a conversion CTA placed before its pair completes only spins on an idle SM;
    - the windowed / chunked grid: key blocks fastest, then heads, then batches, the conversion's order."""
    note = ("dQ conversion overlapped: launched as a programmatic dependent of the main kernel, each CTA waiting for "
            "its (batch, head)'s key blocks to count their dQ adds as landed, so it runs on the SMs the main "
            "kernel's last CTAs leave idle")
    return replace(plan, dq_post_overlap=True, notes=plan.notes + (note,))


def _second_kv_stage(plan: KernelPlan) -> KernelPlan:
    """The persistent backward with dK / dV staged outside K's and V's buffers gets a second K / V stage where it fits
    the shared memory: the producer then loads the next tile's K / V as soon as its first Q / dO are issued (during
    the current tile's last blocks) instead of after the consumers hand the one stage back at the tile's end. Session
    68's timeline: with one stage the next tile's K / V take ~2-2.5 us to land from that hand-back, and a shorter
    epilogue (docs/patches 0001, the store warp) only moved that much time into the K / V wait. d64 / d96 fit (d128
    does not: 230,736 + 65,536 bytes). Session 69 (H100, A/B against one stage, docs/PERF.md): d64 backward raw 1.100 /
    1.028 / 1.010 without a mask and 1.056 / 1.024 / 1.008 causal at s512 / 1k / 2k, s8k 1.004 / 0.980; d96 without a
    mask 1.007 / 1.019 / 1.016 (one round)."""
    kv_bytes = plan.tile_n * (plan.head_dim + plan.head_dim_v) * 2
    smem = plan.smem_bytes + kv_bytes + 2 * 8  # one more stage and its two mbarriers
    if not plan.dkv_staging.phases or smem > SMEM_BUDGET:
        return plan
    budgets = tuple(replace(b, used=smem) if b.name == "shared memory per CTA" else b for b in plan.budgets)
    note = ("K / V in two stages: the next tile's load overlaps the current tile's last blocks (one stage: it waited "
            "for the tile's end)")
    return replace(plan, kv_stages=2, smem_bytes=smem, budgets=budgets, notes=plan.notes + (note,))


def _staging_note(staging) -> str:
    """The plan note of a persistent backward's dK / dV staging (fa4gen.plan.model.dkv_staging)."""
    if not staging.phases:
        return "dK / dV staged in K's and V's buffers: the next tile's K / V load once their stores have read them"
    where = ("dK in the dS buffers, dV in the dQ buffers (once the dQ warp has read the tile's last dQ tiles out)"
             if staging.dv_in_dq else
             ("dK and dV together in dS stage 1 (the next tile's first query block writes stage 0 only)"
              if staging.stage0 else "dK and dV together in the dS buffers")
             if staging.phases == 1 else "dK, then dV, in the dS buffers")
    return (f"dK / dV staged for their TMA stores: {where}; K / V go back to the producer right after a tile's last "
            "GEMMs, so the next tile's K / V load under the epilogue (session 67, no mask: backward +1.6-4.2% at s512-2k)")

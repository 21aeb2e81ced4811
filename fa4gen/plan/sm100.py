"""Plan stage: rules that resolve a spec into an SM100 (Blackwell) forward KernelPlan.

The design is FlashAttention-4's: S and O accumulate in tensor memory (TMEM); one MMA warp issues
every tcgen05 MMA, one load warp every TMA copy; one or two 128-row Q tiles per CTA, each with its
own softmax warpgroup, so that one tile's S = Q·Kᵀ runs on the tensor core while the other tile's
softmax runs (ping-pong); a correction warpgroup rescales O in TMEM when the row max moved and writes
the epilogue. 16 warps:

    warps 0-3   softmax, Q tile 0        warps 8-11  correction
    warps 4-7   softmax, Q tile 1        warp 12     MMA (also allocates TMEM)
                (idle with one Q tile)   warp 13     load (TMA)      warps 14-15 idle

Budgets checked here: TMEM columns (512 per SM: S_i + O_i per Q tile; P_i and the row statistics
live inside S_i), shared memory per CTA (227 KB: Q tiles, an O staging tile per Q tile, K/V stages),
the register file under setmaxnreg and the softmax registers per thread. The inter-role pipelines
are data (fa4gen.plan.protocol) that the template turns into barrier code and the tests model-check.
"""

from __future__ import annotations

from fa4gen.plan import protocol
from fa4gen.plan.model import Budget, KernelPlan, PlanError, problem
from fa4gen.plan.common import check_threshold, identity_fields, poly_choice, semantic_fields
from fa4gen.spec import AttentionSpec

SMEM_BUDGET = 227 * 1024
TMEM_COLUMNS = 512
REG_FILE = 64 * 1024
THREADS = 512
MMA_M = 128  # rows of a 1-CTA tcgen05 MMA = TMEM lanes = rows of one Q tile
ELEM = 2
AUTO_TILE_N = (128, 64)
MAX_AUTO_STAGES = 4
# setmaxnreg per thread (multiples of 8; the four warpgroups sum to 512 = 64K registers / 128 threads):
# (softmax, correction, other) by (Q tiles, key tile width, CTAs per MMA). Softmax warps raise their count,
# the others lower it below the launch count (128). Chosen so that ptxas spills nothing in any variant of
# the spill census (`tools/spill_sweep.py --arch sm100`: head dims 64-256 and (192, 128), four masks, softcap,
# varlen, LSE, poly-exp shares, 2-CTA; docs/SM100.md) nor of the compile tests (tests/test_sm100_compile.py);
# the allocation is not monotonic in these numbers (a split 8 registers away from a clean one spilled in
# session 52's census), so a new split must be re-checked there. Two Q tiles here; one Q tile: REGS_ONE_Q_TILE
# (warpgroup 1 idles with the "other" count).
REGS = {
    (2, "wide", 1): dict(softmax=200, correction=72, other=40),  # tile_n > 96: 128 S values per thread
    (2, "wide", 2): dict(softmax=200, correction=72, other=40),
    # tile_n <= 96: head_dim 192 MMAs need more in the MMA warp; the correction warps' LSE epilogue of (192, 128)
    # spilled 6-12 at 80 (session 52, was 168 / 80 / 96)
    (2, "narrow", 1): dict(softmax=168, correction=96, other=80),
    (2, "narrow", 2): dict(softmax=160, correction=96, other=96),  # d192 2-CTA (168 / 80 / 96 spilled 2 with softcap)
}
# one Q tile (ping_pong: false where two tiles would fit), O at most 128 columns, any key tile width, one CTA or a pair:
# the softmax warps of d128 / (192, 128) chunked with every 3rd exp2 emulated spilled 8 at 200 (and d64 / d128 window +
# varlen with every 7th spilled 7 at 208); 216 / 112 / 88 is clean in the one-Q-tile census (session 53, was 200 / 128 / 88)
REGS_ONE_Q_TILE = dict(softmax=216, correction=112, other=88)
# 2-CTA with 128-key tiles above head dim 128 ((192, 128)): the MMA warp, issuing the pair's cta_group::2 MMAs of
# 192-deep K, spilled 18-37 registers at 40 (session 52); 192 / 72 / 56 is clean there, but spilled 11 in the
# d128 softmax warps (softcap, every 7th exp2 emulated), so it is kept to these head dims
REGS_TWO_CTA_WIDE_ABOVE_128 = dict(softmax=192, correction=72, other=56)
# one Q tile with O wider than 128 columns (d192 / d256: two tiles do not fit the TMEM): 216 / 112 / 88 spilled 69-71 in
# the fp16 d192 window + GQA + varlen softmax warps (session 53's GQA / fp16 census); 200 / 128 / 88 spilled 2 in fp16
# d192 chunked + varlen with a quarter of the exp2 emulated; 208 / 120 / 88 is clean in all 1,088 d192 / d256 kernels of
# session 54's census (bf16 / fp16, four masks, softcap, GQA, varlen, LSE, shares 0-0.34, 2-CTA)
REGS_ONE_Q_TILE_WIDE_O = dict(softmax=208, correction=120, other=88)
LAUNCH_REGS = REG_FILE // THREADS
# Registers a softmax thread needs besides its S row fragment (row stats, coordinates, addresses), and
# per polynomial degree for the exp2 emulation's temporaries (more when half or more of a row is
# emulated and ptxas interleaves the polynomials); measured with ptxas on the d128 kernels.
SOFTMAX_REGS_OVERHEAD = 48
POLY_REGS_PER_DEGREE = {"some": 2, "half": 5}


def _softmax_regs(tile_n: int, spec: AttentionSpec) -> int:
    poly = spec.pipeline.poly_exp
    per_degree = 0 if poly.share == 0 else POLY_REGS_PER_DEGREE["half" if poly.share >= 0.5 else "some"]
    return tile_n + SOFTMAX_REGS_OVERHEAD + per_degree * poly.degree


def _regs(q_tiles: int, tile_n: int, pair: int, head_dim: int, head_dim_v: int) -> dict:
    """The setmaxnreg split of a plan (REGS for two Q tiles, REGS_ONE_Q_TILE for one); `pair` 2 with two_cta;
    `head_dim` the larger of the two head dims, `head_dim_v` O's width (one Q tile with O wider than 128 columns:
    REGS_ONE_Q_TILE_WIDE_O)."""
    if q_tiles == 1:
        return REGS_ONE_Q_TILE_WIDE_O if head_dim_v > 128 else REGS_ONE_Q_TILE
    width = "wide" if tile_n > 96 else "narrow"
    if (q_tiles, width, pair) == (2, "wide", 2) and head_dim > 128:
        return REGS_TWO_CTA_WIDE_ABOVE_128
    return REGS[(q_tiles, width, pair)]


O_CHUNK = 16  # O columns per TMEM load in the correction warps (registers: the correction has few)
STATS_COLS = 16  # row scale, row max, row sum (4 rows each) per thread, padded to a power of two
PERSISTENT_CTAS = 148  # SMs of a B200; the persistent grid strides over tiles, so any count is correct
TWO_CTA_HEAD_DIMS = (128, 192)
WARP_ROLES = (
    ("softmax0", (0, 1, 2, 3)),
    ("softmax1", (4, 5, 6, 7)),
    ("correction", (8, 9, 10, 11)),
    ("mma", (12,)),
    ("load", (13,)),
    ("idle", (14, 15)),
)


def _tmem_used(q_tiles: int, tile_n: int, dv: int) -> int:
    return q_tiles * (tile_n + dv)


def _smem(q_tiles: int, tile_n: int, stages: int, d: int, dv: int, pair: int = 1) -> tuple[int, int]:
    """(total bytes, barrier bytes) of the SharedStorage struct the template declares: mbarriers and the
    TMEM address first (padded to 1024 bytes), then O staging, Q tiles and the K/V ring, 1024-aligned.

    `pair` 2 (two_cta): each CTA of the pair holds half of every K block (tile_n / 2 keys) and half of
    every V block (head_dim_v / 2 columns), as the B operand of a cta_group::2 MMA is split; one more
    mbarrier (the pair's TMEM deallocation handshake)."""
    barrier_words = 2 * (q_tiles + stages + q_tiles + q_tiles + q_tiles)  # q, kv, sp, stats, o
    barriers = 8 * barrier_words + 4 + (8 if pair == 2 else 0)
    head = -(-barriers // 1024) * 1024
    stage = tile_n * max(d, dv) * ELEM // pair
    return head + q_tiles * MMA_M * (dv + d) * ELEM + stages * stage, barriers


def _fit_stages(q_tiles: int, tile_n: int, d: int, dv: int, pair: int = 1) -> int:
    stages = 0
    while stages < MAX_AUTO_STAGES and _smem(q_tiles, tile_n, stages + 1, d, dv, pair)[0] <= SMEM_BUDGET:
        stages += 1
    return stages


def _choose_tiles(spec: AttentionSpec, problems: list, pair: int = 1) -> tuple[int, int, int]:
    """(q_tiles, tile_n, kv_stages): two Q tiles (ping-pong) first, then the widest key tile that fits."""
    p = spec.pipeline
    d, dv = spec.head_dim, spec.head_dim_v
    if p.tile_m != "auto" and p.tile_m not in (128, 256):
        problems.append(problem("pipeline.tile_m", f"the sm100 family runs one or two Q tiles of {MMA_M} rows per "
                                f"CTA, so tile_m must be 128, 256 or 'auto' (got {p.tile_m})"))
    if p.ping_pong is True and p.tile_m == 128 or p.ping_pong is False and p.tile_m == 256:
        problems.append(problem("pipeline.tile_m", f"tile_m {p.tile_m} contradicts ping_pong: {str(p.ping_pong).lower()} "
                                "(tile_m 256 is two ping-ponging Q tiles, tile_m 128 is one)"))
    if p.ping_pong is True or p.tile_m == 256:
        q_choices = [2]
    elif p.ping_pong is False or p.tile_m == 128:
        q_choices = [1]
    else:
        q_choices = [2, 1]
    n_choices = AUTO_TILE_N if p.tile_n == "auto" else (p.tile_n,)
    tried = []
    for q_tiles in q_choices:
        for tile_n in n_choices:
            tmem = _tmem_used(q_tiles, tile_n, dv)
            stages = _fit_stages(q_tiles, tile_n, d, dv, pair) if p.kv_stages == "auto" else p.kv_stages
            smem, _ = _smem(q_tiles, tile_n, max(stages, 1), d, dv, pair)
            tried.append((q_tiles, tile_n, stages, tmem, smem))
            budget = _regs(q_tiles, tile_n, pair, max(d, dv), dv)["softmax"]
            fits_regs = _softmax_regs(tile_n, spec) <= budget or p.tile_n != "auto"
            if tmem <= TMEM_COLUMNS and smem <= SMEM_BUDGET and stages >= 2 and fits_regs:
                return q_tiles, tile_n, stages
    q_tiles, tile_n, stages, tmem, smem = tried[-1]  # the most modest candidate tells what is over
    if tmem > TMEM_COLUMNS:
        problems.append(problem(
            "pipeline.ping_pong" if q_tiles == 2 and p.ping_pong is True else "pipeline.tile_n",
            f"TMEM budget exceeded: {q_tiles} Q tile(s) x (S {tile_n} + O {dv} columns) = {tmem} columns > "
            f"{TMEM_COLUMNS} (TMEM columns per SM on sm100); use one Q tile (ping_pong: false) or a smaller "
            "pipeline.tile_n",
        ))
    elif smem > SMEM_BUDGET:
        problems.append(problem(
            "pipeline.kv_stages" if p.kv_stages != "auto" else "pipeline.tile_n",
            f"shared memory budget exceeded: {q_tiles} x Q {MMA_M}x{d} + {q_tiles} x O {MMA_M}x{dv} + "
            f"{max(stages, 1)} K/V stages of {tile_n}x{max(d, dv)} need {smem} bytes > {SMEM_BUDGET} (227 KB per "
            "CTA on sm100); lower pipeline.tile_n or pipeline.kv_stages",
        ))
    else:
        problems.append(problem(
            "pipeline.kv_stages",
            f"the sm100 K/V ring needs at least 2 stages (got {stages}): K of block j+1 is loaded while V of "
            "block j is still held, so with one stage the load and MMA warps wait on each other forever",
        ))
    return q_tiles, tile_n, max(stages, 2)


def _two_cta(spec: AttentionSpec, problems: list) -> bool:
    if not spec.pipeline.two_cta:
        return False
    why = []
    if spec.mask.kind != "none":
        why.append(f"a mask ({spec.mask.kind}) gives the two CTAs of a pair different key ranges")
    if spec.head_dim not in TWO_CTA_HEAD_DIMS:
        why.append(f"head_dim {spec.head_dim} is not one of {TWO_CTA_HEAD_DIMS}")
    if why:
        problems.append(problem("pipeline.two_cta", "2-CTA MMA is only planned for non-causal attention with "
                                f"head_dim 128 or 192: {'; '.join(why)}"))
        return False
    return True


def plan_forward(spec: AttentionSpec) -> KernelPlan:
    problems: list = []
    p = spec.pipeline
    d, dv = spec.head_dim, spec.head_dim_v
    if d % 16 or dv % 32:
        problems.append(problem(
            "head_dim", f"tcgen05 MMAs consume K in steps of 16 and the correction warps move O in {O_CHUNK}-column "
            f"chunks, so sm100 needs head_dim % 16 == 0 and head_dim_v % 32 == 0 (got {d}/{dv})",
        ))
    if p.tile_n != "auto" and (p.tile_n % 32 or p.tile_n > 256):
        problems.append(problem("pipeline.tile_n", "sm100 key tiles are loaded from TMEM 32 columns at a time, so "
                                f"tile_n must be a multiple of 32 up to 256 (got {p.tile_n})"))
    if spec.varlen and spec.pipeline.two_cta:
        problems.append(problem("varlen", "varlen with pipeline.two_cta is not available in the sm100 family yet "
                                "(a CTA pair would straddle sequences); use two_cta: false"))
    if spec.backward:
        problems.append(problem("backward", "the sm100 backward kernels are not available yet"))
    two_cta = _two_cta(spec, problems)
    pair = 2 if two_cta else 1
    q_tiles, tile_n, stages = _choose_tiles(spec, problems, pair)
    every, share, fit = poly_choice(spec, tile_n, problems)
    check_threshold(spec, problems)

    regs = _regs(q_tiles, tile_n, pair, max(d, dv), dv)
    softmax_regs = _softmax_regs(tile_n, spec)
    reg_file = 128 * (regs["softmax"] * q_tiles + regs["correction"] + regs["other"] * (3 - q_tiles))
    tmem_used = _tmem_used(q_tiles, tile_n, dv)
    tmem_cols = max(32, 1 << (tmem_used - 1).bit_length())
    smem, _ = _smem(q_tiles, tile_n, stages, d, dv, pair)
    budgets = (
        Budget("shared memory per CTA", smem, SMEM_BUDGET, "bytes"),
        Budget("TMEM columns (S + O per Q tile)", tmem_used, TMEM_COLUMNS, "columns"),
        Budget("softmax registers per thread (estimate)", softmax_regs, regs["softmax"], "regs"),
        Budget("register file per SM", reg_file, REG_FILE, "regs"),
    )
    if softmax_regs > regs["softmax"]:
        problems.append(problem(
            "pipeline.tile_n", f"softmax register budget exceeded: a thread holds {tile_n} S values of its rows + "
            f"{softmax_regs - tile_n} (row state, addresses, poly-exp temporaries) = {softmax_regs} registers > "
            f"{regs['softmax']}; lower pipeline.tile_n (or the poly_exp share or degree)",
        ))
    if problems:
        raise PlanError(f"{spec.name} [sm100]", problems)

    notes = [f"TMEM: S_i at {[i * tile_n for i in range(q_tiles)]}, O_i after them; {tmem_used} of "
             f"{tmem_cols} allocated columns used"]
    if p.ping_pong == "auto":
        notes.append(f"ping_pong auto -> {'on' if q_tiles == 2 else 'off'} ({q_tiles} Q tile(s) fit the TMEM and "
                     "shared memory budgets)")
    if every:
        notes.append(f"poly_exp share {p.poly_exp.share} -> one in every {every} exp2 of a thread's row "
                     f"(effective share {share:.3f}); max relative error {fit.max_rel_error:.2e}")
    kind = spec.mask.kind
    scheduler = "persistent" if kind == "none" else "lpt"
    notes.append("scheduler: persistent grid of one CTA per SM striding over tiles" if scheduler == "persistent"
                 else "scheduler: one CTA per tile, longest (most key blocks) first")
    if two_cta:
        notes.append(f"two_cta: a cluster of 2 CTAs along M shares {2 * MMA_M}-row cta_group::2 MMAs; each CTA keeps "
                     f"its {MMA_M} rows of Q, S, P and O, and {tile_n // 2} keys of each K block and "
                     f"{dv // 2} columns of each V block ({stages} K/V stages of {tile_n * max(d, dv) * ELEM // 2} "
                     "bytes per CTA); the even CTA issues the MMAs")
    # per-CTA TMA bytes (what the shared-memory layouts hold); with two_cta the even CTA's full barrier
    # expects the pair's bytes (pipelines: tx_bytes = 2 x these)
    q_bytes, k_bytes, v_bytes = MMA_M * d * ELEM, tile_n * d * ELEM // pair, tile_n * dv * ELEM // pair
    warp_roles = WARP_ROLES if q_tiles == 2 else tuple(
        (r, w) if r != "softmax1" else ("idle", w) for r, w in WARP_ROLES
    )
    return KernelPlan(
        **identity_fields(spec, "sm100", "sm_100a", "fwd"),
        tile_m=MMA_M * q_tiles * pair,
        tile_n=tile_n,
        kv_stages=stages,
        num_mma_warpgroups=q_tiles,
        threads=THREADS,
        regs_producer=regs["other"],
        regs_consumer=regs["softmax"],
        ping_pong=q_tiles == 2,
        intra_wg_overlap=False,
        scheduler=scheduler,
        **semantic_fields(spec, every, share, fit),
        budgets=budgets,
        notes=tuple(notes),
        q_tiles=q_tiles,
        two_cta=two_cta,
        cluster_m=2 if two_cta else 1,
        mma_m=MMA_M * (2 if two_cta else 1),
        warp_roles=warp_roles,
        regs_softmax=regs["softmax"],
        regs_correction=regs["correction"],
        regs_other=regs["other"],
        tmem_cols=tmem_cols,
        tmem_s=tuple(i * tile_n for i in range(q_tiles)),
        tmem_p=tuple(i * tile_n + tile_n // 2 for i in range(q_tiles)),
        tmem_o=tuple(q_tiles * tile_n + i * dv for i in range(q_tiles)),
        tmem_stats=tuple(i * tile_n for i in range(q_tiles)),
        stats_cols=STATS_COLS,
        o_chunk=O_CHUNK,
        q_bytes=q_bytes,
        k_bytes=k_bytes,
        v_bytes=v_bytes,
        smem_bytes=smem,
        persistent_ctas=PERSISTENT_CTAS,
        pipelines=protocol.sm100_pipelines(q_tiles=q_tiles, kv_stages=stages, q_bytes=q_bytes, k_bytes=k_bytes,
                                           two_cta=two_cta),
        named_barriers=protocol.sm100_named_barriers(q_tiles=q_tiles),
    )

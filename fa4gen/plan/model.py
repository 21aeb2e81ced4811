"""Plan stage: the resolved, frozen description of one kernel (spec × arch × direction).

Every decision the generated code depends on is a field here; templates only read them.
`PlanError` carries problems in the same (location, message) shape as spec errors so the CLI
reports both the same way.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from fa4gen.spec import Problem, SpecError


class PlanError(SpecError):
    """The spec is valid on its own but cannot be planned for an arch (budget, support)."""


class NotAvailableError(PlanError):
    """The requested target exists in the spec language but its kernel family is not built yet."""


@dataclass(frozen=True)
class Budget:
    """One checked resource: what the plan uses against what the arch allows."""

    name: str
    used: int
    limit: int
    unit: str

    def line(self) -> str:
        return f"{self.name}: {self.used} / {self.limit} {self.unit}"


@dataclass(frozen=True)
class KernelPlan:
    # identity
    name: str
    arch: str
    cute_arch: str
    direction: str
    module: str
    class_name: str
    # types and shapes
    dtype: str
    cutlass_dtype: str
    torch_dtype: str
    head_dim: int
    head_dim_v: int
    # tiling and warp roles
    tile_m: int
    tile_n: int
    kv_stages: int
    num_mma_warpgroups: int
    threads: int
    regs_producer: int
    regs_consumer: int
    ping_pong: bool
    intra_wg_overlap: bool
    scheduler: str
    # masking
    mask_kind: str
    causal: bool
    local: bool
    chunked: bool
    window_left: int
    window_right: int
    chunk_size: int
    # softmax
    softcap: float
    rescale_threshold: float
    poly_every: int
    poly_share: float
    poly_degree: int
    poly_coeffs: tuple[float, ...]
    poly_max_rel_error: float
    # interface
    write_lse: bool
    allow_gqa: bool
    varlen: bool = False  # packed sequences: cu_seqlens_q/k (+ seqused_k), bounded TMA views per sequence
    # dispatch: the API runs this kernel for calls whose seqlen_q (the longest sequence, packed) is at
    # least this; 0 = the default kernel of its (arch, direction)
    min_seqlen_q: int = 0
    # dispatch: the API runs this kernel for calls whose seqlen_q lies in one of these inclusive (first, last)
    # ranges, all below the arch's min_seqlen_q kernels; () = not picked by range
    seqlen_q_ranges: tuple[tuple[int, int], ...] = ()
    # dispatch (with min_seqlen_q): ... and only for calls whose sliding window spans at least this many keys per
    # row (left + right + 1; an unbounded side counts as wide enough), or whose chunks (a chunked mask) are at least
    # this long; 0 = any call
    min_window_keys: int = 0
    # dispatch (backward): the API runs this kernel only for calls with as many K/V heads as query heads; the
    # spec allows GQA, and its other backward (dK/dV summed in fp32 over each group) takes the GQA/MQA calls
    mha_only: bool = False
    # dispatch (backward, gqa_head_loop): the API runs this kernel for GQA / MQA calls with at least this many CTAs
    # (key blocks x kv heads x batch); calls with fewer take the spec's fp32-workspace backward (a CTA per q head)
    min_kv_ctas: int = 0
    # checked budgets
    budgets: tuple[Budget, ...] = field(default_factory=tuple)
    notes: tuple[str, ...] = field(default_factory=tuple)
    # sm100 family (fa4gen.plan.sm100); the defaults leave other families' plans as they were
    q_tiles: int = 1  # 128-row Q tiles per CTA; 2 = two tiles alternating on the tensor core (ping-pong)
    two_cta: bool = False  # a CTA pair shares 256-row tcgen05 MMAs (cta_group::2)
    cluster_m: int = 1
    mma_m: int = 0  # rows of one tcgen05 MMA (128, or 256 across a CTA pair)
    warp_roles: tuple = ()  # ((role, (warp ids...)), ...)
    regs_softmax: int = 0  # setmaxnreg per thread, by warpgroup role
    regs_correction: int = 0
    regs_other: int = 0
    tmem_cols: int = 0  # TMEM columns allocated (a power of two, <= 512)
    tmem_s: tuple = ()  # first TMEM column of S_i, per Q tile
    tmem_p: tuple = ()  # first 32-bit column of P_i (two 16-bit values per column), inside S_i
    tmem_o: tuple = ()  # first TMEM column of O_i
    tmem_stats: tuple = ()  # first column of the softmax -> correction row statistics, inside S_i
    stats_cols: int = 0
    o_chunk: int = 0  # O columns the correction warps move per TMEM load
    q_bytes: int = 0  # TMA bytes of one Q tile / K block / V block
    k_bytes: int = 0
    v_bytes: int = 0
    smem_bytes: int = 0  # dynamic shared memory per CTA (checked against the compiled struct)
    # sm90 forward, three consumer warpgroups: when only warpgroup 0 has rows inside the sequence (a sequence's last
    # query tile), warpgroups 1 and 2 skip their GEMMs and softmax and only keep the pipeline and ping-pong
    # handshakes (the protocol model allows any number of busy warpgroups; the template idles two or none)
    skip_idle_warpgroups: bool = False
    persistent_ctas: int = 0  # CTAs of the persistent grid (the target's SM count; sm90: the compile-time stand-in, run time passes the GPU's)
    pipelines: tuple = ()  # fa4gen.plan.protocol.PipelineSpec
    named_barriers: tuple = ()  # fa4gen.plan.protocol.NamedBarrierSpec
    # backward family (fa4gen.plan.sm90.plan_backward)
    deterministic: bool = False  # dQ (and GQA dK/dV) summed in a fixed order through semaphores
    q_stages: int = 1  # smem stages of Q (and its LSE) / of dO (and its D) / of P and dS
    do_stages: int = 1
    pds_stages: int = 1
    dkv_accum: bool = False  # dK/dV summed in fp32 over the q heads of a group (GQA), else stored directly
    # GQA: one CTA per (key block, kv head, batch) runs the query blocks of its group's q heads in turn, so dK/dV
    # stay in registers and are stored once (the MHA kernel's loops, once per q head; no fp32 workspace)
    gqa_head_loop: bool = False
    dq_buffers: int = 1  # fp32 dQ tiles in smem: one per consumer warpgroup, or one shared in turns
    dq_atomic: bool = False  # dQ tiles added by red.global.add.v4.f32 from registers (no smem hand-off)
    # non-deterministic hand-off: the first key block to reach a query tile stores its dQ chunks (a claim flag
    # per tile), the others add once they have landed, so nothing zeroes the fp32 accumulator
    dq_claim: bool = False
    # the dQ conversion (sm90.ConvertChunks) launched with programmatic dependent launch: its CTAs run on the SMs that
    # the persistent loop's last, partial round leaves idle, each once its (batch, head)'s key blocks have counted
    # their dQ adds as landed (a count after the claim flags), instead of after the whole main kernel
    dq_post_overlap: bool = False
    dkv_transposed: bool = False  # dKᵀ = Qᵀ·dS and dVᵀ = dOᵀ·P (head dims on WGMMA's M; tile_n 96 at (192, 128))
    dkv_elementwise: bool = False  # MHA dK/dV to smem value by value (head-dim halves no multiple of stmatrix's 16)
    swap_sdp: bool = False  # compute Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ so Pᵀ and dSᵀ feed dV and dK from registers

    @property
    def has_mask(self) -> bool:
        return self.causal or self.local or self.chunked

    @property
    def has_softcap(self) -> bool:
        return self.softcap > 0.0

    @property
    def bwd_stats_in_smem(self) -> bool:
        """Backward: each query block's LSE2 / D bulk-copied with its Q stage into shared memory (else read from
        global memory per block); see `bwd_stats_in_smem`."""
        return bwd_stats_in_smem(self.head_dim, self.head_dim_v, self.swap_sdp)

    @property
    def dkv_staging(self) -> "DkvStaging":
        """Persistent SM90 backward: where a tile's dK / dV wait for their TMA stores; see `dkv_staging`."""
        return dkv_staging(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def describe(self) -> str:
        """A human-readable listing for `fa4gen plan`."""
        lines = [f"plan {self.name} [{self.arch} {self.direction}] -> module {self.module}"]
        width = max(len(f.name) for f in dataclasses.fields(self))
        for f in dataclasses.fields(self):
            if f.name in ("budgets", "notes", "name", "arch", "direction", "module"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, tuple) and value and isinstance(value[0], float):
                value = "(" + ", ".join(f"{v:.9g}" for v in value) + ")"
            lines.append(f"  {f.name:<{width}}  {value}")
        lines.append("  budgets:")
        lines += [f"    {b.line()}" for b in self.budgets]
        if self.notes:
            lines.append("  notes:")
            lines += [f"    {n}" for n in self.notes]
        return "\n".join(lines)


def bwd_stats_in_smem(head_dim: int, head_dim_v: int, swap_sdp: bool) -> bool:
    """Whether the sm90 backward reads its per-query LSE2 / D from shared memory, bulk-copied with each Q stage:
    with Sᵀ (since session 7) and, since session 42, with S above head dim 64 (d256 / (192, 128): backward +2-6% on
    the H200 against four global loads per block). Not for the d <= 64 softcap backward (S at 128 rows), whose
    registers are at the edge: there ptxas spilled in 12 of 16 variants with the statistics in shared memory
    (among them the plain MHA ones, clean before) against 8 with the global loads (CPU sweep, session 42)."""
    return swap_sdp or max(head_dim, head_dim_v) > 64


@dataclass(frozen=True)
class DkvStaging:
    """Where the SM90 backward's dK / dV wait in shared memory for their TMA stores.

    phases 0: in K's and V's buffers (the one-CTA-per-tile kernels, and a persistent kernel whose dS buffers are too
    small), which a persistent CTA hands back to the producer only after the stores have read them. phases 1 / 2: in
    the dS buffers, dK and dV together (1) or dK, then dV once dK's store has read the buffer (2), starting at dS
    stage `stage0`; K's and V's buffers go back to the producer right after the tile's last GEMMs, so the next tile's
    K / V load while the epilogue runs. stage0 1 (one phase in the stages after the first): the next tile's first
    query block writes dS stage 0 only, and its P / dS barrier, which the storing warp reaches after waiting for its
    stores' reads, comes before any later write to those stages, so the epilogue ends without a barrier."""

    phases: int = 0
    stage0: int = 0
    stage_bytes: int = 0  # one dS stage
    dk_bytes: int = 0
    dv_bytes: int = 0
    # one phase with dK in the dS buffers and dV in the dQ buffers (where dK and dV do not fit the dS buffers
    # together): the consumers wait for the dQ warp to have read its last dQ tiles out (a named barrier per tile)
    dv_in_dq: bool = False
    dq_buffer_bytes: int = 0  # one dQ buffer (fp32, 64 rows)

    def stages_of(self, first: int, nbytes: int) -> range:
        """The dS stages that `nbytes` written from byte `first` of stage `stage0` overlap."""
        start = self.stage0 * self.stage_bytes + first
        return range(start // self.stage_bytes, (start + nbytes - 1) // self.stage_bytes + 1)


def dkv_staging(plan) -> DkvStaging:
    """The persistent SM90 backward's dK / dV staging (`DkvStaging`). Session 67's traced timeline (docs/PERF.md):
    per tile the K / V wait (1.3-2.4 us) and the epilogue (1.4-2.5 us) ran one after the other, ~25% of a d64 / d128
    s512 tile, because the epilogue staged dK / dV in K's and V's buffers; stored from registers instead (session 66's
    docs/patches 0001) the epilogue took 3.7 / 9.0 us. The dS buffers are free at a tile's end (the Sᵀ kernels keep
    no P there): dK and dV go through them, dV through the dQ buffers (free once the dQ warp has read the tile's
    last dQ tiles out) where both do not fit, or one at a time where that does not fit either. The one-at-a-time
    form measured as no gain at d128 (session 67: the epilogue 2.5 -> 3.7 us, hiding the 2.4 us K / V wait)."""
    if plan.scheduler != "persistent" or plan.dkv_accum or not plan.swap_sdp or plan.dtype not in ("bf16", "fp16"):
        return DkvStaging()
    elem = 2
    stage = plan.tile_n * plan.tile_m * elem  # dSᵀ: keys x query rows
    dk, dv = plan.tile_n * plan.head_dim * elem, plan.tile_n * plan.head_dim_v * elem
    total = stage * plan.pds_stages
    if stage % 1024 or dk % 1024:  # the stores' 128-byte swizzle repeats every 1024 bytes
        return DkvStaging()
    if dk + dv <= total - stage:
        return DkvStaging(1, 1, stage, dk, dv)
    if dk + dv <= total:
        return DkvStaging(1, 0, stage, dk, dv)
    dq_buffer = 64 * bwd_dq_cols(plan.head_dim, plan.tile_m) * 4
    if plan.dq_buffers and dk <= total and dv <= plan.dq_buffers * dq_buffer and not plan.dq_atomic:
        return DkvStaging(1, 0, stage, dk, dv, dv_in_dq=True, dq_buffer_bytes=dq_buffer)
    if max(dk, dv) <= total:
        return DkvStaging(2, 0, stage, dk, dv)
    return DkvStaging()


def bwd_dq_cols(d: int, tile_m: int) -> int:
    """Columns of one warpgroup's (64-row) dQ chunk in the SM90 backward: all of dQ's when the warpgroups split it
    by rows (tile_m 128), tile_m when they compute dQᵀ (64 head-dim rows each; tile_m not a multiple of 64), else
    half of them (fa4gen.device.sm90.dq_split, which the kernels use, agrees: tests/test_dq_chunks.py)."""
    return d if tile_m == 128 else tile_m if tile_m % 64 else d // 2


def problem(location: str, message: str) -> Problem:
    return Problem(location=location, message=message)

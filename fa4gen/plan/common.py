"""Plan stage: the decisions every kernel family makes the same way from a spec — what the mask,
softcap, softmax rescale and poly-exp settings resolve to, and the limits on them that come from
the shared device helpers (fa4gen.device.softmax / polyexp), not from an arch.

Both families hold a row's scores spread over 4 lanes, tile_n / 4 elements per thread, so the
poly-exp element pattern and its effective share are the same function of tile_n.
"""

from __future__ import annotations

from fa4gen.plan.model import problem
from fa4gen.plan.polyfit import PolyFit, fit_exp2
from fa4gen.spec import AttentionSpec

# A row keeps a stale max until it grows by more than the threshold, so P (rounded to the input
# dtype before P·V) can reach 2**threshold: fp16 overflows past 2**15, and exp2 in fp32 past 2**127.
THRESHOLD_LIMIT = {"fp16": 14.0, "bf16": 64.0}
# pipeline.rescale_threshold "auto": FA4's threshold (8, exp2 domain), which skips most O rescales once a row's
# max has settled. The sm90 planner sets 0 on the one kernel where always rescaling measured faster
# (plan.sm90.plan_forward_long).
RESCALE_THRESHOLD_AUTO = 8.0
# The largest relative error of the exp2 polynomial that stays invisible in bf16/fp16 results.
POLY_MAX_REL_ERROR = 2.0**-12


def poly_columns(every: int, cols: int) -> int:
    """How many of a thread's `cols` row elements take the polynomial with one-in-`every`."""
    return 0 if every == 0 else sum(1 for c in range(cols) if c % every == every - 1)


def poly_choice(spec: AttentionSpec, tile_n: int, problems: list) -> tuple[int, float, PolyFit]:
    """(every, effective share, fit): every k-th element of a thread's row fragment (tile_n/4 of
    them) is evaluated by the polynomial; the share reported is what the kernel really does."""
    share = spec.pipeline.poly_exp.share
    fit = fit_exp2(spec.pipeline.poly_exp.degree)
    cols = tile_n // 4
    # (1 / share capped: a subnormal share's inverse is inf, which round() refuses; past cols it is refused below)
    every = 0 if share == 0.0 else max(1, round(min(1.0 / share, cols + 1)))
    if every and fit.max_rel_error > POLY_MAX_REL_ERROR:
        problems.append(problem(
            "pipeline.poly_exp.degree",
            f"degree {fit.degree} fits exp2 only to {fit.max_rel_error:.1e} relative error, which shows in bf16/fp16 "
            "results (the emulator puts degree 1 at 4-17x the error budget); use degree >= 3",
        ))
    if every > cols:
        problems.append(problem(
            "pipeline.poly_exp.share",
            f"a share of {share} is below one element per thread row ({cols} elements with tile_n {tile_n}); "
            f"use 0 or at least {1 / cols:.3g}",
        ))
        every = 0
    return every, poly_columns(every, cols) / cols, fit


def rescale_threshold(spec: AttentionSpec) -> float:
    """The spec's rescale threshold, "auto" read as RESCALE_THRESHOLD_AUTO."""
    value = spec.pipeline.rescale_threshold
    return RESCALE_THRESHOLD_AUTO if value == "auto" else float(value)


def check_threshold(spec: AttentionSpec, problems: list) -> None:
    limit = THRESHOLD_LIMIT[spec.dtype]
    if rescale_threshold(spec) > limit:
        problems.append(problem(
            "pipeline.rescale_threshold",
            f"with {spec.dtype}, P can reach 2**rescale_threshold, so it must be <= {limit} "
            f"(got {spec.pipeline.rescale_threshold})",
        ))


DTYPES = {"bf16": ("BFloat16", "bfloat16"), "fp16": ("Float16", "float16")}  # spec dtype -> (cutlass, torch)


def identity_fields(spec: AttentionSpec, arch: str, cute_arch: str, direction: str) -> dict:
    """The KernelPlan fields that name a kernel (spec × arch × direction) and its element types."""
    cutlass_dtype, torch_dtype = DTYPES[spec.dtype]
    return dict(
        name=spec.name,
        arch=arch,
        cute_arch=cute_arch,
        direction=direction,
        module=f"{direction}_{arch}",
        class_name=f"Flash{direction.capitalize()}{arch.capitalize()}",
        dtype=spec.dtype,
        cutlass_dtype=cutlass_dtype,
        torch_dtype=torch_dtype,
        head_dim=spec.head_dim,
        head_dim_v=spec.head_dim_v,
    )


def semantic_fields(spec: AttentionSpec, every: int, share: float, fit: PolyFit) -> dict:
    """The KernelPlan fields that restate the spec's semantics (mask, softcap, softmax, interface)."""
    mask, kind = spec.mask, spec.mask.kind
    return dict(
        mask_kind=kind,
        causal=kind == "causal",
        local=kind == "sliding_window",
        chunked=kind == "chunked",
        window_left=-1 if kind != "sliding_window" or mask.left is None else mask.left,
        window_right=-1 if kind != "sliding_window" or mask.right is None else mask.right,
        chunk_size=mask.chunk_size if kind == "chunked" else 0,
        softcap=float(spec.softcap),
        rescale_threshold=rescale_threshold(spec),
        poly_every=every,
        poly_share=share,
        poly_degree=fit.degree,
        poly_coeffs=fit.coeffs,
        poly_max_rel_error=fit.max_rel_error,
        write_lse=spec.return_lse or spec.backward,
        allow_gqa=spec.allow_gqa,
        varlen=spec.varlen,
    )

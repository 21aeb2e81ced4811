"""Spec stage: the pydantic models of an attention spec (what the user asks for).

An `AttentionSpec` says *what* kernel is wanted (targets, dtype, head dims, mask, features,
pipeline preferences); every "auto" in it is resolved later by fa4gen.plan. Models are frozen and
reject unknown fields. Rules that involve one field live next to the field; rules that tie fields
together live in model validators and raise `RuleError`, which carries the dotted field path so
that the loader can point at the field (see fa4gen.spec.load).
"""

from __future__ import annotations

import keyword
import re
import reprlib
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

__all__ = [
    "AttentionSpec",
    "CausalMask",
    "ChunkedMask",
    "Mask",
    "MASK_KINDS",
    "NoMask",
    "Pipeline",
    "PolyExp",
    "RULE_ERROR",
    "SUPPORTED_HEAD_DIM_PAIRS",
    "SlidingWindowMask",
    "Target",
    "rule_error",
]

Target = Literal["sm90", "sm100"]
Dtype = Literal["bf16", "fp16"]

# Strict scalars: YAML `true` must not become 1, and "1.5" must not become 1.5.
NonNegFloat = Annotated[float, Strict(), AllowInfNan(False), Field(ge=0.0)]
_NON_NEG_FLOAT = TypeAdapter(NonNegFloat)
UnitFloat = Annotated[float, Strict(), AllowInfNan(False), Field(ge=0.0, le=1.0)]

NAME_PATTERN = r"^[a-z_][a-z0-9_]{0,63}$"
HEAD_DIM_MIN, HEAD_DIM_MAX, HEAD_DIM_STEP = 8, 256, 8
# (head_dim, head_dim_v) pairs with head_dim != head_dim_v that the kernels support.
SUPPORTED_HEAD_DIM_PAIRS: tuple[tuple[int, int], ...] = ((192, 128),)

RULE_ERROR = "fa4gen_rule"


def rule_error(*problems: tuple[str, str]) -> PydanticCustomError:
    """A validation error for one or more (relative field path, message) problems.

    The field path is relative to the model the validator runs on ("" means the model itself);
    the loader turns each pair into its own Problem with the full dotted location.
    """
    summary = "; ".join(f"{field}: {msg}" if field else msg for field, msg in problems)
    return PydanticCustomError(RULE_ERROR, "{summary}", {"summary": summary, "problems": problems})


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring, _SHORT_REPR.maxother = 3, 200, 200
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxdict = _SHORT_REPR.maxset = 8
# softcap's range (AttentionSpec._softcap): fp32-normal softcap * log2(e) and scale / softcap
SOFTCAP_MIN, SOFTCAP_MAX = 1e-30, 1e30


def show_value(value: Any) -> str:
    """A given value for an error message, spelled as in spec files where that differs."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    # bounded: a YAML alias bomb is a small file whose full repr is gigabytes
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- masks -----------------------------------------------------------------------------------


class NoMask(_Model):
    """Every query attends to every key."""

    kind: Literal["none"] = "none"

    def describe(self) -> str:
        return "none"


class CausalMask(_Model):
    """Query i attends to keys j <= i (bottom-right aligned when seqlen_q != seqlen_k)."""

    kind: Literal["causal"] = "causal"

    def describe(self) -> str:
        return "causal"


class SlidingWindowMask(_Model):
    """Query i attends to keys in [i - left, i + right]; None means unbounded on that side."""

    kind: Literal["sliding_window"] = "sliding_window"
    left: Annotated[StrictInt, Field(ge=0)] | None = Field(
        default=None, description="Keys to the left of the diagonal; null = unbounded."
    )
    right: Annotated[StrictInt, Field(ge=0)] | None = Field(
        default=0, description="Keys to the right of the diagonal; null = unbounded."
    )

    @model_validator(mode="after")
    def _one_bound(self) -> SlidingWindowMask:
        if self.left is None and self.right is None:
            raise rule_error(
                ("", "left and right cannot both be null (unbounded); use kind: none for no mask")
            )
        return self

    def describe(self) -> str:
        def side(v: int | None) -> str:
            return "inf" if v is None else str(v)

        return f"sliding_window(left={side(self.left)}, right={side(self.right)})"


class ChunkedMask(_Model):
    """Queries attend causally within their own chunk of `chunk_size` keys (Llama 4 style)."""

    kind: Literal["chunked"] = "chunked"
    chunk_size: Annotated[StrictInt, Field(ge=1, le=2**31 - 1)]  # an Int32 in the kernels

    def describe(self) -> str:
        return f"chunked({self.chunk_size})"


Mask = Annotated[
    Union[NoMask, CausalMask, SlidingWindowMask, ChunkedMask], Field(discriminator="kind")
]
MASK_TYPES: dict[str, type[_Model]] = {
    "none": NoMask,
    "causal": CausalMask,
    "sliding_window": SlidingWindowMask,
    "chunked": ChunkedMask,
}
MASK_KINDS: tuple[str, ...] = tuple(MASK_TYPES)


# --- pipeline --------------------------------------------------------------------------------


class PolyExp(_Model):
    """Emulate a share of exp2 with a polynomial on the FMA units (FA4 trick)."""

    share: UnitFloat = Field(default=0.0, description="Fraction of exp2 done by polynomial.")
    degree: Annotated[StrictInt, Field(ge=1, le=5)] = Field(
        default=3, description="Polynomial degree (coefficients are fit by the planner)."
    )


def _int_range(step: int, lo: int, hi: int) -> dict[str, int]:
    """JSON Schema hints for editors; numeric keywords do not constrain the "auto" string."""
    return {"multipleOf": step, "minimum": lo, "maximum": hi}


_HEAD_DIM_RANGE = _int_range(HEAD_DIM_STEP, HEAD_DIM_MIN, HEAD_DIM_MAX)


def _auto_int(value: Any, handler: ValidatorFunctionWrapHandler, *, step: int, lo: int, hi: int):
    try:
        value = handler(value)
    except ValidationError:
        raise PydanticCustomError(
            "auto_or_int", "expected an integer or 'auto' (got {given})", {"given": show_value(value)}
        ) from None
    if value != "auto" and (value % step or not lo <= value <= hi):
        what = f"a multiple of {step} in [{lo}, {hi}]" if step > 1 else f"in [{lo}, {hi}]"
        raise PydanticCustomError(
            "auto_or_int", "must be 'auto' or {what} (got {given})", {"what": what, "given": value}
        )
    return value


class Pipeline(_Model):
    """Pipeline preferences; "auto" leaves the choice to the planner."""

    ping_pong: StrictBool | Literal["auto"] = Field(
        default="auto", description="Two softmax warpgroups alternate tiles."
    )
    intra_wg_overlap: StrictBool | Literal["auto"] = Field(
        default="auto",
        description="Issue S_j = Q·K_jᵀ before O += P_{j-1}·V_{j-1} and do softmax j while it runs.",
    )
    poly_exp: PolyExp = PolyExp()
    rescale_threshold: NonNegFloat | Literal["auto"] = Field(
        default="auto",
        description="Skip the O rescale unless the row max grew by more than this (log2 "
        "domain); 0 = always rescale. auto: 8, except where the planner measured 0 faster "
        "(the sm90 d64 forward's one-CTA kernel for long calls without a mask).",
    )
    two_cta: StrictBool = Field(default=False, description="2-CTA MMA (sm100 only).")
    tile_m: StrictInt | Literal["auto"] = Field(
        default="auto", description="Query tile rows.", json_schema_extra=_int_range(64, 64, 256)
    )
    tile_n: StrictInt | Literal["auto"] = Field(
        default="auto", description="Key tile rows.", json_schema_extra=_int_range(16, 16, 256)
    )
    kv_stages: StrictInt | Literal["auto"] = Field(
        default="auto", description="K/V shared-memory pipeline stages.",
        json_schema_extra=_int_range(1, 1, 8),
    )
    q_stages: StrictInt | Literal["auto"] = Field(
        default="auto",
        description="sm90 persistent forward: Q shared-memory buffers. 2 lets the producer load the next "
        "tile's Q (and the K block behind it) while this tile's last S GEMMs still read the current one; "
        "kernels that run one CTA per tile load Q once and keep 1. auto: 2 where it fits at head dims <= 128, "
        "else 1.",
        json_schema_extra=_int_range(1, 1, 2),
    )
    bwd_swap_ab: StrictBool | Literal["auto"] = Field(
        default="auto",
        description="Backward: compute Sᵀ = K·Qᵀ so Pᵀ and dSᵀ feed dV and dK from registers "
        "(FA3's layout; head_dim <= 128).",
    )
    bwd_dq_atomic: StrictBool | Literal["auto"] = Field(
        default="auto",
        description="Backward: add each dQ tile into global memory with vector reductions from "
        "registers (red.global.add.v4.f32) instead of a shared-memory hand-off and bulk reduce; "
        "frees that buffer for pipeline stages. auto: above head_dim 128; with deterministic: true "
        "a turn warp waits for each query block's turn and passes it once the adds are issued.",
    )

    @field_validator("ping_pong", "intra_wg_overlap", "bwd_swap_ab", "bwd_dq_atomic", mode="wrap")
    @classmethod
    def _ping_pong(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(
                "auto_or_bool", "expected true, false or 'auto' (got {given})",
                {"given": show_value(value)},
            ) from None

    @field_validator("rescale_threshold", mode="wrap")
    @classmethod
    def _rescale_threshold(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, str) and value == "auto":
            return value
        try:
            return _NON_NEG_FLOAT.validate_python(value)
        except ValidationError as err:
            raise PydanticCustomError(
                "auto_or_float", "{reason}, or 'auto' (got {given})",
                {"reason": err.errors()[0]["msg"], "given": show_value(value)},
            ) from None

    @field_validator("tile_m", mode="wrap")
    @classmethod
    def _tile_m(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _auto_int(value, handler, step=64, lo=64, hi=256)

    @field_validator("tile_n", mode="wrap")
    @classmethod
    def _tile_n(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _auto_int(value, handler, step=16, lo=16, hi=256)

    @field_validator("kv_stages", mode="wrap")
    @classmethod
    def _kv_stages(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _auto_int(value, handler, step=1, lo=1, hi=8)

    @field_validator("q_stages", mode="wrap")
    @classmethod
    def _q_stages(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _auto_int(value, handler, step=1, lo=1, hi=2)


# --- the spec --------------------------------------------------------------------------------


class AttentionSpec(_Model):
    """A declarative description of one attention kernel family."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="fa4gen attention spec")

    name: str = Field(
        pattern=NAME_PATTERN,
        description="Python identifier for the generated module (lowercase, <= 64 chars).",
    )
    description: str = Field(default="", max_length=500, description="Free text for humans.")
    targets: list[Target] = Field(min_length=1, description="GPU architectures to build for.")
    dtype: Dtype = Field(description="Element type of Q, K, V and O.")
    head_dim: StrictInt = Field(
        description="Head dimension of Q and K.", json_schema_extra=_HEAD_DIM_RANGE
    )
    head_dim_v: StrictInt | None = Field(
        default=None, description="Head dimension of V and O; null = head_dim.",
        json_schema_extra=_HEAD_DIM_RANGE,
    )
    mask: Mask = NoMask()
    softcap: NonNegFloat = Field(
        default=0.0, description="Logit soft-capping: cap * tanh(s / cap); 0 disables it."
    )
    allow_gqa: StrictBool = Field(default=True, description="Allow fewer KV heads than Q heads.")
    varlen: StrictBool = Field(default=False, description="Packed variable-length sequences.")
    return_lse: StrictBool = Field(default=False, description="Also return the log-sum-exp.")
    backward: StrictBool = Field(default=False, description="Generate the backward kernel.")
    deterministic: StrictBool = Field(
        default=False, description="Deterministic backward (no atomic dQ accumulation)."
    )
    pipeline: Pipeline = Pipeline()

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, value: Any) -> Any:
        if isinstance(value, str) and not re.fullmatch(NAME_PATTERN, value):
            raise PydanticCustomError(
                "spec_name",
                "must be a lowercase Python identifier: a-z, 0-9 and _, not starting with a "
                "digit, at most 64 characters (got {given})",
                {"given": show_value(value)},
            )
        if not isinstance(value, str):  # before pydantic's lax coercion (bytes, enums) skips the checks here
            raise PydanticCustomError("spec_name", "must be a string (got {given})", {"given": show_value(value)})
        if keyword.iskeyword(value):
            raise PydanticCustomError(
                "spec_name", "must not be a Python keyword (got {given})", {"given": show_value(value)}
            )
        if value.startswith("__") and value.endswith("__"):
            raise PydanticCustomError(
                "spec_name", "must not be a dunder name, which Python reserves (got {given})",
                {"given": show_value(value)},
            )
        return value

    @field_validator("softcap")
    @classmethod
    def _softcap(cls, value: float) -> float:
        # the kernels take softcap * log2(e) and softmax_scale / softcap as fp32: outside this range one of
        # them leaves fp32's normal numbers and the scores come out inf * 0 = NaN (3e38) or 0 / 0 (1e-40)
        if value != 0.0 and not SOFTCAP_MIN <= value <= SOFTCAP_MAX:
            raise PydanticCustomError(
                "softcap", "must be 0 (off) or in [{lo}, {hi}] (the kernels take softcap * log2(e) and "
                "scale / softcap as fp32; got {given})",
                {"lo": f"{SOFTCAP_MIN:g}", "hi": f"{SOFTCAP_MAX:g}", "given": show_value(value)},
            )
        return value

    @field_validator("targets")
    @classmethod
    def _unique_targets(cls, targets: list[str]) -> list[str]:
        seen: set[str] = set()
        for i, target in enumerate(targets):
            if target in seen:
                raise rule_error((str(i), f"duplicate target {target!r} (got {targets!r})"))
            seen.add(target)
        return targets

    @field_validator("head_dim", "head_dim_v")
    @classmethod
    def _head_dim(cls, value: int | None) -> int | None:
        if value is not None and (
            value % HEAD_DIM_STEP or not HEAD_DIM_MIN <= value <= HEAD_DIM_MAX
        ):
            raise PydanticCustomError(
                "head_dim",
                "must be a multiple of {step} in [{lo}, {hi}] (got {given})",
                {"step": HEAD_DIM_STEP, "lo": HEAD_DIM_MIN, "hi": HEAD_DIM_MAX, "given": value},
            )
        return value

    @model_validator(mode="after")
    def _cross_field_rules(self) -> AttentionSpec:
        if self.head_dim_v is None:
            # Frozen model: fill the resolved value once, during validation.
            object.__setattr__(self, "head_dim_v", self.head_dim)
        problems: list[tuple[str, str]] = []
        if self.pipeline.two_cta and "sm100" not in self.targets:
            problems.append(
                ("pipeline.two_cta", f"two_cta needs 'sm100' in targets (got {self.targets!r})")
            )
        pair = (self.head_dim, self.head_dim_v)
        if pair[0] != pair[1] and pair not in SUPPORTED_HEAD_DIM_PAIRS:
            allowed = ", ".join(f"({a}, {b})" for a, b in SUPPORTED_HEAD_DIM_PAIRS)
            problems.append((
                "head_dim_v",
                f"unsupported (head_dim, head_dim_v) = ({pair[0]}, {pair[1]}); supported: "
                f"head_dim_v equal to head_dim, or {allowed}",
            ))
        if self.deterministic and not self.backward:
            problems.append(
                ("deterministic", "deterministic only applies to the backward pass; it needs "
                 "backward: true (got backward: false)")
            )
        if problems:
            raise rule_error(*problems)
        return self

    @property
    def head_dim_v_resolved(self) -> int:
        """head_dim_v as an int (always filled after validation; kept for readability)."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

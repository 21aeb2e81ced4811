"""Spec stage: the declarative attention spec (models, loading, schema, digest).

The first stage of fa4gen: `load_spec("specs/llama3_8b.yaml")` returns a frozen, validated
`AttentionSpec`; every problem is reported as a `SpecError` listing located `Problem`s.
Pure Python: nothing here imports cutlass or torch.
"""

from fa4gen.spec.load import (
    DOCUMENT,
    SPEC_SUFFIXES,
    Problem,
    SpecError,
    discover_specs,
    load_spec,
    problems_from_validation_error,
    spec_digest,
    spec_from_dict,
    spec_json_schema,
)
from fa4gen.spec.model import (
    MASK_KINDS,
    SUPPORTED_HEAD_DIM_PAIRS,
    AttentionSpec,
    CausalMask,
    ChunkedMask,
    Mask,
    NoMask,
    Pipeline,
    PolyExp,
    SlidingWindowMask,
    Target,
)

__all__ = [
    "DOCUMENT",
    "MASK_KINDS",
    "SPEC_SUFFIXES",
    "SUPPORTED_HEAD_DIM_PAIRS",
    "AttentionSpec",
    "CausalMask",
    "ChunkedMask",
    "Mask",
    "NoMask",
    "Pipeline",
    "PolyExp",
    "Problem",
    "SlidingWindowMask",
    "SpecError",
    "Target",
    "discover_specs",
    "load_spec",
    "problems_from_validation_error",
    "spec_digest",
    "spec_from_dict",
    "spec_json_schema",
]

"""Emulator stage: a CPU model, in torch, of exactly what a generated kernel computes for a plan.

`emulate_forward(q, k, v, plan)` runs the SM90 forward's algorithm — its tiles, key-block order
and range, mask decisions, conditional rescale threshold, polynomial exp2 share, element
pattern and coefficients, P rounded to the input dtype, fp32 accumulation, final normalization —
so CI can check every algorithmic choice a spec makes against the exact reference
(fa4gen.reference) without a GPU, and a GPU run can hold the kernel to the emulator with a
tolerance much tighter than the one against the exact result (fa4gen.golden.tolerance).

Sits beside fa4gen.reference (a test-side stage): it reads plans, never imports cutlass.
"""

from fa4gen.emulate.forward import (
    EMULATED_ARCHS,
    Algorithm,
    RowState,
    emulate_forward,
    exp2_mufu,
    exp2_poly,
    online_softmax_step,
    runtime_scalars,
)
from fa4gen.emulate.tiling import (
    fragment_column,
    mask_phases,
    n_block_range,
    poly_columns,
    row_bounds,
    schedule,
    tile_bounds,
    tile_needs_mask,
)

__all__ = [
    "EMULATED_ARCHS", "Algorithm", "RowState", "emulate_forward", "exp2_mufu", "exp2_poly", "fragment_column",
    "mask_phases", "n_block_range", "online_softmax_step", "poly_columns", "row_bounds", "runtime_scalars",
    "schedule", "tile_bounds", "tile_needs_mask",
]

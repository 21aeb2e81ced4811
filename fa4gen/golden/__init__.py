"""Golden tests of generated variants: the runner behind `fa4gen test`.

For each generated package (in this repo or anywhere on disk): compile + SASS checks for every
available kernel, the forward plan's algorithm emulated on the CPU against the exact reference, and —
with a Hopper GPU — the real forward kernel against both the reference and the emulator, and the
backward kernel's gradients against the reference gradients (bitwise repeats when deterministic).
A test-side stage: it uses every stage before it (spec, plan, compile, api through the package)
plus fa4gen.reference and fa4gen.emulate.
"""

from fa4gen.golden.backward import BWD_CASE_SHAPES, backward_numerics, bitwise_repeat
from fa4gen.golden.checks import (
    CASE_SHAPES,
    Case,
    CheckResult,
    cases,
    compile_and_sass,
    emulator_vs_reference,
    has_hopper,
    kernel_numerics,
    make_inputs,
)
from fa4gen.golden.runner import run, run_variant, table_rows
from fa4gen.golden.tolerance import Comparison, against_emulator, against_reference, grad_against_reference
from fa4gen.golden.variants import Variant, load_variant, packages_under, resolve

__all__ = [
    "BWD_CASE_SHAPES", "CASE_SHAPES", "Case", "CheckResult", "Comparison", "Variant", "against_emulator",
    "against_reference", "backward_numerics", "bitwise_repeat", "cases", "compile_and_sass", "emulator_vs_reference",
    "grad_against_reference", "has_hopper", "kernel_numerics", "load_variant", "make_inputs", "packages_under",
    "resolve", "run", "run_variant", "table_rows",
]

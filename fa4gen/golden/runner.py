"""Golden tests: run every check that applies to each variant on this machine, as table rows.

On a machine with a Hopper GPU, an sm90 forward kernel is run and compared with the exact reference
and with the emulator (fa4gen.golden.checks.kernel_numerics), and an sm90 backward kernel's gradients
are compared with the exact reference gradients, and repeated bit for bit when the spec is
deterministic (fa4gen.golden.backward.backward_numerics). Anywhere else — and for targets no local GPU
can run — each available kernel is compiled and its SASS checked, and a forward plan's algorithm is
emulated on the CPU against the exact reference. Every kernel of a variant gets at least one check: a
direction without one is a failed row, not a skipped one. Targets the package could not build are
listed as skipped with the reason from its lock file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from fa4gen.golden.backward import backward_numerics
from fa4gen.golden.checks import (
    CheckResult, check_name, compile_and_sass, emulator_vs_reference, has_hopper, kernel_numerics,
)
from fa4gen.golden.variants import Variant

GPU_ARCHS = {"sm90"}  # archs whose kernels a local Hopper GPU runs


def _crashed(variant: Variant, arch: str, check: str, err: Exception) -> CheckResult:
    return CheckResult(variant.name, arch, check, "FAIL", f"{type(err).__name__}: {err}")


def run_variant(variant: Variant, *, gpu: bool, progress: Callable[[str], None] | None = None) -> list[CheckResult]:
    results: list[CheckResult] = []
    for plan in variant.plans:
        arch, direction = plan["arch"], plan["direction"]
        if progress is not None:
            progress(f"{variant.name} [{arch} {direction}] ...")
        if direction not in ("fwd", "bwd"):
            results.append(CheckResult(variant.name, arch, f"{direction} kernel", "FAIL",
                                       f"no golden check for {direction!r} kernels"))
            continue
        if gpu and arch in GPU_ARCHS:
            numerics = kernel_numerics if direction == "fwd" else backward_numerics
            try:
                results += numerics(variant, plan)
            except Exception as err:  # noqa: BLE001 - a crash of one variant is its failure, not the run's
                results.append(_crashed(variant, arch, check_name(plan, "kernel numerics"), err))
            continue
        results.append(compile_and_sass(variant, plan))
        if direction == "bwd":
            continue  # no CPU emulator of the backward: its numerics are checked on a Hopper GPU
        try:
            results.append(emulator_vs_reference(variant, plan))
        except Exception as err:  # noqa: BLE001
            results.append(_crashed(variant, arch, check_name(plan, "emulator vs reference"), err))
    for arch, why in sorted(variant.unavailable.items()):
        results.append(CheckResult(variant.name, arch, "-", "skip", f"not available yet: {why}"))
    return results


def run(variants: Iterable[Variant], *, gpu: bool | None = None, progress=None) -> list[CheckResult]:
    """All results for `variants`; gpu=None means "use a Hopper GPU if there is one"."""
    use_gpu = has_hopper() if gpu is None else gpu
    return [r for v in variants for r in run_variant(v, gpu=use_gpu, progress=progress)]


def table_rows(results: list[CheckResult]) -> list[tuple[str, ...]]:
    rows = [("variant", "arch", "check", "result", "time", "detail")]
    for r in results:
        rows.append((r.variant, r.arch, r.check, r.status, f"{r.seconds:.1f}s" if r.seconds else "-", r.detail))
    return rows


__all__ = ["GPU_ARCHS", "run", "run_variant", "table_rows"]

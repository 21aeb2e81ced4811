"""Plan stage: resolve an AttentionSpec into one frozen KernelPlan per (arch, direction).

Each target architecture registers a planner here. Adding a target means adding its planner and
its templates; a target whose kernel family does not exist yet is registered as unavailable and
gets a clear NotAvailableError instead of a crash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fa4gen.plan import sm90, sm100
from fa4gen.plan.model import Budget, KernelPlan, NotAvailableError, PlanError, problem
from fa4gen.spec import AttentionSpec


@dataclass(frozen=True)
class ArchFamily:
    name: str
    cute_arch: str
    # None: not asked for. A family's plans come in this order (sm90: a backward's MHA twin before it, so the
    # arch's last plan is its default backward)
    planners: tuple[Callable[[AttentionSpec], KernelPlan | None], ...]
    unavailable: str = ""


ARCHS: dict[str, ArchFamily] = {
    "sm90": ArchFamily("sm90", "sm_90a", (sm90.plan_forward, sm90.plan_forward_long,
                                             sm90.plan_forward_rows128, sm90.plan_backward_gqa,
                                             sm90.plan_backward_mha, sm90.plan_backward)),
    "sm100": ArchFamily("sm100", "sm_100a", (sm100.plan_forward,)),
}


def plan_kernels(spec: AttentionSpec, arch: str) -> list[KernelPlan]:
    """Every kernel plan for one target of `spec` (forward, and backward where the spec asks for it)."""
    family = ARCHS.get(arch)
    if family is None:
        raise PlanError(spec.name, [problem("targets", f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")])
    if arch not in spec.targets:
        raise PlanError(spec.name, [problem("targets", f"{arch} is not among the spec's targets {spec.targets}")])
    if family.unavailable:
        raise NotAvailableError(f"{spec.name} [{arch}]", [problem("targets", family.unavailable)])
    return [plan for plan in (planner(spec) for planner in family.planners) if plan is not None]


def available_targets(spec: AttentionSpec) -> tuple[list[str], list[str]]:
    """(targets that can be built now, targets whose family is not available yet)."""
    ok = [t for t in spec.targets if not ARCHS[t].unavailable]
    return ok, [t for t in spec.targets if ARCHS[t].unavailable]


__all__ = [
    "ARCHS", "ArchFamily", "Budget", "KernelPlan", "NotAvailableError", "PlanError",
    "available_targets", "plan_kernels",
]

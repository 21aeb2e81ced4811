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
    # checked budgets
    budgets: tuple[Budget, ...] = field(default_factory=tuple)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def has_mask(self) -> bool:
        return self.causal or self.local or self.chunked

    @property
    def has_softcap(self) -> bool:
        return self.softcap > 0.0

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


def problem(location: str, message: str) -> Problem:
    return Problem(location=location, message=message)

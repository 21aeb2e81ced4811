"""Golden tests: which generated variants to test, and loading them from disk by path.

A variant is one generated package: a folder with spec.lock.json, an __init__.py (the API) and
one module per kernel. `fa4gen test` names it by a spec file (its package is <out>/<name>), by the
package folder itself (anywhere: it need not be in this repo or on sys.path), or by a folder of
either; `--all` takes every package under <out>.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from fa4gen.compile.generated import import_from_path
from fa4gen.spec import SPEC_SUFFIXES, Problem, SpecError, discover_specs, load_spec

LOCK = "spec.lock.json"


@dataclass
class Variant:
    """One generated package on disk and its lock file (resolved spec + plans)."""

    name: str
    path: Path
    lock: dict[str, Any] = field(repr=False)
    _module: ModuleType | None = field(default=None, repr=False)

    @property
    def plans(self) -> list[dict[str, Any]]:
        return list(self.lock.get("plans", []))

    @property
    def unavailable(self) -> dict[str, str]:
        return dict(self.lock.get("unavailable_targets", {}))

    @property
    def import_name(self) -> str:
        """A module name unique to this folder, so two packages of one spec never collide."""
        digest = hashlib.sha256(str(self.path).encode()).hexdigest()[:10]
        return f"_fa4gen_golden_{self.name}_{digest}"

    def load(self) -> ModuleType:
        """Import the package's API from its folder (its kernels compile on first call)."""
        if self._module is None:
            self._module = import_from_path(self.import_name, self.path / "__init__.py", package=True)
        return self._module


def is_package(path: Path) -> bool:
    return (path / LOCK).is_file() and (path / "__init__.py").is_file()


def load_variant(path: Path) -> Variant:
    path = path.resolve()
    try:
        lock = json.loads((path / LOCK).read_text())
        name = lock["spec"]["name"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SpecError(path / LOCK, [Problem("<document>", f"not a readable fa4gen lock file ({err})")]) from None
    return Variant(name=name, path=path, lock=lock)


def packages_under(root: Path) -> list[Variant]:
    """Every generated package directly under `root`, sorted by folder name."""
    if not root.is_dir():
        raise SpecError(root, [Problem("<document>", "no such folder of generated packages")])
    return [load_variant(p) for p in sorted(root.iterdir()) if p.is_dir() and is_package(p)]


def resolve(targets: list[str], *, out: Path, all_packages: bool) -> tuple[list[Variant], list[str]]:
    """Variants named on the command line (see the module docstring), and one problem line for
    each argument that names none."""
    variants: list[Variant] = []
    problems: list[str] = []
    roots = ([out] if all_packages else []) + [Path(t) for t in targets]
    for i, path in enumerate(roots):
        try:
            if all_packages and i == 0:
                variants += packages_under(path)
            elif path.is_dir() and is_package(path):
                variants.append(load_variant(path))
            elif path.is_dir() and any(is_package(p) for p in path.iterdir() if p.is_dir()):
                variants += packages_under(path)
            else:
                for spec_path in discover_specs([path]):
                    variants.append(_package_of_spec(spec_path, out))
        except SpecError as err:
            problems += err.lines()
    unique = {v.path: v for v in variants}
    return list(unique.values()), problems


def _package_of_spec(spec_path: Path, out: Path) -> Variant:
    spec = load_spec(spec_path)
    pkg = out / spec.name
    if not is_package(pkg):
        raise SpecError(spec_path, [Problem(
            "<document>", f"{pkg} is not a generated package; run `fa4gen build {spec_path}` first",
        )])
    return load_variant(pkg)


__all__ = ["LOCK", "SPEC_SUFFIXES", "Variant", "is_package", "load_variant", "packages_under", "resolve"]

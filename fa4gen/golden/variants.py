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
    """The package at `path`, after checking that it is what its lock file says: the lock's shape, its
    spec digest, every file's sha256, and the plans' mask and softcap against the lock's spec (the
    reference the checks compare with is built from the plan, so a plan edited by hand — or a planner
    that lost the spec's mask — would otherwise test itself)."""
    path = path.resolve()
    try:
        lock = json.loads((path / LOCK).read_text())
        name = lock["spec"]["name"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SpecError(path / LOCK, [Problem("<document>", f"not a readable fa4gen lock file ({err})")]) from None
    problem = _lock_problem(path, lock)
    if problem:
        raise SpecError(path / LOCK, [Problem("<document>", f"{problem}; rebuild it with `fa4gen build`")])
    return Variant(name=name, path=path, lock=lock)


def _lock_problem(path: Path, lock: Any) -> str | None:
    from fa4gen.reference import mask_semantics, spec_mask_semantics
    from fa4gen.spec import spec_digest, spec_from_dict

    plans, files = lock.get("plans"), lock.get("files")
    if not isinstance(lock.get("spec"), dict) or not isinstance(files, dict) or not isinstance(
            lock.get("unavailable_targets", {}), dict):
        return "the lock file is damaged (spec, files or unavailable_targets is not a mapping)"
    if not isinstance(plans, list) or not plans or not all(
            isinstance(p, dict) and {"arch", "direction", "module"} <= p.keys() for p in plans):
        return "the lock file lists no kernel plans (or damaged ones)"
    if not all(isinstance(k, str) and isinstance(h, str) for k, h in files.items()):
        return "the lock file's file digests are damaged"
    for rel, digest in sorted(files.items()):
        try:
            data = (path / rel).read_bytes() if "/" not in rel and not rel.startswith(".") else None
        except OSError as err:
            return f"{rel}: cannot read it ({err.strerror or err})"
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            return f"{rel} differs from the file the lock describes (edited or damaged)"
    try:
        spec = spec_from_dict(lock["spec"], source=str(path / LOCK))
    except SpecError as err:
        return f"the lock's spec no longer validates: {err.lines()[0]}"
    if lock.get("spec_sha256") != spec_digest(spec):
        return "the lock's spec does not match its spec_sha256 (edited by hand?)"
    want = spec_mask_semantics(spec)
    for plan in plans:
        try:
            got = mask_semantics(plan)
        except (KeyError, TypeError):
            return f"plan {plan.get('module')!r} lacks its mask fields"
        if got != want:
            return f"plan {plan.get('module')!r} computes {got}, but the lock's spec asks for {want}"
    return None


def packages_under(root: Path) -> tuple[list[Variant], list[str]]:
    """Every generated package directly under `root`, sorted by folder name, and one problem line per
    package that does not load (the others are still tested)."""
    if not root.is_dir():
        raise SpecError(root, [Problem("<document>", "no such folder of generated packages")])
    variants, problems = [], []
    for p in sorted(root.iterdir()):
        if p.is_dir() and is_package(p):
            try:
                variants.append(load_variant(p))
            except SpecError as err:
                problems += err.lines()
    return variants, problems


def resolve(targets: list[str], *, out: Path, all_packages: bool) -> tuple[list[Variant], list[str]]:
    """Variants named on the command line (see the module docstring), and one problem line for
    each argument that names none."""
    variants: list[Variant] = []
    problems: list[str] = []
    roots = ([out] if all_packages else []) + [Path(t) for t in targets]
    for i, path in enumerate(roots):
        try:
            if all_packages and i == 0 or path.is_dir() and not is_package(path) and any(
                    is_package(p) for p in path.iterdir() if p.is_dir()):
                found, bad = packages_under(path)
                variants, problems = variants + found, problems + bad
            elif path.is_dir() and is_package(path):
                variants.append(load_variant(path))
            elif path.is_dir() and (path / LOCK).is_file():
                problems.append(f"{path}: a damaged generated package: __init__.py is missing; rebuild it with "
                                "`fa4gen build`")
            elif path.name == LOCK and path.is_file():
                problems.append(f"{path}: name the package folder ({path.parent}), not its lock file")
            else:
                for spec_path in discover_specs([path]):
                    try:
                        variants.append(_package_of_spec(spec_path, out))
                    except SpecError as err:  # every spec of a folder gets its line, not just the first
                        problems += err.lines()
        except SpecError as err:
            problems += err.lines()
    unique = {v.path: v for v in variants}
    return list(unique.values()), problems


def _package_of_spec(spec_path: Path, out: Path) -> Variant:
    from fa4gen.spec import spec_digest

    spec = load_spec(spec_path)
    pkg = out / spec.name
    if not is_package(pkg):
        raise SpecError(spec_path, [Problem(
            "<document>", f"{pkg} is not a generated package; run `fa4gen build {spec_path}` first",
        )])
    variant = load_variant(pkg)
    if variant.lock.get("spec_sha256") != spec_digest(spec):
        raise SpecError(spec_path, [Problem(
            "<document>", f"{pkg} was built from another version of this spec; run `fa4gen build {spec_path}` first",
        )])
    return variant


__all__ = ["LOCK", "SPEC_SUFFIXES", "Variant", "is_package", "load_variant", "packages_under", "resolve"]

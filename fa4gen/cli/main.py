"""CLI stage: the `fa4gen` click group and the spec commands (validate, schema, list, show).

Error handling lives in one place: `Fa4genGroup.invoke` turns a `SpecError` raised by any
command into its problem lines on stderr and exit status 2 (no traceback). Commands added later
(plan, build, cache, inspect, ...) get the same behaviour by registering on `main`; a command
that collects several failures itself can call `exit_with_problems(lines)`.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NoReturn

import click
import yaml

from fa4gen.plan import ARCHS
from fa4gen.spec import AttentionSpec, SpecError, discover_specs, load_spec, spec_json_schema

EXIT_PROBLEMS = 2  # same status click uses for usage errors: "the input was wrong"


def exit_with_problems(lines: Iterable[str]) -> NoReturn:
    """Print problem lines to stderr and end the process with status 2."""
    for line in lines:
        click.echo(line, err=True)
    raise SystemExit(EXIT_PROBLEMS)


class Fa4genGroup(click.Group):
    """click.Group that reports SpecError as problem lines instead of a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SpecError as err:
            exit_with_problems(err.lines())


def _version() -> str:
    import fa4gen

    declared = getattr(fa4gen, "__version__", None)
    if declared:
        return str(declared)
    try:
        return importlib.metadata.version("fa4gen")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        return "0+unknown"


@click.group(cls=Fa4genGroup, name="fa4gen")
@click.version_option(version=_version(), prog_name="fa4gen")
def main() -> None:
    """Compile declarative attention specs into CuTe-DSL FlashAttention kernels."""


# --- helpers shared by the spec commands -----------------------------------------------------


def head_dims(spec: AttentionSpec) -> str:
    """`d128`, or `d192/128` when V has its own head dim."""
    if spec.head_dim_v == spec.head_dim:
        return f"d{spec.head_dim}"
    return f"d{spec.head_dim}/{spec.head_dim_v}"


def _load_all(paths: Sequence[str]) -> tuple[list[tuple[Path, AttentionSpec]], list[str]]:
    """Load every spec under `paths`; return the good ones and the problem lines of the rest."""
    loaded: list[tuple[Path, AttentionSpec]] = []
    problems: list[str] = []
    for raw in paths:
        try:
            files = discover_specs([raw])
        except SpecError as err:
            problems.extend(err.lines())
            continue
        for path in files:
            try:
                spec = load_spec(path)
            except SpecError as err:
                problems.extend(err.lines())
                continue
            first = next((p for p, s in loaded if s.name == spec.name), None)
            if first is not None:  # both would write generated/<name>: the later one would silently win
                problems.append(f"{path}: name: {spec.name!r} is also the name of {first}; each spec needs its own")
                continue
            loaded.append((path, spec))
    return loaded, problems


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows
    )


# --- commands --------------------------------------------------------------------------------


@main.command()
@click.argument("specs", nargs=-1, required=True, type=click.Path(path_type=str))
def validate(specs: tuple[str, ...]) -> None:
    """Check spec files or directories of them; exit 2 on problems."""
    loaded, problems = _load_all(specs)
    for path, spec in loaded:
        click.echo(
            f"ok  {path}  ({spec.name}: targets {','.join(spec.targets)}, {head_dims(spec)}, "
            f"{spec.mask.kind})"
        )
    if problems:
        exit_with_problems(problems)


@main.command()
def schema() -> None:
    """Print the JSON Schema of spec files (for editor completion)."""
    click.echo(json.dumps(spec_json_schema(), indent=2))


@main.command("list")
@click.argument("directory", default="specs", type=click.Path(path_type=str))
def list_specs(directory: str) -> None:
    """Table of the specs in DIRECTORY (default: specs)."""
    loaded, problems = _load_all([directory])
    if loaded:
        header = ("name", "targets", "dtype", "head dims", "mask", "file")
        rows = [
            (spec.name, ",".join(spec.targets), spec.dtype, head_dims(spec),
             spec.mask.describe(), str(path))
            for path, spec in loaded
        ]
        click.echo(_table([header, *rows]))
    if problems:
        exit_with_problems(problems)


@main.command()
@click.argument("spec", type=click.Path(path_type=str))
@click.option(
    "--format", "fmt", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True
)
def show(spec: str, fmt: str) -> None:
    """Print SPEC fully resolved (every default filled in)."""
    data = load_spec(spec).model_dump(mode="json")
    if fmt == "json":
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(yaml.safe_dump(data, sort_keys=False, default_flow_style=False), nl=False)


# --arch of the commands that take one target (build_cmds, dispatch_cmd): defined here, which both import, so
# importing either module first (e.g. `import fa4gen.cli.build_cmds`) finds it defined
ARCH_CHOICE = click.Choice(sorted(ARCHS))


# Commands that plan, build, compile and inspect register themselves on `main`.
from fa4gen.cli import build_cmds  # noqa: E402,F401
from fa4gen.cli import test_cmd  # noqa: E402,F401
from fa4gen.cli import dispatch_cmd  # noqa: E402,F401

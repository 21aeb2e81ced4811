"""CLI stage: the commands that plan, build, compile and inspect (plan, build, inspect, cache).

Registered on the `fa4gen` group from fa4gen.cli.main. Spec and plan problems are collected over
all specs and reported together (exit 2, one line per problem, nothing written for a failing
spec); a stale generated/ under --check or a failed compile exits 1.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import click

from fa4gen.builder import (
    CompileJob, KernelReport, compile_jobs, diff_package, orphan_packages, plan_spec, render_spec, spec_label,
    write_package,
)
from fa4gen.cli.main import ARCH_CHOICE, _load_all, _table, exit_with_problems, head_dims, main
from fa4gen.plan import NotAvailableError, PlanError, plan_kernels
from fa4gen.spec import SpecError

OPCODES = ("hgmma", "utchmma", "ldtm", "sttm", "utmaldg", "utmastg", "mufu_ex2", "ffma", "ffma2", "bar", "ldl", "stl")


def _mma(arch: str, sass: dict) -> str:
    """The tensor-core MMA count in the arch's own SASS spelling (HGMMA on sm90, UTCHMMA on sm100)."""
    key, label = ("utchmma", "UTCHMMA") if arch == "sm100" else ("hgmma", "HGMMA")
    return f"{sass[key]} {label}" if key in sass else "-"


def _kernel_row(name: str, r: KernelReport, smem: str) -> tuple[str, ...]:
    sass = r.meta.get("sass") or {}
    spills = r.meta.get("spill_stores")
    return (
        name, r.arch, r.module, r.status, f"{r.seconds:.1f}s" if r.seconds else "-",
        str(r.meta.get("registers", "-")), smem, "-" if spills is None else str(spills + (r.meta.get("spill_loads") or 0)),
        _mma(r.arch, sass), str(sass.get("mufu_ex2", "-")),
    )


@main.command()
@click.argument("spec", type=click.Path(path_type=str))
@click.option("--arch", type=ARCH_CHOICE, default=None, help="Only this target (default: all of the spec's).")
@click.option("--json", "as_json", is_flag=True, help="Print the plans as one JSON list (as in spec.lock.json).")
def plan(spec: str, arch: str | None, as_json: bool) -> None:
    """Print the resolved KernelPlans of SPEC: one per target and direction (forward, and the
    backward when the spec has backward: true), separated by a blank line."""
    loaded, problems = _load_all([spec])
    if problems:
        exit_with_problems(problems)
    plans = []
    from_dir = Path(spec).is_dir()
    if arch and from_dir and not any(arch in s.targets for _, s in loaded):
        raise click.UsageError(f"--arch {arch}: no spec in {spec} targets it")
    for _, s in loaded:
        if arch:
            if from_dir and arch not in s.targets:
                continue  # over a directory, --arch picks the specs that target it (as build does)
            plans += plan_kernels(s, arch)  # an unavailable family asked for by name is an error (exit 2)
        else:
            ok, unavailable = plan_spec(s)
            plans += ok
            for target, why in unavailable.items():
                click.echo(f"{s.name} [{target}]: {why}", err=True)
    if as_json:
        click.echo(json.dumps([p.to_dict() for p in plans], indent=2, sort_keys=True))
    elif plans:
        click.echo("\n\n".join(p.describe() for p in plans))


@main.command()
@click.argument("specs", nargs=-1, type=click.Path(path_type=str))
@click.option("--check", is_flag=True, help="Write nothing; exit 1 with a diff if generated/ is stale.")
@click.option("--compile", "do_compile", is_flag=True, help="Also compile every kernel ahead of time (no GPU needed).")
@click.option("--arch", "archs", type=ARCH_CHOICE, multiple=True, help="Compile only these targets (repeatable).")
@click.option("--out", default="generated", show_default=True, type=click.Path(path_type=Path))
@click.option("--sass/--no-sass", default=True, show_default=True, help="Disassemble compiled kernels for the summary.")
@click.option("--jobs", "-j", default=0, show_default=True, type=click.IntRange(min=0),
              help="With --compile: compile processes at once (0: one per CPU, as memory allows; 1: in this process).")
def build(specs: tuple[str, ...], check: bool, do_compile: bool, archs: tuple[str, ...], out: Path, sass: bool,
          jobs: int) -> None:
    """Generate generated/<name>/ for each spec (default: every spec in specs/)."""
    loaded, problems = _load_all(list(specs) or ["specs"])
    rows = [("spec", "arch", "kernel", "status", "compile", "regs", "smem", "spills", "MMA", "MUFU.EX2")]
    stale: list[str] = []
    # per built spec: its name, its kernels' reports (rendered only), shared-memory budgets, the kernels to compile
    # (with --compile: all specs' compile together after the loop) and its unavailable targets
    built: list[tuple[str, list[KernelReport], dict, list[CompileJob] | None, dict]] = []
    for path, spec in loaded:
        try:
            if archs:
                if not set(archs) & set(spec.targets):
                    if specs:  # named on the command line: say so (over the whole of specs/ it is skipped)
                        problems.append(f"{path}: --arch: {', '.join(archs)} not among the spec's targets "
                                        f"({', '.join(spec.targets)})")
                    continue
                for a in archs:
                    if a in spec.targets:
                        plan_kernels(spec, a)  # raises NotAvailableError for a family not built yet
            pkg, plans, unavailable = render_spec(spec, spec_label(path, out.resolve().parent))
        except (PlanError, SpecError) as err:
            problems.extend(err.lines())
            continue
        if check:
            diff = diff_package(pkg, out)
            stale += diff
            status = "stale" if diff else "up to date"
        else:
            try:
                changed = write_package(pkg, out)
            except SpecError as err:  # a folder fa4gen did not generate: named, nothing written
                problems.extend(err.lines())
                continue
            except OSError as err:  # --out is a file, read-only, ...
                problems.append(f"{path}: --out: cannot write {out / spec.name}: {err.strerror or err}")
                continue
            status = f"wrote {len(changed)} file(s)" if changed else "unchanged"
        budgets = {(p.arch, p.module): p.budgets[0].used for p in plans}  # a forward and a backward per arch
        reports = [KernelReport(p.arch, p.module, status) for p in plans]
        to_compile = None  # with --compile, the kernels to compile; their reports replace the rendered ones
        if do_compile and not check:
            to_compile = [CompileJob(out / spec.name, f"{out.name}.{spec.name}", p, spec.name)
                          for p in plans if not archs or p.arch in archs]
        built.append((spec.name, reports, budgets, to_compile, unavailable))
    compiled = compile_jobs([job for _, _, _, spec_jobs, _ in built for job in spec_jobs or ()], keep_sass=sass,
                            workers=jobs, log=lambda line: click.echo(line, err=True))
    failed = any(r.status == "failed" for r in compiled)
    for name, reports, budgets, spec_jobs, unavailable in built:
        if spec_jobs is not None:
            reports, compiled = compiled[:len(spec_jobs)], compiled[len(spec_jobs):]
        for r in reports:
            rows.append(_kernel_row(name, r, f"{budgets[r.arch, r.module] // 1024}K"))
            if r.status == "failed":
                click.echo(f"{name} [{r.arch}]: compile failed: {r.detail}", err=True)
        rows += [(name, arch, "-", "not available yet", "-", "-", "-", "-", "-", "-") for arch in unavailable]
    # the whole of specs/: generated packages no spec produces any more are stale — unless a spec failed
    # to load (its package is no orphan, only unreadable now: nothing is removed for it)
    if not specs and not problems:
        for orphan in orphan_packages(out, {spec.name for _, spec in loaded}):
            if check:
                stale.append(f"{orphan} is not produced by any spec in specs/ any more\n")
            else:
                shutil.rmtree(orphan)
                rows.append((orphan.name, "-", "-", "removed (no spec)", "-", "-", "-", "-", "-", "-"))
    if len(rows) > 1:
        click.echo(_table(rows))
    if problems:
        exit_with_problems(problems)
    if stale:
        click.echo("".join(stale), err=True, nl=False)
        click.echo(f"{out}/ is stale: run `fa4gen build{'' if out == Path('generated') else f' --out {out}'}` "
                   "and commit the result", err=True)
        raise SystemExit(1)
    if failed:
        raise SystemExit(1)


@main.command()
@click.argument("specs", nargs=-1, type=click.Path(path_type=str))
@click.option("--arch", "archs", type=ARCH_CHOICE, multiple=True, help="Only these targets.")
@click.option("--out", default="generated", show_default=True, type=click.Path(path_type=Path))
@click.option("--opcodes", "top", default=0, show_default=True, type=click.IntRange(min=0),
              help="Also list the N most frequent opcodes.")
@click.option("--jobs", "-j", default=0, show_default=True, type=click.IntRange(min=0),
              help="Compile processes at once (0: one per CPU, as memory allows; 1: in this process).")
def inspect(specs: tuple[str, ...], archs: tuple[str, ...], out: Path, top: int, jobs: int) -> None:
    """Compile (or load from the cache) and summarize each kernel's SASS and resources; exit 1 if a
    kernel fails to compile."""
    loaded, problems = _load_all(list(specs) or ["specs"])
    if problems:
        exit_with_problems(problems)
    failed = False
    chosen = []  # (spec, its compile jobs)
    for path, spec in loaded:
        if archs and not set(archs) & set(spec.targets):
            if specs:  # named on the command line: say so (over the whole of specs/ it is skipped), as build does
                problems.append(f"{path}: --arch: {', '.join(archs)} not among the spec's targets "
                                f"({', '.join(spec.targets)})")
            continue
        plans, _ = plan_spec(spec, archs=list(archs) or None)
        pkg, _, _ = render_spec(spec, spec_label(path, out.resolve().parent))
        if diff_package(pkg, out):
            exit_with_problems([f"{path}: {out / spec.name} is stale or missing; run `fa4gen build"
                                f"{'' if out == Path('generated') else f' --out {out}'}` first"])
        chosen.append((spec, [CompileJob(out / spec.name, f"{out.name}.{spec.name}", p, spec.name) for p in plans]))
    reports = iter(compile_jobs([j for _, spec_jobs in chosen for j in spec_jobs], keep_sass=True, workers=jobs,
                                log=lambda line: click.echo(line, err=True)))
    for spec, spec_jobs in chosen:
        for r in (next(reports) for _ in spec_jobs):
            click.echo(f"{spec.name} [{r.arch}] {r.module} ({head_dims(spec)}, {spec.mask.kind}): {r.status}")
            if r.status == "failed":
                click.echo(f"  {r.detail}")
                failed = True
                continue
            m = r.meta
            click.echo(f"  registers {m.get('registers')}  stack {m.get('stack_frame')}  "
                       f"spill stores/loads {m.get('spill_stores')}/{m.get('spill_loads')}")
            counts = m.get("sass") or {}
            click.echo("  " + "  ".join(f"{k.upper()} {counts.get(k, 0)}" for k in OPCODES))
            if top:
                hist = sorted((counts.get("opcodes") or {}).items(), key=lambda kv: -kv[1])[:top]
                click.echo("  top: " + ", ".join(f"{k} {v}" for k, v in hist))
    if problems:
        exit_with_problems(problems)
    if failed:
        raise SystemExit(1)


@main.group()
def cache() -> None:
    """The on-disk kernel cache ($FA4GEN_CACHE_DIR, else the XDG cache dir)."""


def _cache_folder():
    """The cache `fa4gen cache` works on; a root that is a file is one line and exit 2."""
    from fa4gen.compile.cache import DiskCache

    c = DiskCache()
    if c.root.exists() and not c.root.is_dir():
        exit_with_problems([f"cache: {c.root} is not a folder (FA4GEN_CACHE_DIR?)"])
    return c


def _or_exit(action, where: str):
    """action(), with an OSError (permissions, a vanished folder) as one line and exit 2."""
    try:
        return action()
    except OSError as err:
        exit_with_problems([f"cache: {where}: {err.strerror}" if err.strerror else f"cache: {err}"])


@cache.command("ls")
def cache_ls() -> None:
    """List cached kernels."""
    c = _cache_folder()
    entries = _or_exit(c.ls, f"cannot read {c.root}")
    click.echo(f"cache: {c.root} ({len(entries)} entries)")
    rows = [("key", "name", "arch", "regs", "created")]
    for e in entries:
        created = e.meta.get("created")
        try:
            created = time.strftime("%Y-%m-%d %H:%M", time.localtime(created))
        except (TypeError, ValueError, OverflowError, OSError):  # a damaged or foreign meta.json
            created = str(created)
        rows.append((e.key[:16], str(e.meta.get("name")), str(e.meta.get("arch")), str(e.meta.get("registers")), created))
    if entries:
        click.echo(_table(rows))


@cache.command("clear")
def cache_clear() -> None:
    """Remove every cached kernel."""
    c = _cache_folder()
    removed = _or_exit(c.clear, str(c.root))
    click.echo(f"removed {removed} entries from {c.root}")

"""CLI stage: `fa4gen test` — golden tests of generated variants (fa4gen.golden).

Registered on the `fa4gen` group from fa4gen.cli.main. Arguments that name no (loadable) generated
package get one line each and exit 2 — after the packages that do load were tested; otherwise any
failing check exits 1 after the whole table is printed.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from fa4gen.cli.main import _table, exit_with_problems, main


@main.command("test")
@click.argument("specs", nargs=-1, type=click.Path(path_type=str))
@click.option("--all", "all_packages", is_flag=True, help="Every generated package under --out.")
@click.option("--out", default="generated", show_default=True, type=click.Path(path_type=Path),
              help="Where spec files' packages live (and what --all scans).")
@click.option("--cpu", "cpu_only", is_flag=True, help="CPU checks only (compile + SASS, emulator), even with a GPU.")
def test(specs: tuple[str, ...], all_packages: bool, out: Path, cpu_only: bool) -> None:
    """Golden tests of generated variants: SPEC files, package folders (anywhere), or --all.

    With a Hopper GPU, each sm90 forward kernel runs against the exact reference and the CPU emulator
    of its plan, and each sm90 backward kernel's gradients against the exact reference gradients
    (repeated bit for bit when the spec is deterministic); otherwise (and for other targets) each
    kernel is compiled and its SASS checked, and a forward plan's algorithm is emulated against the
    exact reference. Backward rows name their checks "bwd ...".
    """
    from fa4gen.golden import has_hopper, resolve, run, table_rows
    from fa4gen.golden.runner import GPU_ARCHS

    if not specs and not all_packages:
        exit_with_problems(["fa4gen test: name spec files or generated package folders, or pass --all"])
    variants, problems = resolve(list(specs), out=out, all_packages=all_packages)
    if problems and not variants:
        exit_with_problems(problems)
    if not variants:
        exit_with_problems([f"fa4gen test: no generated packages found under {out}"])
    for line in problems:  # the packages that do load are still tested; the exit status says it (2)
        click.echo(line, err=True)
    gpu = False if cpu_only else has_hopper()
    click.echo(f"fa4gen test: {len(variants)} variant(s), {'Hopper GPU' if gpu else 'CPU only'}", err=True)
    start = time.perf_counter()
    results = run(variants, gpu=gpu, progress=lambda line: click.echo(line, err=True))
    click.echo(_table(table_rows(results)))
    failed = sum(r.failed for r in results)
    passed = sum(r.status == "pass" for r in results)
    skipped = sum(r.status == "skip" for r in results)
    # kernels whose numerics only a GPU checks (the CPU rows compile them and emulate their plans)
    gpu_only = 0 if gpu else sum(p["arch"] in GPU_ARCHS for v in variants for p in v.plans)
    not_run = f"; kernel numerics of {gpu_only} kernel(s) not run (no Hopper GPU{' used' if cpu_only else ''})" if gpu_only else ""
    click.echo(f"{passed} passed, {failed} failed, {skipped} skipped in {time.perf_counter() - start:.1f}s{not_run}")
    if problems:
        exit_with_problems(problems)
    if failed:
        raise SystemExit(1)

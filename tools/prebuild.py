"""Compile the fa4gen kernels a benchmark will use ahead of time, several at once, into the disk cache its
timed run then loads them from.

CuTe-DSL compiles for sm_90a without a GPU, one kernel per process at a time: a grid or A/B run that compiles
each kernel at its first call spends most of a device call compiling on one core of sixteen (session 22: one
side of a d256 / (192, 128) deterministic A/B took 540 s). Here every (spec, kernel module) pair is a job for
a pool of worker processes; each renders the spec exactly as `fa4gen.build(spec_dict)` does (label
"<dict>", so the module source and with it the cache key are the same) and compiles that module into the
cache of $FA4GEN_CACHE_DIR (the cache takes concurrent writers: a lock per entry). A job that fails is
reported and skipped: the timed run then compiles that kernel itself, or shows the same error there.

    from prebuild import prebuild; prebuild([spec_dict, ...], workers=8)
    python3 tools/prebuild.py --workers 8 SPEC.json ...   (each file one spec dict, or a list of them)
"""

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

PACKAGE = "fa4gen_prebuild"


def jobs_of(spec_dicts: list[dict]) -> list[tuple[dict, str]]:
    """(spec dict, kernel module) for every kernel each spec plans, specs deduplicated in order."""
    from fa4gen.builder import plan_spec
    from fa4gen.spec import spec_from_dict

    seen, jobs = set(), []
    for data in spec_dicts:
        text = json.dumps(data, sort_keys=True)
        if text in seen:
            continue
        seen.add(text)
        plans, _ = plan_spec(spec_from_dict(data, source="<dict>"))
        jobs += [(data, plan.module) for plan in plans]
    return jobs


def compile_job(job: tuple[dict, str]) -> tuple[str, str, str, float]:
    """Compile one kernel module of one spec into the default disk cache: (spec name, module, status, s)."""
    from fa4gen.builder import compile_package, render_spec, write_package
    from fa4gen.spec import spec_from_dict

    data, module = job
    t0 = time.perf_counter()
    spec = spec_from_dict(data, source="<dict>")
    pkg, plans, _ = render_spec(spec, "<dict>")  # the label fa4gen.build gives a dict spec
    plan = next(p for p in plans if p.module == module)
    with tempfile.TemporaryDirectory(prefix="fa4gen-prebuild-") as tmp:
        root = Path(tmp)
        write_package(pkg, root / PACKAGE)
        sys.path.insert(0, str(root))
        try:
            (report,) = compile_package(root / PACKAGE / spec.name, f"{PACKAGE}.{spec.name}", [plan], keep_sass=False)
        finally:
            sys.path.remove(str(root))
    status = report.status if report.status != "failed" else f"failed: {report.detail}"[:300]
    return spec.name, module, status, round(time.perf_counter() - t0, 1)


def prebuild(spec_dicts: list[dict], workers: int, log=print) -> list[tuple[str, str, str, float]]:
    """Compile every kernel of `spec_dicts` with `workers` processes (spawned: the caller may hold CUDA);
    one line per kernel through `log`; returns (spec name, module, status, seconds) per kernel."""
    jobs = jobs_of(spec_dicts)
    if not jobs:
        return []
    t0 = time.perf_counter()
    import fa4gen  # which tree compiles (an A/B's ref side runs from .ab/ref)

    log(f"prebuild: fa4gen from {Path(fa4gen.__file__).resolve().parent}")
    log(f"prebuild: {len(jobs)} kernels of {len({json.dumps(d, sort_keys=True) for d, _ in jobs})} specs "
        f"in {min(workers, len(jobs))} processes")
    results = []
    ctx = multiprocessing.get_context("spawn")
    # the spawned workers import this module by name to find compile_job: with its folder on the path they
    # inherit (the parent may have imported it some other way)
    here = str(Path(__file__).resolve().parent)
    added = here not in sys.path
    if added:
        sys.path.append(here)
    try:
        with ProcessPoolExecutor(max_workers=max(1, min(workers, len(jobs))), mp_context=ctx) as pool:
            for name, module, status, seconds in pool.map(compile_job, jobs):
                results.append((name, module, status, seconds))
                log(f"  {name}.{module}: {status} ({seconds} s)")
    finally:
        if added:
            sys.path.remove(here)
    log(f"prebuild: done in {time.perf_counter() - t0:.0f} s")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+", type=Path, help="JSON files, each one spec dict or a list of them")
    ap.add_argument("--workers", type=int, default=max(1, (multiprocessing.cpu_count() or 2) - 1))
    args = ap.parse_args(argv)
    if args.workers < 1:
        raise SystemExit(f"--workers: expected a positive count, got {args.workers}")
    dicts = []
    for path in args.specs:
        data = json.loads(path.read_text())
        dicts += data if isinstance(data, list) else [data]
    results = prebuild(dicts, args.workers)
    return sum(1 for *_, status, _ in results if status.startswith("failed"))


if __name__ == "__main__":
    sys.exit(main())

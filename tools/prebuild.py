"""Compile the fa4gen kernels a benchmark will use ahead of time, several at once, into the disk cache its
timed run then loads them from.

CuTe-DSL compiles for sm_90a without a GPU, one kernel per process at a time: a grid or A/B run that compiles
each kernel at its first call spends most of a device call compiling on one core of sixteen (session 22: one
side of a d256 / (192, 128) deterministic A/B took 540 s). Here every (spec, kernel module) pair is a job for
a pool of worker processes (`fa4gen.builder.compile_jobs`, what `fa4gen build --compile --jobs N` runs); this
process renders each spec exactly as `fa4gen.build(spec_dict)` does (label "<dict>", so the module source and
with it the cache key are the same), and the workers compile the modules into the cache of $FA4GEN_CACHE_DIR
(the cache takes concurrent writers: a lock per entry); kernels already there are not compiled again. A job
that fails is reported and skipped: the timed run then compiles that kernel itself, or shows the same error
there.

    from prebuild import prebuild; prebuild([spec_dict, ...], workers=8)
    python3 tools/prebuild.py --workers 8 SPEC.json ...   (each file one spec dict, or a list of them)
"""

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

PACKAGE = "fa4gen_prebuild"


def jobs_of(spec_dicts: list[dict], root: Path) -> list:
    """A compile job (fa4gen.builder.CompileJob) for every kernel each spec plans, specs deduplicated in order:
    each spec rendered under `root` exactly as `fa4gen.build(spec_dict)` renders it (label "<dict>", so the
    module source and with it the cache key are the same), in a folder of its own (two specs may share a
    name)."""
    from fa4gen.builder import CompileJob, render_spec, write_package
    from fa4gen.spec import spec_from_dict

    seen, jobs = set(), []
    for data in spec_dicts:
        text = json.dumps(data, sort_keys=True)
        if text in seen:
            continue
        seen.add(text)
        spec = spec_from_dict(data, source="<dict>")
        pkg, plans, _ = render_spec(spec, "<dict>")
        out = root / f"spec{len(seen)}"
        write_package(pkg, out)
        jobs += [CompileJob(out / spec.name, f"{PACKAGE}.{spec.name}", plan, spec.name) for plan in plans]
    return jobs


def prebuild(spec_dicts: list[dict], workers: int, log=print) -> list[tuple[str, str, str, float]]:
    """Compile every kernel of `spec_dicts` with `workers` processes (fa4gen.builder.compile_jobs: fresh
    subprocesses, the caller may hold CUDA) into the cache of $FA4GEN_CACHE_DIR; one line per kernel through
    `log`; returns (spec name, module, status, seconds) per kernel."""
    from fa4gen.builder import compile_jobs

    t0 = time.perf_counter()
    import fa4gen  # which tree compiles (an A/B's ref side runs from .ab/ref)

    log(f"prebuild: fa4gen from {Path(fa4gen.__file__).resolve().parent}")
    with tempfile.TemporaryDirectory(prefix="fa4gen-prebuild-") as tmp:
        jobs = jobs_of(spec_dicts, Path(tmp))
        if not jobs:
            return []
        log(f"prebuild: {len(jobs)} kernels of {len({j.pkg_dir for j in jobs})} specs")
        reports = compile_jobs(jobs, keep_sass=False, workers=workers, log=lambda line: log(f"  {line}"))
    results = [(job.label, r.module, r.status if r.status != "failed" else f"failed: {r.detail}"[:300],
                round(r.seconds, 1)) for job, r in zip(jobs, reports)]
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

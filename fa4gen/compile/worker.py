"""A compile process of `fa4gen.builder.compile_jobs`: `python -m fa4gen.compile.worker`.

It reads one job per line on stdin (JSON: pkg_dir, package, plan, keep_sass, cache_root), compiles it
(`fa4gen.builder._compile_one`) and answers one JSON line (the KernelReport's fields) on the stdout it was
started with, until stdin closes. Anything else written to stdout — by CuTe-DSL, a warning, a print in a
kernel module — goes to stderr instead, so the answers stay one per line.

A plain subprocess, not multiprocessing: a spawned multiprocessing child re-runs the parent's main script
when it has no `if __name__ == "__main__":` guard (a user's build script), and a forked one inherits CUDA
and threads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys


def serve(jobs, answers) -> None:
    from fa4gen.builder import _compile_one

    for line in jobs:
        if not line.strip():
            continue
        job = json.loads(line)
        report = _compile_one(job["pkg_dir"], job["package"], job["plan"], job["keep_sass"], job["cache_root"])
        answers.write(json.dumps(dataclasses.asdict(report), default=str) + "\n")
        answers.flush()


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # fd 1 (C code included) now reaches stderr
    sys.stdout = sys.stderr
    serve(sys.stdin, answers)


if __name__ == "__main__":
    main()

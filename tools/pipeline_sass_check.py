"""Does fa4gen's trimmed cute-to-nvvm pipeline (fa4gen.compile.generated.SKIPPED_PASS_OPTIONS) compile the same
machine code as CuTe-DSL's whole one? Every kernel of the given specs is compiled twice on the CPU (no GPU), once
with FA4GEN_FULL_PIPELINE=1 and once without, and the two SASS listings are compared instruction for
instruction (addresses, encodings and the kernel symbols, which carry the cache key, left out), and so are the
cubins' resources (registers, shared memory, stack, spill counts). Prints one row
per kernel and exits 1 when any kernel differs or fails to compile, so a new toolchain or a new kernel shape that
the skipped passes would have changed shows up before a GPU session does.

Run: `PYTHONPATH=. python tools/pipeline_sass_check.py [specs/*.yaml ...] [--archs sm90,sm100] [--workers N]
[--out F.json] [--dump DIR]
[--options 'use-...-pass=false ...']` (default: every spec under specs/, both archs; about 4 s a kernel per core
and mode).
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def compile_all(pairs, root: Path, full: bool, workers: int, log, opts: str = "") -> dict:
    """{(spec, arch, module): (instructions, resources) or None (failed)} under one pipeline setting (`opts`: these
    cute-to-nvvm options instead of fa4gen's own, through FA4GEN_PASS_OPTIONS, which each compile reads, in this
    process or a compile process; CUTE_DSL_COMPILER_OPT would not do: CuTe-DSL reads it once per process, so an
    in-process second run would silently compile without it)."""
    from fa4gen.builder import compile_specs_for_sass
    from fa4gen.compile.sass import instruction_lines

    saved = {k: os.environ.get(k) for k in ("FA4GEN_FULL_PIPELINE", "FA4GEN_PASS_OPTIONS")}
    os.environ.pop("FA4GEN_PASS_OPTIONS", None)
    if full:
        os.environ["FA4GEN_FULL_PIPELINE"] = "1"
    else:
        os.environ.pop("FA4GEN_FULL_PIPELINE", None)
        if opts:
            os.environ["FA4GEN_PASS_OPTIONS"] = opts
    try:
        results = compile_specs_for_sass(pairs, root, "pc_full" if full else "pc_trim", workers=workers, log=log)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out = {}
    for (spec, _), rows in zip(pairs, results):
        for plan, report, sass in rows:
            out[(spec.name, plan.arch, plan.module)] = (instruction_lines(sass), resources(report.meta)) if sass and (
                report.status in ("compiled", "cached")) else None
    return out


def resources(meta: dict) -> list:
    """Each CUDA function's resources from the cubin (registers, shared memory, stack, ...), by function in the
    order of their names (which carry the cache key, so they are left out), and the module's spill counts."""
    kernels = meta.get("kernels", {})
    return [sorted(kernels[name].items()) for name in sorted(kernels)] + [
        (k, meta.get(k)) for k in ("registers", "smem_static", "smem_dynamic", "stack_frame", "spill_loads",
                                   "spill_stores")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="*", help="spec files (default: specs/*.yaml)")
    ap.add_argument("--archs", default="sm90,sm100", help="comma-separated: sm90, sm100")
    ap.add_argument("--workers", type=int, default=0, help="compile processes (0: auto)")
    ap.add_argument("--out", help="write the per-kernel rows as JSON here")
    ap.add_argument("--options", default="", help="compare the whole pipeline with these cute-to-nvvm options "
                    "(e.g. 'use-strength-reduction-pass=false') instead of fa4gen's SKIPPED_PASS_OPTIONS")
    ap.add_argument("--dump", help="write each differing kernel's two instruction lists into this folder")
    args = ap.parse_args(argv)

    from fa4gen.plan import plan_kernels
    from fa4gen.spec import load_spec

    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    bad = [a for a in archs if a not in ("sm90", "sm100")]
    if bad:
        ap.error(f"--archs: unknown arch {bad[0]!r} (expected sm90 and/or sm100)")
    paths = [Path(p) for p in args.specs] or sorted((ROOT / "specs").glob("*.yaml"))
    pairs = []
    for path in paths:
        spec = load_spec(path)
        plans = [p for arch in archs if arch in spec.targets for p in plan_kernels(spec, arch)]
        if plans:
            pairs.append((spec, plans))
    count = sum(len(plans) for _, plans in pairs)
    print(f"{count} kernels of {len(pairs)} specs, each compiled with the whole pipeline and the trimmed one",
          file=sys.stderr, flush=True)

    def log(msg):
        print(f"  {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="fa4gen-pc-") as tmp:
        t = time.perf_counter()
        full = compile_all(pairs, Path(tmp) / "full", True, args.workers, log)
        t_full = time.perf_counter() - t
        t = time.perf_counter()
        trim = compile_all(pairs, Path(tmp) / "trim", False, args.workers, log, args.options)
        t_trim = time.perf_counter() - t

    rows, failed = [], 0
    print("| spec | arch | kernel | instructions (whole / trimmed) | same SASS |")
    print("|---|---|---|---|---|")
    for key in full:
        a, b = full[key], trim.get(key)
        same = a is not None and a == b  # (the same instructions and the same resources)
        a, b = a and a[0], b and b[0]
        failed += not same
        if args.dump and not same:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            for mode, listing in (("whole", a), ("trimmed", b)):
                Path(args.dump, f"{key[0]}.{key[2]}.{mode}.txt").write_text("\n".join(listing or []) + "\n")
        rows.append(dict(spec=key[0], arch=key[1], kernel=key[2], whole=None if a is None else len(a),
                         trimmed=None if b is None else len(b), same=same))
        print(f"| {key[0]} | {key[1]} | {key[2]} | {rows[-1]['whole']} / {rows[-1]['trimmed']} | "
              f"{'yes' if same else '**no**'} |")
    print(f"\n{len(rows) - failed} of {len(rows)} kernels compile to the same SASS; wall time of the compiles "
          f"{t_full:.0f} s (whole) / {t_trim:.0f} s (trimmed)")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(rows=rows, whole_s=t_full, trimmed_s=t_trim), indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

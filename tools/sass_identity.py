"""Does this tree compile the same machine code as a git ref? Every kernel of the given specs (default: specs/*.yaml)
is compiled on the CPU (no GPU) twice: in this tree, and in a temporary worktree of REF (`git worktree add`,
removed after); the two SASS listings are compared instruction for instruction (addresses, encodings and the
kernel symbols, which carry the cache key, left out), and so are the cubins' resources (registers, shared memory,
stack, spill counts). A change to shared device helpers or templates that leaves a family's SASS identical needs no
GPU run for that family (docs/VERIFICATION.md); this is the check. Prints one row per kernel, exits 1 when any
differs or fails to compile.

Run: `PYTHONPATH=. python tools/sass_identity.py --ref main [specs/x.yaml ...] [--archs sm90] [--workers N]
[--out F.json] [--dump DIR]` (about 4 s a kernel per core and tree).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def listings(paths: list[str], archs: list[str], workers: int, out: Path) -> None:
    """Compile every kernel of `paths` for `archs` with the tree this process imports fa4gen from (fa4gen's own
    pipeline: `compile_all` of tools/pipeline_sass_check.py, trimmed) and write {"spec|arch|module": [instructions,
    resources] or null} to `out`."""
    from fa4gen.plan import plan_kernels
    from fa4gen.spec import load_spec
    from pipeline_sass_check import compile_all  # this script's folder, first on sys.path

    pairs = []
    for path in paths:
        spec = load_spec(Path(path))
        plans = [p for arch in archs if arch in spec.targets for p in plan_kernels(spec, arch)]
        if plans:
            pairs.append((spec, plans))
    with tempfile.TemporaryDirectory(prefix="fa4gen-sid-") as tmp:
        rows = compile_all(pairs, Path(tmp), False, workers, lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    out.write_text(json.dumps({"|".join(key): value for key, value in rows.items()}))


def _run_tree(tree: Path, paths: list[str], archs: list[str], workers: int, out: Path) -> dict:
    """`listings` in a child process (this script, run again) whose fa4gen, templates and helpers are `tree`'s."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps([paths, archs, workers]),
                    "--ref", "-", "--out", str(out)], env=env, cwd=tree, check=True)
    return json.loads(out.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="*", help="spec files (default: specs/*.yaml), read from this tree for both")
    ap.add_argument("--ref", required=True, help="the git ref to compare against (e.g. main, HEAD~1)")
    ap.add_argument("--archs", default="sm90,sm100", help="comma-separated: sm90, sm100")
    ap.add_argument("--workers", type=int, default=0, help="compile processes per tree (0: auto)")
    ap.add_argument("--out", help="write the per-kernel rows as JSON here")
    ap.add_argument("--dump", help="write each differing kernel's two instruction lists into this folder")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: compile in this process's tree, write --out
    args = ap.parse_args(argv)
    if args.child:
        paths, archs, workers = json.loads(args.child)
        listings(paths, archs, workers, Path(args.out))
        return 0
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    bad = [a for a in archs if a not in ("sm90", "sm100")]
    if bad:
        ap.error(f"--archs: unknown arch {bad[0]!r} (expected sm90 and/or sm100)")
    paths = [str(Path(p).resolve()) for p in args.specs] or [str(p) for p in sorted((ROOT / "specs").glob("*.yaml"))]
    rev = subprocess.run(["git", "rev-parse", "--verify", f"{args.ref}^{{commit}}"], cwd=ROOT, capture_output=True,
                         text=True)
    if rev.returncode:
        ap.error(f"--ref: {args.ref!r} is not a commit of this repository ({rev.stderr.strip()})")
    with tempfile.TemporaryDirectory(prefix="fa4gen-sid-") as tmp:
        ref_tree = Path(tmp) / "ref"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(ref_tree), rev.stdout.strip()], cwd=ROOT,
                       check=True)
        try:
            print(f"compiling in {args.ref} ({rev.stdout.strip()[:10]}) ...", file=sys.stderr, flush=True)
            ref = _run_tree(ref_tree, paths, archs, args.workers, Path(tmp) / "ref.json")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(ref_tree)], cwd=ROOT, check=False)
        print("compiling in this tree ...", file=sys.stderr, flush=True)
        new = _run_tree(ROOT, paths, archs, args.workers, Path(tmp) / "new.json")

    rows, differ = [], 0
    print(f"| spec | arch | kernel | instructions ({args.ref} / this tree) | same SASS |")
    print("|---|---|---|---|---|")
    for key in sorted(set(ref) | set(new)):
        a, b = ref.get(key), new.get(key)
        same = a is not None and a == b
        differ += not same
        if args.dump and not same:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            for side, v in (("ref", a), ("new", b)):
                Path(args.dump, f"{key.replace('|', '.')}.{side}.txt").write_text("\n".join(v[0] if v else []) + "\n")
        spec, arch, kernel = key.split("|")
        na, nb = (None if v is None else len(v[0]) for v in (a, b))
        rows.append(dict(spec=spec, arch=arch, kernel=kernel, ref=na, new=nb, same=same))
        print(f"| {spec} | {arch} | {kernel} | {na} / {nb} | {'yes' if same else 'NO'} |")
    print(f"{len(rows) - differ} of {len(rows)} kernels compile to the same SASS and resources as {args.ref}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

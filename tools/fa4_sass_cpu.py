"""flash-attn-4's SM90 kernels compiled on the CPU (no GPU) and their loops listed the way tools/sass_loops.py lists
fa4gen's: per loop that issues MMAs, its instructions, MMAs, MUFU.EX2, LDL/STL and most frequent opcodes. Puts the
hand-written reference's key-block loop next to ours between GPU sessions (session 33: flash-attn-4's d128 backward
loop without a mask is 465 instructions to our 453, its d64 causal loop 714, always masked, to our 684 masked /
576 unmasked; its statistics come by 64 SHFL + 4 LDS per block where ours take 32 LDS).

flash-attn-4 comes from its wheel (`--fa4-wheel`, default .device/anchors/, as tools/compile_time_cpu.py) and
compiles in a child process under torch's FakeTensorMode with CUTE_DSL_ARCH=sm_90a and CUTE_DSL_KEEP=cubin:
the forward through `flash_attn_func`, the backward through its `_flash_attn_bwd` with the arguments
`flash_attn_func`'s autograd passes by default (the autograd engine itself needs a CUDA device guard, which a
CPU build of torch lacks). The shape is (2, 1024, 8, D), MHA.

Run: `PYTHONPATH=. python tools/fa4_sass_cpu.py --dim 128|192x128 [--causal] [--direction fwd|bwd] [--ops 32]
[--cycles] [--keep DIR]`,
then e.g. `PYTHONPATH=. python tools/sass_loops.py '{"name": "x", "targets": ["sm90"], "dtype": "bf16",
"head_dim": 128, "mask": {"kind": "none"}, "backward": true, "allow_gqa": false}' --ops 32` for fa4gen's.
`--cycles` adds each loop's static issue cycles and MUFU.EX2 stream, as `tools/sass_loops.py --cycles` prints ours
(session 60: flash-attn-4's d128 causal backward loop 844 cycles, ours 1,068). `--cubins FILE ...` lists the loops of
cubins built elsewhere instead: the GPU machine's DSL libraries are the cu13 build and this machine's the cu12 one,
and their ptxas allocate differently (session 77: the d64 no-mask one-CTA forward's loop builds its K / V descriptors
in vector registers here, where session 43's H200 listing had uniform ones), so for the GPU's own SASS bring its
cubins here: `tools/gpu_cubins.sh $OUT/cubins.tar -- python3 tools/bench_fwd.py ...` on the GPU keeps flash-attn-4's
(CUTE_DSL_KEEP=cubin with its own disk cache off, else a cached kernel writes none) and fa4gen's cache artifacts
(its compile ignores CUTE_DSL_KEEP) in one flat tar, which `--cubins` reads. `--bodies DIR` writes each loop's
instructions with their stall counts, one file per loop, to diff two kernels' loops (session 78: flash-attn-4's d64
forward loop multiplies O between its exponentials, ours behind the rescale vote's branch).
"""

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from compile_time_cpu import FA4_PRELUDE, unpack_fa4  # noqa: E402

CHILD = FA4_PRELUDE + """
from torch._subclasses.fake_tensor import FakeTensorMode
from flash_attn.cute.interface import flash_attn_func, _flash_attn_bwd
with FakeTensorMode(allow_non_fake_inputs=True):
    q, k = (torch.empty(2, 1024, 8, {dim}, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    v, out, dout = (torch.empty(2, 1024, 8, {dim_v}, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    if {direction!r} == "fwd":
        flash_attn_func(q, k, v, causal={causal})
    else:
        lse = torch.empty(2, 8, 1024, dtype=torch.float32, device="cuda")
        _flash_attn_bwd(q, k, v, out, dout, lse, causal={causal})
print("COMPILED")
"""

# the main kernel's cubin among what the child keeps (pre/postprocess kernels are listed too, after it)
MAIN = {"fwd": "FlashAttentionForwardSm90", "bwd": "FlashAttentionBackwardSm90"}


def compile_fa4(dim: int, causal: bool, direction: str, wheel_dir: Path, keep: Path,
                dim_v: int | None = None, ptx: bool = False) -> list[Path]:
    """flash-attn-4's cubins for one call (V's head dim `dim_v`, default `dim`), compiled in a child process into
    `keep`; with `ptx`, its PTX next to them (to read with tools/ptx_livethrough.py)."""
    with tempfile.TemporaryDirectory(prefix="fa4-sass-") as tmp:
        site = unpack_fa4(wheel_dir, Path(tmp) / "site")
        env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132",
                   FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="0", CUTE_DSL_KEEP="ptx,cubin" if ptx else "cubin",
                   CUTE_DSL_DUMP_DIR=str(keep))
        code = CHILD.format(site=str(site), dim=dim, dim_v=dim_v or dim, causal=causal, direction=direction)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0 or "COMPILED" not in r.stdout:
        tail = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        raise SystemExit(f"flash-attn-4 did not compile (d{dim}, {direction}): {tail}")
    cubins = sorted(keep.glob("*.cubin"), key=lambda p: (MAIN[direction] not in p.name, p.name))
    if not cubins:
        raise SystemExit(f"flash-attn-4 compiled but left no cubin in {keep} (CUTE_DSL_KEEP=cubin)")
    return cubins


def describe(name: str, raw: bytes, ops: int, cycles: bool = False, bodies: Path | None = None) -> list[str]:
    """One line per kernel function with MMA loops of the cubin (or host object) `raw`, named `name`, then a line per
    loop (as tools/sass_loops.py), and with `cycles` a line per loop of its static issue cycles (tools/sass_loops.py
    --cycles; with `ops`, also its opcodes of the most cycles). With `bodies`, each loop's instructions (as
    `fa4gen.compile.sass.instruction_lines` compares them, each with its stall count) go to
    bodies/<name's stem>.<function index>.loop<loop index>.sass, for a side-by-side diff of two kernels' loops."""
    from sass_loops import _mma_loops, loop_cycles, loop_lines, loop_rows

    from fa4gen.compile.sass import control_listing

    lines = []
    # the control listing reads as the plain one (each instruction line ends in its stall count); a host object
    # (fa4gen's cache artifacts) is read as the cubins it embeds
    listing = control_listing(raw)
    for f, fn in enumerate(listing.split(".section\t.text.")[1:]):
        if not loop_rows(fn):
            continue
        function = fn.split("\n", 1)[0].split(",")[0]
        spills = len(re.findall(r"\b(?:LDL|STL)\b", fn))
        lines.append(f"{function[:100]}: {fn.count(chr(10))} lines, {spills} LDL/STL")
        lines += loop_lines(fn, ops=ops)
        if cycles:
            lines += loop_cycles(fn, ops=ops)
        if bodies is not None:
            bodies.mkdir(parents=True, exist_ok=True)
            for k, (body, _) in enumerate(_mma_loops(fn, 1)):
                out = bodies / f"{_stem(name)}.{f}.loop{k}.sass"
                out.write_text("".join(_bare(b) + "\n" for b in body))
                lines.append(f"    loop {k}: {len(body)} instructions in {out}")
    return lines


def _stem(name: str) -> str:
    """A short file stem for a cubin or artifact name (CuTe-DSL's cubin names run to hundreds of characters)."""
    stem = re.sub(r"\.(sm_\d+a?\.cubin|cubin|o)$", "", name)
    return stem if len(stem) <= 60 else stem[:40] + "_" + hashlib.sha1(stem.encode()).hexdigest()[:12]


def _bare(line: str) -> str:
    """A listing line as `instruction_lines` compares it (no address, encoding or symbol), with its stall count."""
    from fa4gen.compile.sass import instruction_lines, issue_cycles

    text = " ".join(instruction_lines(line)) or line.strip()
    return f"{text:<64} # stall {issue_cycles([line])}"


def cubin_inputs(paths: list[Path]) -> list[tuple[str, bytes]]:
    """(name, bytes) of each --cubins argument: a cubin or host object as it is, a tar (e.g. the GPU machine's
    tools/gpu_cubins.sh output) as each of its .cubin / .o members, sorted by name."""
    out = []
    for path in paths:
        if tarfile.is_tarfile(path):
            with tarfile.open(path) as tar:
                members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith((".cubin", ".o"))),
                                 key=lambda m: m.name)
                if not members:
                    raise SystemExit(f"--cubins: {path} holds no .cubin or .o file")
                out += [(Path(m.name).name, tar.extractfile(m).read()) for m in members]
        else:
            out.append((path.name, path.read_bytes()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", default="128", help="head dim (64, 96, 128, 192, 256), or DxDV for V's own (192x128)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--direction", choices=("fwd", "bwd"), default="bwd")
    ap.add_argument("--ops", type=int, default=0, metavar="N", help="also the N most frequent opcodes of each loop")
    ap.add_argument("--fa4-wheel", type=Path, default=ROOT / ".device" / "anchors",
                    help="folder with the flash_attn_4, quack_kernels and einops wheels")
    ap.add_argument("--cycles", action="store_true",
                    help="also each loop's static issue cycles and MUFU.EX2 stream (from the control codes)")
    ap.add_argument("--keep", type=Path, default=None, help="keep flash-attn-4's cubins in this folder")
    ap.add_argument("--ptx", action="store_true", help="also keep flash-attn-4's PTX (in --keep's folder)")
    ap.add_argument("--cubins", type=Path, nargs="+", metavar="CUBIN", default=None,
                    help="no compile: list the loops of these cubins, or of the cubins embedded in host objects "
                         "(fa4gen's cache artifacts), e.g. ones a GPU machine built with its own toolchain; a tar "
                         "(tools/gpu_cubins.sh's) is read as its .cubin / .o members")
    ap.add_argument("--bodies", type=Path, default=None, metavar="DIR",
                    help="also write each MMA loop's instructions (with their stall counts) to DIR, one file per "
                         "loop, to diff two kernels' loops")
    args = ap.parse_args(argv)
    if args.cubins:
        missing = [str(c) for c in args.cubins if not c.is_file()]
        if missing:
            ap.error(f"--cubins: no such file: {', '.join(missing)}")
        for name, raw in cubin_inputs(args.cubins):
            print(f"== {name}")
            for line in describe(name, raw, args.ops, args.cycles, args.bodies):
                print(line)
        return 0
    d, x, dv = args.dim.partition("x")
    if not (d.isdigit() and (dv.isdigit() if x else not dv)):
        ap.error(f"--dim: expected a head dim such as 128 or DxDV such as 192x128, got {args.dim!r}")
    with tempfile.TemporaryDirectory(prefix="fa4-cubins-") as tmp:
        keep = args.keep or Path(tmp)
        keep.mkdir(parents=True, exist_ok=True)
        for cubin in compile_fa4(int(d), args.causal, args.direction, args.fa4_wheel, keep, int(dv) if dv else None,
                                 args.ptx):
            for line in describe(cubin.name, cubin.read_bytes(), args.ops, args.cycles, args.bodies):
                print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

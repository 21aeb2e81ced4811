"""Cold compile of one forward kernel, fa4gen against flash-attn-4, on the CPU (no GPU): #3's target
"cold compile per variant no slower than flash-attn-4's first call", tracked between GPU sessions.

Each round runs two fresh processes in alternating order (the CPU's run-to-run spread is large): fa4gen
compiling, into an empty disk cache, the kernel that its first call of a (1, 128, 1, 128) bf16 causal d128 call
compiles (the spec of tools/launch_cost.py; `--seqlen-q`: the kernel of another length; `--head-dim` / `--mask`:
another variant, both sides; `--backward`: the backward kernels instead, fa4gen's backward module against
flash-attn-4's `_flash_attn_bwd`), and flash-attn-4's `flash_attn_func` on the same shape under
torch's FakeTensorMode (its CPU-only compile path: FLASH_ATTENTION_ARCH / CUTE_DSL_ARCH sm_90a). Both have
cutlass imported before the clock starts, as `import flash_attn.cute` does. Each child also reports where the
time went: CuTe-DSL's tracing of the Python kernel into MLIR, the MLIR pipeline with code generation and
ptxas (one native call), and, for fa4gen, the export of the compiled module as an object (`export_s`: its host code
through LLVM at O3, ~0.24 s of the d128 backward's ~1.8 s on the dev CPU, session 59) and the cache's side files
(`link_s`: the shared-library link). Sessions before 59 reported the two summed as `cache_write_s`. `host_codegen_s`
times that host-code codegen on both sides (flash-attn-4 runs it when its compiled function makes its callable).

flash-attn-4 comes from its wheel (`--fa4-wheel`, default: the one `../shared/device/pack.sh --anchors` put
under .device/anchors/, with quack and einops beside it), unpacked into a temporary folder; quack's autotuner
module, which imports triton (not a dependency here) and which the forward does not use, is replaced by a
stand-in in that child only.

Run: `PYTHONPATH=. python tools/compile_time_cpu.py [--rounds 3] [--out FILE.json] [--pass-timing N]`;
`--against-ref` times this tree against `tools/ab_bench.sh prepare REF`'s .ab/ref instead (paired, alternating). The H200's number is
`tools/launch_cost.py`'s (cold_process_cutlass_imported against flash_attn_4_cold_process).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = dict(name="compile_time_d128", targets=["sm90"], dtype="bf16", head_dim=128, mask={"kind": "causal"})


def spec_for(head_dim: int, causal: bool, backward: bool = False) -> dict:
    """The timed spec: d128 causal is SPEC (its name, so its cache keys, unchanged); other variants by --head-dim /
    --mask; with `backward`, an MHA training spec (backward: true, allow_gqa: false: the grid's backward)."""
    if (head_dim, causal, backward) == (128, True, False):
        return SPEC
    return dict(SPEC, name=f"compile_time_d{head_dim}_{'causal' if causal else 'none'}{'_bwd' if backward else ''}",
                head_dim=head_dim, mask={"kind": "causal" if causal else "none"},
                **(dict(backward=True, allow_gqa=False) if backward else {}))

# timers around CuTe-DSL's tracing and its native compile (pass pipeline, code generation, ptxas)
HOOK = """
import functools, inspect, time
from cutlass.base_dsl import compiler as _C, dsl as _D
SPLIT = {}
def _timed(owner, name, label):
    f = getattr(owner, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            SPLIT[label] = SPLIT.get(label, 0.0) + time.perf_counter() - t
    setattr(owner, name, w)
_NATIVE = next(c for _, c in inspect.getmembers(_C, inspect.isclass)
               if "compile" in c.__dict__ and "PassManager" in inspect.getsource(c.__dict__["compile"]))
_timed(_NATIVE, "compile", "native_s")
_timed(next(c for _, c in inspect.getmembers(_D, inspect.isclass) if "generate_original_ir" in c.__dict__),
       "generate_original_ir", "trace_s")
# the host code's LLVM codegen into an object, which both sides pay with TVM-FFI: fa4gen in its export (inside
# export_s), flash-attn-4 when its compiled function makes its callable
try:
    from cutlass.cutlass_dsl import tvm_ffi_provider as _TP
    _timed(_TP._aot_support, "export_module_to_bytes", "host_codegen_s")
except (ImportError, AttributeError):
    pass
# Python's cyclic collector: its time inside the clock and how many full (generation 2) collections ran
import gc
_GC = [0.0]
def _gc_cb(phase, info):
    if phase == "start":
        _GC[0] = time.perf_counter()
    else:
        SPLIT["gc_s"] = SPLIT.get("gc_s", 0.0) + time.perf_counter() - _GC[0]
        SPLIT["gc_full"] = SPLIT.get("gc_full", 0) + (info["generation"] == 2)
gc.callbacks.append(_gc_cb)
"""

# with --pass-timing: MLIR's per-pass timing of the native compile (the pass manager's own report, on stderr)
PASS_HOOK = """
_plain = _NATIVE.compile
def _compile_timed(self, module, pipeline, *a, **k):
    parse = self.passmanager.PassManager.parse
    def parse_timed(text, *pa, **pk):
        pm = parse(text, *pa, **pk)
        pm.enable_timing()
        return pm
    self.passmanager.PassManager.parse = staticmethod(parse_timed)
    try:
        return _plain(self, module, pipeline, *a, **k)
    finally:
        self.passmanager.PassManager.parse = parse
_NATIVE.compile = _compile_timed
"""
PASS_LINE = re.compile(r"^\s*([0-9.]+) \(\s*[0-9.]+%\)\s+(\S.*?)\s*$")

OURS = """
import json, sys, time
import torch, cutlass
{hook}
import fa4gen
from fa4gen.compile import aot
_timed(aot, "export_object", "export_s")
_timed(aot, "_cache_extras", "link_s")
pkg = fa4gen.build({spec!r})
op = pkg._forward
plan = {plan}
SPLIT.clear()
t = time.perf_counter()
op.function(plan)
print("RESULT", json.dumps(dict(first_compile_s=time.perf_counter() - t, kernel=plan["module"], fa4gen_from=fa4gen.__file__,
                                **SPLIT)))
"""

# the plan fa4gen's child compiles: the forward of a call's length, or (--backward) the spec's backward module, whose
# one compile holds the preprocess, the main kernel and the conversions (the forward is then not compiled)
PLAN_FWD = 'op.forward_plan("sm90", {seqlen_q})'
PLAN_BWD = 'op.bwd_plans["sm90"]'

# a child process's start with flash-attn-4 importable from its unpacked wheels (`site`; format-escaped braces)
FA4_PRELUDE = """
import json, os, sys, time, types
sys.path.insert(0, {site!r})
stub = types.ModuleType("quack.autotuner")  # imports triton; flash-attn-4's kernels do not autotune
stub.autotune = lambda *a, **k: (lambda f: f)
stub.AutotuneConfig = type("AutotuneConfig", (), {{"__init__": lambda self, *a, **k: None}})
sys.modules["quack.autotuner"] = stub
import torch, cutlass
"""

FA4 = FA4_PRELUDE + """{hook}
from flash_attn.cute.interface import _flash_attn_bwd, flash_attn_func
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode(allow_non_fake_inputs=True):
    q = torch.empty(1, 128, 1, {head_dim}, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(1, 1, 128, dtype=torch.float32, device="cuda")
    SPLIT.clear()
    t = time.perf_counter()
    {call}
    print("RESULT", json.dumps(dict(first_compile_s=time.perf_counter() - t, **SPLIT)))
"""
# flash-attn-4's timed call: its forward, or (--backward) _flash_attn_bwd on the fake tensors, which compiles its
# preprocess, main and postprocess kernels (and not the forward)
CALL_FWD = "flash_attn_func(q, q, q, causal={causal})"
CALL_BWD = "_flash_attn_bwd(q, q, q, q, q, lse, None, {causal}, 0.0)"


def child_code(backward: bool, hook: str, spec: dict, seqlen_q: int) -> str:
    """fa4gen's child: compile the timed plan of `spec` into an empty cache."""
    return OURS.format(hook=hook, spec=spec, plan=PLAN_BWD if backward else PLAN_FWD.format(seqlen_q=seqlen_q))


def fa4_code(backward: bool, hook: str, site: str, head_dim: int, causal: bool) -> str:
    """flash-attn-4's child: its first call of the same variant on fake tensors."""
    call = (CALL_BWD if backward else CALL_FWD).format(causal=causal)
    return FA4.format(hook=hook, site=site, head_dim=head_dim, call=call)


def run_child(code: str, env: dict, passes: int = 0, cwd: Path = ROOT) -> dict:
    """One child's RESULT. `cwd`: with --against-ref a temporary folder, since `python -c` puts its working
    directory first on sys.path and the project root would shadow the reference tree (session 44)."""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=cwd)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        tail = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        raise SystemExit(f"child failed: {tail}")
    out = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in json.loads(line[len("RESULT "):]).items()}
    if passes:  # the slowest passes of the pass manager's timing report (its "Total" line first)
        timed = [(float(m[1]), m[2]) for m in map(PASS_LINE.match, r.stderr.splitlines()) if m]
        out["passes"] = [[name, round(t, 3)] for t, name in sorted(timed, reverse=True)[:passes + 1]]
    return out


def ir_counts(folder: Path) -> dict:
    """Op lines (`=`), `scf.if` regions and register loads in the kernels' clean MLIR (KEEP=ir) under folder."""
    text = "\n".join(f.read_text() for f in sorted(folder.glob("*_clean.mlir")))
    if not text:
        raise SystemExit(f"--ir-ops: no *_clean.mlir written under {folder} (CuTe-DSL's KEEP=ir)")
    lines = text.splitlines()
    return dict(op_lines=sum("=" in ln for ln in lines), scf_if=sum("scf.if" in ln for ln in lines),
                memref_load=sum("cute.memref.load" in ln for ln in lines))


def unpack_fa4(wheel_dir: Path, into: Path) -> Path:
    """flash-attn-4, quack and einops unpacked from their wheels in wheel_dir (pure Python)."""
    wheels = [next(wheel_dir.glob(f"{name}-*.whl"), None) for name in ("flash_attn_4", "quack_kernels", "einops")]
    if None in wheels:
        raise SystemExit(f"--fa4-wheel: expected flash_attn_4, quack_kernels and einops wheels in {wheel_dir} "
                         "(../shared/device/pack.sh --anchors makes them)")
    for whl in wheels:
        with zipfile.ZipFile(whl) as z:
            z.extractall(into)
    return into


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fa4-wheel", type=Path, default=ROOT / ".device" / "anchors",
                    help="folder with the flash_attn_4, quack_kernels and einops wheels")
    ap.add_argument("--seqlen-q", type=int, default=128,
                    help="fa4gen compiles the forward kernel a call of this many query rows runs (128: the persistent "
                         "short-call kernel, as tools/launch_cost.py's first call; 8192: the one-CTA-per-tile kernel); "
                         "flash-attn-4 always compiles its one kernel of the 128-row call")
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 96, 128, 192, 256),
                    help="head dim of the timed call, both sides (default 128)")
    ap.add_argument("--mask", choices=("causal", "none"), default="causal", help="the call's mask, both sides")
    ap.add_argument("--backward", action="store_true",
                    help="time the backward kernels' first compile instead (both sides; --seqlen-q does not apply)")
    ap.add_argument("--out", type=Path, help="also write the rounds and medians here (JSON)")
    ap.add_argument("--pass-timing", type=int, default=0, metavar="N",
                    help="also report the N slowest MLIR passes of each native compile (the pass manager's timing; "
                         "CudaToBinaryPass holds LLVM's NVPTX code generation and ptxas)")
    ap.add_argument("--ir-ops", action="store_true",
                    help="also count each kernel's MLIR after canonicalize + CSE (CuTe-DSL's KEEP=ir): op lines, "
                         "scf.if regions, register loads. Deterministic, where the times move +-25%% between runs")
    ap.add_argument("--against-ref", action="store_true",
                    help="time this tree against the reference tree of `tools/ab_bench.sh prepare REF` (.ab/ref) "
                         "instead of flash-attn-4, same kernel, alternating order; prints paired ratios")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds: expected a positive count")
    spec = spec_for(args.head_dim, args.mask == "causal", args.backward)
    hook = HOOK + (PASS_HOOK if args.pass_timing else "")
    ours = child_code(args.backward, hook, spec, args.seqlen_q)
    if args.against_ref:
        return against_ref(args, ours)
    rows = {"fa4gen": [], "flash_attn_4": []}
    with tempfile.TemporaryDirectory(prefix="fa4gen-ct-") as tmp:
        site = unpack_fa4(args.fa4_wheel, Path(tmp) / "site")
        base = dict(os.environ, CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132",
                    FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="0", FA4GEN_QUIET="1",
                    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        for rnd in range(args.rounds):
            order = ["fa4gen", "flash_attn_4"] if rnd % 2 == 0 else ["flash_attn_4", "fa4gen"]
            for name in order:
                ir_dir, ir_env = Path(tmp) / f"ir_{name}{rnd}", {}
                if args.ir_ops:
                    ir_dir.mkdir()
                    ir_env = dict(CUTE_DSL_KEEP="ir", CUTE_DSL_DUMP_DIR=str(ir_dir))
                if name == "fa4gen":
                    env = dict(base, FA4GEN_CACHE_DIR=str(Path(tmp) / f"cache{rnd}"), **ir_env)  # empty: a compile
                    rows[name].append(run_child(ours, env, args.pass_timing))
                else:
                    code = fa4_code(args.backward, hook, str(site), args.head_dim, args.mask == "causal")
                    rows[name].append(run_child(code, dict(base, **ir_env), args.pass_timing))
                if args.ir_ops:
                    rows[name][-1]["ir"] = ir_counts(ir_dir)
                print(name, rows[name][-1], flush=True)
    med = {name: {k: round(statistics.median(r[k] for r in rs if k in r), 3)
                  for k in ("first_compile_s", "trace_s", "native_s", "host_codegen_s", "export_s", "link_s", "gc_s",
                            "gc_full")
                  if any(k in r for r in rs)}
           for name, rs in rows.items()}
    ratio = round(med["fa4gen"]["first_compile_s"] / med["flash_attn_4"]["first_compile_s"], 3)
    print(f"medians over {args.rounds} rounds: {json.dumps(med)}; fa4gen / flash-attn-4 first compile {ratio}")
    if args.out:
        args.out.write_text(json.dumps(dict(rounds=rows, medians=med, ratio=ratio), indent=1))
    return 0


def against_ref(args, ours: str) -> int:
    """--against-ref: this tree's first compile against .ab/ref's, each child run from an empty folder with its
    tree first on PYTHONPATH (each RESULT names the fa4gen it imported, checked here)."""
    ref = ROOT / ".ab" / "ref"
    if not (ref / "fa4gen").is_dir():
        raise SystemExit("--against-ref: no .ab/ref/fa4gen (run 'tools/ab_bench.sh prepare REF' first)")
    rows = {"fa4gen": [], "ref": []}
    with tempfile.TemporaryDirectory(prefix="fa4gen-ct-") as tmp:
        for rnd in range(args.rounds):
            for name in ("fa4gen", "ref") if rnd % 2 == 0 else ("ref", "fa4gen"):
                first = [str(ref)] if name == "ref" else []
                env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", FA4GEN_QUIET="1",
                           FA4GEN_CACHE_DIR=str(Path(tmp) / f"cache_{name}{rnd}"),
                           PYTHONPATH=os.pathsep.join(filter(None, [*first, str(ROOT), os.environ.get("PYTHONPATH")])))
                res = run_child(ours, env, args.pass_timing, cwd=Path(tmp))
                if Path(res["fa4gen_from"]).resolve().is_relative_to(ref.resolve()) != (name == "ref"):
                    raise SystemExit(f"side {name}: fa4gen came from {res['fa4gen_from']}")
                rows[name].append(res)
                print(name, res, flush=True)
    paired = {k: round(statistics.median(a[k] / b[k] for a, b in zip(rows["fa4gen"], rows["ref"])), 3)
              for k in ("first_compile_s", "trace_s", "native_s")}
    print(f"this tree / .ab/ref ({(ref / 'COMMIT').read_text().strip()[:12] if (ref / 'COMMIT').exists() else '?'}), "
          f"paired medians over {args.rounds} rounds: {json.dumps(paired)}")
    if args.out:
        args.out.write_text(json.dumps(dict(rounds=rows, paired=paired), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

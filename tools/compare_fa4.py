"""Compile flash-attn-4's own forward and fa4gen's on the CPU (sm_100a or sm_90a) and print their SASS
side by side: static instruction counts, and with --loops the loops that issue MMAs (instructions, MMAs,
MUFU.EX2 per loop body) — docs/SM100.md "Structural comparison with FlashAttention-4"; docs/PERF.md
(session 11) for sm_90a. `--cycles` adds each loop's static issue cycles (the stall counts ptxas encodes, summed;
tools/sass_loops.py --cycles). The backwards: tools/fa4_sass_cpu.py --cycles beside tools/sass_loops.py --cycles.

    .venv/bin/python tools/compare_fa4.py [--arch sm100|sm90] [--loops] [--cycles] [--markdown]

Needs flash-attn-4 (pip install --no-deps flash_attn_4-*.whl; quack-kernels, einops) in the venv, or its wheels
(`--fa4-wheel DIR`, default .device/anchors/ from ../shared/device/pack.sh --anchors when flash-attn-4 does not
import): unpacked into a temporary folder as tools/compile_time_cpu.py does, quack's autotuner (which imports
triton, unused by the kernels compiled here) replaced by a stand-in.
FA4 is driven through its public flash_attn_func under torch's FakeTensorMode: it plans and compiles
exactly what it would launch on a B200 / H100-class GPU (FLASH_ATTENTION_NUM_SMS stands in for the
driver's SM count), and nothing runs. Counts are static instructions in the binary, not executed ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

ARCH = "sm100"  # set by main() from --arch, before anything imports CuTe-DSL or flash-attn-4
os.environ.setdefault("FA4GEN_CACHE_DIR", tempfile.mkdtemp(prefix="fa4gen-cmp-cache-"))  # compile, not load
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPCODES_BY_ARCH = {
    "sm100": ("utchmma", "ldtm", "sttm", "mufu_ex2", "ffma", "ffma2", "utmaldg", "bar", "ldl", "stl", "total"),
    "sm90": ("hgmma", "mufu_ex2", "ffma", "utmaldg", "bar", "ldl", "stl", "total"),
}
TARGETS = {"sm100": ("sm_100", "sm_100a", "148"), "sm90": ("sm_90", "sm_90a", "132")}  # FA4 arch, CuTe arch, SMs
CASES = [  # (label, head_dim, head_dim_v, causal)
    ("d64", 64, 64, False),
    ("d128", 128, 128, False),
    ("d128 causal", 128, 128, True),
    ("d192/128 causal", 192, 128, True),
]


class _Device:
    """Stands in for cutlass.utils.HardwareInfo, which asks the CUDA driver for the SM count: FA4's
    static persistent scheduler sizes its grid with it while tracing."""

    def get_device_multiprocessor_count(self) -> int:
        return int(os.environ["FLASH_ATTENTION_NUM_SMS"])


def fa4_kernel(d: int, dv: int, causal: bool):
    """(meta, SASS text, seconds, control listing) of FA4's forward as flash_attn_func would compile it for the
    arch."""
    import cutlass.utils
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa4gen.compile.aot import export_object, inspect_object
    from fa4gen.compile.sass import control_listing
    from flash_attn.cute import interface

    cutlass.utils.HardwareInfo = _Device
    if ARCH == "sm90":
        from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90 as Kernel
    else:
        from flash_attn.cute.flash_fwd_sm100 import FlashAttentionForwardSm100 as Kernel

    seen = []  # FA4's kernel objects, kept alive: their SharedStorage is the dynamic shared memory
    setup = Kernel._setup_attributes
    Kernel._setup_attributes = lambda self: (seen.append(self), setup(self))[1]

    interface._flash_attn_fwd.compile_cache.clear()
    start = time.perf_counter()
    with FakeTensorMode():
        q = torch.empty(2, 4096, 16, d, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 4096, 16, d, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(2, 4096, 16, dv, dtype=torch.bfloat16, device="cuda")
        interface.flash_attn_func(q, k, v, causal=causal)
    seconds = time.perf_counter() - start
    (compiled,) = list(interface._flash_attn_fwd.compile_cache.cache.values())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fa4.o"
        export_object(compiled, path)
        obj = path.read_bytes()
    meta, sass = inspect_object(obj, keep_sass=True)
    Kernel._setup_attributes = setup
    storage = getattr(seen[-1], "shared_storage", None) if seen else None
    meta["smem"] = storage.size_in_bytes() if storage is not None else "?"  # dynamic: not in the cubin
    return meta, sass, seconds, control_listing(obj)


def fa4gen_kernel(d: int, dv: int, causal: bool):
    """(meta, SASS text, seconds, plan, control listing) of fa4gen's default forward for the arch, compiled here."""
    from fa4gen.builder import compile_for_sass, plan_spec
    from fa4gen.compile.cache import DiskCache
    from fa4gen.compile.sass import control_listing
    from fa4gen.spec import spec_from_dict

    spec = spec_from_dict({"name": f"cmp_d{d}_{dv}_{int(causal)}", "targets": [ARCH], "dtype": "bf16",
                           "head_dim": d, "head_dim_v": dv, "mask": {"kind": "causal" if causal else "none"}})
    plans, _ = plan_spec(spec, archs=[ARCH])
    # the default forward (a masked d <= 64 spec also has a 192-row one for long calls)
    root = Path(tempfile.mkdtemp(prefix="fa4gen-cmp-"))
    ((plan, report, sass),) = compile_for_sass(spec, plans[:1], root, "cmp")
    if report.status == "failed":
        raise RuntimeError(report.detail)
    entry = next(e for e in DiskCache(root / "cache").ls() if e.meta.get("name") == f"{spec.name}.{plan.module}")
    return report.meta, sass, report.seconds, plan, control_listing(entry.artifact_path.read_bytes())


def mma_loops(sass: str | None) -> str:
    """'instructions/MMAs/EX2' of each loop issuing MMAs, smallest first (the per-block bodies)."""
    from sass_loops import loop_rows  # tools/, this script's folder

    if not sass:
        return "no SASS"
    return ", ".join(f"{n}/{m}/{e}" for n, m, e, _ in sorted(loop_rows(sass))[:4])


def loop_issue_cycles(control: str | None) -> str:
    """'instructions/issue cycles/MUFU.EX2 stream cycles' of each loop issuing MMAs, smallest first (a control
    listing: fa4gen.compile.sass.disassemble_with_control)."""
    from sass_loops import loop_cycle_rows  # tools/, this script's folder

    if not control:
        return "no SASS"
    return ", ".join(f"{n}/{cycles}/{stream}" for n, cycles, _, stream, _ in sorted(loop_cycle_rows(control))[:4])


def row(name, meta, seconds, smem):
    s = meta["sass"]
    return [name, str(meta["registers"]), str(smem)] + [str(s.get(k, 0)) for k in OPCODES_BY_ARCH[ARCH]] + [f"{seconds:.1f}"]


def _use_fa4_wheels(wheel_dir: Path) -> None:
    """flash-attn-4 importable from its wheels in wheel_dir: unpacked into a temporary folder put first on
    sys.path, quack.autotuner (it imports triton; the forward and backward compiled here do not autotune)
    replaced by a stand-in module."""
    import types

    from compile_time_cpu import unpack_fa4  # tools/, this script's folder

    sys.path.insert(0, str(unpack_fa4(wheel_dir, Path(tempfile.mkdtemp(prefix="fa4-wheels-")))))
    stub = types.ModuleType("quack.autotuner")
    stub.autotune = lambda *a, **k: (lambda f: f)
    stub.AutotuneConfig = type("AutotuneConfig", (), {"__init__": lambda self, *a, **k: None})
    sys.modules["quack.autotuner"] = stub


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["sm100", "sm90"], default="sm100")
    ap.add_argument("--loops", action="store_true", help="add each kernel's MMA loops: instructions/MMAs/EX2")
    ap.add_argument("--cycles", action="store_true",
                    help="add each kernel's MMA loops: instructions/static issue cycles/MUFU.EX2 stream cycles")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--fa4-wheel", type=Path, default=None,
                    help="folder with the flash_attn_4, quack_kernels and einops wheels (default when flash-attn-4 "
                         "does not import: .device/anchors)")
    args = ap.parse_args(argv)
    if args.fa4_wheel is not None or importlib.util.find_spec("flash_attn") is None:
        _use_fa4_wheels(args.fa4_wheel or Path(__file__).resolve().parents[1] / ".device" / "anchors")
    global ARCH
    ARCH = args.arch
    fa4_arch, cute_arch, sms = TARGETS[ARCH]
    os.environ.setdefault("FLASH_ATTENTION_ARCH", fa4_arch)
    os.environ.setdefault("CUTE_DSL_ARCH", cute_arch)
    os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", sms)
    header = ["kernel", "regs", "smem"] + [k.upper() for k in OPCODES_BY_ARCH[ARCH]] + ["compile s"]
    if args.loops:
        header.append("MMA loops (instr/MMA/EX2)")
    if args.cycles:
        header.append("MMA loops (instr/issue cycles/EX2 stream cycles)")

    def extra(sass, control):
        return ([mma_loops(sass)] if args.loops else []) + ([loop_issue_cycles(control)] if args.cycles else [])

    rows = [header]
    for label, d, dv, causal in CASES:
        meta, sass, seconds, plan, control = fa4gen_kernel(d, dv, causal)
        rows.append(row(f"{label}: fa4gen", meta, seconds, plan.smem_bytes) + extra(sass, control))
        try:
            fmeta, fsass, fsec, fcontrol = fa4_kernel(d, dv, causal)
            rows.append(row(f"{label}: FA4", fmeta, fsec, fmeta["smem"]) + extra(fsass, fcontrol))
        except Exception as err:  # noqa: BLE001 - one case FA4 cannot build is a row, not the end
            rows.append([f"{label}: FA4", f"failed: {type(err).__name__}: {str(err)[:80]}"])
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for r in rows[1:]:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(r[i]) if i < len(r) else 0 for r in rows) for i in range(len(header))]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()

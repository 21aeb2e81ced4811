"""Compile flash-attn-4's own SM100 forward and fa4gen's on the CPU for sm_100a, and print their SASS
side by side (docs/SM100.md: "Structural comparison with FlashAttention-4").

    FLASH_ATTENTION_ARCH=sm_100 CUTE_DSL_ARCH=sm_100a FLASH_ATTENTION_NUM_SMS=148 \
        .venv/bin/python tools/compare_fa4_sm100.py [--markdown]

Needs flash-attn-4 (pip install --no-deps flash_attn_4-*.whl; quack-kernels, einops) in the venv.
FA4 is driven through its public flash_attn_func under torch's FakeTensorMode: it plans and compiles
exactly what it would launch on a B200 (FLASH_ATTENTION_NUM_SMS stands in for the driver's SM count),
and nothing runs. Counts are static instructions in the binary, not executed ones.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_100")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "148")
os.environ.setdefault("FA4GEN_CACHE_DIR", tempfile.mkdtemp(prefix="fa4gen-cmp-cache-"))  # compile, not load
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPCODES = ("utchmma", "ldtm", "sttm", "mufu_ex2", "ffma", "ffma2", "utmaldg", "bar", "ldl", "stl", "total")
CASES = [  # (label, head_dim, head_dim_v, causal)
    ("d64", 64, 64, False),
    ("d128", 128, 128, False),
    ("d128 causal", 128, 128, True),
    ("d192/128 causal", 192, 128, True),
]


class _B200:
    """Stands in for cutlass.utils.HardwareInfo, which asks the CUDA driver for the SM count: FA4's
    static persistent scheduler sizes its grid with it while tracing."""

    def get_device_multiprocessor_count(self) -> int:
        return int(os.environ["FLASH_ATTENTION_NUM_SMS"])


def fa4_kernel(d: int, dv: int, causal: bool):
    """(meta, seconds) of FA4's forward as flash_attn_func would compile it for a B200."""
    import cutlass.utils
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa4gen.compile.aot import export_object, inspect_object
    from flash_attn.cute import interface

    cutlass.utils.HardwareInfo = _B200
    from flash_attn.cute.flash_fwd_sm100 import FlashAttentionForwardSm100

    seen = []  # FA4's kernel objects, kept alive: their SharedStorage is the dynamic shared memory
    setup = FlashAttentionForwardSm100._setup_attributes
    FlashAttentionForwardSm100._setup_attributes = lambda self: (seen.append(self), setup(self))[1]

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
        meta, _ = inspect_object(path.read_bytes(), keep_sass=True)
    FlashAttentionForwardSm100._setup_attributes = setup
    meta["smem"] = seen[-1].shared_storage.size_in_bytes()  # dynamic: not in the cubin
    return meta, seconds


def fa4gen_kernel(d: int, dv: int, causal: bool):
    from fa4gen.builder import compile_package, render_spec, write_package
    from fa4gen.spec import spec_from_dict

    spec = {"name": f"cmp_d{d}_{dv}_{int(causal)}", "targets": ["sm100"], "dtype": "bf16", "head_dim": d,
            "head_dim_v": dv, "mask": {"kind": "causal" if causal else "none"}}
    pkg, plans, _ = render_spec(spec_from_dict(spec), "tools/compare_fa4_sm100.py")
    out = Path(tempfile.mkdtemp(prefix="fa4gen-cmp-"))
    write_package(pkg, out)
    (report,) = compile_package(out / pkg.name, f"cmp_{pkg.name}", plans, keep_sass=True)
    if report.status == "failed":
        raise RuntimeError(report.detail)
    return report.meta, report.seconds, plans[0]


def row(name, meta, seconds, smem):
    s = meta["sass"]
    return [name, str(meta["registers"]), str(smem)] + [str(s.get(k, 0)) for k in OPCODES] + [f"{seconds:.1f}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    header = ["kernel", "regs", "smem"] + [k.upper() for k in OPCODES] + ["compile s"]
    rows = [header]
    for label, d, dv, causal in CASES:
        meta, seconds, plan = fa4gen_kernel(d, dv, causal)
        rows.append(row(f"{label}: fa4gen", meta, seconds, plan.smem_bytes))
        try:
            fmeta, fsec = fa4_kernel(d, dv, causal)
            rows.append(row(f"{label}: FA4", fmeta, fsec, fmeta["smem"]))
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

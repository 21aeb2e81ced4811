"""Golden tests: measure how far kernels are from the emulator and the reference, case by case.

`python -m fa4gen.golden.calibrate [PACKAGE_DIR...]` (Hopper GPU) prints, for every golden case of
every package (default: generated/*), the kernel's error against the exact reference as a
fraction of its budget, its distance to the emulator in ulps (max, and the share of bit-identical
elements) and the LSE differences. This is the data behind the tolerances in
fa4gen.golden.tolerance; rerun it when the kernel or the emulator changes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from fa4gen.emulate import emulate_forward
from fa4gen.golden.checks import TORCH_DTYPES, _poison_allocator, case_seed, cases, kernel_of, make_inputs
from fa4gen.golden.tolerance import against_emulator, against_reference, reference_budget
from fa4gen.golden.variants import is_package, load_variant, packages_under
from fa4gen.reference import attention_ref, mask_semantics


def measure(variant, plan) -> list[str]:
    pkg = variant.load()
    dtype = TORCH_DTYPES[plan["dtype"]]
    lines = []
    for case in cases(plan):
        q, k, v = make_inputs(plan, case, seed=case_seed(variant, case), device="cuda")
        b, s_q, _, h, _ = case.shape
        out = torch.full((b, s_q, h, plan["head_dim_v"]), float("nan"), device="cuda", dtype=dtype)
        _poison_allocator((b, h, s_q))
        with kernel_of(pkg, plan):
            res = pkg.attention(q, k, v, out=out, return_lse=plan["write_lse"], **case.kwargs())
        torch.cuda.synchronize()
        sem = mask_semantics(plan, window=case.window, chunk_size=case.chunk_size)
        exact, exact_lse = attention_ref(q, k, v, **sem)
        low, _ = attention_ref(q, k, v, upcast=False, **sem)
        emu, emu_lse = emulate_forward(q.cpu(), k.cpu(), v.cpu(), plan, **case.kwargs())
        budget = reference_budget(exact, low)
        line = (f"{variant.name:24s} {case.label():44s} ref {against_reference(out, exact, low).worst:5.2f} "
                f"emu-ref {against_reference(emu.to(exact.device), exact, low).worst:5.2f} "
                f"emu: {against_emulator(out, emu, dtype, budget).detail}")
        if plan["write_lse"]:
            lse = res[1].cpu()
            fin = ~emu_lse.isinf()
            d_emu = (lse[fin] - emu_lse[fin]).abs().max().item() if fin.any() else 0.0
            d_ref = (lse[fin] - exact_lse.cpu()[fin]).abs().max().item() if fin.any() else 0.0
            line += f"  lse-emu {d_emu:.2e} lse-ref {d_ref:.2e}"
        lines.append(line)
    return lines


def main(argv: list[str]) -> int:
    if argv:
        variants = [load_variant(Path(a)) for a in argv if is_package(Path(a))]
    else:
        variants, problems = packages_under(Path("generated"))
        for line in problems:
            print(line, file=sys.stderr)
    for variant in variants:
        for plan in variant.plans:
            if plan["arch"] == "sm90" and plan["direction"] == "fwd":
                print("\n".join(measure(variant, plan)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

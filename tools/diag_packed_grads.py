"""Per-row gradient errors of a packed (varlen) backward golden case, on the lent GPU: for each of dq,
dk, dv, the kernel's max error per packed row against the exact reference next to the low-precision
reference's, and where the worst one sits. Written to diagnose qwen2_7b_packed's dq (with dlse) miss in
session 4 (docs/perf/2026-11-29_s4_qwen_dq_diag.txt): ulp-sized errors, no wrong rows.

Run: `source tools/device_env.sh; python3 tools/diag_packed_grads.py [generated/qwen2_7b_packed]`.
"""

import sys
from pathlib import Path

import torch

from fa4gen.golden import packed
from fa4gen.golden.checks import case_seed, cases
from fa4gen.golden.variants import load_variant
from fa4gen.reference import attention_ref_grads, mask_semantics

SHAPES = [(3, 1, 1, 2, 2), (1, 113, 203, 4, 2)]  # two of the backward's golden case shapes


def main() -> int:
    var = load_variant(Path(sys.argv[1] if len(sys.argv) > 1 else "generated/qwen2_7b_packed"))
    plan = next(p for p in var.lock["plans"] if p["direction"] == "bwd" and not p.get("mha_only"))
    pkg = var.load()
    for shape in SHAPES:
        case = next(cases(plan, [shape]))
        seed = case_seed(var, case)
        for with_dlse in (False, True):
            q, k, v, seq = packed.case_inputs(plan, case.shape, seed=seed, device="cuda")
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out, lse = pkg.attention(q, k, v, return_lse=True, **seq)
            gen = torch.Generator(device="cuda").manual_seed(seed + 1)  # the golden check's output grads
            dout = torch.randn(out.shape, generator=gen, device="cuda", dtype=out.dtype)
            dlse = torch.randn(lse.shape, generator=gen, device="cuda", dtype=torch.float32) if with_dlse else None
            torch.autograd.backward([out, lse] if with_dlse else [out], [dout, dlse] if with_dlse else [dout])
            sem = mask_semantics(plan, window=None, chunk_size=None)
            exact = attention_ref_grads(q, k, v, dout, dlse=dlse, packed=seq, **sem)
            low = attention_ref_grads(q, k, v, dout, dlse=dlse, upcast=False, packed=seq, **sem)
            print(shape, "dlse" if with_dlse else "no dlse", "cu_q", seq["cu_seqlens_q"].tolist(),
                  "cu_k", seq["cu_seqlens_k"].tolist())
            for name, t, e, lo in zip("qkv", (q, k, v), exact, low):
                err = (t.grad.float() - e).abs().amax(dim=(1, 2))
                low_err = (lo.float() - e).abs().amax(dim=(1, 2))
                i = int(err.argmax())
                print(f"  d{name}: max err {err.max().item():.4g} at row {i} (low-precision: max "
                      f"{low_err.max().item():.4g}, {low_err[i].item():.4g} at that row; |exact| there "
                      f"{e[i].abs().max().item():.3g})")
                print("    per-row err:", [round(x, 4) for x in err.tolist()[:40]])
                print("    per-row low:", [round(x, 4) for x in low_err.tolist()[:40]])
            q.grad = k.grad = v.grad = None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

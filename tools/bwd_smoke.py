"""Kernel-level check of the SM90 backward (no autograd wiring): build backward specs, call the
compiled backward directly with its workspaces, compare dQ/dK/dV with fp32 autograd of the
reference (2x the error of a low-precision reference, plus atol), and repeat deterministic specs.

    python tools/bwd_smoke.py [--out DIR]       (on a Hopper GPU)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

from fa4gen.builder import build_module
from fa4gen.compile.cache import DiskCache
from fa4gen.compile.generated import compile_generated
from fa4gen.api.runtime import ForwardOp
from fa4gen.reference import attention_ref, attention_ref_grads


SPECS = {
    "b128c": dict(head_dim=128, mask={"kind": "causal"}, allow_gqa=False),
    "b128": dict(head_dim=128, allow_gqa=False),
    "b64g": dict(head_dim=64, allow_gqa=True),
    "b96c": dict(head_dim=96, dtype="fp16", mask={"kind": "causal"}, allow_gqa=False),
    "b192": dict(head_dim=192, head_dim_v=128, mask={"kind": "causal"}, allow_gqa=True),
    "b256": dict(head_dim=256, allow_gqa=False),
    "b128wd": dict(head_dim=128, mask={"kind": "sliding_window", "left": 100, "right": 0}, softcap=30.0,
                   allow_gqa=True, deterministic=True),
    "b128kd": dict(head_dim=128, mask={"kind": "chunked", "chunk_size": 96}, allow_gqa=False, deterministic=True),
}
BENCH = {f"p{d}{'c' if c else ''}": dict(head_dim=d, allow_gqa=False, **({"mask": {"kind": "causal"}} if c else {}))
         for d in (64, 128, 256) for c in (False, True)}
BENCH_SWAP = {f"{k}s": dict(v, pipeline={"bwd_swap_ab": True}) for k, v in list(BENCH.items()) if "256" not in k}
SHAPES = [(1, 1, 1, 2, 2), (2, 113, 255, 4, 2), (1, 1000, 1000, 2, 1), (1, 384, 128, 2, 2), (1, 200, 701, 3, 3)]


def spec_dict(name: str) -> dict:
    spec = dict(name=name, targets=["sm90"], dtype="bf16", backward=True)
    spec.update({**SPECS, **BENCH, **BENCH_SWAP}[name])
    return spec


def median_ms(fn, reps=30):
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def bench(root: Path, names, seqlens=(2048, 16384)) -> list[dict]:
    """bwd TFLOP/s (2.5 x fwd FLOPs) of the generated kernel vs flash-attn-4, same process."""
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception:  # noqa: BLE001
        flash_attn_func = None
    rows = []
    for name in names:
        pkg = build_module(spec_dict(name), out_dir=root)
        pkg_dir = Path(pkg.__file__).parent
        lock = json.loads((pkg_dir / "spec.lock.json").read_text())
        plan = next(x for x in lock["plans"] if x["direction"] == "bwd" and not x.get("mha_only"))
        fn = compile_generated(pkg_dir / "bwd_sm90.py", f"{pkg.__name__}.bwd_sm90", plan, cache=DiskCache()).function
        d, causal = plan["head_dim"], plan["causal"]
        for s in seqlens:
            b, h = 16384 // s, 2048 // d
            q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            out = torch.randn_like(q)
            lse = torch.randn(b, h, s, device="cuda") + 10
            ws = [torch.zeros(b, h, s, device="cuda"), torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                  torch.empty(b, h, s, device="cuda"), torch.empty(b, h, s, device="cuda"),
                  torch.zeros(b, s, h, d, device="cuda")]
            scale = d ** -0.5
            args = ForwardOp._backward_args(plan, scale, None, None, seqlens=(s, s))

            def ours():
                ws[-1].zero_()
                fn(q, k, v, out, do, lse, *ws, *args)

            flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
            t = median_ms(ours)
            row = dict(spec=name, d=d, s=s, causal=causal, swap_ab=plan["swap_sdp"], fa4gen=flops / t / 1e9)
            if flash_attn_func is not None:
                qq, kk, vv = (t_.clone().requires_grad_() for t_ in (q, k, v))
                o = flash_attn_func(qq, kk, vv, causal=causal)
                o = o[0] if isinstance(o, tuple) else o
                t4 = median_ms(lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True))
                row["fa4"] = flops / t4 / 1e9
            rows.append(row)
            print(f"bench d{d} s{s} {'causal' if causal else 'full  '}{' swapAB' if plan['swap_sdp'] else ''}: fa4gen {row['fa4gen']:.0f} TFLOP/s"
                  + (f", flash-attn-4 {row['fa4']:.0f} ({row['fa4gen'] / row['fa4']:.2f}x)" if "fa4" in row else ""))
    return rows


def run_case(pkg_dir: Path, name: str, plan: dict, fwd_plan: dict, fn, shape, deterministic: bool):
    b, s_q, s_k, h, h_kv = shape
    if not plan["dkv_accum"]:
        h_kv = h
    dev = "cuda"
    dtype = getattr(torch, plan["torch_dtype"])
    d, dv = plan["head_dim"], plan["head_dim_v"]
    gen = torch.Generator(device=dev).manual_seed(zlib.crc32(f"{name}{shape}".encode()))
    q = torch.randn(b, s_q, h, d, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(b, s_k, h_kv, d, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(b, s_k, h_kv, dv, device=dev, dtype=dtype, generator=gen)
    dout = torch.randn(b, s_q, h, dv, device=dev, dtype=dtype, generator=gen)
    scale = d ** -0.5
    mask = dict(causal=plan["causal"], softcap=plan["softcap"])
    if plan["local"]:
        mask["window"] = (plan["window_left"], plan["window_right"])
    if plan["chunked"]:
        mask["chunk"] = plan["chunk_size"]
    # forward in fp32 (the saved O and LSE are what the kernel's forward would give, up to rounding)
    out_f, lse_f = attention_ref(q, k, v, softmax_scale=scale, dtype=torch.float32, **mask)
    ref_grads = attention_ref_grads(q, k, v, dout, softmax_scale=scale, **mask)  # exact (fp32)
    low_grads = attention_ref_grads(q, k, v, dout, softmax_scale=scale, upcast=False, **mask)  # the budget
    out = out_f.detach().to(dtype)
    lse = lse_f.detach().float().contiguous()
    dlse = torch.zeros_like(lse)
    dq = torch.full_like(q, float("nan"))
    dk = torch.full_like(k, float("nan"))
    dv_ = torch.full_like(v, float("nan"))
    lse2 = torch.empty_like(lse)
    dpsum = torch.empty_like(lse)
    dq_acc = torch.zeros(b, s_q, h, d, device=dev, dtype=torch.float32)
    tensors = [q, k, v, out, dout, lse, dlse, dq, dk, dv_, lse2, dpsum, dq_acc]
    if plan["dkv_accum"]:
        tensors += [torch.zeros(b, s_k, h_kv, d, device=dev), torch.zeros(b, s_k, h_kv, dv, device=dev)]
    if plan["deterministic"]:
        tensors.append(torch.zeros(b, h, -(-s_q // plan["tile_m"]), device=dev, dtype=torch.int32))
        if plan["dkv_accum"]:
            tensors.append(torch.zeros(b, h_kv, -(-s_k // plan["tile_n"]), device=dev, dtype=torch.int32))
    args = ForwardOp._backward_args(plan, scale, None, None, seqlens=(s_q, s_k))  # the runtime's own

    def launch():
        for t in tensors[12:]:
            if t.dtype == torch.int32 or t.dtype == torch.float32:
                t.zero_()
        fn(*tensors, *args)
        torch.cuda.synchronize()
        return dq.clone(), dk.clone(), dv_.clone()

    got = launch()
    rows = []
    for gname, g, ref, lp in zip(("dq", "dk", "dv"), got, ref_grads, low_grads):
        err = (g.float() - ref).abs().max().item()
        budget = 2 * (lp.float() - ref).abs().max().item() + 1e-3 * (1 + ref.abs().max().item())
        rows.append((gname, err, budget, bool(torch.isfinite(g).all()) and err <= budget))
    same = None
    if deterministic:
        same = all(all(torch.equal(a, b_) for a, b_ in zip(got, launch())) for _ in range(10))
    return rows, same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="comma-separated spec names")
    ap.add_argument("--bench", action="store_true", help="also time the backward against flash-attn-4")
    ap.add_argument("--swap", action="store_true", help="bench also the pipeline.bwd_swap_ab variants")
    a = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp())
    names = a.only.split(",") if a.only else list(SPECS)
    results, ok = [], True
    for name in names:
        pkg = build_module(spec_dict(name), out_dir=root)
        pkg_dir = Path(pkg.__file__).parent
        lock = json.loads((pkg_dir / "spec.lock.json").read_text())
        plan = next(x for x in lock["plans"] if x["direction"] == "bwd" and not x.get("mha_only"))
        fwd_plan = next(x for x in lock["plans"] if x["direction"] == "fwd")
        t0 = time.time()
        try:
            fn = compile_generated(pkg_dir / "bwd_sm90.py", f"{pkg.__name__}.bwd_sm90", plan, cache=DiskCache()).function
        except Exception as e:  # report and go on
            print(f"{name}: compile failed: {type(e).__name__}: {str(e)[:400]}")
            ok = False
            continue
        ct = time.time() - t0
        for shape in SHAPES:
            try:
                rows, same = run_case(pkg_dir, name, plan, fwd_plan, fn, shape, plan["deterministic"])
            except Exception as e:
                print(f"{name} {shape}: FAILED {type(e).__name__}: {str(e)[:400]}")
                ok = False
                break
            line = " ".join(f"{g}={e:.2e}/{bud:.2e}{'' if good else '!'}" for g, e, bud, good in rows)
            good = all(r[3] for r in rows) and same is not False
            ok &= good
            print(f"{'ok ' if good else 'BAD'} {name:7s} {str(shape):22s} {line}" + ("" if same is None else f" det={same}")
                  + f"  (compile {ct:.1f}s)")
            results.append(dict(spec=name, shape=shape, rows=rows, deterministic_same=same))
    perf = bench(root, names=list(BENCH) + (list(BENCH_SWAP) if a.swap else [])) if a.bench else []
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "bwd_smoke.json").write_text(json.dumps(dict(checks=results, bench=perf), indent=1))
    print("ALL OK" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

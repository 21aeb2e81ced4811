"""Varlen forward benchmark on the lent GPU: fa4gen's `varlen: true` kernel next to flash-attn-4's
flash_attn_varlen_func in one process, on the same packed batch.

16384 tokens packed from sequences of mixed length (a fixed, seeded draw from [min_len, max_len]),
hidden 2048 (heads = 2048 / d), bf16, causal and not. TFLOP/s = Σ_i 4·h·s_i²·d (halved when causal)
/ median time (triton do_bench), both called with max_seqlen_q given (no host read-back). Outputs
are compared against each other (max abs difference) so a fast wrong kernel shows.

--bwd adds the backward through autograd (out.backward(dout) alone, as tools/bench_fwd.py times it;
bwd TFLOP/s = 2.5 × the forward FLOPs / time) of a `backward: true` varlen spec (MHA) next to
flash-attn-4's varlen backward, with the largest gradient difference between the two (`--repeats N`: N passes
each, the median reported and every pass kept); --bwd-swap-ab
builds that backward in the Sᵀ layout (head dims <= 128). `--breakdown` adds, after each backward pass, where one
backward call's time goes (`bwd_breakdown`): the GPU wall time per call between CUDA events, the summed kernel
times per kernel name (torch.profiler), the host time per call and the SM clock, so a slow pass shows whether a
kernel ran slower or the GPU waited between launches (session 27: the d128 causal varlen backward ran some passes
at ~0.55x the others, in no fixed pass or process).

Run on the GPU machine: `source tools/device_env.sh; python3 tools/bench_varlen.py --out $OUT`.
"""

import argparse
import cProfile
import json
import random
import statistics
from pathlib import Path

import torch

try:
    from triton.testing import do_bench
except ImportError:  # a CPU machine: importable (tools/bwd_profile.py, tests), not runnable
    do_bench = None

import fa4gen
from bench_fwd import _first, bwd_time_ms, pass_order
from host_overhead_cpu import top_own_time

TOKENS, HIDDEN = 16384, 2048


def lengths(seed: int, lo: int, hi: int) -> list[int]:
    rng, out = random.Random(seed), []
    while sum(out) < TOKENS:
        out.append(min(rng.randint(lo, hi), TOKENS - sum(out)))
    return out


def packed_kwargs(lens: list[int]) -> dict:
    """The sequence arguments of a packing with these lengths (q and k packed alike), as
    flash_attn_varlen_func takes them and fa4gen's varlen API does."""
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))


def kernel_totals(events, calls: int) -> dict:
    """Microseconds per call by kernel name (its first 60 characters), from (name, total us) pairs of a
    profile over `calls` calls, largest first."""
    per = {}
    for name, us in events:
        per[name[:60]] = per.get(name[:60], 0.0) + us / calls
    return {name: round(us, 1) for name, us in sorted(per.items(), key=lambda kv: -kv[1])}


def bwd_breakdown(run, q, k, v, calls: int = 5) -> dict:
    """Where one backward call of run(q, k, v) goes, over `calls` calls queued back to back (no L2 flush, no
    sync between them): `gpu_wall_us`, the median GPU time per call between CUDA events around it;
    `kernels_us`, the profiler's kernel time per call by name; `gaps_us`, the wall time not covered by a kernel
    (the GPU waiting for the host, if large); `host_us`, the host time to queue one call; `sm_clock_mhz`, the
    SM clock read after the calls (torch.cuda.clock_rate, needs pynvml; None without); `host_top_tottime`, the 15
    Python functions with the most own time per call under cProfile (its overhead inflates them; compare them with
    each other, not with host_us)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    out = run(qg, kg, vg)
    dout = torch.randn_like(out)
    out.backward(dout, retain_graph=True)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    host = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            qg.grad = kg.grad = vg.grad = None
            t = time.perf_counter()
            starts[i].record()
            out.backward(dout, retain_graph=True)
            ends[i].record()
            host.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
    # the host side by Python function (cProfile over the same number of calls, after the timed ones): where a
    # host-bound backward spends its time
    pr = cProfile.Profile()
    for i in range(calls):
        qg.grad = kg.grad = vg.grad = None
        pr.enable()
        out.backward(dout, retain_graph=True)
        pr.disable()
    torch.cuda.synchronize()
    host_top = top_own_time(pr, calls, 15)
    wall = statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))

    def device_us(event):  # (renamed from cuda_time_total in newer torch)
        return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)

    kernels = kernel_totals(((e.key, device_us(e)) for e in prof.key_averages() if device_us(e) > 0), calls)
    try:
        clock = torch.cuda.clock_rate()
    except Exception:  # noqa: BLE001 - pynvml missing
        clock = None
    return {"gpu_wall_us": round(wall, 1), "kernels_us": kernels, "gaps_us": round(wall - sum(kernels.values()), 1),
            "host_us": round(statistics.median(host), 1), "sm_clock_mhz": clock, "host_top_tottime": host_top}


def main() -> None:
    if do_bench is None:
        raise SystemExit("bench_varlen.py times on the GPU machine (triton's do_bench is not importable here)")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--ranges", default="128-1024,512-8192", help="comma-separated lo-hi sequence length ranges")
    ap.add_argument("--bwd", action="store_true", help="add backward columns")
    ap.add_argument("--repeats", type=int, default=1,
                    help="with --bwd: time each backward this many times (bench_fwd.pass_order's orders; the median "
                         "is reported, every pass kept in the JSON as <impl>_bwd_passes)")
    ap.add_argument("--breakdown", action="store_true",
                    help="with --bwd: after each pass, one backward call's kernels, GPU wall, host time and SM clock "
                         "(JSON: <impl>_bwd_breakdown, one entry per pass)")
    ap.add_argument("--bwd-swap-ab", action="store_true",
                    help="with --bwd: fa4gen's backward in the Sᵀ layout (pipeline.bwd_swap_ab: true; d <= 128)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats: expected a positive count")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except Exception as err:  # noqa: BLE001
        print(f"flash-attn-4 not importable: {err}")
        flash_attn_varlen_func = None
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        h = HIDDEN // d
        for causal in (False, True):
            swap = args.bwd and args.bwd_swap_ab and d <= 128
            pkg = fa4gen.build(dict(name=f"bench_varlen{'_bwd' if args.bwd else ''}{'_swap' if swap else ''}_d{d}_"
                                         f"{'causal' if causal else 'full'}",
                                    targets=["sm90"], dtype="bf16", head_dim=d, varlen=True, backward=args.bwd,
                                    allow_gqa=not args.bwd, mask={"kind": "causal" if causal else "none"},
                                    pipeline={"bwd_swap_ab": True} if swap else {}))
            for rng in args.ranges.split(","):
                lo, hi = (int(x) for x in rng.split("-"))
                lens = lengths(d + int(causal), lo, hi)
                q, k, v = (torch.randn(TOKENS, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = sum(4 * h * s * s * d for s in lens) / (2 if causal else 1)
                kw = packed_kwargs(lens)
                res = dict(d=d, causal=causal, lengths=f"{lo}-{hi}", sequences=len(lens), max_seqlen=max(lens))
                ours = pkg.attention(q, k, v, **kw)
                res["fa4gen"] = round(flops / do_bench(lambda: pkg.attention(q, k, v, **kw), warmup=25, rep=100,
                                                       return_mode="median") * 1e-9, 1)
                if flash_attn_varlen_func is not None:
                    fa_kw = dict(kw, causal=causal)
                    theirs = _first(flash_attn_varlen_func(q, k, v, **fa_kw))
                    res["max_abs_diff_vs_fa4"] = (ours.float() - theirs.float()).abs().max().item()
                    res["fa4"] = round(flops / do_bench(lambda: flash_attn_varlen_func(q, k, v, **fa_kw), warmup=25,
                                                        rep=100, return_mode="median") * 1e-9, 1)
                    res["vs_fa4"] = round(res["fa4gen"] / res["fa4"], 3)
                if args.bwd:
                    impls = {"fa4gen": lambda q, k, v: pkg.attention(q, k, v, **kw)}
                    if flash_attn_varlen_func is not None:
                        impls["fa4"] = lambda q, k, v: _first(flash_attn_varlen_func(q, k, v, **fa_kw))
                    grads, passes = {}, {impl: [] for impl in impls}
                    for rep in range(args.repeats):  # each pass in another order (pass_order): no fixed predecessor
                        for impl in pass_order(impls, rep):
                            ms, grads[impl] = bwd_time_ms(impls[impl], q, k, v)
                            passes[impl].append(round(2.5 * flops / (ms * 1e-3) / 1e12, 1))
                            if args.breakdown:
                                res.setdefault(f"{impl}_bwd_breakdown", []).append(bwd_breakdown(impls[impl], q, k, v))
                    for impl, tflops in passes.items():
                        res[f"{impl}_bwd"] = statistics.median(tflops)
                        if args.repeats > 1:
                            res[f"{impl}_bwd_passes"] = tflops
                    if len(grads) == 2:
                        res["bwd_vs_fa4"] = round(res["fa4gen_bwd"] / res["fa4_bwd"], 3)
                        res["bwd_max_abs_diff_vs_fa4"] = max((a.float() - b.float()).abs().max().item()
                                                             for a, b in zip(grads["fa4gen"], grads["fa4"]))
                print(json.dumps(res), flush=True)
                rows.append(res)
    (out_dir / "bench_varlen.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
    lines = ["| d | causal | lengths | sequences | fa4gen | flash-attn-4 | fa4gen/FA4 | max abs diff | bwd fa4gen | "
             "bwd FA4 | bwd fa4gen/FA4 | bwd max abs diff |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['d']} | {'y' if r['causal'] else 'n'} | {r['lengths']} | {r['sequences']} | {r['fa4gen']} | "
                     f"{r.get('fa4')} | {r.get('vs_fa4')} | {r.get('max_abs_diff_vs_fa4')} | {r.get('fa4gen_bwd')} | "
                     f"{r.get('fa4_bwd')} | {r.get('bwd_vs_fa4')} | {r.get('bwd_max_abs_diff_vs_fa4')} |")
    (out_dir / "bench_varlen.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Forward (and, with --bwd, backward) benchmark on the lent GPU, following ../shared/docs/BENCHMARK.md
(the FA papers' grid).

batch × seqlen = 16384 tokens, hidden 2048 (heads = 2048 / d), d in {64, 128, 256}, seqlen 512..16k,
causal and not; fa4gen's kernel side by side with flash-attn-4 and torch SDPA (cuDNN, flash) in one
process. TFLOP/s = 4·b·h·s²·d (halved when causal) / median time (triton do_bench). Writes JSON and
a markdown table with ratio columns to --out.

--bwd adds backward columns: the time of out.backward(dout) alone (the forward graph is kept and
the input gradients are reset outside the timed region), bwd TFLOP/s = 2.5 × fwd FLOPs / time, for
fa4gen (specs with backward: true; allow_gqa: false, since the grid is MHA; --gqa G gives k and v
heads / G heads and allow_gqa: true), flash-attn-4's
flash_attn_func and SDPA's cuDNN and flash backends; --deterministic adds fa4gen's deterministic: true
backward. Outputs go to bench_bwd.{json,md} then (bench_fwd.* otherwise); each finished cell is also appended
to bench_bwd.partial.jsonl (bench_fwd.partial.jsonl), which is what a run stopped by a timeout leaves.

--processes N runs the whole command in N fresh processes one after another and merges them per cell (the
median TFLOP/s, the median of each process's own ratios, each implementation's spread): flash-attn-4's backward
time moves by several percent from one process to the next (docs/PERF.md, session 46).

--tile-m, --tile-n, --kv-stages and --pipeline FIELD=JSON (any forward pipeline field) change fa4gen's forward
specs only, for plan-only A/Bs of one tree (`AB_NEW_ARGS="--pipeline ping_pong=false" tools/ab_bench.sh run ...`;
AB_NEW_ARGS splits on spaces, so write JSON without them).

Run on the GPU machine: `source tools/device_env.sh; python3 tools/bench_fwd.py --out $OUT [--bwd] [--processes N]`.
"""

import argparse
import contextlib
import json
import statistics
import sys
import math
import time
import zlib
from pathlib import Path

import torch

try:
    from triton.testing import do_bench
except ImportError:  # a CPU machine: only --prebuild-only runs there
    do_bench = None

import fa4gen


def _fa4():
    try:
        from flash_attn.cute.interface import flash_attn_func

        return flash_attn_func
    except Exception as err:  # noqa: BLE001
        print(f"flash-attn-4 not importable: {err}")
        return None


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def run(q, k, v, causal):
        with sdpa_kernel(be):  # (BHSD: fewer key/value heads than query heads with --gqa)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    enable_gqa=k.shape[1] != q.shape[1])

    return run


def _first(result):
    """flash_attn_func returns out or (out, lse) depending on the version."""
    return result[0] if isinstance(result, tuple) else result


def _sdpa_bshd(backend, causal: bool):
    """An SDPA backend on BSHD tensors: transposed views in and out, as the forward columns call it."""
    return lambda q, k, v: backend(*(x.transpose(1, 2) for x in (q, k, v)), causal).transpose(1, 2)


def _masks(text: str) -> list[str]:
    masks = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in masks if m not in ("none", "causal")]
    if bad or not masks:
        raise SystemExit(f"--masks: expected a comma list of 'none' and 'causal', got {text!r}")
    return masks


# --bwd-dq-atomic: fa4gen's non-deterministic backwards with pipeline.bwd_dq_atomic: true (an experiment);
# --bwd-det-dq-atomic: the deterministic ones (ordered adds from registers). `auto` already takes both
# above head dim 128, so the flags matter at d <= 128; --bwd-dq-handoff: both with pipeline.bwd_dq_atomic:
# false (dQ through shared memory, bulk-reduced by the dQ warp: flash-attn-4's way at (192, 128))
DQ_ATOMIC = False
DET_DQ_ATOMIC = False
DQ_HANDOFF = False


def _dims(text: str) -> list[tuple[int, int]]:
    """--dims: comma list of head dims, each `D` or `DxDV` (head_dim x head_dim_v, e.g. 192x128)."""
    dims = []
    for token in (t.strip() for t in text.split(",") if t.strip()):
        parts = token.split("x")
        if len(parts) > 2 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"--dims: expected a comma list of D or DxDV (e.g. 64,128,192x128), got {text!r}")
        dims.append((int(parts[0]), int(parts[-1])))
    return dims


def _pipeline_field(text: str) -> tuple[str, object]:
    """--pipeline FIELD=JSON: (field, value). Only the syntax is checked here; the spec model checks the field."""
    field, eq, value = text.partition("=")
    if not eq or not field.isidentifier():
        raise argparse.ArgumentTypeError(f"expected FIELD=JSON (e.g. ping_pong=false), got {text!r}")
    try:
        return field, json.loads(value)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{field}: the value is not JSON ({err.msg}): {value!r}") from None


# An implementation's output (or gradient) against a reference's before it is timed (--ablation, and
# tools/sustained_bench.py's variants, pinned kernels and backwards): bf16 results of two orderings of the same
# arithmetic differ by a few ulps (the grid reads 0.0005-0.001 against cuDNN); 2^-6 of the reference's largest
# magnitude (at least 1) leaves room for those and catches a wrong result.
OUTPUT_TOLERANCE = 2.0**-6


def outputs_agree(got, ref) -> tuple[bool, float]:
    """(max |got - ref| <= OUTPUT_TOLERANCE x max(1, max |ref|), max |got - ref|)."""
    diff = (got.float() - ref.float()).abs().max().item()
    return diff <= OUTPUT_TOLERANCE * max(1.0, ref.float().abs().max().item()), diff


def _row_mask(causal: bool, window: int | None = None, chunk: int | None = None) -> dict:
    """A grid row's mask: none, or causal, whose rows become a sliding window of `window` keys left of the diagonal
    (none right) or a chunked mask of `chunk` keys."""
    if causal and window is not None:
        return {"kind": "sliding_window", "left": window, "right": 0}
    if causal and chunk is not None:
        return {"kind": "chunked", "chunk_size": chunk}
    return {"kind": "causal" if causal else "none"}


def _fwd_spec(d: int, causal: bool, dv: int | None = None, tile_m="auto", softcap: float = 0.0,
              tile_n="auto", window: int | None = None, lse: bool = False, kv_stages="auto",
              pipeline: dict | None = None, chunk: int | None = None) -> dict:
    """The forward spec the grid benchmarks (and tools/bwd_ncu.py --fwd profiles). window: the causal rows
    become sliding windows of `window` keys left of the diagonal (Gemma 2's local layers: left 4095, right 0);
    chunk: the causal rows become a chunked mask of `chunk` keys (Llama 4's local layers: 8192).
    lse: the spec has backward: true, so the forward also writes the LSE (what a training spec compiles).
    pipeline: further spec pipeline fields (--pipeline), applied last; the name carries a hash of them."""
    dv = dv or d
    extra = dict(pipeline or {})
    tag = f"_p{zlib.crc32(json.dumps(extra, sort_keys=True).encode()):08x}" if extra else ""
    mask = _row_mask(causal, window, chunk)
    return dict(name=f"bench_d{d}{f'x{dv}' if dv != d else ''}_{'causal' if causal else 'full'}{'_sc' if softcap else ''}"
                     f"{f'_m{tile_m}' if tile_m != 'auto' else ''}{f'_n{tile_n}' if tile_n != 'auto' else ''}"
                     f"{f'_s{kv_stages}' if kv_stages != 'auto' else ''}{tag}"
                     f"{f'_w{window}' if causal and window is not None else ''}"
                     f"{f'_c{chunk}' if causal and chunk is not None else ''}"
                     f"{'_lse' if lse else ''}",
                targets=["sm90"], dtype="bf16", head_dim=d, head_dim_v=dv, mask=mask, backward=lse,
                softcap=softcap, pipeline={"tile_m": tile_m, "tile_n": tile_n, "kv_stages": kv_stages, **extra})


def _causal_keys(s: int, window: int | None, chunk: int | None = None) -> float:
    """Query-key pairs a causal row of length s computes (s²/2 as the grid counts it; with a window of
    `window` keys left of the diagonal, or chunks of `chunk` keys, the exact count)."""
    if chunk is not None:
        whole, rest = divmod(s, chunk)
        return whole * chunk * (chunk + 1) / 2 + rest * (rest + 1) / 2
    if window is None or window + 1 >= s:
        return s * s / 2
    w = window + 1
    return w * (w + 1) / 2 + (s - w) * w


def _bwd_spec(d: int, causal: bool, deterministic: bool, swap_ab: bool = False, dv: int | None = None,
              softcap: float = 0.0, gqa: bool = False, window: int | None = None) -> dict:
    """The backward spec of a grid row (window: the causal rows as sliding windows, as in _fwd_spec)."""
    if DQ_HANDOFF:
        atomic = False
    elif DET_DQ_ATOMIC if deterministic else DQ_ATOMIC:
        atomic = True
    else:
        atomic = None  # the plan's auto
    name = (f"bench_bwd{'_det' if deterministic else ''}{'_swap' if swap_ab else ''}"
            f"{'' if atomic is None else '_atomic' if atomic else '_handoff'}"
            f"_d{d}{f'x{dv}' if dv and dv != d else ''}_{'causal' if causal else 'full'}{'_sc' if softcap else ''}"
            f"{'_gqa' if gqa else ''}{f'_w{window}' if causal and window is not None else ''}")
    pipeline = ({"bwd_swap_ab": True} if swap_ab else {}) | ({} if atomic is None else {"bwd_dq_atomic": atomic})
    return dict(name=name, targets=["sm90"], dtype="bf16", head_dim=d, head_dim_v=dv or d,
                mask=_row_mask(causal, window), softcap=softcap,
                backward=True, deterministic=deterministic, allow_gqa=gqa, pipeline=pipeline)


def _warm_backward(pkg, d: int, dv: int | None = None) -> float:
    """Compile (or load) the forward and backward of a backward package; seconds taken."""
    t0 = time.perf_counter()
    x = torch.randn(1, 128, 1, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn(1, 128, 1, dv or d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pkg.attention(x, x, y).sum().backward()
    torch.cuda.synchronize()
    return round(time.perf_counter() - t0, 2)


def _rep_ms(fn) -> float:
    """do_bench's time budget for `fn`: 100 ms, or enough for ~25 timed calls of a long one (a 15 ms d256
    s16k backward got 6 in 100 ms)."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return max(100.0, 25 * start.elapsed_time(end))


def bench_ms(fn, **kw) -> float:
    """Median ms of fn over do_bench (L2 flushed before every call), with at least ~25 timed calls."""
    return do_bench(fn, warmup=25, rep=_rep_ms(fn), return_mode="median", **kw)


# --settle S: every timing window is preceded by S seconds of the same implementation run back to back, untimed, so
# it is timed at the clock its own power draw settles at rather than at the one its predecessor left. Session 77
# (--clock-log, H100 at the 700 W cap): inside the grid, flash-attn-4's forward ran at 1633-1675 MHz in the d128
# no-mask s16k cell, right after SDPA's flash kernel (the old rotation kept that order in every pass), against 1483-1489
# MHz sustained (tools/sustained_bench.py), while ours ran at ~1450 in both.
SETTLE_S = 0.0
SETTLE_CHUNK_S = 0.05  # GPU seconds of calls between synchronizations


def run_for(fn, seconds: float) -> int:
    """Call fn back to back for `seconds` (host time), synchronizing every ~SETTLE_CHUNK_S of GPU work (so the host
    span matches the GPU's); the number of calls made. The chunk is sized from the second of two calls (a first
    call may compile)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    calls, chunk = 2, max(1, round(SETTLE_CHUNK_S / max(start.elapsed_time(end) * 1e-3, 1e-6)))
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(chunk):
            fn()
        calls += chunk
        torch.cuda.synchronize()
    return calls


def settle(fn) -> None:
    if SETTLE_S > 0:
        run_for(fn, SETTLE_S)


def bwd_time_ms(run, q, k, v) -> tuple[float, tuple]:
    """Median time of the backward of run(q, k, v) (BSHD in and out), and the gradients it gives."""
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    out = run(qg, kg, vg)
    torch.manual_seed(0)  # the same dout for every implementation, laid out like its out
    dout = torch.empty_like(out).copy_(torch.randn(out.shape, device=out.device, dtype=out.dtype))
    out.backward(dout, retain_graph=True)
    # copies: do_bench calls the backward several times before it starts clearing .grad, and autograd
    # accumulates into an existing .grad in place (the 2026-11-29 grid's diff column was inflated by it)
    grads = tuple(g.clone() for g in (qg.grad, kg.grad, vg.grad))

    def step():
        qg.grad = kg.grad = vg.grad = None
        out.backward(dout, retain_graph=True)

    settle(step)
    ms = bench_ms(lambda: out.backward(dout, retain_graph=True), grad_to_none=[qg, kg, vg])
    return ms, grads


# --clock-log: each timing's (time.time() start, end) per column, kept on the cell's row under "_spans" until the run
# ends and tools/clock_log.py turns them into the row's "clocks" (mean SM clock / power over each column's timings)
CLOCK_SPANS = False


def _span(res: dict, column: str, t0: float) -> None:
    if CLOCK_SPANS:
        res.setdefault("_spans", {}).setdefault(column, []).append((t0, time.time()))


def pass_order(names, rep: int) -> list:
    """`names` in pass `rep`'s order: pass 0 as given, later passes the rows of a Williams design, so over n passes
    (2n for an odd count n) every implementation is timed right after every other one equally often and no
    implementation is always first. A plain rotation kept each implementation's predecessor fixed in every pass,
    and on a power-capped card the predecessor sets the clock a short timing window starts at (session 77:
    flash-attn-4, always timed after SDPA's flash kernel, ran ~10% above its sustained clock in the d128 no-mask s16k
    cell)."""
    names = list(names)
    n = len(names)
    if n < 2:
        return names
    base = [0]  # 0, 1, n-1, 2, n-2, ...: consecutive differences take every nonzero value mod n once
    for j in range(1, n):
        base.append((j + 1) // 2 if j % 2 else n - j // 2)
    label = {symbol: names[j] for j, symbol in enumerate(base)}  # pass 0's row is `names` as given
    row, backwards = (rep // 2, rep % 2 == 1) if n % 2 else (rep, False)
    order = [label[(symbol + row) % n] for symbol in base]
    return order[::-1] if backwards else order


def bwd_columns(res: dict, impls: dict, q, k, v, flops: float, repeats: int = 1) -> None:
    """Backward TFLOP/s of every implementation into `res` (the median over `repeats` passes, each in a
    pass_order), fa4gen's gradients checked against cuDNN's."""
    grads, times = {}, {name: [] for name in impls}
    for rep in range(repeats):
        for name in pass_order(impls, rep):
            try:
                t0 = time.time()
                ms, grads[name] = bwd_time_ms(impls[name], q, k, v)
                _span(res, f"{name}_bwd", t0)
                times[name].append(ms)
            except Exception as err:  # noqa: BLE001
                res[f"{name}_bwd_error"] = f"{type(err).__name__}: {err}"[:200]
    for name, ms in times.items():
        res[f"{name}_bwd"] = round(2.5 * flops / (statistics.median(ms) * 1e-3) / 1e12, 1) if ms else None
    if "fa4gen" in grads and "cudnn" in grads:
        res["bwd_max_abs_diff_vs_cudnn"] = max((a.float() - b.float()).abs().max().item()
                                               for a, b in zip(grads["fa4gen"], grads["cudnn"]))
    best = max([res.get("fa4_bwd") or 0, res.get("cudnn_bwd") or 0])
    ours = res.get("fa4gen_bwd")
    res["bwd_vs_fa4"] = round(ours / res["fa4_bwd"], 3) if ours and res.get("fa4_bwd") else None
    res["bwd_vs_best"] = round(ours / best, 3) if ours and best else None
    if ours and res.get("fa4gen_det_bwd"):
        res["det_vs_nondet"] = round(res["fa4gen_det_bwd"] / ours, 3)


def row_specs(args, d: int, dv: int, causal: bool) -> tuple[dict, dict | None, dict | None]:
    """The fa4gen spec dicts of one grid row: the forward, the backward (--bwd) and the deterministic
    backward (--deterministic), None where the run has none."""
    def bwd(deterministic: bool) -> dict:
        return _bwd_spec(d, causal, deterministic, args.bwd_swap_ab, dv, args.softcap,
                         args.gqa > 1 or args.bwd_allow_gqa, args.window)

    fwd = _fwd_spec(d, causal, dv, args.tile_m, args.softcap, args.tile_n, args.window, args.fwd_lse,
                    args.kv_stages, args.pipeline, args.chunk)
    return fwd, bwd(False) if args.bwd else None, bwd(True) if args.bwd and args.deterministic else None


def run_specs(args) -> list[dict]:
    """Every fa4gen spec dict the grid run builds, in its order (for --prebuild)."""
    return [spec for d, dv in _dims(args.dims) for causal in (m == "causal" for m in _masks(args.masks))
            for spec in row_specs(args, d, dv, causal) if spec is not None]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--dims", default="64,128,256", help="comma list of head dims, D or DxDV (e.g. 192x128)")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--ablation", action="store_true",
                    help="s4k/s16k: each pipeline switch off in turn (d: --ablation-dim; --repeats, --settle and "
                         "--clock-log apply; each switch's output is compared with the default's before it is timed)")
    ap.add_argument("--ablation-dim", type=int, default=128, help="head dim of the --ablation run")
    ap.add_argument("--bwd", action="store_true", help="add backward columns (bwd TFLOP/s = 2.5 x fwd FLOPs / time)")
    ap.add_argument("--deterministic", action="store_true", help="with --bwd: also fa4gen's deterministic backward")
    ap.add_argument("--masks", default="none,causal", help="comma list of none, causal (grid rows to run)")
    ap.add_argument("--processes", type=int, default=1, metavar="N",
                    help="run the whole command in N fresh processes one after another (out/proc_<i>) and merge "
                         "them per cell: median TFLOP/s, median of the same-run ratios, each side's spread")
    ap.add_argument("--repeats", type=int, default=1,
                    help="time every cell this many times, each pass in another implementation order (pass_order: every "
                         "implementation after every other equally often); median")
    ap.add_argument("--softcap", type=float, default=0.0,
                    help="logit softcap of every spec (flash-attn-4 gets the same; SDPA has none, so its columns stay empty)")
    ap.add_argument("--window", type=int, default=None, metavar="LEFT",
                    help="the causal rows as sliding windows: LEFT keys left of the diagonal, none right (Gemma 2's "
                         "local layers: 4095); flash-attn-4 gets window_size=(LEFT, 0); with --bwd the backward rows too")
    ap.add_argument("--chunk", type=int, default=None, metavar="KEYS",
                    help="the causal rows as a chunked mask of KEYS keys (Llama 4's local layers: 8192); flash-attn-4 "
                         "has no chunked mask and runs causal (its TFLOP/s count causal's pairs), as a same-run clock "
                         "reference only (A/Bs divide by it); "
                         "forward only")
    ap.add_argument("--fwd-lse", action="store_true",
                    help="the forward specs have backward: true, so the forward writes the LSE as training specs do")
    ap.add_argument("--bwd-swap-ab", action="store_true",
                    help="with --bwd: fa4gen's backward in the Sᵀ layout (pipeline.bwd_swap_ab: true; d <= 128)")
    ap.add_argument("--tile-m", default="auto", type=lambda t: t if t == "auto" else int(t),
                    help="forward pipeline.tile_m of fa4gen's grid kernels (auto, 128 or 192)")
    ap.add_argument("--tile-n", default="auto", type=lambda t: t if t == "auto" else int(t),
                    help="forward pipeline.tile_n of fa4gen's grid kernels (auto or a multiple of 16 the plan accepts)")
    ap.add_argument("--kv-stages", default="auto", type=lambda t: t if t == "auto" else int(t),
                    help="forward pipeline.kv_stages of fa4gen's grid kernels (auto = 2, or a count the shared memory fits)")
    ap.add_argument("--pipeline", action="append", default=[], metavar="FIELD=JSON", type=_pipeline_field,
                    help="a forward pipeline field of fa4gen's grid kernels, its value as JSON (repeatable; e.g. "
                         "ping_pong=false, rescale_threshold=0, 'poly_exp={\"share\":0.25,\"degree\":3}'); the spec "
                         "model checks the fields before the run starts, the planner each head dim's plan")
    ap.add_argument("--bwd-stages", default=None,
                    help="with --bwd: try these backward stages first, 'Q,dO,PdS,dQbuf' (e.g. 1,1,2,2; an experiment: "
                         "fa4gen.plan.sm90.BWD_STAGE_ORDER gets it in front, the plan still checks the fit)")
    ap.add_argument("--bwd-dq-atomic", action="store_true",
                    help="with --bwd: fa4gen's non-deterministic backward adds dQ from registers (pipeline.bwd_dq_atomic: true)")
    ap.add_argument("--bwd-det-dq-atomic", action="store_true",
                    help="with --deterministic: fa4gen's deterministic backward adds dQ from registers in turns "
                         "(pipeline.bwd_dq_atomic: true; auto already does above d128)")
    ap.add_argument("--bwd-dq-handoff", action="store_true",
                    help="with --bwd: fa4gen's backwards (deterministic too) hand dQ to the dQ warp through shared memory "
                         "(pipeline.bwd_dq_atomic: false; auto does at d <= 128)")
    ap.add_argument("--gqa", type=int, default=1, metavar="G",
                    help="query heads per key/value head (default 1: the grid is MHA; G > 1 gives k and v "
                         "heads / G heads and fa4gen's backward allow_gqa: true)")
    ap.add_argument("--bwd-allow-gqa", action="store_true",
                    help="with --bwd: fa4gen's backwards compiled with allow_gqa: true (the spec default) even for the "
                         "MHA grid, so they take the GQA dK/dV path (fp32 workspaces + postprocess) MHA calls take there")
    ap.add_argument("--prebuild", type=int, default=0, metavar="N",
                    help="first compile every fa4gen kernel of the run in N processes (tools/prebuild.py; no GPU "
                         "needed), so each first call loads from the disk cache: the first_call_s columns then time "
                         "a cache load, not a compile")
    ap.add_argument("--prebuild-only", action="store_true", help="with --prebuild: stop after compiling")
    ap.add_argument("--fwd-kernel", default=None, metavar="MODULE",
                    help="run every fa4gen forward call on this kernel of its spec, whatever the call's seqlen_q "
                         "(ForwardOp.pinned; e.g. fwd_sm90: the persistent forward at lengths that dispatch to "
                         "fwd_sm90_long), for plan-only A/Bs of the dispatch thresholds; each row records the kernel "
                         "that ran (fa4gen_kernel). Pinned calls skip the API's call cache (every call runs its "
                         "argument checks, tens of µs of host time), so time cells whose kernel takes >= 0.5 ms")
    ap.add_argument("--clock-log", action="store_true",
                    help="sample the SM clock, power and temperature with nvidia-smi every 50 ms while the run "
                         "times (tools/clock_log.py): each row gets 'clocks' (per column, the mean over its timings) "
                         "and the markdown a clock table; the samples go to OUT/clock_log.csv")
    ap.add_argument("--settle", type=float, default=0.0, metavar="SECONDS",
                    help="before every timing window, run the same implementation back to back for SECONDS, untimed, "
                         "so each is timed at the clock its own power draw settles at (default 0: as before; session "
                         "77 read flash-attn-4 at +10%% clock inside the grid's d128 no-mask s16k cell, timed right "
                         "after SDPA's flash kernel, against its sustained clock)")
    ap.add_argument("--skip", default="",
                    help="comma list of cudnn, sdpa_flash: not timed (their columns stay empty; the forward is still "
                         "checked against cuDNN). tools/ab_bench.sh passes cudnn,sdpa_flash: its comparison reads "
                         "only fa4gen and flash-attn-4")
    args = ap.parse_args()
    args.pipeline = dict(args.pipeline)
    if args.pipeline:  # checked by the spec model now, not when the first kernel builds
        from fa4gen.spec import SpecError, spec_from_dict

        try:
            spec_from_dict(_fwd_spec(64, False, pipeline=args.pipeline), source="--pipeline")
        except SpecError as err:
            raise SystemExit(str(err)) from None
    skip = {name for name in args.skip.split(",") if name}
    if not skip <= {"cudnn", "sdpa_flash"}:
        raise SystemExit(f"--skip: expected a comma list of cudnn, sdpa_flash; got {args.skip!r}")
    if args.window is not None and args.window < 0:
        raise SystemExit(f"--window: expected a key count >= 0; got {args.window}")
    if args.chunk is not None and (args.chunk < 1 or args.bwd or args.window is not None):
        raise SystemExit(f"--chunk: expected a key count >= 1, forward only (not with --bwd or --window); got {args.chunk}")
    if args.bwd_dq_handoff and (args.bwd_dq_atomic or args.bwd_det_dq_atomic):
        raise SystemExit("--bwd-dq-handoff: not with --bwd-dq-atomic / --bwd-det-dq-atomic")
    if not args.settle >= 0:
        raise SystemExit(f"--settle: expected seconds >= 0, got {args.settle}")
    global DQ_ATOMIC, DET_DQ_ATOMIC, DQ_HANDOFF, CLOCK_SPANS, SETTLE_S
    SETTLE_S = args.settle
    DQ_ATOMIC, DET_DQ_ATOMIC, DQ_HANDOFF = args.bwd_dq_atomic, args.bwd_det_dq_atomic, args.bwd_dq_handoff
    if args.bwd_stages:
        from fa4gen.plan import sm90

        sm90.BWD_STAGE_ORDER = (tuple(int(x) for x in args.bwd_stages.split(",")),) + sm90.BWD_STAGE_ORDER
    if args.fwd_kernel is not None:  # (on the CPU too: the plans name each spec's forward kernels)
        from fa4gen.plan import plan_kernels
        from fa4gen.spec import spec_from_dict

        for d, dv in _dims(args.dims):
            for causal in (m == "causal" for m in _masks(args.masks)):
                spec = row_specs(args, d, dv, causal)[0]
                modules = [p.module for p in plan_kernels(spec_from_dict(spec), "sm90") if p.direction == "fwd"]
                if args.fwd_kernel not in modules:
                    raise SystemExit(f"--fwd-kernel: {spec['name']} has no forward kernel {args.fwd_kernel!r} "
                                     f"(its forwards: {', '.join(modules)})")
    if args.gqa < 1 or any((2048 // d) % args.gqa for d, _ in _dims(args.dims)):
        raise SystemExit(f"--gqa: expected a positive count dividing every row's head count (2048 / d), got {args.gqa}")
    if args.processes < 1 or (args.processes > 1 and args.ablation):
        raise SystemExit(f"--processes: expected a count >= 1 (not with --ablation), got {args.processes}")
    if args.prebuild_only and not args.prebuild:
        raise SystemExit("--prebuild-only: give --prebuild N (the number of compile processes) too")
    if args.prebuild:
        if args.ablation or args.bwd_stages:
            # (the ablation builds its own variants; --bwd-stages changes planning in this process only)
            raise SystemExit("--prebuild: not with --ablation or --bwd-stages")
        from prebuild import prebuild

        results = prebuild(run_specs(args), args.prebuild)
        failed = [f"{name}.{module}" for name, module, status, _ in results if status.startswith("failed")]
        if failed:
            print(f"prebuild: {len(failed)} failed ({', '.join(failed)}); the run compiles those at their first call")
        if args.prebuild_only:
            return
    if do_bench is None:
        raise SystemExit("bench_fwd.py times on the GPU machine (triton's do_bench is not importable here)")
    if args.ablation:
        return ablation(Path(args.out), args.ablation_dim, args.repeats, args.clock_log)
    if args.processes > 1:
        return run_processes(args, Path(args.out))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "bench_bwd" if args.bwd else "bench_fwd"
    partial = out_dir / f"{stem}.partial.jsonl"
    partial.unlink(missing_ok=True)
    clock = None
    if args.clock_log:
        from clock_log import ClockLog

        clock = ClockLog(out_dir / "clock_log.csv")
        CLOCK_SPANS = clock.start()
        clock = clock if CLOCK_SPANS else None
    fa4 = _fa4()
    cudnn, flash = _sdpa("cudnn"), _sdpa("flash")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: a @ a, warmup=25, rep=100, return_mode="median")
    matmul = round(2 * 8192**3 / (mm_ms * 1e-3) / 1e12, 1)
    print(f"bf16 8192^3 matmul: {matmul} TFLOP/s")
    rows = []
    pins = contextlib.ExitStack()  # --fwd-kernel: the row's package runs every forward call on that kernel
    for d, dv in _dims(args.dims):
        for causal in (m == "causal" for m in _masks(args.masks)):
            t0 = time.perf_counter()
            sc = args.softcap
            fa4_kw = {"softcap": sc} if sc else {}  # flash-attn-4 computes the same softcap
            fwd_spec, bwd_spec, det_spec = row_specs(args, d, dv, causal)
            pkg = fa4gen.build(fwd_spec)
            op = pkg._forward
            pins.close()  # the previous row's package
            if args.fwd_kernel is not None:
                pins.enter_context(op.pinned(args.fwd_kernel))
            x = torch.randn(1, 128, 1, d, device="cuda", dtype=torch.bfloat16)
            pkg.attention(x, x, torch.randn(1, 128, 1, dv, device="cuda", dtype=torch.bfloat16))
            torch.cuda.synchronize()
            first_call_s = round(time.perf_counter() - t0, 2)
            if args.bwd:
                bwd_pkg = fa4gen.build(bwd_spec)
                bwd_first_call_s = _warm_backward(bwd_pkg, d, dv)
                det_pkg = fa4gen.build(det_spec) if det_spec is not None else None
                det_first_call_s = _warm_backward(det_pkg, d, dv) if det_pkg is not None else None
            for s in map(int, args.seqlens.split(",")):
                b, h = 16384 // s, 2048 // d
                h_kv = h // args.gqa
                q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(b, s, h_kv, dv, device="cuda", dtype=torch.bfloat16)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                pairs = _causal_keys(s, args.window, args.chunk) if causal else s * s
                flops = 2 * b * h * pairs * (d + dv)  # Q·Kᵀ over d, P·V over dv
                windowed = causal and args.window is not None
                chunked = causal and args.chunk is not None
                res = {"d": d, "dv": dv, "seqlen": s, "causal": causal, "batch": b, "heads": h, "kv_heads": h_kv,
                       "first_call_s": first_call_s, "window": (args.window, 0) if windowed else None,
                       "chunk": args.chunk if chunked else None,
                       "fa4gen_kernel": op.forward_plan(op.arch_for(q.device), s)["module"]}
                ours = pkg.attention(q, k, v)
                impls = {"fa4gen": lambda: pkg.attention(q, k, v),
                         "cudnn": lambda: cudnn(qt, kt, vt, causal), "sdpa_flash": lambda: flash(qt, kt, vt, causal)}
                # (SDPA computes no softcap, sliding window or chunked mask)
                untimed = {"cudnn", "sdpa_flash"} if sc or windowed or chunked else skip
                for name in untimed:
                    impls.pop(name)
                    res[name] = None
                if fa4 is not None:
                    fa4_win = {"window_size": (args.window, 0)} if windowed else {}
                    impls["fa4"] = lambda: fa4(q, k, v, causal=causal, **fa4_kw, **fa4_win)
                try:  # (cuDNN may refuse a head_dim_v unlike head_dim)
                    if sc or windowed or chunked:
                        raise ValueError("SDPA has no softcap, sliding window or chunked mask")
                    ref = cudnn(qt, kt, vt, causal).transpose(1, 2)
                    res["max_abs_diff_vs_cudnn"] = (ours.float() - ref.float()).abs().max().item()
                except Exception as err:  # noqa: BLE001
                    res["max_abs_diff_vs_cudnn"] = None
                    res["cudnn_ref_error"] = f"{type(err).__name__}: {err}"[:200]
                times = {name: [] for name in impls}
                for rep in range(args.repeats):  # each pass in another order (pass_order): no fixed predecessor
                    for name in pass_order(impls, rep):
                        try:
                            settle(impls[name])
                            t0 = time.time()
                            times[name].append(bench_ms(impls[name]))
                            _span(res, name, t0)
                        except Exception as err:  # noqa: BLE001
                            res[f"{name}_error"] = f"{type(err).__name__}: {err}"[:200]
                for name, ms in times.items():
                    # (--chunk: flash-attn-4 runs plain causal, so its TFLOP/s count causal's pairs)
                    work = 2 * b * h * _causal_keys(s, None) * (d + dv) if chunked and name == "fa4" else flops
                    res[name] = round(work / (statistics.median(ms) * 1e-3) / 1e12, 1) if ms else None
                best = max([res.get("fa4") or 0, res.get("cudnn") or 0])
                res["vs_fa4"] = round(res["fa4gen"] / res["fa4"], 3) if res.get("fa4") else None
                res["vs_best"] = round(res["fa4gen"] / best, 3) if best else None
                if args.bwd:
                    res["bwd_first_call_s"], res["det_first_call_s"] = bwd_first_call_s, det_first_call_s
                    bwd_impls = {"fa4gen": bwd_pkg.attention, "cudnn": _sdpa_bshd(cudnn, causal),
                                 "sdpa_flash": _sdpa_bshd(flash, causal)}
                    for name in untimed:
                        bwd_impls.pop(name)
                        res[f"{name}_bwd"] = None
                    if det_pkg is not None:
                        bwd_impls["fa4gen_det"] = det_pkg.attention
                    if fa4 is not None:
                        bwd_impls["fa4"] = lambda q, k, v: _first(fa4(q, k, v, causal=causal, **fa4_kw, **fa4_win))
                        if det_pkg is not None:  # the deterministic columns side by side
                            bwd_impls["fa4_det"] = lambda q, k, v: _first(fa4(q, k, v, causal=causal, deterministic=True,
                                                                              **fa4_kw, **fa4_win))
                    bwd_columns(res, bwd_impls, q, k, v, flops, args.repeats)
                rows.append(res)
                print(json.dumps(res), flush=True)
                with partial.open("a") as f:  # a run cut short by a timeout still leaves its finished cells
                    f.write(json.dumps(res) + "\n")
    # the clock moves over a grid (the matmul went 729 -> 794 TFLOP/s between two grids 7 minutes apart):
    # the matmul again at the end, so a "% of matmul" can quote both
    mm_ms = do_bench(lambda: a @ a, warmup=25, rep=100, return_mode="median")
    matmul_after = round(2 * 8192**3 / (mm_ms * 1e-3) / 1e12, 1)
    if clock is not None:
        clock.stop()
        for r in rows:
            r["clocks"] = {column: clock.window(spans) for column, spans in r.pop("_spans", {}).items()}
    (out_dir / f"{stem}.json").write_text(json.dumps({"matmul_tflops": matmul, "matmul_tflops_after": matmul_after,
                                                      "gpu": torch.cuda.get_device_name(),
                                                      "argv": sys.argv[1:], "rows": rows}, indent=1))
    note = (f"bf16 8192^3 matmul in the same run: {matmul} TFLOP/s before the grid, {matmul_after} after; "
            f"{args.repeats} timing pass(es) per cell"
            + (f"; every timing window after {args.settle} s of the same implementation, untimed (--settle)"
               if args.settle else "")
            + (f"; GQA, {args.gqa} query heads per key/value head" if args.gqa > 1 else "")
            + (f"; causal rows are sliding windows of {args.window} keys left of the diagonal, none right"
               if args.window is not None else "")
            + (f"; causal rows are chunks of {args.chunk} keys for fa4gen, while flash-attn-4 runs plain causal (a "
               "clock reference: its ratio columns are not a comparison)" if args.chunk is not None else "")
            + ("; forward specs with backward: true (LSE written)" if args.fwd_lse else ""))
    lines = [note, "", *table(rows, args.bwd, args.deterministic), *clock_table(rows)]
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def table(rows: list[dict], bwd: bool, deterministic: bool) -> list[str]:
    """The markdown table of a run's rows (or of tools' merged rows): TFLOP/s per implementation, the ratios."""
    head = "| d | seqlen | causal | fa4gen | flash-attn-4 | cuDNN | SDPA flash | fa4gen/FA4 | fa4gen/best |"
    if bwd:
        head += " bwd fa4gen | bwd FA4 | bwd cuDNN | bwd SDPA flash | bwd fa4gen/FA4 | bwd fa4gen/best |"
        head += " bwd det | det/non-det | bwd FA4 det |" if deterministic else ""
    head += " diff vs cuDNN |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        line = (f"| {_dims_label(r)} | {r['seqlen']} | {'y' if r['causal'] else 'n'} | {r['fa4gen']} | {r.get('fa4')} | "
                f"{r['cudnn']} | {r['sdpa_flash']} | {r['vs_fa4']} | {r['vs_best']} |")
        if bwd:
            line += (f" {r['fa4gen_bwd']} | {r.get('fa4_bwd')} | {r['cudnn_bwd']} | {r['sdpa_flash_bwd']} | "
                     f"{r['bwd_vs_fa4']} | {r['bwd_vs_best']} |")
            line += f" {r.get('fa4gen_det_bwd')} | {r.get('det_vs_nondet')} | {r.get('fa4_det_bwd')} |" if deterministic else ""
        # largest |fa4gen - cuDNN| of the outputs (and of the gradients, after the slash): the run's check
        diff = r.get("max_abs_diff_vs_cudnn")
        line += f" {'-' if diff is None else f'{diff:.3g}'}"
        line += f" / {r['bwd_max_abs_diff_vs_cudnn']:.3g} |" if r.get("bwd_max_abs_diff_vs_cudnn") is not None else " |"
        lines.append(line)
    return lines


CLOCK_COLUMNS = (("fa4gen", "fa4gen"), ("fa4", "flash-attn-4"), ("cudnn", "cuDNN"), ("fa4gen_bwd", "bwd fa4gen"),
                 ("fa4_bwd", "bwd FA4"), ("cudnn_bwd", "bwd cuDNN"))


def clock_table(rows: list[dict], which: str = "") -> list[str]:
    """--clock-log's table: per cell and column, the mean SM clock (MHz) and power (W) over its timings; [] when no
    row has clocks. `which` names the run in the title (e.g. " of process 2")."""
    if not any(r.get("clocks") for r in rows):
        return []
    cols = [(key, title) for key, title in CLOCK_COLUMNS if any((r.get("clocks") or {}).get(key) for r in rows)]
    lines = ["", f"SM clock during each column's timings{which} (MHz, mean of nvidia-smi's 50 ms samples; power in W):", "",
             "| d | seqlen | causal | " + " | ".join(title for _, title in cols) + " |", "|---" * (3 + len(cols)) + "|"]
    for r in rows:
        cells = []
        for key, _ in cols:
            c = (r.get("clocks") or {}).get(key)
            cells.append(f"{c['sm_mhz']} ({c['watts']} W)" if c else "-")
        lines.append(f"| {_dims_label(r)} | {r['seqlen']} | {'y' if r['causal'] else 'n'} | " + " | ".join(cells) + " |")
    return lines


def _dims_label(r: dict):
    return r["d"] if r.get("dv", r["d"]) == r["d"] else f"{r['d']}x{r['dv']}"


# TFLOP/s columns of a row (per implementation) and its same-run ratio columns, as main() writes them
TFLOPS_COLUMNS = ("fa4gen", "fa4", "cudnn", "sdpa_flash", "fa4gen_bwd", "fa4_bwd", "cudnn_bwd", "sdpa_flash_bwd",
                  "fa4gen_det_bwd", "fa4_det_bwd")
RATIO_COLUMNS = ("vs_fa4", "vs_best", "bwd_vs_fa4", "bwd_vs_best", "det_vs_nondet")


def merge_runs(runs: list[dict]) -> dict:
    """Rows of several processes' runs (each a bench_*.json: every cell timed side by side in that one process)
    merged per cell: each TFLOP/s column the median over the processes that have it, with its range
    (`<column>_range`, [min, max]); each ratio column the median of the processes' own same-run ratios (not a
    ratio of medians), with their range too; diffs against cuDNN the largest. Cells in the order of the first run
    that has them; `processes` counts the runs that have the cell."""
    cells: dict[tuple, list[dict]] = {}
    for run in runs:
        for r in run["rows"]:
            cells.setdefault((r["d"], r.get("dv", r["d"]), r["seqlen"], r["causal"]), []).append(r)
    rows = []
    for same in cells.values():
        row = dict(same[0])
        row["processes"] = len(same)
        if any("clocks" in r for r in same):  # --clock-log: each process's own, in run order
            row.pop("clocks", None)
            row["clocks_per_process"] = [r.get("clocks") for r in same]
        for col in TFLOPS_COLUMNS + RATIO_COLUMNS:
            values = [r[col] for r in same if r.get(col) is not None]
            if col in row or values:
                row[col] = round(statistics.median(values), 3 if col in RATIO_COLUMNS else 1) if values else None
                row[f"{col}_range"] = [min(values), max(values)] if values else None
        for col in ("max_abs_diff_vs_cudnn", "bwd_max_abs_diff_vs_cudnn"):
            values = [r[col] for r in same if r.get(col) is not None]
            if values:
                row[col] = max(values)
        rows.append(row)
    return {"processes": len(runs), "gpu": runs[0].get("gpu") if runs else None,
            "matmul_tflops": [run.get("matmul_tflops") for run in runs],
            "matmul_tflops_after": [run.get("matmul_tflops_after") for run in runs], "rows": rows}


def spread_table(rows: list[dict], bwd: bool) -> list[str]:
    """Per cell, each implementation's TFLOP/s range over the processes (max / min - 1) and the range of the
    same-run fa4gen / flash-attn-4 ratio: which side's time moved between processes."""
    cols = ["fa4gen", "fa4", "cudnn"] + (["fa4gen_bwd", "fa4_bwd", "cudnn_bwd"] if bwd else [])
    names = {"fa4gen": "fa4gen", "fa4": "FA4", "cudnn": "cuDNN"}
    head = ("| d | seqlen | causal | processes | " + " | ".join(
        (f"bwd {names[c[:-4]]}" if c.endswith("_bwd") else names[c]) + " spread" for c in cols)
        + " | fa4gen/FA4 range |" + (" bwd fa4gen/FA4 range |" if bwd else ""))
    lines = [head, "|---" * (head.count("|") - 1) + "|"]

    def spread(r, col):
        lo_hi = r.get(f"{col}_range")
        return f"{100 * (lo_hi[1] / lo_hi[0] - 1):.1f}%" if lo_hi and lo_hi[0] else "-"

    def span(r, col):
        lo_hi = r.get(f"{col}_range")
        return f"{lo_hi[0]}–{lo_hi[1]}" if lo_hi else "-"

    for r in rows:
        line = (f"| {_dims_label(r)} | {r['seqlen']} | {'y' if r['causal'] else 'n'} | {r['processes']} | "
                + " | ".join(spread(r, c) for c in cols) + f" | {span(r, 'vs_fa4')} |")
        line += f" {span(r, 'bwd_vs_fa4')} |" if bwd else ""
        lines.append(line)
    return lines


def run_processes(args, out_dir: Path, work_dir: Path | None = None) -> None:
    """--processes N: this command's run in N fresh processes one after another (each the protocol's one-process
    run, into a temporary folder), merged after each into out_dir/bench_*.{json,md} (merge_runs; the JSON keeps
    every process's own run under "runs", so a device call returns two files). flash-attn-4's backward time moved
    by up to 9.5% between processes where fa4gen's moved 1.1% (docs/PERF.md, session 46), so a cell near 1.0x read
    in one process can flip. flash-attn-4 keeps its compiled kernels on disk between the processes
    (FLASH_ATTENTION_CUTE_DSL_CACHE_*, unless set), fa4gen loads its own from its cache."""
    import os
    import subprocess
    import tempfile

    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "bench_bwd" if args.bwd else "bench_fwd"
    env = dict(os.environ)
    env.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    env.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(Path(tempfile.gettempdir()) / "fa4gen_bench_fa4_cache"))
    work_dir = work_dir or Path(tempfile.mkdtemp(prefix="fa4gen_bench_processes_"))
    runs, failed = [], []
    for i in range(1, args.processes + 1):
        proc_dir = work_dir / f"proc_{i}"
        cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:],
               "--out", str(proc_dir), "--processes", "1", "--prebuild", "0"]
        print(f"process {i} of {args.processes}: {proc_dir}", flush=True)
        if subprocess.run(cmd, env=env).returncode != 0 or not (proc_dir / f"{stem}.json").exists():
            failed.append(i)
            continue
        runs.append(json.loads((proc_dir / f"{stem}.json").read_text()))
        merged = merge_runs(runs)
        merged.update(argv=sys.argv[1:], runs=runs)
        (out_dir / f"{stem}.json").write_text(json.dumps(merged, indent=1))
        lines = [f"{len(runs)} process(es) of `tools/bench_fwd.py {' '.join(sys.argv[1:])}`, each timing every cell "
                 f"side by side in one run; TFLOP/s: the median over the processes; ratios: the median of each "
                 f"process's own ratios. bf16 8192^3 matmul per process: "
                 + ", ".join(f"{a} -> {b}" for a, b in zip(merged["matmul_tflops"], merged["matmul_tflops_after"])),
                 "", *table(merged["rows"], args.bwd, args.deterministic), "",
                 "Spread over the processes:", "", *spread_table(merged["rows"], args.bwd)]
        for n, run in enumerate(runs, 1):  # --clock-log: each process's clock table
            lines += clock_table(run["rows"], f" of process {n}")
        (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    if failed:
        print(f"processes {failed} failed or wrote no {stem}.json (see their output above)")
    if runs:
        print((out_dir / f"{stem}.md").read_text())
    else:
        raise SystemExit("--processes: no process finished")


ABLATION = {
    "default": {},
    "ping_pong off": {"ping_pong": False},
    "intra_wg_overlap off": {"intra_wg_overlap": False},
    "rescale_threshold 0": {"rescale_threshold": 0.0},
    "poly_exp share 0.15": {"poly_exp": {"share": 0.15, "degree": 3}},
    "kv_stages 3": {"kv_stages": 3},
    "tile_m 192": {"tile_m": 192},
    "tile_m 192, tile_n 96": {"tile_m": 192, "tile_n": 96},
    "tile_m 192, rescale_threshold 0": {"tile_m": 192, "rescale_threshold": 0.0},
}


def ablation_ratio(row: dict | None, default: float | None) -> str:
    """An ablation row's cell in the markdown: its TFLOP/s over the default's, or why it has none (the planner
    refused the switch: no timing passes; its output differed from the default's: no passes timed)."""
    if row is None or "passes" not in row:
        return "refused"
    if row["tflops"] is None:
        return "wrong output"
    return f"{row['tflops'] / default:.3f}" if default else "—"


def ablation(out_dir: Path, d: int = 128, repeats: int = 1, clock_log: bool = False):
    """Each pipeline switch flipped from the default, head dim d, causal and not, s4k and s16k, with
    flash-attn-4 on the same shapes as a reference row; switches the planner refuses for this d (e.g.
    tile_m 192 over the register budget) are listed as refused. Per mask and seqlen every switch is timed
    `repeats` times in pass_order's orders (median; --settle applies), after its output is compared with the
    default's (a switch that computes something else is reported, not timed); with `clock_log`, each row's mean SM
    clock and power over its timings (tools/clock_log.py)."""
    from fa4gen.plan import PlanError

    out_dir.mkdir(parents=True, exist_ok=True)
    clock = None
    if clock_log:
        from clock_log import ClockLog

        clock = ClockLog(out_dir / "clock_log.csv")
        clock = clock if clock.start() else None
    fa4 = _fa4()
    labels = list(ABLATION) + (["flash-attn-4"] if fa4 is not None else [])
    rows = []
    for causal in (False, True):
        runs = {}
        for i, label in enumerate(labels):
            if label == "flash-attn-4":
                runs[label] = lambda q, k, v: fa4(q, k, v, causal=causal)  # noqa: E731
                continue
            try:
                pkg = fa4gen.build(dict(name=f"abl_d{d}_{'c' if causal else 'n'}{i}", targets=["sm90"], dtype="bf16",
                                        head_dim=d, mask={"kind": "causal" if causal else "none"},
                                        pipeline=ABLATION[label]))
            except PlanError as err:
                print(f"{label}: refused by the planner for d{d}: {err}".splitlines()[0])
                rows += [{"switch": label, "causal": causal, "seqlen": s, "tflops": None} for s in (4096, 16384)]
                continue
            runs[label] = lambda q, k, v, pkg=pkg: pkg.attention(q, k, v)
        for s in (4096, 16384):
            b, h = 16384 // s, 2048 // d
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            impls = {label: (lambda run=run: run(q, k, v)) for label, run in runs.items()}
            ref = impls["default"]()
            diffs = {}
            for label, fn in list(impls.items()):
                if label in ("default", "flash-attn-4"):
                    continue
                ok, diffs[label] = outputs_agree(fn(), ref)
                if not ok:
                    print(f"{label}: output differs from the default's by {diffs[label]:.3g} at s{s}; not timed")
                    impls.pop(label)
            times, spans = {label: [] for label in impls}, {label: [] for label in impls}
            for rep in range(repeats):
                for label in pass_order(impls, rep):
                    settle(impls[label])
                    t0 = time.time()
                    times[label].append(do_bench(impls[label], warmup=25, rep=100, return_mode="median"))
                    spans[label].append((t0, time.time()))
            for label in runs:
                row = {"switch": label, "causal": causal, "seqlen": s,
                       "tflops": round(flops / statistics.median(times[label]) / 1e9, 1) if times.get(label) else None,
                       "passes": [round(flops / ms / 1e9, 1) for ms in times.get(label, [])],
                       "max_abs_diff_vs_default": diffs.get(label), "_spans": spans.get(label, [])}
                rows.append(row)
                print(json.dumps({key: val for key, val in row.items() if key != "_spans"}), flush=True)
    if clock is not None:
        clock.stop()
    for r in rows:
        spans_of = r.pop("_spans", [])
        if clock is not None and spans_of:
            r["clock"] = clock.window(spans_of)
    (out_dir / f"ablation_d{d}.json").write_text(json.dumps(rows, indent=1))
    base = {(r["causal"], r["seqlen"]): r["tflops"] for r in rows if r["switch"] == "default"}
    lines = [f"{repeats} timing pass(es) per cell" + (f", each after {SETTLE_S} s of the same switch (--settle)"
                                                      if SETTLE_S else ""), "",
             f"| switch (d{d}) | causal | s4k TFLOP/s | s16k TFLOP/s | vs default s4k | vs default s16k |"
             + (" SM MHz s4k / s16k |" if clock is not None else ""),
             "|---|---|---|---|---|---|" + ("---|" if clock is not None else "")]
    for causal in (False, True):
        for label in labels:
            got = {r["seqlen"]: r for r in rows if r["switch"] == label and r["causal"] == causal}
            t = {s: got[s]["tflops"] if s in got else None for s in (4096, 16384)}
            ratio = {s: ablation_ratio(got.get(s), base[(causal, s)]) for s in (4096, 16384)}
            line = f"| {label} | {'y' if causal else 'n'} | {t[4096]} | {t[16384]} | {ratio[4096]} | {ratio[16384]} |"
            if clock is not None:
                mhz = [(got.get(s, {}).get("clock") or {}).get("sm_mhz") for s in (4096, 16384)]
                line += f" {mhz[0]} / {mhz[1]} |"
            lines.append(line)
    (out_dir / f"ablation_d{d}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

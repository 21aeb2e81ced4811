"""Sustained throughput on the GPU: each implementation's kernel run back to back for seconds, at the clock and power
the card settles at, with nvidia-smi's SM clock and power over the measured span (tools/clock_log.py).

Why: bench_fwd.py times short do_bench windows (100 ms, the L2 flushed before every call), so a cell's clock is
whatever the card's recent history left it at. Session 77's --clock-log grid (docs/PERF.md) read the d128 no-mask
s16k forward at 1437-1467 MHz for fa4gen against 1633-1675 MHz for flash-attn-4, all three kernels at the 700 W
cap: under the power cap a kernel's speed is set by its energy per unit of work, not by its cycles. Training
runs layer after layer on a hot card, so the sustained figure is the one users get at long sequence lengths.

Each (cell, implementation) runs `--warm` seconds to settle, then `--seconds` measured (chunks of ~50 ms of calls,
synchronized between chunks so the host-side span matches the GPU's work; CUDA events time the span). Each round takes
another order (bench_fwd.pass_order). Per implementation: TFLOP/s (median over rounds), mean SM MHz and W over the
measured spans, TFLOP/J (TFLOP/s / W) and TFLOP per clock GHz (TFLOP/s / GHz: the work per cycle, clock-independent),
and each as a ratio to flash-attn-4's. Before a cell is timed, every fa4gen forward (variants and pinned kernels too)
and the backward's dQ / dK / dV are compared with flash-attn-4's (else cuDNN's); one that differs stops the run. No L2
flush between calls (the back-to-back case); at 16k tokens of d >= 64 a call's K / V (>= 64 MiB) does not fit the 50 MB
L2.

Run (GPU machine, after `source tools/device_env.sh`):
    python3 tools/sustained_bench.py --dims 128 --masks none --seqlens 16384 [--bwd] [--rounds 2]
        [--variant NAME:FIELD=JSON[;FIELD=JSON]] [--skip cudnn] --out $OUT/sustained
--variant adds a fa4gen forward with those pipeline fields (bench_fwd.py's --pipeline syntax; e.g.
`--variant pp_off:ping_pong=false`), timed as `fa4gen:NAME`, and --bwd-variant the same for the backward
(`fa4gen_bwd:NAME`, e.g. `--bwd-variant swap:bwd_swap_ab=true`); --fwd-kernel MODULE adds the default forward pinned
to that kernel of its spec (tools/pin_ab.py's pinning), timed as `fa4gen@MODULE`. `--cells RUN/sustained.json ...`
(no GPU) prints the per-cell ratio table of finished runs (the README's); `--ab DIR` the new / ref table of
`AB_SCRIPT=sustained_bench.py tools/ab_bench.sh run N -- ARGS` (the rounds of a sustained row agree within ~0.5%,
against the grid's ±5%, so long-cell A/Bs resolve about 1%).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

def parse_variant(text: str) -> tuple[str, dict]:
    """`NAME:FIELD=JSON[;FIELD=JSON...]` -> (NAME, {FIELD: value}); NAME an identifier, each value JSON."""
    name, sep, rest = text.partition(":")
    if not sep or not re.fullmatch(r"[a-z_][a-z0-9_]{0,15}", name) or not rest:
        raise argparse.ArgumentTypeError(
            f"expected NAME:FIELD=JSON[;FIELD=JSON] with NAME a lowercase identifier of at most 16 "
            f"characters (it joins the spec's name), got {text!r}")
    from bench_fwd import _pipeline_field  # (bench_fwd.py --pipeline's FIELD=JSON)

    fields = {}
    for part in rest.split(";"):
        if not re.match(r"[a-z_][a-z0-9_]*=", part):  # (pipeline fields are lowercase)
            raise argparse.ArgumentTypeError(f"{name}: expected FIELD=JSON with a lowercase FIELD, got {part!r}")
        try:
            field, value = _pipeline_field(part)
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(f"{name}: {err}") from None
        fields[field] = value
    return name, fields


def is_backward(impl: str) -> bool:
    """An implementation name of a backward: fa4gen_bwd, fa4_bwd, cudnn_bwd, or a variant fa4gen_bwd:NAME."""
    return impl.split(":")[0].split("@")[0].endswith("_bwd")


def _bwd_variant_spec(d: int, causal: bool, dv: int, name: str | None = None, fields: dict | None = None) -> dict:
    """bench_fwd.py's backward spec of a grid row, with `fields` over its pipeline (--bwd-variant NAME)."""
    from bench_fwd import _bwd_spec

    spec = _bwd_spec(d, causal, False, dv=dv)
    if name is not None:
        spec["name"] = f"{spec['name']}_v{name}"
        spec["pipeline"] = {**spec["pipeline"], **(fields or {})}
    return spec


def summarize(runs: list[dict]) -> list[dict]:
    """Rows per (cell, implementation) from the per-round runs (each {"cell": ..., "impl": ..., "tflops", "sm_mhz",
    "watts", "temp_c"}): median TFLOP/s, mean MHz / W, TFLOP/J and TFLOP per GHz, and each as a ratio to the same
    cell's flash-attn-4 ("fa4", or "fa4_bwd" for a backward implementation) where the cell has one."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["cell"], r["impl"]), []).append(r)
    rows = []
    for (cell, impl), rs in groups.items():
        tf = [r["tflops"] for r in rs if r.get("tflops")]
        mhz = [r["sm_mhz"] for r in rs if r.get("sm_mhz")]
        w = [r["watts"] for r in rs if r.get("watts")]
        row = {"cell": cell, "impl": impl, "rounds": len(tf), "tflops": round(statistics.median(tf), 1) if tf else None,
               "tflops_all": [round(x, 1) for x in tf],
               "sm_mhz": round(statistics.fmean(mhz), 1) if mhz else None,
               "watts": round(statistics.fmean(w), 1) if w else None,
               "temp_c": max((r["temp_c"] for r in rs if r.get("temp_c") is not None), default=None)}
        row["tflop_per_j"] = round(row["tflops"] / row["watts"], 4) if row["tflops"] and row["watts"] else None
        row["tflop_per_ghz"] = round(row["tflops"] / (row["sm_mhz"] / 1000), 1) if row["tflops"] and row["sm_mhz"] else None
        rows.append(row)
    by_key = {(r["cell"], r["impl"]): r for r in rows}
    for r in rows:
        ref = by_key.get((r["cell"], "fa4_bwd" if is_backward(r["impl"]) else "fa4"))
        for key, out in (("tflops", "vs_fa4"), ("tflop_per_ghz", "per_clock_vs_fa4"), ("tflop_per_j", "per_joule_vs_fa4")):
            r[out] = round(r[key] / ref[key], 3) if ref and r[key] and ref.get(key) else None
    return rows


def table(rows: list[dict]) -> list[str]:
    def show(x):
        return "—" if x is None else str(x)

    lines = ["| cell | implementation | TFLOP/s (rounds) | SM MHz | W | max °C | TFLOP/J | TFLOP/s per GHz | "
             "vs FA4 | per clock vs FA4 | per joule vs FA4 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rounds = " / ".join(str(x) for x in r["tflops_all"])
        lines.append(f"| {r['cell']} | {r['impl']} | {show(r['tflops'])} ({rounds}) | {show(r['sm_mhz'])} | "
                     f"{show(r['watts'])} | {show(r['temp_c'])} | {show(r['tflop_per_j'])} | {show(r['tflop_per_ghz'])} | "
                     f"{show(r['vs_fa4'])} | {show(r['per_clock_vs_fa4'])} | {show(r['per_joule_vs_fa4'])} |")
    return lines


def cell_table(files: list[Path]) -> list[str]:
    """One line per cell of sustained.json files (in their order; a cell in several files once per file): fa4gen's
    forward and backward over flash-attn-4's and over the better of flash-attn-4 and cuDNN, with both sides' clocks
    (the README's sustained table)."""
    lines = ["| cell | forward / FA4 | forward / best | backward / FA4 | backward / best | MHz fa4gen / FA4 (fwd; bwd) | "
             "file |", "|---|---|---|---|---|---|---|"]
    for path in files:
        rows = json.loads(Path(path).read_text())["rows"]
        at = {(r["cell"], r["impl"]): r for r in rows}

        def ratio(cell, ours, theirs):
            mine = at.get((cell, ours), {}).get("tflops")
            best = max([at.get((cell, t), {}).get("tflops") or 0 for t in theirs])
            return f"{mine / best:.3f}" if mine and best else "—"

        def mhz(cell, impl):
            return at.get((cell, impl), {}).get("sm_mhz") or "—"

        for cell in dict.fromkeys(r["cell"] for r in rows):
            clocks = f"{mhz(cell, 'fa4gen')} / {mhz(cell, 'fa4')}"
            if (cell, "fa4gen_bwd") in at:
                clocks += f"; {mhz(cell, 'fa4gen_bwd')} / {mhz(cell, 'fa4_bwd')}"
            lines.append(f"| {cell} | {ratio(cell, 'fa4gen', ['fa4'])} | {ratio(cell, 'fa4gen', ['fa4', 'cudnn'])} | "
                         f"{ratio(cell, 'fa4gen_bwd', ['fa4_bwd'])} | {ratio(cell, 'fa4gen_bwd', ['fa4_bwd', 'cudnn_bwd'])} | "
                         f"{clocks} | {Path(path).parent.name}/{Path(path).name} |")
    return lines


def ab_table(ab_dir: Path) -> list[str]:
    """tools/ab_bench.sh with AB_SCRIPT=sustained_bench.py: per (cell, fa4gen implementation), new/ref through each
    run's own flash-attn-4 (the median over runs of fa4gen / flash-attn-4, new over ref: clock drift between the
    processes cancels) and raw (median TFLOP/s, new over ref), from DIR/{new,ref}_N/sustained.json."""
    def side(name: str) -> dict[tuple, list[tuple[float, float | None]]]:
        got: dict[tuple, list[tuple[float, float | None]]] = {}
        for path in sorted(ab_dir.glob(f"{name}_*/sustained.json")):
            rows = {(r["cell"], r["impl"]): r for r in json.loads(path.read_text())["rows"]}
            for (cell, impl), r in rows.items():
                if impl.startswith("fa4gen") and r.get("tflops"):
                    ref = rows.get((cell, "fa4_bwd" if is_backward(impl) else "fa4"), {}).get("tflops")
                    got.setdefault((cell, impl), []).append((r["tflops"], r["tflops"] / ref if ref else None))
        return got

    new, ref = side("new"), side("ref")
    lines = ["| cell | implementation | new TFLOP/s (runs) | ref TFLOP/s (runs) | new/ref through FA4 | raw new/ref |",
             "|---|---|---|---|---|---|"]
    for key in [k for k in new if k in ref]:
        a, b = new[key], ref[key]
        raw = statistics.median(x for x, _ in a) / statistics.median(x for x, _ in b)
        ra, rb = [r for _, r in a if r], [r for _, r in b if r]
        through = f"{statistics.median(ra) / statistics.median(rb):.3f}" if ra and rb else "—"
        lines.append(f"| {key[0]} | {key[1]} | {' / '.join(str(x) for x, _ in a)} | {' / '.join(str(x) for x, _ in b)} | "
                     f"{through} | {raw:.3f} |")
    if len(lines) == 2:
        lines.append("| (no cell in both sides' runs) | | | | | |")
    return lines


def check_outputs(cell: str, impls: dict) -> None:
    """Every fa4gen forward of `impls` against flash-attn-4's output (cuDNN's without it: BHSD, so transposed; else
    the default fa4gen's), by bench_fwd.outputs_agree; SystemExit naming the implementation when one is off."""
    import torch
    from bench_fwd import OUTPUT_TOLERANCE, outputs_agree

    ref_name = next((n for n in ("fa4", "cudnn", "fa4gen") if n in impls), None)
    if ref_name is None:
        return
    ref = impls[ref_name]()
    ref = (ref[0] if isinstance(ref, tuple) else ref)
    if ref_name == "cudnn":
        ref = ref.transpose(1, 2)
    for name, fn in impls.items():
        if name.startswith("fa4gen") and name != ref_name:
            ok, diff = outputs_agree(fn(), ref)
            if not ok:
                raise SystemExit(f"sustained_bench: {name} differs from {ref_name} in {cell} by {diff:.3g} "
                                 f"(> {OUTPUT_TOLERANCE:.3g} x max |reference|): not timing it")
    torch.cuda.synchronize()


def check_grads(cell: str, steps: dict, leaves_of: dict) -> None:
    """Every fa4gen backward's gradients (fa4gen_bwd and its variants) against flash-attn-4's (else cuDNN's): one step
    of each (`steps`: name -> a backward step that fills its `leaves_of[name]` (q, k, v) gradients), then dQ, dK, dV
    compared as check_outputs compares outputs."""
    from bench_fwd import OUTPUT_TOLERANCE, outputs_agree

    ref_name = next((n for n in ("fa4_bwd", "cudnn_bwd") if n in steps), None)
    if ref_name is None:
        return
    grads = {}
    for name in steps:
        if name == ref_name or name.startswith("fa4gen_bwd"):
            steps[name]()
            grads[name] = [x.grad.clone() for x in leaves_of[name]]
    for name, got in grads.items():
        if name == ref_name:
            continue
        for label, g, ref in zip(("dQ", "dK", "dV"), got, grads[ref_name]):
            ok, diff = outputs_agree(g, ref)
            if not ok:
                raise SystemExit(f"sustained_bench: {name}'s {label} differs from {ref_name}'s in {cell} by {diff:.3g} "
                                 f"(> {OUTPUT_TOLERANCE:.3g} x max |reference|): not timing it")


def sustain(fn, warm_s: float, seconds: float):
    """Run fn back to back: `warm_s` seconds unmeasured, then `seconds` measured (bench_fwd.run_for: synchronized
    every ~50 ms of GPU work). (calls, GPU ms between CUDA events around the measured calls, (t0, t1) host span)."""
    import torch
    from bench_fwd import run_for

    fn()  # (a first call may compile)
    torch.cuda.synchronize()
    if warm_s > 0:
        run_for(fn, warm_s)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    start.record()
    calls = run_for(fn, seconds)
    end.record()
    torch.cuda.synchronize()
    return calls, start.elapsed_time(end), (t0, time.time())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="128", help="comma list of head dims")
    ap.add_argument("--masks", default="none", help="comma list of none, causal")
    ap.add_argument("--seqlens", default="16384", help="comma list; batch = 16384 / seqlen, heads = 2048 / d")
    ap.add_argument("--bwd", action="store_true", help="also the backwards (fa4gen, flash-attn-4, cuDNN)")
    ap.add_argument("--variant", action="append", default=[], type=parse_variant, metavar="NAME:FIELD=JSON[;...]",
                    help="a fa4gen forward with these pipeline fields, timed as fa4gen:NAME (repeatable)")
    ap.add_argument("--bwd-variant", action="append", default=[], type=parse_variant, metavar="NAME:FIELD=JSON[;...]",
                    help="with --bwd: a fa4gen backward with these pipeline fields (e.g. bwd_swap_ab=true, "
                         "bwd_dq_atomic=true), timed as fa4gen_bwd:NAME (repeatable)")
    ap.add_argument("--fwd-kernel", action="append", default=[], metavar="MODULE",
                    help="also fa4gen's default forward pinned to this kernel of its spec whatever the call's seqlen_q "
                         "(e.g. fwd_sm90: the persistent forward where the API runs fwd_sm90_long), timed as "
                         "fa4gen@MODULE (repeatable; pinned calls skip the API's call cache, so time calls of >= 0.5 ms)")
    ap.add_argument("--skip", default="", help="comma list of cudnn, fa4: not timed")
    ap.add_argument("--warm", type=float, default=2.0, help="seconds each implementation runs before its measured span")
    ap.add_argument("--seconds", type=float, default=3.0, help="measured seconds per implementation and round")
    ap.add_argument("--rounds", type=int, default=2,
                    help="passes over the implementations, each in another order (bench_fwd.pass_order)")
    ap.add_argument("--out", default="sustained_out")
    ap.add_argument("--cells", nargs="+", type=Path, metavar="JSON",
                    help="no run: print the per-cell ratio table of these sustained.json files (the README's) and stop")
    ap.add_argument("--ab", type=Path, metavar="DIR",
                    help="no run: the A/B table of tools/ab_bench.sh's DIR/{new,ref}_N/sustained.json (AB_SCRIPT="
                         "sustained_bench.py) and stop")
    args = ap.parse_args(argv)
    if args.ab:
        if not args.ab.is_dir():
            ap.error(f"--ab: no such folder: {args.ab}")
        print("\n".join(ab_table(args.ab)))
        return 0
    if args.cells:
        missing = [str(p) for p in args.cells if not p.is_file()]
        if missing:
            ap.error(f"--cells: no such file: {', '.join(missing)}")
        print("\n".join(cell_table(args.cells)))
        return 0
    skip = {s for s in args.skip.split(",") if s}
    if not skip <= {"cudnn", "fa4"}:
        ap.error(f"--skip: expected a comma list of cudnn, fa4; got {args.skip!r}")
    if args.rounds < 1 or args.seconds <= 0 or args.warm < 0:
        ap.error("--rounds >= 1, --seconds > 0 and --warm >= 0 expected")
    from bench_fwd import _causal_keys, _dims, _fa4, _first, _fwd_spec, _masks, _sdpa, _sdpa_bshd, pass_order

    dims, masks = _dims(args.dims), _masks(args.masks)
    if args.variant:  # checked by the spec model before anything runs
        from fa4gen.spec import SpecError, spec_from_dict

        for name, fields in args.variant:
            try:
                spec_from_dict(_fwd_spec(64, False, pipeline=fields), source=f"--variant {name}")
            except SpecError as err:
                raise SystemExit(str(err)) from None
    if args.bwd_variant and not args.bwd:
        ap.error("--bwd-variant: give --bwd too")
    for name, fields in args.bwd_variant:  # checked by the spec model and the planner before anything runs
        from fa4gen.plan import plan_kernels
        from fa4gen.spec import SpecError, spec_from_dict

        for d, dv in dims:
            for causal in (m == "causal" for m in masks):
                try:
                    plan_kernels(spec_from_dict(_bwd_variant_spec(d, causal, dv, name, fields),
                                                source=f"--bwd-variant {name}"), "sm90")
                except SpecError as err:
                    raise SystemExit(str(err)) from None
    if args.fwd_kernel:  # (on the CPU too: the plans name each spec's forward kernels)
        from fa4gen.plan import plan_kernels
        from fa4gen.spec import spec_from_dict

        for d, dv in dims:
            for causal in (m == "causal" for m in masks):
                spec = _fwd_spec(d, causal, dv)
                modules = [p.module for p in plan_kernels(spec_from_dict(spec), "sm90") if p.direction == "fwd"]
                for module in args.fwd_kernel:
                    if module not in modules:
                        raise SystemExit(f"--fwd-kernel: {spec['name']} has no forward kernel {module!r} "
                                         f"(its forwards: {', '.join(modules)})")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("sustained_bench: needs a CUDA GPU (it runs kernels for seconds); none is visible here")
    import fa4gen
    from clock_log import ClockLog

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clock = ClockLog(out / "clock_log.csv")
    if not clock.start():
        raise SystemExit("sustained_bench: no nvidia-smi samples, so no clock or power to read; stopping")
    fa4 = None if "fa4" in skip else _fa4()
    cudnn = None if "cudnn" in skip else _sdpa("cudnn")
    runs = []
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for d, dv in dims:
        for causal in (m == "causal" for m in masks):
            pkgs = {"fa4gen": fa4gen.build(_fwd_spec(d, causal, dv))}
            for name, fields in args.variant:
                pkgs[f"fa4gen:{name}"] = fa4gen.build(_fwd_spec(d, causal, dv, pipeline=fields))
            bwd_pkgs = {}
            if args.bwd:
                bwd_pkgs["fa4gen_bwd"] = fa4gen.build(_bwd_variant_spec(d, causal, dv))
                for name, fields in args.bwd_variant:
                    bwd_pkgs[f"fa4gen_bwd:{name}"] = fa4gen.build(_bwd_variant_spec(d, causal, dv, name, fields))
            for s in map(int, args.seqlens.split(",")):
                b, h = max(1, 16384 // s), 2048 // d
                q, k = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                v = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                flops = 2 * b * h * (_causal_keys(s, None) if causal else s * s) * (d + dv)
                cell = f"d{d}{f'x{dv}' if dv != d else ''} s{s} {'causal' if causal else 'none'}"
                impls = {name: (lambda p=p: p.attention(q, k, v)) for name, p in pkgs.items()}
                for module in args.fwd_kernel:
                    def pinned(module=module, p=pkgs["fa4gen"]):
                        with p._forward.pinned(module):
                            return p.attention(q, k, v)

                    impls[f"fa4gen@{module}"] = pinned
                if fa4 is not None:
                    impls["fa4"] = lambda: fa4(q, k, v, causal=causal)
                if cudnn is not None:
                    impls["cudnn"] = lambda: cudnn(qt, kt, vt, causal)
                work = {name: flops for name in impls}
                check_outputs(cell, impls)
                if bwd_pkgs:
                    fwds = {name: p.attention for name, p in bwd_pkgs.items()}
                    if fa4 is not None:
                        fwds["fa4_bwd"] = lambda q, k, v: _first(fa4(q, k, v, causal=causal))
                    if cudnn is not None:
                        fwds["cudnn_bwd"] = _sdpa_bshd(cudnn, causal)
                    torch.manual_seed(0)
                    dout = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
                    leaves_of = {}
                    for name, run in fwds.items():
                        leaves = leaves_of[name] = tuple(x.detach().requires_grad_() for x in (q, k, v))
                        o = run(*leaves)

                        def step(o=o, leaves=leaves):
                            for x in leaves:
                                x.grad = None
                            o.backward(dout, retain_graph=True)

                        impls[name] = step
                        work[name] = 2.5 * flops
                    check_grads(cell, {name: impls[name] for name in fwds}, leaves_of)
                for rnd in range(args.rounds):
                    for name in pass_order(impls, rnd):
                        calls, ms, span = sustain(impls[name], args.warm, args.seconds)
                        r = {"cell": cell, "impl": name, "round": rnd, "calls": calls, "ms": round(ms, 2),
                             "tflops": round(work[name] * calls / (ms * 1e-3) / 1e12, 1), "span": span}
                        runs.append(r)
                        print(json.dumps(r), flush=True)
                del q, k, v, qt, kt, vt
    # the card's own reference: a bf16 8192^3 matmul sustained the same way, after the cells
    calls, ms, span = sustain(lambda: a @ a, args.warm, args.seconds)
    matmul = {"tflops": round(2 * 8192**3 * calls / (ms * 1e-3) / 1e12, 1), "span": span}
    clock.stop()  # (the windows are read once nvidia-smi has exited: its output buffer holds the latest samples back)
    for r in [*runs, matmul]:
        clk = clock.window([r["span"]]) or {}
        r.update({key: clk.get(key) for key in ("sm_mhz", "watts", "temp_c", "samples")})
    rows = summarize(runs)
    (out / "sustained.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "argv": sys.argv[1:],
                                                    "matmul_after": matmul, "runs": runs, "rows": rows}, indent=1))
    lines = [f"Sustained ({args.warm} s warm + {args.seconds} s measured per implementation and round, {args.rounds} "
             f"round(s) in bench_fwd.pass_order's orders; no L2 flush between calls). "
             f"bf16 8192^3 matmul sustained after the cells: "
             f"{matmul['tflops']} TFLOP/s at {matmul.get('sm_mhz')} MHz, {matmul.get('watts')} W", "", *table(rows)]
    (out / "sustained.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

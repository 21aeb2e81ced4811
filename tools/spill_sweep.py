"""Register spills (LDL/STL) of every SM90 kernel over a grid of spec variants, compiled on the CPU (no
GPU needed). Issue #3 asks for no LDL/STL in any SM90 kernel; the committed specs are checked by the CPU
test suite, this covers the variants a user can select: head dims, masks, softcap, GQA, varlen,
deterministic, fp16/bf16, poly-exp shares (`--poly`). `--arch sm100` sweeps the SM100 forwards instead (compiled
only; forward-only specs, `--lse` then meaning return_lse, `--two-cta` the 2-CTA MMA, kept to its planned cases:
no mask, not varlen).

For each kernel of each variant it prints the spill instructions per CUDA function of the module
(main kernel, pre/postprocess), by the warp role whose setmaxnreg region holds them (`spills_by_role`: "softmax 216",
"consumers 240", "launch" before any setmaxnreg), and the loops issuing MMAs that hold some (instructions, MMAs, LDL/STL;
the per-block loops, where a spill costs every iteration, are the short ones: see tools/sass_loops.py).
Writes a JSON summary with --out.

Run: `PYTHONPATH=. python tools/spill_sweep.py [--dims 64,128,256] [--masks none,causal] [--only bwd] [--out F]`;
session 52's SM100 census (688 variants, ~17 minutes on two cores; docs/SM100.md): `--arch sm100 --dims
64,128,192,192x128,256 --masks none,causal,window,chunked --softcap 0,20 --gqa 0 --varlen 0,1 --det 0 --lse 0,1 --poly
0,0.15,0.25,0.34 --two-cta 0,1`; `--ping-pong 0` builds the one-Q-tile plans (sm100) the default does not;
`--tile-m / --tile-n / --kv-stages` (comma lists of integers or auto) and `--bwd-swap-ab / --bwd-dq-atomic` build
the explicit choices a spec may make (session 54's censuses of them: docs/PERF.md).
One compile is about 3-10 s on one core; the default grid is a few hundred kernels (tens of minutes).
"""

import argparse
import itertools
import json
import os
import re
import tempfile
from pathlib import Path

MASKS = {
    "none": {"kind": "none"},
    "causal": {"kind": "causal"},
    "window": {"kind": "sliding_window", "left": 100, "right": 20},
    "chunked": {"kind": "chunked", "chunk_size": 96},
}


def variants(dims, masks, softcaps, gqas, varlens, dets, dtypes, lses=(True,), polys=(0.0,), two_ctas=(False,),
             arch="sm90", ping_pongs=("auto",), tile_ms=("auto",), tile_ns=("auto",), kv_stages=("auto",),
             swaps=("auto",), dq_atomics=("auto",)):
    """Spec dicts of the grid: with the LSE, backward: true, so each has a forward (writing the LSE) and a backward
    kernel; without (lses holding False), forward-only inference specs, return_lse: false (their forward keeps no
    LSE registers, so it allocates differently: session 49's d64 chunked + softcap 192-row forward spilled 12 there
    and 4 with the LSE). `dets` applies to the LSE variants only. `polys`: poly_exp shares (0: MUFU only).
    arch "sm100": forward-only specs (no SM100 backward), the LSE as return_lse; `two_ctas` True only without a mask
    and varlen (the planner's 2-CTA cases). `ping_pongs`: "auto", True or False (pipeline.ping_pong; on sm100 False is one
    Q tile per CTA). `tile_ms`, `tile_ns`, `kv_stages`: "auto" or explicit pipeline.tile_m / tile_n / kv_stages, the
    forward choices a spec may set (combinations the planner refuses are reported as refused); `swaps`, `dq_atomics`:
    "auto", True or False (the backward's pipeline.bwd_swap_ab / bwd_dq_atomic)."""
    for (d, dv), mask, softcap, gqa, varlen, det, dtype, lse, poly, two, pp, tm, tn, kv, sw, at in itertools.product(
            dims, masks, softcaps, gqas, varlens, dets, dtypes, lses, polys, two_ctas, ping_pongs, tile_ms, tile_ns,
            kv_stages, swaps, dq_atomics):
        if (sw != "auto" or at != "auto") and not (lse and arch == "sm90"):
            continue  # (backward switches: training specs only)
        if det and (not lse or arch != "sm90"):
            continue  # (deterministic is a backward property)
        if two and (arch != "sm100" or mask != "none" or varlen):
            continue
        # the pipeline fields set explicitly ("auto" leaves one alone): (field, name tag, value)
        explicit = [(field, tag, value) for field, tag, value in (
            ("ping_pong", "pp", pp), ("tile_m", "m", tm), ("tile_n", "n", tn), ("kv_stages", "kv", kv),
            ("bwd_swap_ab", "swap", sw), ("bwd_dq_atomic", "atomic", at)) if value != "auto"]
        name = (f"sw_{dtype}_d{d}{f'x{dv}' if dv != d else ''}_{mask}{'_sc' if softcap else ''}"
                f"{'_gqa' if gqa else ''}{'_vl' if varlen else ''}{'_det' if det else ''}{'' if lse else '_nolse'}"
                f"{f'_p{round(poly * 100)}' if poly else ''}{'_2cta' if two else ''}"
                f"{''.join(f'_{tag}{int(value)}' for _, tag, value in explicit)}{'_sm100' if arch == 'sm100' else ''}")
        pipeline = {**({"poly_exp": {"share": poly, "degree": 3}} if poly else {}),
                    **({"two_cta": True} if two else {}), **{field: value for field, _, value in explicit}}
        training = lse and arch == "sm90"
        yield dict(name=name, targets=[arch], dtype=dtype, head_dim=d, head_dim_v=dv, mask=MASKS[mask],
                   softcap=softcap, allow_gqa=gqa, varlen=varlen, backward=training, deterministic=det,
                   **({} if arch == "sm90" else {"return_lse": lse}), **({"pipeline": pipeline} if pipeline else {}))


def _functions(sass: str):
    """(function name, its SASS text) per .text section."""
    parts = sass.split(".section\t.text.")
    for part in parts[1:]:
        head, _, body = part.partition("\n")
        yield head.split(",")[0].strip(), body


def _short(name: str) -> str:
    for key in ("FlashBwd", "FlashFwd", "ConvertChunks", "PreprocessVarlen", "Preprocess", "Convert"):
        if key in name:
            return key
    return name[:40]


_SETMAXNREG = re.compile(r"\bUSETMAXREG\.(?:TRY_ALLOC|DEALLOC)\S*\s+(?:U?P\d+,\s*)?(0x[0-9a-fA-F]+|\d+)")


def role_names(plan) -> dict[int, str]:
    """setmaxnreg count -> the warp roles that set it, from the plan's register split (SM90: producer / consumers;
    SM100: softmax / correction / other). Roles sharing a count are joined with '/'."""
    roles = (("producer", "regs_producer"), ("consumers", "regs_consumer"), ("softmax", "regs_softmax"),
             ("correction", "regs_correction"), ("other", "regs_other"))
    names: dict[int, list[str]] = {}
    for role, field in roles:
        count = getattr(plan, field, 0) or 0
        if count:
            names.setdefault(count, []).append(role)
    return {count: "/".join(found) for count, found in names.items()}


def spills_by_role(body: str, names: dict[int, str] | None = None) -> dict[str, int]:
    """LDL/STL of one function's SASS by the setmaxnreg region they sit in: each spill counts for the last
    USETMAXREG before it in the listing ("launch" before any). Warp-role branches follow their setmaxnreg in
    program order in these kernels, so the region names the role whose register budget ran out. `names` maps a
    count to role names (role_names); a count not in it is reported as "setmaxnreg N"."""
    names = names or {}
    region, counts = "launch", {}
    for line in body.splitlines():
        found = _SETMAXNREG.search(line)
        if found:
            n = int(found.group(1), 0)
            region = f"{names[n]} {n}" if n in names else f"setmaxnreg {n}"
        elif re.search(r"\b(LDL|STL)\b", line):
            counts[region] = counts.get(region, 0) + 1
    return counts


def _mma_loop_spills(sass: str, loops) -> list[tuple[int, int, int]]:
    """(instructions, MMAs, LDL/STL) of every loop that issues MMAs and spills. `loops` lists nested and
    overlapping back-branch regions too, so the per-block loops are the short ones with the kernel's
    per-block MMA count (tools/sass_loops.py prints them all)."""
    rows = []
    for body in loops(sass):
        mma = sum(any(op in line for op in ("HGMMA", "UTCHMMA", "UTCQMMA", "UTCOMMA")) for line in body)
        spills = sum(bool(re.search(r"\b(LDL|STL)\b", line)) for line in body)
        if mma and spills:
            rows.append((len(body), mma, spills))
    return rows


def sweep(specs, out_rows, directions=("fwd", "bwd"), workers=0, skip_twins=False, arch="sm90"):
    from fa4gen.builder import compile_specs_for_sass, plan_spec
    from fa4gen.compile.sass import loops
    from fa4gen.plan import PlanError
    from fa4gen.spec import spec_from_dict

    pairs = []
    for data in specs:
        try:
            spec = spec_from_dict(data)
            plans, _ = plan_spec(spec, archs=[arch])
            # skip_twins: an allow_gqa variant's MHA-call backward (bwd_sm90_mha) is the allow_gqa: false variant's
            # kernel, which the sweep compiles anyway when its variants include those (main: --gqa with a 0)
            plans = [p for p in plans if p.direction in directions and not (p.mha_only and skip_twins)]
        except (PlanError, ValueError) as err:  # a combination the planner refuses (reported, not a spill)
            out_rows.append(dict(spec=data["name"], refused=str(err).splitlines()[0][:160]))
            print(f"{data['name']}: refused: {str(err).splitlines()[0][:120]}", flush=True)
            continue
        pairs.append((spec, plans))
    with tempfile.TemporaryDirectory(prefix="fa4gen-spills-") as tmp:
        # every variant's kernels compile together, in as many processes as the machine allows
        progress = lambda line: print(line, flush=True)  # noqa: E731
        for rows in compile_specs_for_sass(pairs, Path(tmp), "sw_gen", workers=workers, log=progress):
            for plan, report, sass in rows:
                if sass is None:
                    out_rows.append(dict(spec=plan.name, kernel=plan.module, error=report.detail or "not compiled"))
                    print(f"{plan.name} {plan.module}: NOT COMPILED {report.detail}", flush=True)
                    continue
                per_fn, by_role, names = {}, {}, role_names(plan)
                for fn, body in _functions(sass):
                    n = len(re.findall(r"\b(?:LDL|STL)\b", body))
                    if n:
                        per_fn[_short(fn)] = per_fn.get(_short(fn), 0) + n
                        for role, k in spills_by_role(body, names).items():
                            key = f"{_short(fn)}: {role}"
                            by_role[key] = by_role.get(key, 0) + k
                in_loops = _mma_loop_spills(sass, loops)
                row = dict(spec=plan.name, kernel=plan.module, tile_m=plan.tile_m, tile_n=plan.tile_n,
                           spills=per_fn, spills_by_role=by_role, mma_loops_with_spills=in_loops)
                out_rows.append(row)
                flag = "" if not per_fn else (f"  SPILLS {per_fn}; by setmaxnreg region {by_role}; "
                                              f"MMA loops (instructions, MMAs, LDL/STL): {in_loops}")
                print(f"{plan.name} {plan.module} {plan.tile_m}x{plan.tile_n}{flag}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="64,96,128,192x128,256", help="D or DxDV, comma list")
    ap.add_argument("--masks", default="none,causal,window,chunked")
    ap.add_argument("--softcap", default="0,20", help="comma list of softcap values")
    ap.add_argument("--gqa", default="0,1")
    ap.add_argument("--varlen", default="0,1")
    ap.add_argument("--det", default="0,1")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--lse", default="1", help="comma list: 1 = training specs (backward: true, the forward writes the "
                    "LSE), 0 = forward-only specs without the LSE")
    ap.add_argument("--only", choices=("fwd", "bwd"), default=None, help="compile only this direction's kernels")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--jobs", type=int, default=0, help="compile processes (0: one per CPU, as memory allows)")
    ap.add_argument("--arch", choices=("sm90", "sm100"), default="sm90",
                    help="sm100: the SM100 forwards (compiled only; forward-only specs, --lse as return_lse)")
    ap.add_argument("--poly", default="0", help="comma list of poly_exp shares (0: MUFU only)")
    ap.add_argument("--two-cta", default="0", help="sm100: comma list of 0 / 1 (2-CTA MMA; no mask, not varlen)")
    ap.add_argument("--ping-pong", default="auto", help="comma list of auto / 0 / 1 (pipeline.ping_pong; on sm100 0 is "
                    "one Q tile per CTA)")
    for flag, field in (("--tile-m", "tile_m"), ("--tile-n", "tile_n"), ("--kv-stages", "kv_stages")):
        ap.add_argument(flag, default="auto", help=f"comma list of auto / integers (pipeline.{field}: the explicit "
                        "choices a spec may make; refused combinations are listed as refused)")
    ap.add_argument("--bwd-swap-ab", default="auto", help="comma list of auto / 0 / 1 (pipeline.bwd_swap_ab; training "
                    "specs only)")
    ap.add_argument("--bwd-dq-atomic", default="auto", help="comma list of auto / 0 / 1 (pipeline.bwd_dq_atomic)")
    args = ap.parse_args(argv)
    os.environ.setdefault("FA4GEN_QUIET", "1")
    dims = [(int(t.split("x")[0]), int(t.split("x")[-1])) for t in args.dims.split(",")]
    flags = lambda text: [bool(int(x)) for x in text.split(",")]  # noqa: E731
    # comma lists of "auto" or values: switches (0 / 1) or integers
    auto_or = lambda text, conv: ["auto" if x == "auto" else conv(int(x)) for x in text.split(",")]  # noqa: E731
    specs = variants(dims, args.masks.split(","), [float(x) for x in args.softcap.split(",")],
                     flags(args.gqa), flags(args.varlen), flags(args.det), args.dtypes.split(","), flags(args.lse),
                     [float(x) for x in args.poly.split(",")], flags(args.two_cta), args.arch,
                     auto_or(args.ping_pong, bool),
                     *(auto_or(text, int) for text in (args.tile_m, args.tile_n, args.kv_stages)),
                     *(auto_or(text, bool) for text in (args.bwd_swap_ab, args.bwd_dq_atomic)))
    rows = []
    try:
        sweep(specs, rows, (args.only,) if args.only else ("fwd", "bwd"), workers=args.jobs,
              skip_twins=False in flags(args.gqa), arch=args.arch)
    finally:
        if args.out is not None:
            args.out.write_text(json.dumps(rows, indent=1))
    spilled = [r for r in rows if r.get("spills")]
    print(f"{len(rows)} kernels, {len(spilled)} with LDL/STL, "
          f"{sum(1 for r in spilled if r['mma_loops_with_spills'])} of them with some inside a loop that issues MMAs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Session 51's SM100 poly-exp spill census (CPU, no GPU): every SM100 forward of head dims 64 / 128 / (192, 128),
four masks, softcap 0 / 20, varlen, 2-CTA (no mask, not varlen), LSE or not, with every 3rd / 4th / 7th column
emulated (poly_exp share 0.34 / 0.25 / 0.15), compiled for sm_100a in two processes; prints and writes (name,
poly_every, LDL/STL, FFMA2, FADD2.RM) per kernel. The every-5th-to-7th census ran the same loops with `--shares
0.15,0.17,0.2 --dims 64,128`. Run from the project root (about 8 minutes on two cores):
`PYTHONPATH=. python docs/perf/2026-12-04_s51_cpu/sm100_poly_spill_census.py OUT.json [--shares ...] [--dims ...]`.
"""

import argparse
import itertools
import json
import re
import tempfile
from pathlib import Path

from fa4gen.builder import compile_specs_for_sass, plan_spec
from fa4gen.plan import PlanError
from fa4gen.spec import spec_from_dict

MASKS = {
    "none": {"kind": "none"},
    "causal": {"kind": "causal"},
    "window": {"kind": "sliding_window", "left": 100, "right": 20},
    "chunked": {"kind": "chunked", "chunk_size": 96},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--shares", default="0.15,0.25,0.34")
    ap.add_argument("--dims", default="64,128,192x128")
    args = ap.parse_args()
    dims = [(int(t.split("x")[0]), int(t.split("x")[-1])) for t in args.dims.split(",")]
    shares = [float(x) for x in args.shares.split(",")]
    pairs, refused = [], []
    for (d, dv), mask, share, sc, vl, two, lse in itertools.product(
            dims, MASKS, shares, [0.0, 20.0], [False, True], [False, True], [False, True]):
        if two and (vl or mask != "none"):
            continue
        name = (f"s1_d{d}x{dv}_{mask}_p{int(share * 100)}{'_sc' if sc else ''}{'_vl' if vl else ''}"
                f"{'_2cta' if two else ''}{'_lse' if lse else ''}")
        pipeline = {"poly_exp": {"share": share, "degree": 3}, **({"two_cta": True} if two else {})}
        data = dict(name=name, targets=["sm100"], dtype="bf16", head_dim=d, head_dim_v=dv, mask=MASKS[mask],
                    softcap=sc, varlen=vl, return_lse=lse, pipeline=pipeline)
        try:
            spec = spec_from_dict(data)
            plans, _ = plan_spec(spec, archs=["sm100"])
        except (PlanError, ValueError) as err:
            refused.append((name, str(err).splitlines()[0][:100]))
            continue
        pairs.append((spec, plans))
    print(len(pairs), "specs;", len(refused), "refused", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for res in compile_specs_for_sass(pairs, Path(tmp), "s1_gen", workers=2, log=lambda line: None):
            for plan, report, sass in res:
                if sass is None:
                    rows.append((plan.name, "NOT COMPILED", report.detail))
                    continue
                rows.append((plan.name, plan.poly_every, len(re.findall(r"\b(?:LDL|STL)\b", sass)),
                             len(re.findall(r"\bFFMA2\b", sass)), len(re.findall(r"FADD2\.RM", sass))))
    for row in rows:
        print(row)
    bad = [r for r in rows if r[1] == "NOT COMPILED" or r[2] != 0]
    print(len(rows), "kernels,", len(bad), "spill or fail")
    args.out.write_text(json.dumps(dict(rows=rows, refused=refused), indent=1))


if __name__ == "__main__":
    main()

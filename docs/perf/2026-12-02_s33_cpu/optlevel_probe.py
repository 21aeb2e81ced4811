"""Compile one spec's sm90 kernels with CuTe-DSL --opt-level N (in this process) and report time + loop sizes."""
import json, sys, time, tempfile, os
from pathlib import Path
sys.path.insert(0, "tools")
import fa4gen.compile.generated as g
from sass_loops import loop_rows
opt = sys.argv[1]; spec_json = sys.argv[2]
if opt != "default":
    g.COMPILE_OPTIONS = f"--enable-tvm-ffi --opt-level {opt}"
from fa4gen.builder import compile_specs_for_sass, plan_spec
from fa4gen.spec import spec_from_dict
spec = spec_from_dict(json.loads(spec_json))
plans, _ = plan_spec(spec, archs=["sm90"])
plans = [p for p in plans if p.direction == sys.argv[3]] if len(sys.argv) > 3 else plans
with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    rows = compile_specs_for_sass([(spec, plans)], Path(tmp), "opt_pkg", workers=1)[0]
    dt = time.perf_counter() - t0
for plan, report, sass in rows:
    fn = [p for p in (sass or "").split(".section\t.text.") if "Flash" in p.split("\n", 1)[0]]
    body = fn[0] if fn else ""
    print(f"opt {opt} {plan.module}: {report.status} compile {report.seconds:.2f}s "
          f"loops {[r[0] for r in loop_rows(body)]} instrs {body.count(chr(10))} spills {body.count('LDL') + body.count('STL')}")
print(f"opt {opt}: total {dt:.2f} s")

"""The Python part of a call's host overhead, measured on the CPU (no GPU needed): a committed
package's attention() on CPU tensors with the launch, the device checks and the arch lookup stubbed
out, so what is timed is fa4gen's own per-call work — argument checks, run-time arguments, the two
allocations (CPU ones here) — plus the stubbed launch's call. The GPU number (eager call minus
CUDA-graph replay) comes from tools/launch_cost.py on the H200; this one tracks the Python side
between GPU sessions.

Run: `PYTHONPATH=. python tools/host_overhead_cpu.py [--calls N] [--package llama3_8b]`.
"""

import argparse
import importlib
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", default="llama3_8b")
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args(argv)
    pkg = importlib.import_module(f"generated.{args.package}")
    op = pkg._forward
    plan = op.plans["sm90"]
    op.arch_for = lambda device: "sm90"
    op._check_devices = lambda device, named: None
    op.function = lambda plan: (lambda *a: None)
    op._launch = lambda fn, device, launch_args: fn(*launch_args)
    dtype = getattr(torch, plan["torch_dtype"])
    h_kv = 8 if plan["allow_gqa"] else 32
    q = torch.randn(1, 128, 32, plan["head_dim"], dtype=dtype)
    k = torch.randn(1, 128, h_kv, plan["head_dim"], dtype=dtype)
    v = torch.randn(1, 128, h_kv, plan["head_dim_v"], dtype=dtype)
    with torch.no_grad():
        for label, kwargs in (("first call of a signature (full checks)", None), ("repeated signature", {})):
            if kwargs is None:
                t0 = time.perf_counter()
                for _ in range(args.calls // 10):
                    op._calls.clear()
                    pkg.attention(q, k, v)
                per = (time.perf_counter() - t0) / (args.calls // 10)
            else:
                for _ in range(1000):
                    pkg.attention(q, k, v)
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    pkg.attention(q, k, v)
                per = (time.perf_counter() - t0) / args.calls
            print(f"{args.package}: {label}: {per * 1e6:.1f} us per call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

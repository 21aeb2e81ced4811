"""The Python part of a call's host overhead, measured on the CPU (no GPU needed): a committed
package's attention() on CPU tensors with the launch, the device checks and the arch lookup stubbed
out, so what is timed is fa4gen's own per-call work — argument checks, run-time arguments, the two
allocations (CPU ones here) — plus the stubbed launch's call. The GPU number (eager call minus
CUDA-graph replay) comes from tools/launch_cost.py on the H200; this one tracks the Python side
between GPU sessions.

Run: `PYTHONPATH=. python tools/host_overhead_cpu.py [--calls N] [--package llama3_8b] [--dropin] [--alloc-ab]
[--backward]`. --backward times the package's backward call instead (`ForwardOp.backward`, what autograd runs;
launch stubbed, packed sequences for a varlen package, given max_seqlen so unchecked as in training) and lists
the functions with the most own time: a short backward waits for all of it before its kernels start.
--alloc-ab times the replay (`ForwardOp._replay`, launch stubbed) with the output made like q (`empty_like`,
the API's path when out has q's shape and dtype) against made from its shape (`torch.empty`), alternated in
one process: this CPU's run-to-run spread (up to 2x) hides a 1 us difference between separate runs.
--cache-ab times, alternated over 10 rounds in one process, a repeated call with the signature caches (the
launch replay without grad, `ForwardOp._replay`; the checks' verdict with grad, `ForwardOp._grad_calls`) against
the full checks every call (the cache cleared before each); packed sequences of 32 tokens, max_seqlen given,
for a varlen package (packed calls have taken the caches since session 29).
"""

import argparse
import importlib
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", default="llama3_8b")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--dropin", action="store_true",
                    help="also time fa4gen.flash_attn_func on the same call (its own package, built into "
                         "$FA4GEN_CACHE_DIR; masks none / causal) against that package's attention")
    ap.add_argument("--alloc-ab", action="store_true",
                    help="also time the replay with the output made like q against made from its shape")
    ap.add_argument("--backward", action="store_true",
                    help="time the package's backward call (stubbed launch) instead of its forward")
    ap.add_argument("--cache-ab", action="store_true",
                    help="time repeated calls with the signature caches against the full checks, alternated")
    args = ap.parse_args(argv)
    pkg = importlib.import_module(f"generated.{args.package}")
    op = pkg._forward
    plan = op.plans["sm90"]
    _stub(op)
    if args.backward:
        return _time_backward(op, plan, args.calls)
    if args.cache_ab:
        return _time_cache_ab(pkg, plan, args.calls)
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
                per = _per_call(lambda: pkg.attention(q, k, v), args.calls)
            print(f"{args.package}: {label}: {per * 1e6:.1f} us per call")
        if args.dropin:
            _time_dropin(q, k, v, plan, args.calls)
        if args.alloc_ab:
            _time_alloc(op, q, k, v, args.calls)
    return 0


def _time_alloc(op, q, k, v, calls: int) -> None:
    """ForwardOp._replay of the call above, its output made like q (the cached entry as the API keeps it when out
    has q's shape and dtype) against made from its shape, alternated over 8 rounds; median per call."""
    op._calls.clear()
    op(q, k, v)
    (hit,) = op._calls.values()
    if hit.out_shape is not None:
        print(f"--alloc-ab: this package's output is not shaped like q ({hit.out_shape}): nothing to compare")
        return
    sides = {"like q (empty_like)": hit, "from its shape (torch.empty)": hit._replace(out_shape=tuple(q.shape))}
    times = {name: [] for name in sides}
    for r in range(8):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            times[name].append(_per_call(lambda h=sides[name]: op._replay(h, q, k, v), calls))
    for name, ts in times.items():
        print(f"replay, output {name}: {sorted(ts)[len(ts) // 2] * 1e6:.2f} us per call (median of 8)")


def _time_cache_ab(pkg, plan, calls: int, rounds: int = 10) -> int:
    """A repeated call of one signature (4 query heads, 2 key/value heads with GQA, 128 tokens; packed as 4
    sequences of 32 with max_seqlen_q for a varlen package) with the package's signature caches against the
    full checks on every call, alternated over `rounds` rounds; medians. Without grad the launch replay
    (`_calls`); with grad, when the package has a backward, the checks' verdict (`_grad_calls`)."""
    import statistics

    op = pkg._forward
    dtype = getattr(torch, plan["torch_dtype"])
    h, h_kv, d, dv = 4, 2 if plan["allow_gqa"] else 4, plan["head_dim"], plan["head_dim_v"]
    packed = plan.get("varlen", False)
    lead = (128,) if packed else (1, 128)
    kw = {}
    if packed:
        cu = torch.tensor([0, 32, 64, 96, 128], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=32)
    kinds = [("no grad", op._calls, False)] + ([("with grad", op._grad_calls, True)] if op.bwd_plans else [])
    for label, cache, grad in kinds:
        q, k, v = (torch.randn(*lead, n, width, dtype=dtype, requires_grad=grad)
                   for n, width in ((h, d), (h_kv, d), (h_kv, dv)))

        def cached(q=q, k=k, v=v):
            pkg.attention(q, k, v, **kw)

        def full(q=q, k=k, v=v, cache=cache):
            cache.clear()
            pkg.attention(q, k, v, **kw)

        times = {"cached": [], "full checks": []}
        for r in range(rounds):
            order = [("cached", cached), ("full checks", full)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                times[name].append(_per_call(fn, max(calls // rounds, 1)) * 1e6)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"{op.name} ({'packed' if packed else 'batched'}), {label}: {med['cached']:.1f} us per call with the "
              f"signature cache, {med['full checks']:.1f} with the full checks (launch stubbed; medians of {rounds} "
              "alternated rounds)")
    return 0


def _time_backward(op, plan, calls: int) -> int:
    """ForwardOp.backward of a tiny call (4 query heads, 2 key/value heads with GQA, 32 tokens; 4 packed sequences
    of 8 for a varlen package: on the CPU the allocations' fills cost by size, on a GPU they are launches),
    launch stubbed: microseconds per call, and the 12 functions with the most own time under cProfile (which
    inflates them: compare them with each other)."""
    import cProfile

    from fa4gen.api.runtime import Packed

    if not op.bwd_plans:
        print(f"--backward: package {op.name} has no backward")
        return 2
    dtype = getattr(torch, plan["torch_dtype"])
    h, h_kv, d, dv = 4, 2 if plan["allow_gqa"] else 4, plan["head_dim"], plan["head_dim_v"]
    packed = None
    if plan.get("varlen", False):
        lead, lse_shape = (32,), (h, 32)
        cu = torch.tensor([0, 8, 16, 24, 32], dtype=torch.int32)
        packed = Packed.check(op.name, True, cu, cu, 8, None)  # max_seqlen given: unchecked, as in training
        packed.resolve(32, 32)
    else:
        lead, lse_shape = (1, 32), (1, h, 32)
    q = torch.randn(*lead, h, d, dtype=dtype)
    k = torch.randn(*lead, h_kv, d, dtype=dtype)
    v = torch.randn(*lead, h_kv, dv, dtype=dtype)
    out, dout = torch.randn(*lead, h, dv, dtype=dtype), torch.randn(*lead, h, dv, dtype=dtype)
    lse = torch.randn(lse_shape)

    def call():
        op.backward(q, k, v, out, dout, lse, None, softmax_scale=d ** -0.5, packed=packed)

    print(f"{op.name}: backward call: {_per_call(call, calls) * 1e6:.1f} us per call "
          f"({'packed' if packed is not None else 'dense'}, launch stubbed)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    for row in top_own_time(prof, calls, 12):
        print(f"  {row['tottime_us']:7.2f} us own, {row['calls']:3d}x  {row['function']}")
    return 0


def top_own_time(prof, calls: int, n: int) -> list[dict]:
    """The n functions of a cProfile.Profile over `calls` calls with the most own time, per call, most first:
    {"function": "file.py:line(name)", "tottime_us", "cumtime_us", "calls"} (also tools/bench_varlen.py's)."""
    import pstats

    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, primitive calls, tottime, cumtime, callers)}
    return [{"function": f"{path.rsplit('/', 1)[-1]}:{line}({name})", "tottime_us": round(own / calls * 1e6, 2),
             "cumtime_us": round(cum / calls * 1e6, 2), "calls": nc // calls}
            for (path, line, name), (nc, _, own, cum, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]]


def _stub(op) -> None:
    """The launch, the device checks and the arch lookup of a package's ForwardOp replaced (CPU tensors)."""
    op.arch_for = lambda device: "sm90"
    op._check_devices = lambda device, named: None
    op.function = lambda plan: (lambda *a: None)
    op._launch = lambda fn, device, launch_args: fn(*launch_args)


def _time_dropin(q, k, v, plan, calls: int) -> None:
    """fa4gen.flash_attn_func (fa4gen/dropin.py) against its package's own attention, repeated calls."""
    import fa4gen
    from fa4gen import dropin

    if plan["mask_kind"] not in ("none", "causal"):
        print(f"--dropin: mask {plan['mask_kind']!r} not timed (none / causal only)")
        return
    causal = plan["mask_kind"] == "causal"
    dropin._arch_of_device = lambda device: "sm90"
    spec = dropin.flash_attn_spec(q, k, v, causal=causal, arch="sm90")
    own = dropin.package_for(spec)
    _stub(own._forward)
    for label, call in (("its package's attention", lambda: own.attention(q, k, v)),
                        ("fa4gen.flash_attn_func", lambda: fa4gen.flash_attn_func(q, k, v, causal=causal))):
        print(f"{spec['name']}: {label}: {_per_call(call, calls) * 1e6:.1f} us per call")


def _per_call(call, calls: int) -> float:
    """Seconds per call of `call`, after 1000 warm-up calls."""
    for _ in range(1000):
        call()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - t0) / calls


if __name__ == "__main__":
    raise SystemExit(main())

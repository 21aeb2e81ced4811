"""Compile and launch costs on the GPU machine (issue #3 targets): cold compile per variant, load
from the disk cache in a fresh process, and host overhead per call (eager loop vs CUDA-graph replay
of the same call, tiny shape so the kernel time is small and identical in both), and the host time of a
tiny training step (forward + backward through autograd, dense and packed) next to flash-attn-4's.

Run: `source tools/device_env.sh; python3 tools/launch_cost.py --out $OUT`.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

SPEC = dict(name="launch_cost_d128", targets=["sm90"], dtype="bf16", head_dim=128, mask={"kind": "causal"})
CHILD = """
import sys, time, torch, fa4gen
if {preimport!r}:
    import cutlass  # flash-attn-4 imports it at `import flash_attn.cute`: its first call does not pay it
t0 = time.perf_counter()
import tvm_ffi  # part of a cache hit's load: without torch's DLPack C exchange API it loads or builds an addon
print("IMPORT_TVM_FFI_S", time.perf_counter() - t0)
print("DLPACK_C_API", int(hasattr(torch.Tensor, "__dlpack_c_exchange_api__")))
print("FA4GEN_FROM", fa4gen.__file__)  # the tree whose fa4gen ran (tools/cold_first_call_ab.py checks its side)
pkg = fa4gen.build({spec!r})
q = torch.randn(1, {seqlen}, 1, 128, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
t1 = time.perf_counter()
pkg.attention(q, q, q)
torch.cuda.synchronize()
print("FIRST_CALL_S", time.perf_counter() - t1)
print("CUTLASS_IMPORTED", int("cutlass" in sys.modules))  # a cache hit through the shared library needs none
t0 = time.perf_counter()
import cutlass  # the CuTe-DSL import, a per-process cost of compiling (and of the JIT-link fallback)
print("IMPORT_CUTLASS_S", time.perf_counter() - t0)
"""


FA4_CHILD = """
import time, torch
t0 = time.perf_counter()
from flash_attn.cute.interface import flash_attn_func
print("IMPORT_S", time.perf_counter() - t0)
q = torch.randn(1, {seqlen}, 1, 128, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
t1 = time.perf_counter()
flash_attn_func(q, q, q, causal=True)
torch.cuda.synchronize()
print("FIRST_CALL_S", time.perf_counter() - t1)
"""


def _child_values(stdout: str) -> dict:
    """The `NAME number` lines a child process printed (CHILD, FA4_CHILD), as strings by name."""
    return dict(ln.split(None, 1) for ln in stdout.splitlines()
                if (ln.endswith(tuple("0123456789")) or ln.startswith("FA4GEN_FROM ")) and " " in ln)


# the first call's shape (1, seqlen, 1, 128): 128 runs the persistent short-call kernel (fwd_sm90), LONG_SEQLEN
# the one-CTA-per-tile kernel of long calls (fwd_sm90_long, fa4gen/plan/sm90.py), each a variant of its own
LONG_SEQLEN = 8192


def child_env(cache_dir: str) -> dict:
    """The environment of a `first_call` child, which runs from `cache_dir`: `python -c` puts its working
    directory first on sys.path, so run from the project root the project's fa4gen shadowed whatever PYTHONPATH
    put first (tools/cold_first_call_ab.py's reference tree: until session 44 its "ref" side ran this tree).
    The project root goes last on PYTHONPATH, so an earlier entry's fa4gen wins."""
    root = str(Path(__file__).resolve().parent.parent)
    return dict(os.environ, FA4GEN_CACHE_DIR=cache_dir,
                PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), root])))


def first_call(cache_dir: str, preimport: bool = False, seqlen: int = 128) -> dict:
    """A fresh process's first call of SPEC on (1, seqlen, 1, 128) (a compile when `cache_dir` is empty, else a
    disk-cache load); `preimport`: cutlass imported before the clock starts, as flash-attn-4's first call finds it."""
    env = child_env(cache_dir)
    env.pop("FA4GEN_QUIET", None)  # the log line carries the cache-load time apart from the first launch
    r = subprocess.run([sys.executable, "-c", CHILD.format(spec=SPEC, preimport=preimport, seqlen=seqlen)], env=env,
                       capture_output=True, text=True, cwd=cache_dir)
    vals = _child_values(r.stdout)
    if "FIRST_CALL_S" not in vals:
        raise RuntimeError(r.stderr[-3000:])
    log = [ln for ln in r.stderr.splitlines() if ln.startswith("fa4gen:")]
    return {"first_call_s": round(float(vals["FIRST_CALL_S"]), 3),
            "cutlass_imported_by_the_call": bool(int(vals["CUTLASS_IMPORTED"])),
            "import_cutlass_after_s": round(float(vals["IMPORT_CUTLASS_S"]), 3),
            "import_tvm_ffi_before_s": round(float(vals["IMPORT_TVM_FFI_S"]), 3),
            "torch_dlpack_c_api": bool(int(vals["DLPACK_C_API"])), "fa4gen_from": vals["FA4GEN_FROM"], "log": log}


def compiled_call(op, q, o) -> tuple:
    """(the compiled kernel, its run-time arguments, its LSE shape or None) of the cached launch of
    `attention(q, q, q, out=o)` (the ForwardOp's CachedCall for that signature)."""
    from fa4gen.api.runtime import call_key

    hit = op._calls[call_key(q, q, q, None, None, None, False, o)]
    return hit.fn, hit.args, hit.lse_shape


def fa4_first_call(seqlen: int = 128) -> dict | str:
    """flash-attn-4's first call of the same causal d128 shape in a fresh process, its on-disk kernel cache
    off (its default): the compile that #3's cold-compile target compares against, on the same machine."""
    env = dict(os.environ, FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="0")
    r = subprocess.run([sys.executable, "-c", FA4_CHILD.format(seqlen=seqlen)], env=env, capture_output=True, text=True)
    vals = _child_values(r.stdout)
    if "FIRST_CALL_S" not in vals:
        return f"unavailable: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"[:300]
    return {"first_call_s": round(float(vals["FIRST_CALL_S"]), 3), "import_s": round(float(vals["IMPORT_S"]), 3)}


def _timed_calls_us(fn, n: int, drained: bool) -> float:
    """Microseconds per call of n calls after a synchronised warm-up of 50; `drained`: the clock stops
    once the GPU has finished them all (the time per call is then the slower of host and GPU), else
    as soon as the last call has returned (host time alone: few enough calls that the launch queue
    never fills, so no call waits for the GPU)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if drained:
        torch.cuda.synchronize()
    took = time.perf_counter() - t0
    torch.cuda.synchronize()
    return took / n * 1e6


def per_call_us(fn, n=2000) -> float:
    return _timed_calls_us(fn, n, drained=True)


def host_us(fn, n=400) -> float:
    """The host time of one call alone (see _timed_calls_us)."""
    return round(_timed_calls_us(fn, n, drained=False), 2)


def host_overhead(fn) -> dict:
    eager = per_call_us(fn)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    replay = per_call_us(graph.replay)
    return {"eager_us": round(eager, 2), "graph_replay_us": round(replay, 2), "overhead_us": round(eager - replay, 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="launch_out")
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    cache = tempfile.mkdtemp(prefix="fa4gen-cost-")
    res = {"cold_process": first_call(cache), "cached_process": first_call(cache),
           # the compile alone, like for like with flash-attn-4's first call (both with cutlass imported)
           "cold_process_cutlass_imported": first_call(tempfile.mkdtemp(prefix="fa4gen-cost-"), preimport=True),
           "flash_attn_4_cold_process": fa4_first_call(),
           # the long-call kernel's first call, (1, LONG_SEQLEN, 1, 128), both sides
           "cold_process_cutlass_imported_long": first_call(tempfile.mkdtemp(prefix="fa4gen-cost-"), preimport=True,
                                                            seqlen=LONG_SEQLEN),
           "flash_attn_4_cold_process_long": fa4_first_call(LONG_SEQLEN)}
    os.environ["FA4GEN_CACHE_DIR"] = cache
    import fa4gen
    from fa4gen.api.runtime import call_key

    pkg = fa4gen.build(SPEC)
    q = torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(q)
    res["fa4gen"] = host_overhead(lambda: pkg.attention(q, q, q, out=o))  # replayed after the first call
    res["fa4gen_alloc_out"] = host_overhead(lambda: pkg.attention(q, q, q))  # + the output's allocation
    op = pkg._forward
    # the floor under the API: the compiled kernel called with ready arguments (its TVM-FFI call + launch)
    fn, args, lse_shape = compiled_call(op, q, o)
    lse = [torch.empty(lse_shape, dtype=torch.float32, device="cuda")] if lse_shape is not None else []
    res["compiled_call_only"] = host_overhead(lambda: fn(q, q, q, o, *lse, *args))
    res["api_minus_compiled_call_us"] = round(res["fa4gen"]["eager_us"] - res["compiled_call_only"]["eager_us"], 2)
    objs = sorted(Path(cache).rglob("artifact.o"))  # this forward's object (before the backward package adds one)
    # a package with a backward (its forward always writes the LSE), called without grad: the LSE goes to
    # the package's scratch buffer, so out= calls allocate nothing
    pkg_bwd = fa4gen.build(dict(SPEC, name="launch_cost_d128_bwd", backward=True))
    with torch.no_grad():
        res["fa4gen_bwd_package"] = host_overhead(lambda: pkg_bwd.attention(q, q, q, out=o))
        res["fa4gen_bwd_package_alloc_out"] = host_overhead(lambda: pkg_bwd.attention(q, q, q))
    # where a call's host time goes: each part alone, queued without a sync (tools/launch_cost.host_us)
    dev = q.device
    res["host_us"] = {
        "api_out": host_us(lambda: pkg.attention(q, q, q, out=o)),
        "api_alloc_out": host_us(lambda: pkg.attention(q, q, q)),
        "compiled_call": host_us(lambda: fn(q, q, q, o, *lse, *args)),
        "call_key": host_us(lambda: call_key(q, q, q, None, None, None, False, o)),
        "torch_empty": host_us(lambda: torch.empty((1, 128, 1, 128), dtype=torch.bfloat16, device=dev)),
        "current_device": host_us(torch.cuda.current_device),
        "launch_check": host_us(lambda: op._launch(lambda *a: None, dev, [])),
    }
    # the same kernel JIT-linked from its object (the path before the shared library): same call, same args
    if len(objs) == 1:
        import cutlass.cute as cute

        from fa4gen.compile.aot import EXPORT_NAME, _preload_runtime

        _preload_runtime()
        jit_fn = getattr(cute.runtime.load_module(str(objs[0]), enable_tvm_ffi=True), EXPORT_NAME)
        res["compiled_call_jit_linked"] = host_overhead(lambda: jit_fn(q, q, q, o, *lse, *args))
    else:
        res["compiled_call_jit_linked"] = f"skipped: {len(objs)} objects in the cache"
    try:  # fa4gen's flash-attn-style entry point, the same call as flash-attn-4's below (fa4gen/dropin.py)
        res["fa4gen_flash_attn_func"] = host_overhead(lambda: fa4gen.flash_attn_func(q, q, q, causal=True))
        res["host_us"]["fa4gen_flash_attn_func"] = host_us(lambda: fa4gen.flash_attn_func(q, q, q, causal=True))
    except Exception as err:  # noqa: BLE001
        res["fa4gen_flash_attn_func"] = f"failed: {type(err).__name__}: {err}"[:200]
    try:
        from flash_attn.cute.interface import flash_attn_func

        res["flash_attn_4"] = host_overhead(lambda: flash_attn_func(q, q, q, causal=True))
        # its host time per call measured as ours is (queued, no sync), for a like-for-like comparison
        res["host_us"]["flash_attn_4"] = host_us(lambda: flash_attn_func(q, q, q, causal=True))
    except Exception as err:  # noqa: BLE001
        res["flash_attn_4"] = f"unavailable: {type(err).__name__}: {err}"[:200]
    (out / "launch_cost.json").write_text(json.dumps(res, indent=1))
    try:  # (after the file is written: a failure here keeps the numbers above)
        res["training_step"] = training_step()
    except Exception as err:  # noqa: BLE001
        res["training_step"] = f"failed: {type(err).__name__}: {err}"[:300]
    print(json.dumps(res, indent=1))
    (out / "launch_cost.json").write_text(json.dumps(res, indent=1))


class Case(NamedTuple):
    """One tiny training call: `call(q, k, v)` gives out; `inputs` require grad; `pkg` is fa4gen's package
    (None for flash-attn-4) and `kwargs` the packed call's sequence arguments (already bound into `call`)."""
    call: Callable
    inputs: tuple
    dout: torch.Tensor
    pkg: object
    kwargs: dict


def tiny_training_cases(device: str = "cuda") -> tuple[dict, str | None]:
    """The tiny causal d128 calls that `training_step` and tools/bwd_host_probe.py time, dense (1, 128, 1, 128)
    and packed (4 sequences of 32 tokens, max_seqlen given: unchecked, as in training): name -> Case, fa4gen's
    and, when it imports, flash-attn-4's on the same tensors; and why flash-attn-4 is missing (None if not)."""
    import fa4gen

    bf16 = dict(device=device, dtype=torch.bfloat16)
    dense = fa4gen.build(dict(SPEC, name="launch_cost_d128_bwd", backward=True))
    packed = fa4gen.build(dict(SPEC, name="launch_cost_d128_varlen_bwd", varlen=True, backward=True))
    qkv = tuple(torch.randn(1, 128, 1, 128, **bf16, requires_grad=True) for _ in range(3))
    qkv_packed = tuple(torch.randn(128, 1, 128, **bf16, requires_grad=True) for _ in range(3))
    dout, dout_packed = torch.randn(1, 128, 1, 128, **bf16), torch.randn(128, 1, 128, **bf16)
    cu = torch.tensor([0, 32, 64, 96, 128], dtype=torch.int32, device=device)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=32, max_seqlen_k=32)
    cases = {
        "fa4gen_dense": Case(dense.attention, qkv, dout, dense, {}),
        "fa4gen_packed": Case(lambda q, k, v: packed.attention(q, k, v, **kw), qkv_packed, dout_packed, packed, kw),
    }
    try:
        from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func
    except Exception as err:  # noqa: BLE001
        return cases, f"unavailable: {type(err).__name__}: {err}"[:200]

    def first(r):
        return r[0] if isinstance(r, tuple) else r

    cases["flash_attn_4_dense"] = Case(lambda q, k, v: first(flash_attn_func(q, k, v, causal=True)), qkv, dout,
                                       None, {})
    cases["flash_attn_4_packed"] = Case(lambda q, k, v: first(flash_attn_varlen_func(q, k, v, causal=True, **kw)),
                                        qkv_packed, dout_packed, None, kw)
    return cases, None


def training_step() -> dict:
    """A tiny forward + backward through autograd, dense and packed (4 sequences of 32 tokens), against
    flash-attn-4's: `host_us` is the host time of one step queued without a sync, `drained_us` the time per
    step once the GPU has run them (the slower of host and GPU). Where host_us is the larger, steps this
    small are host-bound; the packed backward's Python side is the larger part (its batch-1 views, the
    workspaces)."""
    cases, fa4_missing = tiny_training_cases()
    res = {} if fa4_missing is None else {"flash_attn_4": fa4_missing}
    for name, c in cases.items():
        def step(c=c):
            return torch.autograd.grad(c.call(*c.inputs), c.inputs, c.dout)

        res[name] = {"host_us": host_us(step, n=200), "drained_us": round(per_call_us(step, n=400), 2)}
    return res

if __name__ == "__main__":
    main()

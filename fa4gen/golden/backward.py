"""Golden tests: the numeric checks of a backward kernel, which `fa4gen test` runs on a Hopper GPU.

  bwd grads vs reference  dq, dk, dv of the generated package's attention() through autograd (the
                          package's forward, then its backward kernels) against the exact gradients
                          (fp32 autograd of fa4gen.reference on the GPU): each within 2x the error of
                          the same gradients in the input precision + an atol
                          (tolerance.grad_against_reference); the gradient buffers poisoned with NaN
                          before the backward; every other case also differentiates the LSE
  bwd bitwise repeat      (deterministic specs) REPEATS backward passes over the same inputs give
                          bitwise identical dq, dk, dv

The cases are the forward's (checks.cases: the spec's own window / chunk and a small run-time one;
packed sequences for a varlen variant, fa4gen.golden.packed) over BWD_CASE_SHAPES, a few of the
forward's shapes: fewer, because each case also runs two reference backward passes. On the CPU a backward kernel gets the compile + SASS check
(checks.compile_and_sass); there is no CPU emulator of the backward's algorithm.
"""

from __future__ import annotations

import math
import time

import torch

from fa4gen.golden import packed, tolerance
from fa4gen.golden.checks import CheckResult, Worst, case_seed, cases, check_name, kernel_of
from fa4gen.golden.variants import Variant
from fa4gen.reference import attention_ref_grads, mask_semantics

BWD_CASE_SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, kv_heads)
    (2, 128, 128, 4, 4),  # tile multiples
    (1, 113, 203, 4, 2),  # odd seqlens, seqlen_q < seqlen_k, GQA
    (1, 300, 257, 6, 1),  # odd seqlens, seqlen_q > seqlen_k (causal: rows that see no key), MQA
    (3, 1, 1, 2, 2),  # seqlen 1
]
REPEAT_SHAPE = (2, 1000, 1000, 8, 2)  # many key blocks add into each dQ tile (and, with GQA, each dK/dV tile)
REPEATS = 10
GRADS = ("dq", "dk", "dv")


def backward_numerics(
    variant: Variant, plan: dict, *, shapes=BWD_CASE_SHAPES, repeat_shape=REPEAT_SHAPE, device="cuda",
) -> list[CheckResult]:
    """The backward kernel of `plan` (direction "bwd"), run through the package's autograd, against the
    exact reference gradients; and, for a deterministic plan, its bitwise repeat. `device` is "cuda"
    except in tests of this check's logic, which pass a CPU stand-in for the package."""
    start = time.perf_counter()
    pkg = variant.load()
    worst = Worst(check_name(plan, "grads vs reference"))
    n = 0
    for i, case in enumerate(cases(plan, shapes)):
        seed = case_seed(variant, case)
        q, k, v, seq = packed.case_inputs(plan, case.shape, seed=seed, device=device)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out, lse = pkg.attention(q, k, v, return_lse=True, **seq, **case.kwargs())
        dout, dlse = _output_grads(out, lse, seed=seed, with_dlse=i % 2 == 1)
        _poison_allocator(q, k, v)
        outputs, grads = ([out, lse], [dout, dlse]) if dlse is not None else ([out], [dout])
        with kernel_of(pkg, plan):  # this plan's kernel, also where the API would pick the package's other backward
            torch.autograd.backward(outputs, grads)
        _synchronize(device)
        sem = mask_semantics(plan, window=case.window, chunk_size=case.chunk_size)
        exact = attention_ref_grads(q, k, v, dout, dlse=dlse, packed=seq or None, **sem)
        low = attention_ref_grads(q, k, v, dout, dlse=dlse, upcast=False, packed=seq or None, **sem)
        for name, t, e, lo in zip(GRADS, (q, k, v), exact, low):
            label = name if dlse is None else f"{name} (with dlse)"
            worst.add(tolerance.grad_against_reference(label, t.grad, e, lo, softcap=plan["softcap"] > 0), case)
        n += 1
    results = [worst.result(variant, plan["arch"], n, time.perf_counter() - start)]
    if plan["deterministic"]:
        results.append(bitwise_repeat(variant, plan, shape=repeat_shape, device=device))
    return results


def bitwise_repeat(variant: Variant, plan: dict, *, shape=REPEAT_SHAPE, repeats=REPEATS, device="cuda") -> CheckResult:
    """`repeats` backward passes of one forward, same inputs and output gradients: bit for bit the same."""
    start = time.perf_counter()
    pkg = variant.load()
    case = next(cases(plan, [shape]))
    seed = case_seed(variant, case)
    q, k, v, seq = packed.case_inputs(plan, case.shape, seed=seed, device=device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = pkg.attention(q, k, v, return_lse=True, **seq)
    dout, dlse = _output_grads(out, lse, seed=seed, with_dlse=True)
    with kernel_of(pkg, plan):
        runs = [torch.autograd.grad([out, lse], [q, k, v], [dout, dlse], retain_graph=True) for _ in range(repeats)]
    _synchronize(device)
    cmp = tolerance.bitwise_repeats(runs, GRADS)
    return CheckResult(variant.name, plan["arch"], check_name(plan, "bitwise repeat"), "pass" if cmp.ok else "FAIL",
                       f"{cmp.detail} at {case.label()}", time.perf_counter() - start)


def _output_grads(out: torch.Tensor, lse: torch.Tensor, *, seed: int, with_dlse: bool):
    gen = torch.Generator(device=out.device).manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype)
    dlse = torch.randn(lse.shape, generator=gen, device=lse.device, dtype=torch.float32) if with_dlse else None
    return dout, dlse


def _poison_allocator(*like: torch.Tensor) -> None:
    """Leave NaN-filled blocks of these sizes in the caching allocator: the backward allocates dq, dk, dv
    there, so elements its kernels never write stay NaN and fail the check."""
    if like and like[0].is_cuda:
        junk = [torch.full_like(t, math.nan) for t in like]
        del junk


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


__all__ = ["BWD_CASE_SHAPES", "REPEATS", "REPEAT_SHAPE", "backward_numerics", "bitwise_repeat"]

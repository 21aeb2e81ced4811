"""Fuzzing a generated package's attention() with bad arguments, on the CPU.

The catalogue of bad calls is fa4gen.golden.badcalls: one valid call turned into a call with one
bad argument (dtype, device, rank, head dim, GQA ratio, strides, seqlens, out=, window,
chunk_size, softmax_scale, return_lse, requires_grad, varlen arguments the API does not have).
Every one must raise ValueError, TypeError or RuntimeError before anything is launched — the
kernel launcher is replaced by a tripwire — with a message naming the bad argument.

The API checks every argument before it asks for a CUDA tensor, so on the CPU too each bad call's
error names its argument: (1) for every mutation, sampled (test_every_bad_call_is_refused_before_launch),
and for all of them on one package (test_bad_arguments_are_named_even_with_cpu_tensors); (2) the
device-independent checks one by one. tests/test_gpu_robustness.py runs the whole catalogue end to end
on a GPU.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fa4gen.api.runtime import ForwardOp
from fa4gen.golden import load_variant
from fa4gen.golden.badcalls import CHECKED_BEFORE_DEVICE, MUTATIONS, applicable, bad_call, good_call, names_argument

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in (ROOT / "generated").iterdir() if (p / "spec.lock.json").exists())
FUZZ = settings(
    max_examples=int(os.environ.get("FA4GEN_FUZZ_EXAMPLES", "150")), deadline=None,
    derandomize=os.environ.get("FA4GEN_FUZZ_RANDOM") != "1", database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
ERRORS = (ValueError, TypeError, RuntimeError)
shapes = st.tuples(st.integers(1, 2), st.integers(1, 70), st.integers(0, 70), st.sampled_from([2, 4]), st.just(2))


class Launched(AssertionError):
    """A bad call got past every check."""


_packages: dict[str, tuple] = {}


def _package(name: str):
    """(the package, its sm90 forward plan): the plan attention() validates calls against."""
    if name not in _packages:
        variant = load_variant(ROOT / "generated" / name)
        fwd = next(p for p in variant.plans if p["arch"] == "sm90" and p["direction"] == "fwd" and not p.get("min_seqlen_q"))
        _packages[name] = (variant.load(), fwd)
    return _packages[name]


@contextlib.contextmanager
def tripwire(pkg):
    """Replace the package's compile-and-launch step with one that fails the test."""
    op: ForwardOp = pkg._forward

    def launch(plan):
        raise Launched(f"{op.name}: a bad call reached the kernel launch ({plan['module']})")

    op.function = launch
    try:
        yield
    finally:
        del op.function


def _reject(pkg, call):
    with tripwire(pkg), pytest.raises(ERRORS) as err:
        call.run(pkg.attention)
    return str(err.value)


@FUZZ
@given(st.sampled_from(PACKAGES), shapes, st.sampled_from(sorted(MUTATIONS)), st.integers(0, 20))
# (a packed call without keys, k one dim short: found by a longer random run, session 63; the harness's rank
# mutation indexed the empty first dim)
@example(name="qwen2_7b_packed", shape=(1, 1, 0, 2, 2), kind="k_rank", variant=1)
def test_every_bad_call_is_refused_before_launch(name, shape, kind, variant):
    pkg, plan = _package(name)
    base = good_call(plan, shape=shape)
    if not applicable(kind, plan, base, has_backward=bool(pkg._forward.bwd_plans)):
        return
    call, arg = bad_call(plan, base, kind, variant)
    message = _reject(pkg, call)
    # (a message alone proved nothing: every CPU call is refused at the device check in the end)
    assert names_argument(message, arg), f"{kind}: {message!r} does not name {arg!r}"


@FUZZ
@given(st.sampled_from(PACKAGES), shapes, st.sampled_from(CHECKED_BEFORE_DEVICE), st.integers(0, 20))
def test_arguments_checked_before_the_device_are_named(name, shape, kind, variant):
    pkg, plan = _package(name)
    base = good_call(plan, shape=shape)
    if not applicable(kind, plan, base, has_backward=bool(pkg._forward.bwd_plans)):
        return
    call, arg = bad_call(plan, base, kind, variant)
    message = _reject(pkg, call)
    assert names_argument(message, arg), f"{kind}: {message!r} does not name {arg!r}"


def test_cpu_tensors_are_refused_naming_the_device():
    pkg, plan = _package("llama3_8b")
    message = _reject(pkg, good_call(plan))
    assert message.startswith("q: expected a CUDA tensor")


# --- the device-independent checks, one at a time -------------------------------------------------

VALIDATED = {
    # kind: how ForwardOp checks it without a device (its own helper, as __call__ calls it)
    "softmax_scale": lambda op, plan, call: ForwardOp._scale(call.kwargs["softmax_scale"], plan),
    "window": lambda op, plan, call: ForwardOp._runtime_args(plan, 0.125, call.kwargs["window"], None),
    "chunk_size": lambda op, plan, call: ForwardOp._runtime_args(plan, 0.125, None, call.kwargs["chunk_size"]),
    "out": lambda op, plan, call: ForwardOp._check_out(
        call.kwargs["out"], (*call.q.shape[:-1], plan["head_dim_v"]), call.q.dtype,
        (("q", call.q), ("k", call.k), ("v", call.v))),
    "kv_heads": lambda op, plan, call: op.check_shapes(call.q, call.k, call.v, plan),
    "kv_batch": lambda op, plan, call: op.check_shapes(call.q, call.k, call.v, plan),
    "v_seqlen": lambda op, plan, call: op.check_shapes(call.q, call.k, call.v, plan),
    "v_heads": lambda op, plan, call: op.check_shapes(call.q, call.k, call.v, plan),
}


@FUZZ
@given(st.sampled_from(PACKAGES), shapes, st.sampled_from(sorted(VALIDATED)), st.integers(0, 20))
def test_device_independent_checks_name_the_argument(name, shape, kind, variant):
    pkg, plan = _package(name)
    base = good_call(plan, shape=shape)
    if not applicable(kind, plan, base, has_backward=bool(pkg._forward.bwd_plans)):
        return
    call, arg = bad_call(plan, base, kind, variant)
    if kind == "kv_heads" and call.k.shape[-2] == 0:
        return
    with pytest.raises(ERRORS) as err:
        VALIDATED[kind](pkg._forward, plan, call)
    assert names_argument(str(err.value), arg), f"{kind}: {err.value!s} does not name {arg!r}"


def test_valid_values_pass_the_device_independent_checks():
    for name in PACKAGES:
        pkg, plan = _package(name)
        call = good_call(plan)
        assert math.isclose(ForwardOp._scale(None, plan), plan["head_dim"] ** -0.5)
        assert ForwardOp._scale(0.5, plan) == 0.5
        args = ForwardOp._runtime_args(plan, 0.125, (3, 0) if plan["local"] else None, 64 if plan["chunked"] else None)
        assert len(args) == 1 + (plan["softcap"] > 0) + 2 * plan["local"] + plan["chunked"]
        pkg._forward.check_shapes(call.q, call.k, call.v, plan)


def test_bad_arguments_are_named_even_with_cpu_tensors():
    pkg, plan = _package("mistral_7b")
    for kind in sorted(MUTATIONS):
        if not applicable(kind, plan, good_call(plan), has_backward=bool(pkg._forward.bwd_plans)):
            continue
        for variant in range(MUTATIONS[kind][1]):
            call, arg = bad_call(plan, good_call(plan), kind, variant)
            message = _reject(pkg, call)
            assert names_argument(message, arg), f"{kind}/{variant}: {message!r} does not name {arg!r}"


@pytest.mark.parametrize("name", PACKAGES)
def test_out_scale_and_return_lse_values_found_by_review_are_refused(name):
    """Every variant of the out / softmax_scale / return_lse mutations, deterministically (the fuzz test
    above samples them): expanded out, out overlapping q, out requiring grad, a scale whose fp32
    scale * log2(e) overflows, a non-bool return_lse."""
    pkg, plan = _package(name)
    base = good_call(plan)
    for kind in ("out", "softmax_scale", "return_lse_type"):
        for variant in range(MUTATIONS[kind][1]):
            call, arg = bad_call(plan, base, kind, variant)
            with pytest.raises(ERRORS) as err:
                pkg._forward.validate(call.q, call.k, call.v, **call.kwargs)
            assert names_argument(str(err.value), arg), f"{kind}/{variant}: {err.value!s} does not name {arg!r}"


def test_lengths_beyond_the_kernels_index_range_are_refused():
    """Sequence lengths are int32 in the kernels, and packed rows are addressed within 2^30 per sequence
    (device/varlen.SPAN): expanded (stride-0) inputs of such lengths are refused naming the tensor."""
    pkg, plan = _package("llama3_8b")
    call = good_call(plan)
    big = call.k[:, :1].expand(call.k.shape[0], 2**31, *call.k.shape[2:])
    with pytest.raises(ValueError, match="^k: seqlen must be < 2\\*\\*31"):
        pkg._forward.check_shapes(call.q, big, call.v[:, :1].expand(*big.shape[:-1], call.v.shape[-1]), plan)
    pkg, plan = _package("qwen2_7b_packed")
    call = good_call(plan)
    rows = call.k[:1].expand(2**30 + 1, *call.k.shape[1:])
    with pytest.raises(ValueError, match="^k: at most 2\\*\\*30 packed rows"):
        pkg._forward.check_shapes(call.q, rows, call.v[:1].expand(2**30 + 1, *call.v.shape[1:]), plan)


def test_chunk_size_beyond_int32_is_refused():
    pkg, plan = _package("llama4_chunked")
    with pytest.raises(ValueError, match="chunk_size"):
        ForwardOp._runtime_args(plan, 0.125, None, 2**31)


def test_grad_needs_no_gpu_to_be_refused():
    """A spec without a backward refuses inputs that require grad before it looks at the device."""
    pkg, plan = _package("mistral_7b")
    assert not pkg._forward.bwd_plans  # backward: false
    call = good_call(plan)
    call.q.requires_grad_()
    with torch.enable_grad():
        assert "q requires grad" in _reject(pkg, call)


def test_a_dtype_error_under_autocast_says_autocast_does_not_cast_the_inputs():
    pkg, plan = _package("llama3_8b")
    call = good_call(plan)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match=r"^q: expected dtype .* \(autocast does not cast this function's inputs"):
            pkg._forward.validate(call.q.float(), call.k, call.v)
    with pytest.raises(TypeError, match=r"got torch.float32$"):  # no hint outside autocast
        pkg._forward.validate(call.q.float(), call.k, call.v)

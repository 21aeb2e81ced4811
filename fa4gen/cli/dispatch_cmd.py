"""CLI stage: `fa4gen dispatch` — which of a package's kernels a call of given shapes runs, and when the others do.

A package carries several kernels per direction (a persistent forward and its one-CTA-per-tile twin for long
calls, a 192-row d64 forward, a 128-row twin for lengths 192-row tiles pad worst, an MHA-only backward beside the
GQA one, ...), and the API picks one per call. This command asks the package's own runtime (`ForwardOp`): it
checks a call built from the options on meta tensors (no GPU, no data; the same checks and messages a real call
gets), then runs the runtime's forward / backward selection, so what it prints is what a call would launch.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click

from fa4gen.cli.main import ARCH_CHOICE, exit_with_problems, main

LOCK = "spec.lock.json"


def _window(text: str | None) -> tuple[int, int] | None:
    """`--window LEFT,RIGHT` as the API's (left, right) tuple."""
    if text is None:
        return None
    parts = text.split(",")
    try:
        left, right = (int(p) for p in parts)
    except ValueError:
        raise click.BadParameter(f"expected LEFT,RIGHT (two integers, -1 for an unbounded side), got {text!r}",
                                 param_hint="--window") from None
    return left, right


def _load_op(target: Path):
    """The package's ForwardOp: a generated package folder as built, or the runtime of a spec file's package
    made from its rendered lock file alone (planning needs no compile, and nothing is imported)."""
    from fa4gen.api.runtime import ForwardOp
    from fa4gen.builder import render_spec, spec_label
    from fa4gen.spec import load_spec

    # the runtime reads only its folder's lock file; operators=False: it must not take over the torch.compile
    # operators of a package this process has imported
    if target.is_dir():
        if not (target / LOCK).is_file():
            exit_with_problems([f"{target}: not a generated package (no {LOCK}); name a spec file or a folder "
                                "`fa4gen build` wrote"])
        try:
            return ForwardOp(str(target / "__init__.py"), f"fa4gen_dispatch_{target.name}", operators=False)
        except (ValueError, KeyError, TypeError) as err:  # json.JSONDecodeError is a ValueError
            exit_with_problems([f"{target / LOCK}: unreadable ({type(err).__name__}: {err}); rebuild the package "
                                "with `fa4gen build`"])
    pkg, _, _ = render_spec(load_spec(target), spec_label(target))
    with tempfile.TemporaryDirectory(prefix="fa4gen-dispatch-") as scratch:
        (Path(scratch) / LOCK).write_text(pkg.files[LOCK])
        return ForwardOp(str(Path(scratch) / "__init__.py"), f"fa4gen_dispatch_{pkg.name}", operators=False)


def _call_tensors(op, batch: int, seqlen_q: int, seqlen_k: int, heads: int, kv_heads: int):
    """(q, k, v, packed keyword arguments) of the call on meta tensors; packed specs get `batch` sequences of
    seqlen_q / seqlen_k rows each (cu_seqlens on the CPU: the checks read their values)."""
    import torch

    plan = op.first_plan()
    dtype = getattr(torch, plan["torch_dtype"])
    d, dv = plan["head_dim"], plan["head_dim_v"]

    def meta(*shape):
        return torch.empty(shape, dtype=dtype, device="meta")

    if plan.get("varlen", False):
        cu_q = torch.arange(0, batch + 1, dtype=torch.int32) * seqlen_q
        cu_k = torch.arange(0, batch + 1, dtype=torch.int32) * seqlen_k
        packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k)
        return (meta(batch * seqlen_q, heads, d), meta(batch * seqlen_k, kv_heads, d),
                meta(batch * seqlen_k, kv_heads, dv), packed)
    return meta(batch, seqlen_q, heads, d), meta(batch, seqlen_k, kv_heads, d), meta(batch, seqlen_k, kv_heads, dv), {}


def runs_when(plan: dict, alone: bool = False) -> str:
    """The calls a kernel's plan is selected for, from the fields the runtime's selection reads; `alone`: it is
    its direction's only kernel for its arch."""
    if plan["direction"] == "bwd" and plan.get("mha_only"):
        return "calls with as many k/v heads as q heads"
    if plan["direction"] == "bwd" and plan.get("gqa_head_loop"):
        return (f"GQA / MQA calls (not packed) of at least {plan['min_kv_ctas']} CTAs: key blocks of "
                f"{plan['tile_n']} x k/v heads x batch")
    if plan.get("min_seqlen_q"):
        when = f"calls with seqlen_q >= {plan['min_seqlen_q']}"
        keys = plan.get("min_window_keys")
        if keys:
            when += (f" whose chunks are at least {keys} keys" if plan.get("chunked")
                     else f" whose sliding window spans at least {keys} keys per row")
        return when
    if plan.get("seqlen_q_ranges"):
        return "calls with seqlen_q in " + ", ".join(f"{a}-{b}" for a, b in plan["seqlen_q_ranges"])
    return "every call" if alone else "every other call"


def summary(plan: dict, alone: bool = False) -> dict:
    """What a reader of a dispatch wants to know about one kernel."""
    out = {
        "module": plan["module"],
        "runs": runs_when(plan, alone),
        "scheduler": plan.get("scheduler"),
        "tile": f"{plan['tile_m']}x{plan['tile_n']}",
    }
    if plan["arch"] == "sm90":
        out["consumer_warpgroups"] = plan.get("num_mma_warpgroups")
    if plan["direction"] == "bwd":
        out["dkv"] = ("fp32 workspaces (GQA sums)" if plan.get("dkv_accum")
                      else "stored from the CTA, its group's q heads in turn" if plan.get("gqa_head_loop")
                      else "stored from the CTA")
        out["deterministic"] = bool(plan.get("deterministic"))
    return out


@main.command()
@click.argument("target", type=click.Path(exists=True, path_type=Path))
@click.option("--batch", "-b", type=click.IntRange(min=1), default=1, show_default=True,
              help="Batch size (packed specs: the number of sequences, each of --seqlen-q / --seqlen-k rows).")
@click.option("--seqlen-q", "-s", type=click.IntRange(min=1), required=True, help="Query rows per sequence.")
@click.option("--seqlen-k", type=click.IntRange(min=1), default=None, help="Key rows per sequence [default: --seqlen-q].")
@click.option("--heads", type=click.IntRange(min=1), required=True, help="Query heads.")
@click.option("--kv-heads", type=click.IntRange(min=1), default=None, help="Key / value heads [default: --heads].")
@click.option("--window", default=None, metavar="LEFT,RIGHT",
              help="The call's sliding window (sliding_window specs) [default: the spec's].")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="The call's chunk size (chunked specs) [default: the spec's].")
@click.option("--arch", type=ARCH_CHOICE, default=None,
              help="The target to dispatch for [default: the package's first].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def dispatch(target: Path, batch: int, seqlen_q: int, seqlen_k: int | None, heads: int, kv_heads: int | None,
             window: str | None, chunk_size: int | None, arch: str | None, as_json: bool) -> None:
    """Which kernels of TARGET (a spec file, or a package folder `fa4gen build` wrote) a call of these shapes runs.

    The call is checked as the API checks a real one (on meta tensors: no GPU needed); then the package's runtime
    picks the forward kernel and, for specs with a backward, the backward one. Every other kernel of the package
    is listed with the calls it runs.
    """
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    kv_heads = heads if kv_heads is None else kv_heads
    win = _window(window)
    op = _load_op(target)
    archs = list(op.plans)
    if arch is None:
        if not archs:
            exit_with_problems([f"{target}: the package has no kernels (unavailable targets: {op.unavailable})"])
        arch = archs[0]
    elif arch not in archs:
        exit_with_problems([f"--arch: {op.name} has no {arch} kernels (it has: {', '.join(archs) or 'none'})"])
    q, k, v, packed = _call_tensors(op, batch, seqlen_q, seqlen_k, heads, kv_heads)
    try:
        op.validate(q, k, v, window=win, chunk_size=chunk_size, **packed)
    except (ValueError, TypeError) as err:
        shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        exit_with_problems([f"{op.name}: this call would be refused ({shapes}): {err}"])
    fwd = op.forward_plan(arch, seqlen_q, win, chunk_size)
    bwd = op.backward_plan(arch, heads, kv_heads, *((0, 0) if packed else (batch, seqlen_k))) if op.bwd_plans else None
    if bwd is not None:
        no_bwd = None
    elif op.bwd_plans:
        no_bwd = f"no {arch} backward kernels (the spec's backward is built for {', '.join(op.bwd_plans)})"
    else:
        no_bwd = "none (the spec has backward: false)"
    kernels = op.kernel_plans(arch)
    fwds = [p for p in kernels if p["direction"] == "fwd"]
    bwds = [p for p in kernels if p["direction"] == "bwd"]
    others = [(p, len(fwds) == 1) for p in fwds if p["module"] != fwd["module"]]
    others += [(p, len(bwds) == 1) for p in bwds if bwd is None or p["module"] != bwd["module"]]
    report = {
        "spec": op.name,
        "arch": arch,
        "call": dict(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads=heads, kv_heads=kv_heads,
                     window=list(win) if win else None, chunk_size=chunk_size, packed=bool(packed)),
        "forward": summary(fwd, len(fwds) == 1),
        "backward": summary(bwd, len(bwds) == 1) if bwd is not None else None,
        "other_kernels": [summary(p, alone) for p, alone in others],
    }
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    call = report["call"]
    extra = (f", window ({win[0]}, {win[1]})" if win else "") + (f", chunk_size {chunk_size}" if chunk_size else "")
    click.echo(f"{op.name} ({arch}): batch {batch}{' (packed sequences)' if packed else ''}, seqlen_q {seqlen_q}, "
               f"seqlen_k {seqlen_k}, {heads} q heads / {kv_heads} k/v heads{extra}")
    for label, s in (("forward", report["forward"]), ("backward", report["backward"])):
        if s is None:
            click.echo(f"  {label:<9} {no_bwd}")
            continue
        click.echo(f"  {label:<9} {s['module']}: {_describe(s)}")
    for s in report["other_kernels"]:
        click.echo(f"  not this call: {s['module']} runs {s['runs']}")


def _describe(s: dict) -> str:
    parts = [f"{s['scheduler']} scheduler", f"{s['tile']} tiles"]
    if "consumer_warpgroups" in s:
        parts.append(f"{s['consumer_warpgroups']} consumer warpgroups")
    if "dkv" in s:
        parts.append(f"dK/dV {s['dkv']}")
        if s["deterministic"]:
            parts.append("deterministic")
    return ", ".join(parts) + f" (runs {s['runs']})"


__all__ = ["dispatch", "runs_when", "summary"]

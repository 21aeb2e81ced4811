"""Where the host time of a backward call goes, on the GPU machine (no profiler: cProfile inflates every
call by its count, so its listing ranks functions but does not size them).

Each row is the host time of one call of a piece alone, queued without a sync (few enough calls that the
launch queue never fills, so no call waits for the GPU): the whole training step (forward + backward through
autograd) of a tiny call, dense and packed (4 sequences of 32 tokens, max_seqlen given: unchecked, as in
training), the backward alone through autograd (retain_graph), fa4gen's `ForwardOp.backward` called directly,
the compiled backward function called on prepared arguments (its three launches), and the torch operations the
call makes (allocations, the packed path's views, the zero dLSE); flash-attn-4's step
and backward beside them when it imports. The difference between the autograd row and the direct row is the
engine's share; between the direct row and the compiled call, fa4gen's Python.

Run (GPU machine): `source tools/device_env.sh; python3 tools/bwd_host_probe.py [--out DIR]`.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_cost import _timed_calls_us, tiny_training_cases  # noqa: E402  (tools/ is not a package)


def host_us(fn, n: int = 40, rounds: int = 7) -> float:
    """Median over `rounds` of launch_cost's host time per call of n calls queued after a sync (this host's
    speed swings between rounds; see the module doc)."""
    return round(statistics.median(_timed_calls_us(fn, n, drained=False) for _ in range(rounds)), 2)


def _pieces(pkg, q, k, v, dout, kw) -> dict:
    """Host time of the training step, the autograd backward, the direct backward and the compiled call."""
    op = pkg._forward
    rows = {"step": host_us(lambda: torch.autograd.grad(pkg.attention(q, k, v, **kw), (q, k, v), dout))}
    out = pkg.attention(q, k, v, **kw)
    rows["forward_with_grad"] = host_us(lambda: pkg.attention(q, k, v, **kw))
    rows["backward_autograd"] = host_us(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    fn_node = out.grad_fn
    ctx_packed = getattr(fn_node, "packed", None)
    saved = fn_node.saved_tensors[:5]
    scale = fn_node.scale

    def direct():
        op.backward(*saved[:4], dout, saved[4], None, softmax_scale=scale, packed=ctx_packed)

    rows["backward_direct"] = host_us(direct)
    captured = {}
    launch = op._launch

    def capture(fn, device, args):
        captured["call"] = (fn, list(args))
        launch(fn, device, args)

    op._launch = capture
    direct()
    op._launch = launch
    fn, args = captured["call"]
    rows["compiled_backward_call"] = host_us(lambda: fn(*args))
    if ctx_packed is not None:
        ts = [q] * 10
        rows["ten_batch1_views"] = host_us(lambda: [t[None] for t in ts])
    lse_shape = tuple(saved[4].shape)
    rows["zero_dlse"] = host_us(lambda: op._zero_dlse(lse_shape, q.device))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cases, fa4_missing = tiny_training_cases()
    res = {"device": torch.cuda.get_device_name()}
    for name, c in cases.items():
        if c.pkg is not None:
            res[name] = _pieces(c.pkg, *c.inputs, c.dout, c.kwargs)
            continue
        out = c.call(*c.inputs)
        res[name] = {  # flash-attn-4: the rows that need no access to its internals
            "step": host_us(lambda c=c: torch.autograd.grad(c.call(*c.inputs), c.inputs, c.dout)),
            "forward_with_grad": host_us(lambda c=c: c.call(*c.inputs)),
            "backward_autograd": host_us(lambda c=c, out=out: torch.autograd.grad(out, c.inputs, c.dout,
                                                                                 retain_graph=True)),
        }
    if fa4_missing is not None:
        res["flash_attn_4"] = fa4_missing
    q = cases["fa4gen_dense"].inputs[0]
    f32, i32 = dict(dtype=torch.float32, device="cuda"), dict(dtype=torch.int32, device="cuda")
    res["torch"] = {
        "empty_f32": host_us(lambda: torch.empty((1, 1, 256), **f32)),
        "empty_like": host_us(lambda: torch.empty_like(q)),
        "zeros_i32": host_us(lambda: torch.zeros((1, 1, 2), **i32)),
        "view_none": host_us(lambda: q[None]),
        "is_current_stream_capturing": host_us(torch.cuda.is_current_stream_capturing),
    }

    class Nothing(torch.autograd.Function):  # the engine's own cost: a backward that returns its input
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    y = Nothing.apply(q)
    dout = cases["fa4gen_dense"].dout
    res["torch"]["autograd_engine_trivial"] = host_us(lambda: torch.autograd.grad(y, (q,), dout, retain_graph=True))
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bwd_host_probe.json").write_text(json.dumps(res, indent=1))

if __name__ == "__main__":
    main()

"""GPU checks of the generated API's contract: clear errors for bad tensors, the compile log line,
and loading from the disk cache in a later process (skipped without a Hopper GPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")]


def _qkv(b=1, s=64, h=4, h_kv=4, d=128, dtype=torch.bfloat16):
    mk = lambda hh: torch.randn(b, s, hh, d, device="cuda", dtype=dtype)  # noqa: E731
    return mk(h), mk(h_kv), mk(h_kv)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda q, k, v: (q.half(), k, v), "q: expected dtype torch.bfloat16"),
        (lambda q, k, v: (q[..., :64].contiguous(), k, v), "q: expected head_dim 128"),
        (lambda q, k, v: (q, k[:, :, :3].contiguous(), v[:, :, :3].contiguous()), "kv heads (3) must divide q heads (4)"),
        (lambda q, k, v: (q.transpose(1, 3).contiguous().transpose(1, 3), k, v), "last dim must be contiguous"),
        (lambda q, k, v: (q, k, v[:, :32].contiguous()), "v: expected seqlen_k 64"),
        (lambda q, k, v: (q[0], k, v), "q: expected 4 dims"),
        (lambda q, k, v: (q.cpu(), k, v), "q: expected a CUDA tensor"),
    ],
)
def test_bad_tensors_are_named(mutate, message):
    import generated.llama3_8b as pkg

    q, k, v = mutate(*_qkv())
    with pytest.raises((ValueError, TypeError)) as err:
        pkg.attention(q, k, v)
    assert message in str(err.value)


def test_grad_without_backward_is_refused():
    import generated.mistral_7b as pkg  # backward: false

    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="has no backward"):
        pkg.attention(q.requires_grad_(), k, v)


def test_second_process_loads_from_disk_cache(tmp_path):
    code = (
        "import torch, generated.vit_encoder as p\n"
        "q = torch.randn(1, 77, 2, 64, device='cuda', dtype=torch.float16)\n"
        "p.attention(q, q, q); torch.cuda.synchronize()\n"
    )
    env = dict(os.environ, FA4GEN_CACHE_DIR=str(tmp_path))
    env.pop("FA4GEN_QUIET", None)  # the log lines are what this test reads
    runs = [subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert "fa4gen: compiling vit_encoder for sm_90a ... done in" in runs[0].stderr
    assert "fa4gen: loaded vit_encoder for sm_90a from the disk cache" in runs[1].stderr


def test_precompile_loads_every_kernel_so_no_call_compiles(tmp_path):
    """precompile() on the GPU: every kernel of the package compiled in compile processes and loaded, so the
    calls that follow (forward of both lengths: the 128-row twin and the long kernel, backward) log no compile; the result is still attention."""
    code = (
        "import torch, generated.vit_encoder as p\n"
        "print('RESULT', sorted(p.precompile(jobs=2).items()))\n"
        "for s in (77, 4500):\n"
        "    q = torch.randn(1, s, 2, 64, device='cuda', dtype=torch.float16, requires_grad=True)\n"
        "    p.attention(q, q, q).float().sum().backward()\n"
        "torch.cuda.synchronize()\n"
    )
    env = dict(os.environ, FA4GEN_CACHE_DIR=str(tmp_path))
    env.pop("FA4GEN_QUIET", None)  # the log lines are what this test reads
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    # (fwd_sm90_rows128: the 128-row twin that runs seqlen_q 77)
    assert ("RESULT [('bwd_sm90', 'compiled'), ('fwd_sm90', 'compiled'), ('fwd_sm90_long', 'compiled'), "
            "('fwd_sm90_rows128', 'compiled')]") in r.stdout
    assert "compiling 4 kernels in 2 processes" in r.stderr
    assert "fa4gen: compiling vit_encoder" not in r.stderr  # no call compiled: precompile loaded all four


def test_repeated_calls_replay_the_launch_with_new_data():
    """From the second call of a signature on, the API skips its checks and only allocates and launches
    (ForwardOp._replay): every call's output is still its own inputs' attention, within the forward's
    rule (2x the low-precision error + 1e-5), and each form of the call (return_lse, out=, neither, the
    last writing its LSE into the scratch buffer) has one key."""
    import generated.llama3_8b as pkg
    from fa4gen.reference import attention_ref

    op = pkg._forward
    given = None
    for i in range(5):
        q, k, v = _qkv(b=2, s=200, h=4, h_kv=1)
        if i >= 2:  # out= calls have their own key (out's layout) and write into the given buffer
            given = torch.full_like(q, float("nan"))
        out, lse = pkg.attention(q, k, v, return_lse=True, out=given)
        assert given is None or out is given
        torch.cuda.synchronize()
        ref, ref_lse = attention_ref(q, k, v, causal=True)
        low, _ = attention_ref(q, k, v, causal=True, upcast=False)
        budget = 2 * (low.float() - ref).abs().max().item() + 1e-5
        assert (out.float() - ref).abs().max().item() <= budget
        assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-4)
        # without return_lse the kernel writes the LSE into the package's scratch buffer: same out
        alone = pkg.attention(q, k, v)
        torch.cuda.synchronize()
        assert (alone.float() - ref).abs().max().item() <= budget
    assert sum(key[0] == q.shape for key in op._calls) == 3
    assert op._lse_scratch[q.device.index].numel() >= lse.numel()


def test_repeated_training_calls_make_no_device_sync():
    """A repeated forward + backward (both with and without an LSE gradient) enqueues its work without
    synchronising with the device, so the host can run ahead of the GPU: a synchronising call inside either
    (a host read-back, a blocking host-to-device copy) leaves the GPU idle while the host enqueues the rest,
    as session 23 found in the varlen backward. torch's sync debug mode raises on any synchronising call."""
    import generated.llama3_8b as pkg

    q, k, v = (t.requires_grad_() for t in _qkv(b=2, s=300, h=8, h_kv=2))
    dout = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # the first calls load the kernels (and size the device's zero-dLSE buffer)
        out, lse = pkg.attention(q, k, v, return_lse=True)
        torch.autograd.grad([out, lse], [q, k, v], [dout, torch.randn_like(lse)])
        torch.autograd.grad(pkg.attention(q, k, v), [q, k, v], dout)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = pkg.attention(q, k, v, return_lse=True)
        grads = torch.autograd.grad([out, lse], [q, k, v], [dout, torch.ones_like(lse)])
        grads_no_lse = torch.autograd.grad(pkg.attention(q, k, v), [q, k, v], dout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.isfinite(g).all() for g in grads + grads_no_lse)

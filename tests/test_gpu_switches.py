"""GPU numerics for every combination of SM90 pipeline switches a spec can select, and the
poly-exp device helper's accuracy (skipped without a Hopper GPU).

Same tolerance rule as tests/test_gpu_forward.py: max abs error ≤ 2 × the error of the
attention computed in the input precision + 1e-5, against an fp32 reference.
"""

import itertools
import math

import pytest
import torch

import fa4gen
from fa4gen.plan.polyfit import fit_exp2
from fa4gen.reference import attention_ref

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")]

SWITCHES = list(itertools.product(
    (False, True),  # ping_pong
    (False, True),  # intra_wg_overlap
    (0.0, 8.0),  # rescale_threshold
    (0.0, 0.25),  # poly_exp share
))


@pytest.mark.parametrize("ping_pong, overlap, threshold, share", SWITCHES)
@pytest.mark.parametrize("tile_m", [128, 192])
def test_switch_combination(ping_pong, overlap, threshold, share, tile_m):
    pipeline = dict(ping_pong=ping_pong, intra_wg_overlap=overlap, rescale_threshold=threshold,
                    poly_exp=dict(share=share, degree=3), tile_m=tile_m)
    name = f"sw_{int(ping_pong)}{int(overlap)}_{int(threshold)}_{int(share * 100)}_{tile_m}"
    pkg = fa4gen.build(dict(name=name, targets=["sm90"], dtype="bf16", head_dim=64, mask={"kind": "causal"},
                            return_lse=True, pipeline=pipeline))
    gen = torch.Generator(device="cuda").manual_seed(tile_m + int(share * 100))
    for b, s_q, s_k, h, h_kv in ((2, 300, 300, 4, 2), (1, 77, 1030, 2, 1)):
        q = torch.randn(b, s_q, h, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
        # large logits make the running max move often, so the rescale paths are exercised
        k = 3 * torch.randn(b, s_k, h_kv, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(b, s_k, h_kv, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.full_like(q, float("nan"))
        _, lse = pkg.attention(q, k, v, out=out, return_lse=True)
        ref, ref_lse = attention_ref(q, k, v, causal=True)
        low, _ = attention_ref(q, k, v, causal=True, upcast=False)
        err = (out.float() - ref).abs().max().item()
        budget = 2 * (low.float() - ref).abs().max().item() + 1e-5
        assert err <= budget, f"{name} {(b, s_q, s_k, h, h_kv)}: max error {err:.3g} > {budget:.3g}"
        fin = ~ref_lse.isinf()
        assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-3, rtol=1e-4)


def test_poly_exp2_relative_error_on_device():
    """The device polynomial exp2 over the fp32 inputs softmax can feed it ([-126, 8]), before any
    rounding to bf16: relative error below 2^-10 (degree 3 fits to ~8.6e-5)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import from_dlpack

    from fa4gen.compile.aot import target_arch
    from fa4gen.device import polyexp

    coeffs = fit_exp2(3).coeffs

    @cute.kernel
    def kernel(x: cute.Tensor, y: cute.Tensor):
        i = cute.arch.block_idx()[0] * 128 + cute.arch.thread_idx()[0]
        if i < x.shape[0]:
            y[i] = polyexp.exp2_poly(x[i], coeffs)

    @cute.jit
    def launch(x: cute.Tensor, y: cute.Tensor):
        kernel(x, y).launch(grid=[cute.ceil_div(x.shape[0], 128), 1, 1], block=[128, 1, 1])

    n = 1 << 21
    x = torch.linspace(-126.0, 8.0, 1 << 20, device="cuda", dtype=torch.float32)
    # the inputs below -126 (masked scores) ride at the end of the same launch: the compiled function's
    # shape is static, so calling it again on a shorter tensor would index past that tensor (session 33
    # saw that as an illegal address on the H200)
    below = torch.tensor([-126.5, -200.0, float("-inf")], device="cuda")
    x = torch.cat([x, torch.rand(n - (1 << 20), device="cuda") * 134 - 126, below])
    y = torch.empty_like(x)
    with target_arch("sm_90a"):
        fn = cute.compile(launch, from_dlpack(x), from_dlpack(y))
    fn(from_dlpack(x), from_dlpack(y))
    torch.cuda.synchronize()
    exact = torch.exp2(x[:n].double())
    rel = ((y[:n].double() - exact).abs() / exact).max().item()
    assert rel < 2.0**-10, f"max relative error {rel:.3g}"
    out = y[n:]
    assert torch.equal(out, torch.zeros_like(out)), "inputs below -126 (masked scores) must give exactly 0"
    assert math.isfinite(rel)

"""The Sᵀ backward with 128-row tiles (d <= 64, no softcap) rounds Pᵀ to bf16 inside its exp2 stream: compiled for
sm_90a on the CPU, the mask-free per-block loop of the d64 causal backward holds nearly all of its 64 Pᵀ conversions
(F2FP) between its first and last MUFU.EX2.

Until this change the template converted Pᵀ after forming dSᵀ from the fp32 Pᵀ (so that the two copies were never
live at once); ptxas then left 25 of the loop's 64 F2FP outside the stream, where each costs its own issue cycles, while a
MUFU.EX2 stream has ~8 cycles between its instructions to fill (the stall counts ptxas encodes). Static issue cycles
of that loop (`tools/sass_loops.py --cycles`): 1,242 before, 1,195 after; the registers still fit (no LDL/STL in the
d64 backward census, tools/spill_sweep.py --dims 64 --only bwd)."""

import pytest

pytestmark = pytest.mark.compile

pytest.importorskip("cutlass")
from conftest import backward_block_loops, backward_main_sass  # noqa: E402
from fa4gen.compile.sass import find_nvdisasm  # noqa: E402

if find_nvdisasm() is None:
    pytest.skip("nvdisasm not installed (needed for the SASS)", allow_module_level=True)

# the benchmark's kernel (MHA: allow_gqa false, as tools/bench_fwd.py compiles it)
SPEC = dict(name="p_stream_d64_causal", targets=["sm90"], dtype="bf16", head_dim=64, mask={"kind": "causal"},
            backward=True, allow_gqa=False)


@pytest.fixture(scope="module")
def bwd_sass(tmp_path_factory):
    return backward_main_sass(SPEC, tmp_path_factory.mktemp("p_stream"), "p_stream_gen")


def test_P_is_rounded_inside_the_exp2_stream(bwd_sass):
    plan, sass = bwd_sass
    assert plan.swap_sdp and plan.tile_m == 128
    block_loops = backward_block_loops(plan, sass)
    assert len(block_loops) >= 2  # causal: the masked run and the mask-free one
    mask_free = block_loops[0]
    ex2 = [i for i, line in enumerate(mask_free) if "MUFU.EX2" in line]
    assert len(ex2) == 64  # 128 x 128 Sᵀ over two warpgroups: 64 scores per thread
    f2fp = [i for i, line in enumerate(mask_free) if "F2FP" in line]
    assert len(f2fp) == 64  # 32 pairs of Pᵀ and 32 of dSᵀ
    inside = sum(ex2[0] < i < ex2[-1] for i in f2fp)
    assert inside >= 56, f"{inside} of 64 F2FP inside the exp2 stream (39 before session 60's change)"

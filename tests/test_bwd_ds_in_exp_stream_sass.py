"""The Sᵀ backward with 64-row tiles forms dSᵀ inside its exp2 stream: compiled for sm_90a on the CPU, each
per-block MMA loop of the d128 causal backward waits for dPᵀ between its first and last MUFU.EX2, and the
mask-free loop does most of its dSᵀ arithmetic (dPᵀ - D, then times Pᵀ) in the MUFU.EX2s' issue gaps.

Until this change the dV GEMM was issued between the exp2 stream and the wait for dPᵀ. That WGMMA issue kept ptxas
from moving the wait and the dSᵀ arithmetic up, so the 32 MUFU.EX2 of a block ran back to back, each ~8 cycles
after the last (the control codes' stall counts), with only the Pᵀ conversions between them: 3.3% of the d128
causal s2k main kernel's stall samples sat on those MUFU.EX2 in session 59's Nsight page, against 0.3% in
flash-attn-4's, whose loop issues dV after dS. Static issue cycles of the mask-free loop (the control codes' stall
counts summed, `tools/sass_loops.py --cycles`): 1,068 before, 990 after. The 80- and 128-row tiles issued dV
after dS already; with a softcap the 64-row tiles keep the early dV (the late form spilled there)."""

import pytest

pytestmark = pytest.mark.compile

pytest.importorskip("cutlass")
from conftest import backward_block_loops, backward_main_sass  # noqa: E402
from fa4gen.compile.sass import find_nvdisasm, summarize_sass  # noqa: E402

if find_nvdisasm() is None:
    pytest.skip("nvdisasm not installed (needed for the SASS)", allow_module_level=True)

# the benchmark's kernel (MHA: allow_gqa false, as tools/bench_fwd.py compiles it)
SPEC = dict(name="ds_stream_d128_causal", targets=["sm90"], dtype="bf16", head_dim=128, mask={"kind": "causal"},
            backward=True, allow_gqa=False)


@pytest.fixture(scope="module")
def bwd_sass(tmp_path_factory):
    return backward_main_sass(SPEC, tmp_path_factory.mktemp("ds_stream"), "ds_stream_gen")


def test_dS_is_formed_inside_the_exp2_stream(bwd_sass):
    plan, sass = bwd_sass
    assert plan.swap_sdp and plan.tile_m == 64
    block_loops = backward_block_loops(plan, sass)
    assert len(block_loops) >= 2  # causal: the masked run and the mask-free one
    for body in block_loops[:2]:
        ex2 = [i for i, line in enumerate(body) if "MUFU.EX2" in line]
        assert len(ex2) == 32  # 64 x 128 Sᵀ per warpgroup: 32 scores per thread
        # the wait for dPᵀ: the only wait for all GEMM groups before the dV GEMM
        dp_wait = next(i for i, line in enumerate(body) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line)
        assert ex2[0] < dp_wait < ex2[-1], "the wait for dPᵀ is not inside the exp2 stream"
        # the dV GEMM (Pᵀ from registers) comes after every exp2
        first_wait = next(i for i, line in enumerate(body) if "WARPGROUP.DEPBAR" in line)
        dv = next(i for i, line in enumerate(body) if i > first_wait and "HGMMA" in line)
        assert dv > ex2[-1]
    mask_free = block_loops[0]
    ex2 = [i for i, line in enumerate(mask_free) if "MUFU.EX2" in line]
    inside = summarize_sass("\n".join(mask_free[ex2[0]:ex2[-1]])).opcodes  # base opcodes, predicates dropped
    # dPᵀ - D (32 FADD) and the products with Pᵀ (32 FMUL): at least half of each between the exp2s
    fadd, fmul = inside.get("FADD", 0), inside.get("FMUL", 0)
    assert fadd >= 16 and fmul >= 16, (fadd, fmul)

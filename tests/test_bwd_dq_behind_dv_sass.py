"""The Sᵀ backward with 128-row tiles (d <= 64, no softcap) issues dQ behind dV without waiting for dV: compiled for
sm_90a on the CPU, each per-block loop of the d64 backwards has no WGMMA wait between the P/dS barrier and dQ's first
HGMMA, and its five GEMMs stay five commit groups (ptxas did not serialize them for want of registers).

Until session 61 the template waited for dV (`wait_group(0)`) before dQ at 80 and 128 rows, so that Pᵀ's bf16
registers (dV's A operand) were free before dQ's accumulator was allocated. At 80 rows that is still needed: without
it ptxas serializes every WGMMA of the loop (a wait after each HGMMA; 1,042 -> 1,190 static issue cycles). At 128 rows
ptxas keeps the two apart, as in flash-attn-4's d64 loop, and the tensor core runs dQ while dV drains: d64 causal
masked loop 1,338 -> 1,248 static issue cycles (`tools/sass_loops.py --cycles`), the mask-free one 1,195 -> 1,190."""

import pytest

pytestmark = pytest.mark.compile

pytest.importorskip("cutlass")
from conftest import backward_block_loops, backward_main_sass  # noqa: E402
from fa4gen.compile.sass import find_nvdisasm  # noqa: E402

if find_nvdisasm() is None:
    pytest.skip("nvdisasm not installed (needed for the SASS)", allow_module_level=True)

CASES = {
    # the benchmark's kernels (MHA: allow_gqa false, as tools/bench_fwd.py compiles them)
    "d64_causal": dict(name="dq_dv_d64_causal", targets=["sm90"], dtype="bf16", head_dim=64, mask={"kind": "causal"},
                       backward=True, allow_gqa=False),
    "d64_none_gqa": dict(name="dq_dv_d64_none", targets=["sm90"], dtype="bf16", head_dim=64, backward=True),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def bwd_sass(request, tmp_path_factory):
    return backward_main_sass(CASES[request.param], tmp_path_factory.mktemp(request.param), "dq_dv_gen")


def test_dq_is_issued_behind_dv_without_a_wait(bwd_sass):
    plan, sass = bwd_sass
    assert plan.swap_sdp and plan.tile_m == 128
    block_loops = backward_block_loops(plan, sass)
    assert block_loops
    for body in block_loops:
        # the P/dS barrier (named barrier 2, both consumer warpgroups) and dQ's first HGMMA after it
        pds = next(i for i, line in enumerate(body) if "BAR.SYNC" in line and "0x2, 0x100" in line)
        dq = next(i for i in range(pds, len(body)) if "HGMMA" in body[i])
        waits = [line.strip() for line in body[pds:dq] if "WARPGROUP.DEPBAR" in line]
        assert not waits, f"a WGMMA wait between the P/dS barrier and dQ: {waits}"
        # S, dP, dV, dQ, dK: five commit groups, not one per HGMMA
        groups = sum("HGMMA" in line and "gsb0" in line for line in body)
        assert groups == 5, f"{groups} WGMMA groups in a block: ptxas serialized them"

"""The S = Q·Kᵀ backward (head dims above 128, where Sᵀ does not fit) reads each row's LSE2 and D from shared
memory, bulk-copied by the producer with the block's Q stage, as the Sᵀ backward does: compiled for sm_90a on the
CPU, its per-block MMA loops issue no global load. Until session 42 each thread read its rows' LSE2 and D with
four predicated global loads per block while the S GEMM ran (loop of the (192, 128) MHA kernel 451 instructions,
434 with the shared-memory reads; flash-attn-4's 438)."""

import re

import pytest

pytestmark = pytest.mark.compile

pytest.importorskip("cutlass")
from conftest import backward_main_sass  # noqa: E402
from fa4gen.compile.sass import find_nvdisasm, loops  # noqa: E402

if find_nvdisasm() is None:
    pytest.skip("nvdisasm not installed (needed for the SASS)", allow_module_level=True)

# the benchmark's kernels (MHA: allow_gqa false, as tools/bench_fwd.py compiles them); (192, 128) on its 64 x 96
# dKᵀ/dVᵀ tile with the dQ hand-off, d256 on 64 x 64 with dQ added from registers
SPECS = {
    "d192x128_none": dict(name="stats_smem_192", targets=["sm90"], dtype="bf16", head_dim=192, head_dim_v=128,
                          mask={"kind": "none"}, backward=True, allow_gqa=False),
    "d256_causal": dict(name="stats_smem_256", targets=["sm90"], dtype="bf16", head_dim=256,
                        mask={"kind": "causal"}, backward=True, allow_gqa=False),
}


@pytest.mark.parametrize("key", sorted(SPECS))
def test_block_loops_read_the_statistics_from_shared_memory(key, tmp_path):
    plan, sass = backward_main_sass(SPECS[key], tmp_path, f"stats_smem_{key}")
    assert not plan.swap_sdp
    bodies = loops(sass)
    mma = [sum("HGMMA" in line for line in body) for body in bodies]
    # the per-block loops (masked and mask-free runs): those with all of a block's GEMMs
    block_loops = [body for body, n in zip(bodies, mma) if n == max(mma)]
    assert max(mma) >= 8 and block_loops, "no MMA loop found in the backward's SASS"
    for body in block_loops:
        globals_ = [line.strip() for line in body if re.search(r"\bLDG\b", line)]  # not UTMALDG
        assert not globals_, f"global loads in a block loop: {globals_[:4]}"
        # each thread's two rows: LSE2 and D from the Q stage's shared-memory copy
        assert sum(bool(re.search(r"\bLDS\b", line)) for line in body) >= 4

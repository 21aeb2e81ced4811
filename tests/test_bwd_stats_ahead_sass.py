"""The Sᵀ backward reads each query's LSE2 and D from shared memory ahead of the MMA waits that precede their use:
compiled for sm_90a on the CPU, every per-block MMA loop of the d128 causal backward (64-row tiles) issues its
LSE2 and D loads before the block's first HGMMA. Read after the waits (as before session 37), their shared-memory
latency stalled the exp2 / dS arithmetic: short-scoreboard stalls 20.4% of the d128 causal s16k samples against
flash-attn-4's 5.2%, 13.8% with the loads ahead, and the backward 1-2% faster (docs/PERF.md, session 37). D was read
while the exp2 stream ran until session 40, where ptxas gave the loads' address register to the dS store addresses
three instructions after the last load (a write-after-read wait on the shared-memory queue)."""

import re

import pytest

pytestmark = pytest.mark.compile

pytest.importorskip("cutlass")
from conftest import backward_main_sass  # noqa: E402
from fa4gen.compile.sass import find_nvdisasm, loops  # noqa: E402

if find_nvdisasm() is None:
    pytest.skip("nvdisasm not installed (needed for the SASS)", allow_module_level=True)

# the benchmark's kernel (MHA: allow_gqa false, as tools/bench_fwd.py compiles it)
SPEC = dict(name="stats_d128_causal", targets=["sm90"], dtype="bf16", head_dim=128, mask={"kind": "causal"},
            backward=True, allow_gqa=False)


@pytest.fixture(scope="module")
def bwd_sass(tmp_path_factory):
    return backward_main_sass(SPEC, tmp_path_factory.mktemp("stats"), "stats_gen")


def test_statistics_are_read_ahead_of_the_mma_waits(bwd_sass):
    plan, sass = bwd_sass
    assert plan.swap_sdp and plan.tile_m == 64  # 64-row tiles: LSE2_HELD 16
    per_block = (plan.head_dim + plan.head_dim_v + plan.tile_n + 2 * plan.tile_m) // 16
    block_loops = [body for body in loops(sass) if sum("HGMMA" in line for line in body) == per_block]
    assert len(block_loops) >= 2  # causal: the masked run and the mask-free one
    for body in sorted(block_loops, key=len)[:2]:
        mma = [i for i, line in enumerate(body) if "HGMMA" in line]
        first_wait = next(i for i, line in enumerate(body) if "WARPGROUP.DEPBAR" in line)
        # the dV GEMM: the first HGMMA after the wait for Sᵀ (its A operand, Pᵀ, comes from registers)
        dv = next(i for i in mma if i > first_wait)
        lds = [i for i, line in enumerate(body) if "LDS.64" in line]
        # 16 LSE2 and 16 D per thread = 16 LDS.64 (two adjacent queries per load), all before the Sᵀ GEMM
        assert sum(i < mma[0] for i in lds) >= 16, "LSE2 or D is read after the Sᵀ GEMM is issued"
        assert not any(first_wait < i < dv for i in lds), "statistics read between the Sᵀ wait and the dV GEMM"
        # the loads' address register is not written again right after them (its write would wait for the queue)
        last = max(i for i in lds if i < mma[0])
        address = re.search(r"\[(R\d+)", body[last]).group(1)
        for line in body[last + 1:last + 9]:
            dest = re.search(r"^(?:@!?U?P\w+\s+)?[A-Z][\w.]*\s+(R\d+)\b", re.sub(r"^\s*/\*\w+\*/\s*", "", line))
            assert dest is None or dest.group(1) != address, f"{address} rewritten right after the loads: {line}"

"""Backward variants that held LDL/STL compile without register spills for sm_90a on the CPU (issue #3
asks for no LDL/STL in any SM90 kernel; tools/spill_sweep.py sweeps the whole grid, these are the cases
that spilled before, one per cause):

- the d256 varlen preprocess held a spilled register while all eight 16-byte chunks of O and dO per
  lane were in flight; four at a time fit (the dense one keeps all eight: four spilled 4 at fp16);
- the GQA epilogue's tile coordinates (head_kv, batch, key block, ...), live across the consumers' main
  loop at their register limit, were spilled once per CTA; they now wait in shared memory (the tile
  record) and the epilogue reads them back;
- the varlen query-block range, computed before the role split and live into the producer warps'
  24 registers, was spilled and reloaded between the masked and unmasked runs (d64 causal varlen);
  the consumers now take it from the tile record;
- the fp16 deterministic MHA backward with 80-row Sᵀ steps spilled a piece of the dS stmatrix's per-thread
  index (signed-division fix-ups of tidx_c); the template masks that index to [0, 256) there;
- the persistent backward (MHA without a mask): LLVM hoisted the epilogue's dK / dV stmatrix addresses out of
  the tile loop, and held across every tile's query blocks they spilled (fp16 d128 10, bf16 d128 softcap 4); the
  template derives them from an index it cannot hoist (tidx_e)."""

import re

import pytest

pytestmark = pytest.mark.compile

pytest.importorskip("cutlass")
from fa4gen.compile.sass import find_nvdisasm  # noqa: E402

if find_nvdisasm() is None:
    pytest.skip("nvdisasm not installed (needed for the SASS)", allow_module_level=True)

CAUSAL = {"kind": "causal"}
NONE = {"kind": "none"}

CASES = {
    # name: (head dim, mask, GQA, varlen, deterministic[, dtype, softcap]); LDL/STL before the fix in the
    # comment
    "d256_causal_varlen": (256, CAUSAL, False, True, False),  # preprocess 2
    "d256_none_gqa_varlen_det": (256, NONE, True, True, True),  # main 2 + preprocess 2
    # the dense preprocess keeps all eight chunks in flight (four at a time spilled 4 at fp16)
    "d256_causal_fp16": (256, CAUSAL, False, False, False, "fp16", 0.0),
    "d128_none_gqa_det": (128, NONE, True, False, True),  # 4
    "d128_none_gqa_varlen": (128, NONE, True, True, False),  # 8
    "d128_causal_gqa_varlen_det": (128, CAUSAL, True, True, True),  # 14
    "d64_causal_gqa_det": (64, CAUSAL, True, False, True),  # 4
    "d64_causal_varlen": (64, CAUSAL, False, True, False),  # 2, one between the runs
    "d64_causal_gqa_varlen_det": (64, CAUSAL, True, True, True),  # 14
    # fp16 deterministic MHA, 80-row Sᵀ steps: a piece of the dS stmatrix's per-thread index (ds_thread_masked)
    "d128_none_fp16_det": (128, NONE, False, False, True, "fp16", 0.0),  # 3, 1 in the key-block loop
    "d128_none_fp16_varlen_det": (128, NONE, False, True, True, "fp16", 0.0),  # 3
    # the persistent backward: the epilogue's stmatrix addresses hoisted out of the tile loop
    "d128_none_fp16_persistent": (128, NONE, False, False, False, "fp16", 0.0),  # 10
    "d128_none_softcap_persistent": (128, NONE, False, False, False, "bf16", 20.0),  # 4
}


def _spec(case):
    from fa4gen.spec import spec_from_dict

    d, mask, gqa, varlen, det, dtype, softcap = (CASES[case] + ("bf16", 0.0))[:7]
    return spec_from_dict(dict(name=f"ns_{case}", targets=["sm90"], dtype=dtype, head_dim=d, mask=mask,
                               softcap=softcap, allow_gqa=gqa, backward=True, varlen=varlen, deterministic=det))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every case's backward kernel, compiled together (in as many processes as the machine allows)."""
    from fa4gen.builder import compile_specs_for_sass, plan_spec

    pairs = []
    for case in CASES:
        spec = _spec(case)
        plans, _ = plan_spec(spec, archs=["sm90"])
        pairs.append((spec, [next(p for p in plans if p.direction == "bwd" and not p.mha_only)]))
    rows = compile_specs_for_sass(pairs, tmp_path_factory.mktemp("ns"), "ns_gen")
    return {case: row for case, (row,) in zip(CASES, rows)}


@pytest.mark.parametrize("case", list(CASES))
def test_backward_has_no_spills(case, compiled):
    gqa, varlen = CASES[case][2], CASES[case][3]
    bwd, report, sass = compiled[case]
    assert bwd.dkv_accum == gqa  # GQA takes the fp32 dK/dV accumulators (the epilogue under test)
    assert report.status == "compiled", report.detail
    functions = {part.split("\n", 1)[0]: part for part in sass.split(".section\t.text.")[1:]}
    assert any("FlashBwd" in name for name in functions)
    assert any(("PreprocessVarlen" if varlen else "Preprocess") in name for name in functions)
    spilled = {name[:80]: len(re.findall(r"\b(?:LDL|STL)\b", body)) for name, body in functions.items()}
    assert not any(spilled.values()), spilled

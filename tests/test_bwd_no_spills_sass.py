"""The d256 varlen backward (preprocess with its tile lookup, main kernel, dQ postprocess) compiles
without register spills for sm_90a on the CPU: issue #3 asks for no LDL/STL in any SM90 kernel, and
the varlen preprocess at head dim 256 held a spilled register while all eight 16-byte chunks of O and
dO per lane were in flight (tools/spill_sweep.py, session 10); four at a time fit."""

import re

import pytest

pytestmark = pytest.mark.compile

pytest.importorskip("cutlass")
from fa4gen.compile.sass import find_nvdisasm  # noqa: E402

if find_nvdisasm() is None:
    pytest.skip("nvdisasm not installed (needed for the SASS)", allow_module_level=True)


def test_d256_varlen_backward_has_no_spills(tmp_path):
    from fa4gen.builder import compile_for_sass, plan_spec
    from fa4gen.spec import spec_from_dict

    spec = spec_from_dict(dict(name="vl_d256_causal", targets=["sm90"], dtype="bf16", head_dim=256,
                               mask={"kind": "causal"}, backward=True, varlen=True))
    plans, _ = plan_spec(spec, archs=["sm90"])
    bwd = next(p for p in plans if p.direction == "bwd")
    ((_, report, sass),) = compile_for_sass(spec, [bwd], tmp_path, "vl_gen")
    assert report.status == "compiled", report.detail
    functions = {part.split("\n", 1)[0]: part for part in sass.split(".section\t.text.")[1:]}
    assert any("PreprocessVarlen" in name for name in functions)
    spilled = {name[:80]: len(re.findall(r"\b(?:LDL|STL)\b", body)) for name, body in functions.items()}
    assert not any(spilled.values()), spilled

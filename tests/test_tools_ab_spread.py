"""tools/ab_spread.py on a made-up A/B archive: per side and cell, fa4gen's and flash-attn-4's spread over the
side's processes."""

import io
import json
import tarfile

from conftest import load_tool


def _archive(path, runs):
    with tarfile.open(path, "w:gz") as tf:
        for name, rows in runs.items():
            data = json.dumps({"rows": rows}).encode()
            info = tarfile.TarInfo(f"ab/{name}/bench_bwd.json")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_spreads_per_side_and_cell(tmp_path):
    tool = load_tool("ab_spread")
    cell = dict(d=128, seqlen=16384, causal=False)
    _archive(tmp_path / "call4_ab.tgz", {
        "new_1": [dict(cell, fa4gen=100.0, fa4=200.0, fa4gen_bwd=50.0, fa4_bwd=60.0)],
        "new_2": [dict(cell, fa4gen=101.0, fa4=200.0, fa4gen_bwd=50.0, fa4_bwd=54.0)],
        "ref_1": [dict(cell, fa4gen=90.0, fa4=210.0, fa4gen_bwd=45.0, fa4_bwd=60.0)],  # one run: left out
    })
    out = tool.spreads([tmp_path / "call4_ab.tgz"], min_runs=2)
    ((fwd_ours, fwd_fa4),) = out["forward"]
    ((bwd_ours, bwd_fa4),) = out["backward"]
    assert abs(fwd_ours - 0.01) < 1e-9 and fwd_fa4 == 0.0
    assert bwd_ours == 0.0 and abs(bwd_fa4 - 60.0 / 54.0 + 1) < 1e-9
    assert tool.spreads([tmp_path / "call4_ab.tgz"], min_runs=3) == {"forward": [], "backward": []}

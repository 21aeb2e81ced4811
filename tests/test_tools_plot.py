"""tools/plot_bench.py on hand-made bench JSON: forward panels always, backward panels when the run had
--bwd, (192, 128) labelled as such, missing values (None, error strings) skipped. Needs matplotlib
(not a project dependency: skipped where it is absent)."""

import json

import pytest

pytest.importorskip("matplotlib")
from conftest import load_tool  # noqa: E402


def _rows(bwd: bool):
    rows = []
    for d, dv in ((128, 128), (192, 128)):
        for causal in (False, True):
            for s in (1024, 4096):
                row = dict(d=d, dv=dv, seqlen=s, causal=causal, fa4gen=500.0, fa4=480.0, cudnn=None,
                           sdpa_flash="unavailable")
                if bwd:
                    row.update(fa4gen_bwd=400.0, fa4_bwd=420.0, cudnn_bwd=300.0, fa4gen_det_bwd=350.0)
                rows.append(row)
    return rows


@pytest.mark.parametrize("bwd", [False, True])
def test_plot_has_a_panel_row_per_direction_and_mask(tmp_path, bwd):
    tool = load_tool("plot_bench")
    src = tmp_path / "bench.json"
    src.write_text(json.dumps({"gpu": "test", "matmul_tflops": 700.0, "rows": _rows(bwd)}))
    tool.main(str(src), str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    grid = tool.panels(_rows(bwd))
    assert [(d, c) for d, c, _ in grid] == [("forward", False), ("forward", True)] + (
        [("backward", False), ("backward", True)] if bwd else [])
    assert tool.dim_label(dict(d=192, dv=128)) == "d192x128" and tool.dim_label(dict(d=64, dv=64)) == "d64"


def test_plot_merges_runs_and_refuses_a_cell_twice(tmp_path):
    """A grid's short and long cells from two runs drawn as one figure; a cell in both runs is refused by name."""
    tool = load_tool("plot_bench")
    rows = _rows(True)
    short = tmp_path / "short.json"
    long = tmp_path / "long.json"
    short.write_text(json.dumps({"gpu": "test", "matmul_tflops": 700.0, "rows": [r for r in rows if r["seqlen"] == 1024]}))
    long.write_text(json.dumps({"gpu": "test", "matmul_tflops": 650.0, "rows": [r for r in rows if r["seqlen"] == 4096]}))
    merged, meta = tool.merged([str(short), str(long)])
    assert len(merged) == len(rows) and meta["gpu"] == "test" and meta["matmul_runs"] == [700.0, 650.0]
    tool.main(str(short), str(long), str(tmp_path / "both.png"))
    assert (tmp_path / "both.png").stat().st_size > 10_000
    with pytest.raises(SystemExit, match=r"d128x128 no mask s1024 is in both .*short\.json and .*short\.json"):
        tool.merged([str(short), str(short)])
    with pytest.raises(SystemExit, match="usage"):
        tool.main(str(short))

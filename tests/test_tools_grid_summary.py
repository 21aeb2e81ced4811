"""tools/grid_summary.py on the CPU: the README speed table's ranges and the targets' cell counts from
bench_fwd.py JSON files (synthetic runs here; the committed s41 files must give the rows the README quoted)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import grid_summary  # noqa: E402


def _row(d, seqlen, causal, **ratios):
    return {"d": d, "dv": d, "seqlen": seqlen, "causal": causal, "window": None, **ratios}


def _write(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_ranges_and_later_runs_replace_cells(tmp_path):
    short = _write(tmp_path, "short.json", [
        _row(64, 512, False, vs_fa4=1.2, vs_best=1.1, bwd_vs_fa4=0.98, bwd_vs_best=0.98),
        _row(64, 1024, False, vs_fa4=1.1, vs_best=1.04, bwd_vs_fa4=1.06, bwd_vs_best=1.06),
        _row(64, 512, True, vs_fa4=1.5, vs_best=1.0),
    ])
    reread = _write(tmp_path, "reread.json", [_row(64, 512, False, vs_fa4=1.3, vs_best=1.2, bwd_vs_fa4=1.07,
                                                    bwd_vs_best=1.07)])
    cells = grid_summary.load_cells([short, reread])
    rows = {r["mask"]: r for r in grid_summary.summary_rows(cells)}
    assert rows["none"]["forward / flash-attn-4"] == "1.100–1.300"   # s512's 1.2 replaced by the re-read's 1.3
    assert rows["none"]["backward / best"] == "1.060–1.070"
    assert rows["causal"]["forward / best"] == "1.000" and rows["causal"]["backward / best"] == "—"
    assert rows["none"]["seqlens"] == "512, 1024"
    counts = grid_summary.target_counts(cells)
    assert counts[0] == ("forward >= 1.05x best: met in 1 of 3 cells "
                         "(below: d64 causal s512 1.000, d64 none s1024 1.040)")
    assert "backward >= 1.05x best: met in 2 of 2 cells" in counts   # s512's 0.98 was replaced
    assert not any(line.startswith("deterministic") for line in counts)   # no run had the column


def test_committed_s41_runs_give_the_readme_rows():
    """s41's d64 / d128 rows, as the README quoted them before this tool existed."""
    perf = ROOT / "docs" / "perf" / "2026-12-03_s41_device"
    cells = grid_summary.load_cells([perf / "call4_grid_d128_bwd.json", perf / "call5_grid_d64_d256_bwd.json"])
    rows = {(r["head dim"], r["mask"]): r for r in grid_summary.summary_rows(cells)}
    assert rows[("64", "none")]["forward / best"] == "0.906–1.083"
    assert rows[("128", "causal")]["backward / flash-attn-4"] == "1.027–1.078"
    assert rows[("128", "causal")]["deterministic / default backward"] == "0.924–0.988"


def test_cli_refuses_a_file_that_is_not_a_run(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "grid_summary.py"), str(bad)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "expected a bench_fwd.py JSON object with 'rows'" in done.stderr

"""tools/bench_fwd.py --processes: several one-process runs merged per cell (medians, same-run ratios, spreads),
on made-up runs (no GPU)."""

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import load_tool


def _row(d, s, causal, ours, fa4, cudnn, ours_bwd=None, fa4_bwd=None, dv=None):
    row = {"d": d, "dv": dv or d, "seqlen": s, "causal": causal, "batch": 16384 // s, "fa4gen": ours, "fa4": fa4,
           "cudnn": cudnn, "sdpa_flash": None, "vs_fa4": round(ours / fa4, 3), "vs_best": round(ours / max(fa4, cudnn), 3),
           "max_abs_diff_vs_cudnn": 0.002}
    if ours_bwd is not None:
        row.update(fa4gen_bwd=ours_bwd, fa4_bwd=fa4_bwd, cudnn_bwd=400.0, sdpa_flash_bwd=None,
                   bwd_vs_fa4=round(ours_bwd / fa4_bwd, 3), bwd_vs_best=round(ours_bwd / max(fa4_bwd, 400.0), 3),
                   bwd_max_abs_diff_vs_cudnn=0.01)
    return row


def _run(*rows, mm=(800.0, 700.0)):
    return {"matmul_tflops": mm[0], "matmul_tflops_after": mm[1], "gpu": "H200", "rows": list(rows)}


def test_merge_takes_medians_of_tflops_and_of_the_same_run_ratios():
    bench = load_tool("bench_fwd")
    # flash-attn-4's backward moves between processes, ours does not (session 46's s16k reading)
    runs = [_run(_row(128, 16384, False, 680.0, 670.0, 600.0, 615.0, fa4)) for fa4 in (614.0, 589.0, 561.0)]
    runs[1]["rows"].append(_row(192, 16384, True, 700.0, 684.0, 545.0, 452.0, 472.0, dv=128))  # in one run only
    merged = bench.merge_runs(runs)
    assert merged["processes"] == 3 and merged["matmul_tflops"] == [800.0] * 3
    row, other = merged["rows"]
    assert (row["d"], row["processes"], other["processes"]) == (128, 3, 1)
    assert row["fa4gen_bwd"] == 615.0 and row["fa4_bwd"] == 589.0 and row["fa4_bwd_range"] == [561.0, 614.0]
    # the median of the per-process ratios (615 / 589), not a ratio of unrelated medians
    assert row["bwd_vs_fa4"] == round(615.0 / 589.0, 3)
    assert row["bwd_vs_fa4_range"] == [round(615.0 / 614.0, 3), round(615.0 / 561.0, 3)]
    assert row["sdpa_flash"] is None and row["sdpa_flash_range"] is None
    assert other["dv"] == 128 and other["bwd_vs_fa4"] == round(452.0 / 472.0, 3)
    lines = bench.spread_table(merged["rows"], bwd=True)
    assert lines[2].startswith("| 128 | 16384 | n | 3 | 0.0% |")
    assert "9.4%" in lines[2]  # flash-attn-4's backward: 614 / 561 - 1
    assert lines[3].startswith("| 192x128 | 16384 | y | 1 |")
    table = bench.table(merged["rows"], bwd=True, deterministic=False)
    assert table[2].startswith("| 128 | 16384 | n | 680.0 | 670.0 | 600.0 | None | 1.015 |")


def test_processes_runs_the_same_command_in_fresh_processes_and_merges_after_each(tmp_path, monkeypatch):
    """Each child gets the parent's arguments with its own --out, --processes 1 and --prebuild 0 (the parent
    prebuilt); a child that fails is reported and left out; the merge is rewritten after every child."""
    bench = load_tool("bench_fwd")
    calls = []

    def fake_run(cmd, env):
        calls.append(cmd)
        out = Path(cmd[cmd.index("--out", len(cmd) - 6) + 1])
        i = int(out.name.split("_")[1])
        if i == 2:
            return SimpleNamespace(returncode=1)
        out.mkdir(parents=True)
        (out / "bench_fwd.json").write_text(json.dumps(_run(_row(64, 512, False, 360.0 + i, 320.0, 375.0))))
        assert env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["bench_fwd.py", "--dims", "64", "--processes", "3", "--prebuild", "8"])
    args = SimpleNamespace(processes=3, bwd=False, deterministic=False)
    bench.run_processes(args, tmp_path / "out", work_dir=tmp_path / "work")
    assert len(calls) == 3
    assert calls[0][2:] == ["--dims", "64", "--processes", "3", "--prebuild", "8", "--out",
                            str(tmp_path / "work" / "proc_1"), "--processes", "1", "--prebuild", "0"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bench_fwd.json", "bench_fwd.md"]
    merged = json.loads((tmp_path / "out" / "bench_fwd.json").read_text())
    assert merged["processes"] == 2 and merged["rows"][0]["fa4gen"] == 362.0  # median of 361 and 363
    assert [run["rows"][0]["fa4gen"] for run in merged["runs"]] == [361.0, 363.0]
    md = (tmp_path / "out" / "bench_fwd.md").read_text()
    assert md.startswith("2 process(es) of `tools/bench_fwd.py --dims 64") and "Spread over the processes" in md


def test_processes_argument_checked():
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "tools" / "bench_fwd.py"), "--processes", "0"],
                         capture_output=True, text=True, cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin"})
    assert res.returncode != 0 and "--processes: expected a count >= 1" in res.stderr, res.stderr[-500:]


def test_forward_specs_of_hand_set_tiles_are_named_apart():
    """Two rows that differ only in a hand-set tile (or K/V stage count) are two specs (names key the generated
    packages)."""
    bench = load_tool("bench_fwd")
    names = {bench._fwd_spec(64, False, tile_m=m, tile_n=n)["name"] for m in ("auto", 128, 192) for n in ("auto", 64)}
    assert len(names) == 6 and "bench_d64_full_m128_n64" in names
    staged = bench._fwd_spec(64, False, kv_stages=4)
    assert staged["name"] == "bench_d64_full_s4" and staged["pipeline"]["kv_stages"] == 4
    assert bench._fwd_spec(64, False)["pipeline"]["kv_stages"] == "auto"


def test_pipeline_fields_reach_the_forward_spec_and_its_name():
    """--pipeline FIELD=JSON sets any forward pipeline field for plan-only A/Bs; two runs that differ only there build
    two packages (the name carries a hash of the fields); a bad field or value stops the run before any GPU work,
    naming the field."""
    bench = load_tool("bench_fwd")
    assert bench._pipeline_field("rescale_threshold=0") == ("rescale_threshold", 0)
    assert bench._pipeline_field('poly_exp={"share":0.25,"degree":3}') == ("poly_exp", {"share": 0.25, "degree": 3})
    for bad in ("ping_pong", "=1", "ping_pong=fals"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench._pipeline_field(bad)
    off = bench._fwd_spec(64, False, pipeline={"ping_pong": False})
    assert off["pipeline"]["ping_pong"] is False and off["name"].startswith("bench_d64_full_p")
    assert off["name"] != bench._fwd_spec(64, False, pipeline={"ping_pong": True})["name"]
    assert bench._fwd_spec(64, False, pipeline={})["name"] == "bench_d64_full"
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "tools" / "bench_fwd.py"), "--pipeline", "ping_pongg=false"],
                         capture_output=True, text=True, cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin"})
    assert res.returncode != 0 and "pipeline.ping_pongg: unknown field" in res.stderr, res.stderr[-500:]


def test_fwd_kernel_must_be_a_forward_of_every_row_spec():
    """--fwd-kernel pins fa4gen's forward calls to one kernel of the row's spec (plan-only A/Bs of the dispatch
    thresholds); a name some row's spec lacks stops the run before any GPU work, listing that spec's forwards."""
    root = Path(__file__).resolve().parents[1]

    def run(*args):
        return subprocess.run([sys.executable, str(root / "tools" / "bench_fwd.py"), *args], capture_output=True,
                              text=True, cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin"})

    # d256 without a mask has one forward (no persistent kernel, so no long-call twin)
    res = run("--dims", "64,256", "--masks", "none", "--fwd-kernel", "fwd_sm90_long")
    assert res.returncode != 0 and ("--fwd-kernel: bench_d256_full has no forward kernel 'fwd_sm90_long' "
                                    "(its forwards: fwd_sm90)") in res.stderr, res.stderr[-500:]
    res = run("--dims", "64", "--masks", "none,causal", "--fwd-kernel", "fwd_sm90_rows")
    assert res.returncode != 0 and ("bench_d64_full has no forward kernel 'fwd_sm90_rows' (its forwards: fwd_sm90, "
                                    "fwd_sm90_long, fwd_sm90_rows128)") in res.stderr, res.stderr[-500:]
    # the 128-row twin belongs to d64 without a mask only: the causal row's spec stops the run
    res = run("--dims", "64", "--masks", "none,causal", "--fwd-kernel", "fwd_sm90_rows128")
    assert res.returncode != 0 and ("bench_d64_causal has no forward kernel 'fwd_sm90_rows128' (its forwards: "
                                    "fwd_sm90, fwd_sm90_long)") in res.stderr, res.stderr[-500:]

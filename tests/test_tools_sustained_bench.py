"""tools/sustained_bench.py on the CPU: --variant parsing, the per-implementation summary (medians, means, the
per-clock and per-joule ratios to flash-attn-4) and its table, and the refusals before any GPU work (the sustained
runs themselves need the GPU machine)."""

import argparse

import pytest
import torch

from conftest import load_tool

sb = load_tool("sustained_bench")


def test_parse_variant():
    assert sb.parse_variant("pp_off:ping_pong=false") == ("pp_off", {"ping_pong": False})
    assert sb.parse_variant('p:poly_exp={"share":0.25,"degree":3};kv_stages=3') == (
        "p", {"poly_exp": {"share": 0.25, "degree": 3}, "kv_stages": 3})
    for bad in ("ping_pong=false", "1x:ping_pong=false", "a-b:ping_pong=false", "x:", "x:ping_pong",
                "x:Ping=1", "x:ping_pong=flase", "x:__import__('os')=1"):
        with pytest.raises(argparse.ArgumentTypeError, match="--variant"):
            sb.parse_variant(bad)


def _run(impl, tflops, mhz, watts, cell="d128 s16384 none", temp=70.0):
    return {"cell": cell, "impl": impl, "tflops": tflops, "sm_mhz": mhz, "watts": watts, "temp_c": temp}


def test_summarize_ratios():
    runs = [_run("fa4gen", 640.0, 1450.0, 700.0), _run("fa4gen", 660.0, 1470.0, 698.0, temp=72.0),
            _run("fa4", 680.0, 1650.0, 700.0), _run("fa4", 670.0, 1630.0, 696.0),
            _run("fa4gen_bwd", 600.0, 1500.0, 700.0), _run("fa4_bwd", 500.0, 1600.0, 700.0),
            _run("fa4gen", 500.0, 1700.0, 600.0, cell="d64 s16384 none")]
    rows = {(r["cell"], r["impl"]): r for r in sb.summarize(runs)}
    ours, theirs = rows[("d128 s16384 none", "fa4gen")], rows[("d128 s16384 none", "fa4")]
    assert ours["tflops"] == 650.0 and ours["sm_mhz"] == 1460.0 and ours["watts"] == 699.0 and ours["temp_c"] == 72.0
    assert ours["rounds"] == 2 and ours["tflops_all"] == [640.0, 660.0]
    assert ours["tflop_per_ghz"] == round(650.0 / 1.46, 1) and theirs["tflop_per_ghz"] == round(675.0 / 1.64, 1)
    assert ours["vs_fa4"] == round(650 / 675, 3)
    assert ours["per_clock_vs_fa4"] == round((650 / 1.46) / (675 / 1.64), 3) == 1.082
    assert ours["per_joule_vs_fa4"] == round(ours["tflop_per_j"] / theirs["tflop_per_j"], 3)
    assert theirs["vs_fa4"] == 1.0
    # a backward compares with flash-attn-4's backward, not its forward
    assert rows[("d128 s16384 none", "fa4gen_bwd")]["vs_fa4"] == 1.2
    # a cell without flash-attn-4 has no ratios
    lone = rows[("d64 s16384 none", "fa4gen")]
    assert lone["vs_fa4"] is None and lone["per_clock_vs_fa4"] is None and lone["tflop_per_j"] == round(500 / 600, 4)
    lines = sb.table(sb.summarize(runs))
    assert lines[0].startswith("| cell | implementation") and len(lines) == 2 + len(rows)
    assert any("| d64 s16384 none | fa4gen | 500.0 (500.0) |" in line and line.endswith("| — | — | — |")
               for line in lines)


def test_summarize_without_samples():
    rows = sb.summarize([_run("fa4gen", 600.0, None, None), _run("fa4", 600.0, None, None)])
    assert all(r["sm_mhz"] is None and r["tflop_per_j"] is None and r["per_clock_vs_fa4"] is None for r in rows)
    assert rows[0]["vs_fa4"] == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
def test_refusals_before_gpu_work(capsys):
    with pytest.raises(SystemExit):
        sb.main(["--skip", "sdpa"])
    assert "--skip" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sb.main(["--rounds", "0"])
    with pytest.raises(SystemExit, match="tile_n"):  # the spec model names the field before anything runs
        sb.main(["--variant", "n:tile_n=17"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        sb.main(["--variant", "pp:ping_pong=false"])

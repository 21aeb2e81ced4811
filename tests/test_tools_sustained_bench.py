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
                "x:Ping=1", "x:ping_pong=flase", "x:__import__('os')=1", "Upper:ping_pong=false",
                "a_name_longer_than_16:ping_pong=false"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected|not JSON"):
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


def test_backward_variants_compare_with_flash_attn_4s_backward():
    runs = [_run("fa4gen_bwd:swap", 630.0, 1500.0, 700.0), _run("fa4_bwd", 600.0, 1500.0, 700.0),
            _run("fa4", 700.0, 1500.0, 700.0)]
    rows = {r["impl"]: r for r in sb.summarize(runs)}
    assert rows["fa4gen_bwd:swap"]["vs_fa4"] == 1.05
    assert sb.is_backward("fa4gen_bwd:x") and sb.is_backward("cudnn_bwd") and not sb.is_backward("fa4gen:bwd_x")


def test_summarize_without_samples():
    rows = sb.summarize([_run("fa4gen", 600.0, None, None), _run("fa4", 600.0, None, None)])
    assert all(r["sm_mhz"] is None and r["tflop_per_j"] is None and r["per_clock_vs_fa4"] is None for r in rows)
    assert rows[0]["vs_fa4"] == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
def test_refusals_before_gpu_work(capsys):
    with pytest.raises(SystemExit):
        sb.main(["--skip", "sdpa"])
    assert "--skip" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse names the option
        sb.main(["--bwd", "--bwd-variant", "Bad:x=1"])
    assert "argument --bwd-variant: expected NAME:FIELD=JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sb.main(["--rounds", "0"])
    with pytest.raises(SystemExit, match="tile_n"):  # the spec model names the field before anything runs
        sb.main(["--variant", "n:tile_n=17"])
    with pytest.raises(SystemExit):
        sb.main(["--bwd-variant", "s:bwd_swap_ab=true"])  # without --bwd
    assert "--bwd-variant: give --bwd too" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="bwd_swap_ab"):  # the planner refuses the Sᵀ layout above d128, by field
        sb.main(["--bwd", "--dims", "256", "--bwd-variant", "s:bwd_swap_ab=true"])
    with pytest.raises(SystemExit, match="has no forward kernel 'fwd_sm100'"):  # named with the spec's forwards
        sb.main(["--dims", "64", "--fwd-kernel", "fwd_sm100"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        sb.main(["--variant", "pp:ping_pong=false", "--dims", "64", "--fwd-kernel", "fwd_sm90"])


class _FakeEvent:
    """torch.cuda.Event's timing on the CPU: elapsed_time in ms between two record() calls' host times."""

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        import time

        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


def test_run_for_and_settle(fake_cuda):
    import time

    bench = load_tool("bench_fwd")
    calls = []

    def fn():  # a 2 ms "kernel"
        calls.append(1)
        time.sleep(0.002)

    t0 = time.time()
    n = bench.run_for(fn, 0.2)
    took = time.time() - t0
    assert n == len(calls) and 0.2 <= took < 0.5 and 40 <= n <= 130  # ~25-call chunks of 2 ms until 0.2 s pass
    calls.clear()
    bench.settle(fn)  # --settle 0 (the default): nothing runs
    assert calls == []
    bench.SETTLE_S = 0.05
    try:
        bench.settle(fn)
    finally:
        bench.SETTLE_S = 0.0
    assert len(calls) >= 10


def test_sustain_times_only_the_measured_calls(fake_cuda, monkeypatch):
    import time

    sys_path_tools = str(sb.Path(sb.__file__).parent)
    monkeypatch.syspath_prepend(sys_path_tools)
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    n, ms, (t0, t1) = sb.sustain(fn, 0.1, 0.2)
    assert 0.2 <= t1 - t0 < 0.5 and 200 <= ms < 500 and n < len(calls)  # the warm calls are not counted
    assert abs(ms / n - 2.0) < 1.0  # ~2 ms per call


def test_bench_fwd_settle_refuses_negative():
    import subprocess
    import sys

    tool = sb.Path(sb.__file__).parent / "bench_fwd.py"
    out = subprocess.run([sys.executable, str(tool), "--settle", "-1"], capture_output=True, text=True)
    assert out.returncode != 0 and "--settle: expected seconds >= 0" in out.stderr


def test_cells_table_from_files(tmp_path, capsys):
    import json

    runs = [_run("fa4gen", 650.0, 1450.0, 700.0), _run("fa4", 640.0, 1480.0, 700.0), _run("cudnn", 660.0, 1500.0, 700.0),
            _run("fa4gen_bwd", 600.0, 1500.0, 700.0), _run("fa4_bwd", 500.0, 1510.0, 700.0),
            _run("fa4gen", 500.0, 1600.0, 700.0, cell="d64 s4096 none")]
    f = tmp_path / "run" / "sustained.json"
    f.parent.mkdir()
    f.write_text(json.dumps({"rows": sb.summarize(runs)}))
    assert sb.main(["--cells", str(f)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == ("| d128 s16384 none | 1.016 | 0.985 | 1.200 | 1.200 | 1450.0 / 1480.0; 1500.0 / 1510.0 | "
                        "run/sustained.json |")
    assert lines[3] == "| d64 s4096 none | — | — | — | — | 1600.0 / — | run/sustained.json |"
    with pytest.raises(SystemExit):
        sb.main(["--cells", str(tmp_path / "none.json")])
    assert "--cells: no such file" in capsys.readouterr().err


def test_ab_table(tmp_path, capsys):
    import json

    def write(name, ours, fa4, ours_bwd=None, fa4_bwd=None):
        runs = [_run("fa4gen", ours, 1500.0, 700.0), _run("fa4", fa4, 1500.0, 700.0)]
        if ours_bwd:
            runs += [_run("fa4gen_bwd", ours_bwd, 1500.0, 700.0), _run("fa4_bwd", fa4_bwd, 1500.0, 700.0)]
        (tmp_path / name).mkdir()
        (tmp_path / name / "sustained.json").write_text(json.dumps({"rows": sb.summarize(runs)}))

    # the ref runs on a slower clock: raw new/ref 1.10, through flash-attn-4 1.00 forward, 1.05 backward
    write("new_1", 660.0, 660.0, 630.0, 600.0)
    write("new_2", 660.0, 660.0, 630.0, 600.0)
    write("ref_1", 600.0, 600.0, 600.0, 600.0)
    write("ref_2", 600.0, 600.0, 600.0, 600.0)
    assert sb.main(["--ab", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "| d128 s16384 none | fa4gen | 660.0 / 660.0 | 600.0 / 600.0 | 1.000 | 1.100 |"
    assert out[3] == "| d128 s16384 none | fa4gen_bwd | 630.0 / 630.0 | 600.0 / 600.0 | 1.050 | 1.050 |"
    empty = tmp_path / "empty"
    empty.mkdir()
    sb.main(["--ab", str(empty)])
    assert "no cell in both sides' runs" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sb.main(["--ab", str(tmp_path / "missing")])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_pass_order_balances_predecessors(n):
    bench = load_tool("bench_fwd")
    names = [f"impl{i}" for i in range(n)]
    assert bench.pass_order(names, 0) == names  # the first pass keeps the given order
    passes = n if n % 2 == 0 else 2 * n
    orders = [bench.pass_order(names, r) for r in range(passes)]
    assert all(sorted(o) == names for o in orders)
    pairs = [(a, b) for o in orders for a, b in zip(o, o[1:])]
    if n > 1:
        # every implementation right after every other one equally often (once for an even count, twice for odd)
        assert sorted(set(pairs)) == sorted((a, b) for a in names for b in names if a != b)
        assert len(pairs) == len(set(pairs)) * (1 if n % 2 == 0 else 2)
        assert len({o[0] for o in orders}) == n  # and each one first in some pass
    # the old rotation kept every predecessor fixed: impl0 always came right after the last one
    if n == 4:
        assert ("impl2", "impl3") in pairs and ("impl3", "impl2") in pairs


def test_run_for_sizes_its_chunk_after_a_slow_first_call(fake_cuda):
    import time

    bench = load_tool("bench_fwd")
    syncs, calls = [], []
    torch.cuda.synchronize = lambda: syncs.append(len(calls))  # (fake_cuda's stand-in, counting)

    def fn():  # a first call that "compiles" for 0.3 s, then 2 ms calls
        time.sleep(0.3 if not calls else 0.002)
        calls.append(1)

    n = bench.run_for(fn, 0.15)
    assert n == len(calls) and n > 20
    assert len(syncs) < n / 5  # synchronized every ~25 calls, not after each one


def test_output_and_grad_checks_refuse_a_wrong_kernel(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    torch.manual_seed(0)
    ref = torch.randn(2, 64, 4, 32).to(torch.bfloat16)
    close = (ref.float() + 1e-3).to(torch.bfloat16)
    impls = {"fa4gen": lambda: close, "fa4gen:x": lambda: close, "fa4": lambda: ref}
    sb.check_outputs("cell", impls)  # within a few ulps: passes
    impls["fa4gen:bad"] = lambda: torch.zeros_like(ref)
    with pytest.raises(SystemExit, match="fa4gen:bad differs from fa4 in cell"):
        sb.check_outputs("cell", impls)
    # without flash-attn-4, cuDNN's BHSD output is the reference (transposed)
    sb.check_outputs("cell", {"fa4gen": lambda: ref, "cudnn": lambda: ref.transpose(1, 2)})

    q = torch.randn(1, 8, 2, 16)
    leaves_of = {n: tuple(x.clone().requires_grad_() for x in (q, q, q)) for n in ("fa4gen_bwd", "fa4_bwd")}

    def step(name, scale):
        def run():
            for x in leaves_of[name]:
                x.grad = None
            (sum((x * scale).sum() for x in leaves_of[name])).backward()
        return run

    sb.check_grads("cell", {"fa4gen_bwd": step("fa4gen_bwd", 1.0), "fa4_bwd": step("fa4_bwd", 1.0)}, leaves_of)
    with pytest.raises(SystemExit, match="fa4gen_bwd's dQ differs from fa4_bwd's in cell"):
        sb.check_grads("cell", {"fa4gen_bwd": step("fa4gen_bwd", 2.0), "fa4_bwd": step("fa4_bwd", 1.0)}, leaves_of)
    # a backward variant is checked too
    leaves_of["fa4gen_bwd:v"] = tuple(x.clone().requires_grad_() for x in (q, q, q))
    with pytest.raises(SystemExit, match="fa4gen_bwd:v's dQ differs"):
        sb.check_grads("cell", {"fa4gen_bwd": step("fa4gen_bwd", 1.0), "fa4_bwd": step("fa4_bwd", 1.0),
                                "fa4gen_bwd:v": step("fa4gen_bwd:v", 3.0)}, leaves_of)


def test_ablation_ratio_cells():
    bench = load_tool("bench_fwd")
    assert bench.ablation_ratio(None, 600.0) == "refused"
    assert bench.ablation_ratio({"switch": "x", "tflops": None}, 600.0) == "refused"  # the planner's refusal row
    assert bench.ablation_ratio({"tflops": None, "passes": []}, 600.0) == "wrong output"
    assert bench.ablation_ratio({"tflops": 630.0, "passes": [630.0]}, 600.0) == "1.050"


def test_ablation_flow_on_the_cpu(tmp_path, monkeypatch, fake_cuda):
    """bench_fwd.ablation with stand-ins for the GPU parts: a refused switch, one whose output is wrong (reported,
    not timed), the others timed `repeats` times in pass_order's orders with their medians in the table."""
    import json as _json

    from fa4gen.plan import PlanError

    bench = load_tool("bench_fwd")
    real_randn = torch.randn
    # (small CPU tensors: the stand-in kernels ignore the shapes, and s16k x 16 heads x d128 is slow to draw here)
    monkeypatch.setattr(bench.torch, "randn", lambda *shape, device=None, dtype=None: real_randn(2, 8, 2, 8).to(dtype))
    monkeypatch.setattr(bench, "ABLATION", {"default": {}, "ping_pong off": {"ping_pong": False},
                                            "broken": {"rescale_threshold": 1.0}, "refused": {"tile_m": 192}})
    monkeypatch.setattr(bench, "_fa4", lambda: None)
    speed = {}

    class Pkg:
        def __init__(self, pipeline):
            self.pipeline = pipeline

        def attention(self, q, k, v):
            if self.pipeline.get("rescale_threshold") == 1.0:
                return torch.zeros_like(q)
            speed["last"] = 2.0 if self.pipeline.get("ping_pong") is False else 1.0
            return q

    def build(spec):
        if spec["pipeline"].get("tile_m") == 192:
            raise PlanError(spec["name"], [])
        return Pkg(spec["pipeline"])

    monkeypatch.setattr(bench.fa4gen, "build", build)
    order = []

    def do_bench(fn, **kw):
        fn()
        order.append(speed["last"])
        return speed["last"]

    monkeypatch.setattr(bench, "do_bench", do_bench)
    monkeypatch.setattr(bench, "pass_order", lambda names, rep: list(names)[::-1] if rep % 2 else list(names))
    bench.ablation(tmp_path, d=128, repeats=2)
    rows = _json.loads((tmp_path / "ablation_d128.json").read_text())
    by = {(r["switch"], r["causal"], r["seqlen"]): r for r in rows}
    assert len(by[("default", False, 4096)]["passes"]) == 2
    assert len(order) == 2 * 2 * 2 * 2  # masks x seqlens x repeats x the two timed switches
    assert by[("ping_pong off", True, 16384)]["tflops"] == round(by[("default", True, 16384)]["tflops"] / 2, 1)
    assert by[("broken", False, 4096)]["tflops"] is None and by[("broken", False, 4096)]["passes"] == []
    assert by[("refused", False, 4096)]["tflops"] is None and "passes" not in by[("refused", False, 4096)]
    md = (tmp_path / "ablation_d128.md").read_text()
    assert md.startswith("2 timing pass(es) per cell")
    assert "| ping_pong off | n |" in md and "| 0.500 | 0.500 |" in md
    assert "| broken | n | None | None | wrong output | wrong output |" in md
    assert "| refused | y | None | None | refused | refused |" in md

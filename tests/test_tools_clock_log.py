"""tools/clock_log.py and bench_fwd.py --clock-log on the CPU: nvidia-smi's lines parsed, a stand-in sampler's
clock averaged over timing windows, no sampler leaving the run unclocked, and the clock table / per-process merge
(the sampling itself runs on the GPU machine's nvidia-smi)."""

import datetime as dt
import sys
import time

from conftest import load_tool

clock_log = load_tool("clock_log")


def _stamp(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def test_parse_line():
    t = time.time()
    stamp, mhz, watts, temp = clock_log.parse_line(f"{_stamp(t)}, 1980, 351.25, 43")
    assert abs(stamp - t) < 0.002 and (mhz, watts, temp) == (1980.0, 351.25, 43.0)
    assert clock_log.parse_line(f"{_stamp(t)}, 1755, [N/A], 40")[1:] == (1755.0, None, 40.0)
    assert clock_log.parse_line("timestamp, clocks.current.sm [MHz], power.draw [W], temperature.gpu") is None
    assert clock_log.parse_line("garbage") is None


# a stand-in for `nvidia-smi --loop-ms=20`: a line every 20 ms, the clock 1000 MHz for 0.3 s, then 1500 MHz
FAKE = """
import datetime, sys, time
t0 = time.time()
while True:
    t = time.time()
    mhz = 1000 if t - t0 < 0.3 else 1500
    print(datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3] + f", {mhz}, 300.0, 40", flush=True)
    time.sleep(0.02)
"""


def _wait_for(log, enough, what: str, limit_s: float = 20.0) -> list:
    """Poll `log.samples()` while the fake sampler runs until `enough(samples)` holds (asserted after `limit_s`);
    the samples. Waiting on the samples, not on a fixed sleep, keeps the tests right on a loaded machine, where the
    sampler starts late."""
    deadline = time.time() + limit_s
    while True:
        samples = log.samples()
        if enough(samples) or time.time() > deadline:
            assert enough(samples), f"no {what} within {limit_s} s"
            return samples
        time.sleep(0.02)


def _sampled_past_the_switch(log, count: int = 8) -> list[float]:
    """The times of `count` or more samples of the fake sampler's second clock (1500 MHz, from 0.3 s after its own
    start), once it has written them."""
    def second(samples):
        return [s[0] for s in samples if s[1] == 1500.0]
    return second(_wait_for(log, lambda samples: len(second(samples)) >= count, f"{count} samples at 1500 MHz"))


def test_windows_average_the_samples_inside_them(tmp_path):
    log = clock_log.ClockLog(tmp_path / "clock.csv", period_ms=20, command=[sys.executable, "-c", FAKE])
    t_start = time.time()
    assert log.start()
    _sampled_past_the_switch(log)
    log.stop()
    samples = log.samples()
    assert len(samples) > 15 and all(s[1] in (1000.0, 1500.0) for s in samples)
    first = [s for s in samples if s[1] == 1000.0]
    # the windows are placed by the samples' own times: the fake sampler's 0.3 s count from its own start, which
    # a loaded machine delays (a window placed from t_start read 1,200 MHz in session 81's CI)
    second = [s[0] for s in samples if s[1] == 1500.0]
    early = log.window([(first[0][0], first[-1][0])])
    late = log.window([(second[1], second[-1])])
    assert early["sm_mhz"] == 1000.0 and late["sm_mhz"] == 1500.0 and late["watts"] == 300.0 and late["temp_c"] == 40.0
    both = log.window([(first[0][0], first[-1][0]), (second[1], second[-1])])
    assert 1000.0 < both["sm_mhz"] < 1500.0 and both["samples"] == early["samples"] + late["samples"]
    # a window shorter than the period gets its nearest sample; one far from every sample gets none
    mid = first[len(first) // 2][0]
    assert log.window([(mid + 0.001, mid + 0.002)])["samples"] == 1
    assert log.window([(t_start + 100, t_start + 101)]) is None


def test_no_sampler_means_no_clocks(tmp_path, capsys):
    log = clock_log.ClockLog(tmp_path / "c.csv", command=["/nonexistent/nvidia-smi"])
    assert not log.start() and "no sampling" in capsys.readouterr().out
    quits = clock_log.ClockLog(tmp_path / "d.csv", period_ms=20, command=[sys.executable, "-c", "raise SystemExit(6)"])
    assert not quits.start() and "exited with 6" in capsys.readouterr().out
    assert quits.window([(0.0, time.time())]) is None


def test_bench_clock_table_and_merge():
    bench = load_tool("bench_fwd")
    clocks = {"fa4gen": {"sm_mhz": 1650.0, "watts": 690.0, "temp_c": 60.0, "samples": 9},
              "fa4": {"sm_mhz": 1755.0, "watts": 640.0, "temp_c": 59.0, "samples": 8}}
    row = {"d": 64, "dv": 64, "seqlen": 16384, "causal": False, "fa4gen": 516.4, "fa4": 541.3, "cudnn": None,
           "sdpa_flash": None, "vs_fa4": 0.954, "vs_best": 0.954, "clocks": clocks}
    lines = bench.clock_table([row])
    assert lines[3] == "| d | seqlen | causal | fa4gen | flash-attn-4 |"
    assert lines[5] == "| 64 | 16384 | n | 1650.0 (690.0 W) | 1755.0 (640.0 W) |"
    assert bench.clock_table([{k: v for k, v in row.items() if k != "clocks"}]) == []
    merged = bench.merge_runs([{"rows": [row]}, {"rows": [dict(row, clocks=None)]}])["rows"][0]
    assert "clocks" not in merged and merged["clocks_per_process"] == [clocks, None]


def test_the_sampler_ends_with_its_parent(tmp_path):
    """A benchmark killed by a timeout leaves no sampler writing: the sampler gets SIGTERM when its parent dies."""
    import subprocess

    pid_file = tmp_path / "pid"
    parent = f"""
import os, sys, time
sys.path.insert(0, {str(clock_log.__file__.rsplit('/', 1)[0])!r})
import clock_log
log = clock_log.ClockLog({str(tmp_path / 'c.csv')!r}, period_ms=20, command=[sys.executable, "-c", {FAKE!r}])
assert log.start()
open({str(pid_file)!r}, "w").write(str(log._proc.pid))
os._exit(0)   # no atexit: as a kill would
"""
    subprocess.run([sys.executable, "-c", parent], check=True, timeout=60)
    pid = int(pid_file.read_text())
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"sampler {pid} still running after its parent exited")


def test_merged_runs_get_a_clock_table_per_process():
    bench = load_tool("bench_fwd")
    row = {"d": 64, "dv": 64, "seqlen": 512, "causal": True, "clocks": {"fa4gen": {"sm_mhz": 1980.0, "watts": 500.0}}}
    lines = bench.clock_table([row], " of process 2")
    assert lines[1].startswith("SM clock during each column's timings of process 2 (MHz")
    assert lines[5] == "| 64 | 512 | y | 1980.0 (500.0 W) |"


def test_windows_read_while_sampling_see_new_samples(tmp_path):
    # session 77: a window read while the sampler ran cached the file, and every later window found no samples
    log = clock_log.ClockLog(tmp_path / "clock.csv", period_ms=20, command=[sys.executable, "-c", FAKE])
    assert log.start()
    _wait_for(log, bool, "sample")
    # read again and again while sampling: with the file cached by the first read, no later sample would show
    second = _sampled_past_the_switch(log)
    log.stop()
    assert log.window([(second[0], second[4])])["sm_mhz"] == 1500.0

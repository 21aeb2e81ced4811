"""The GPU's SM clock, power and temperature sampled by `nvidia-smi --loop-ms` in a background process while a benchmark
runs, and their means over the benchmark's timing windows (bench_fwd.py --clock-log).

Why: on a throttling card (bf16 matmul 783 -> 636 TFLOP/s over a grid pass, docs/PERF.md session 76) a cell's
ratio moves with the clock each implementation happened to run at; session 76's no-mask s16k cells read 0.95-0.98x
flash-attn-4 inside a grid pass and 1.03-1.12x alone. With each timing window's mean clock recorded, a ratio can be
read next to the clocks its two sides ran at.

The samples are nvidia-smi's (`timestamp, clocks.sm, power.draw, temperature.gpu`, every PERIOD ms, `--loop-ms`); a window
[t0, t1] of `time.time()` values averages the samples inside it (a window shorter than the period gets the sample
nearest its middle). No sample source (no nvidia-smi, or it exits at once) leaves every window None: the benchmark
runs as without the flag.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime as _dt
import signal
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu"


def _number(text: str) -> float | None:
    text = text.strip()
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_line(line: str) -> tuple[float, float | None, float | None, float | None] | None:
    """(epoch seconds, SM MHz, watts, degrees C) of one `--format=csv,noheader,nounits` line, or None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        stamp = _dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()   # the machine's local time
    except ValueError:
        return None
    return stamp, _number(parts[1]), _number(parts[2]), _number(parts[3])


def _die_with_the_parent() -> None:
    """In the sampler's process (Linux): SIGTERM when the benchmark's process ends, so a benchmark stopped by a
    timeout leaves no sampler running."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ClockLog:
    """`nvidia-smi` sampling into `path` from start() to stop(); window() reads the file."""

    def __init__(self, path: Path, period_ms: int = 50, command: list[str] | None = None):
        self.path = Path(path)
        self.period_ms = period_ms
        self.command = command
        self._proc: subprocess.Popen | None = None
        self._out = None
        self._samples: list[tuple[float, float | None, float | None, float | None]] | None = None

    def start(self) -> bool:
        """Start sampling; False (and a printed reason) when there is no sample source."""
        cmd = self.command or ([shutil.which("nvidia-smi") or "nvidia-smi", f"--query-gpu={QUERY}",
                                "--format=csv,noheader,nounits", f"--loop-ms={self.period_ms}"])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._out = self.path.open("w")
        try:
            self._proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.DEVNULL,
                                          preexec_fn=_die_with_the_parent if sys.platform == "linux" else None)
        except OSError as err:
            print(f"clock log: no sampling ({err})")
            self.stop()
            return False
        time.sleep(min(0.5, 4 * self.period_ms / 1000))
        atexit.register(self.stop)
        if self._proc.poll() is not None:
            print(f"clock log: {cmd[0]} exited with {self._proc.returncode}: no sampling")
            self.stop()
            return False
        return True

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None
        if self._out is not None:
            self._out.close()
            self._out = None
        self._samples = None

    def samples(self) -> list[tuple[float, float | None, float | None, float | None]]:
        """The samples so far, sorted by time: read from the file again while the sampler runs (session 77's first
        sustained run cached the file at its first window, and every later window found no samples), once after.
        While it runs, nvidia-smi's output buffer may hold the latest samples back: read windows after stop()."""
        if self._samples is None or self._proc is not None:
            text = self.path.read_text() if self.path.exists() else ""
            samples = sorted(s for s in map(parse_line, text.splitlines()) if s is not None)
            if self._proc is not None:
                return samples
            self._samples = samples
        return self._samples

    def window(self, spans: list[tuple[float, float]]) -> dict | None:
        """Means over the samples inside any of `spans` ((t0, t1) pairs of time.time()): {"sm_mhz", "watts",
        "temp_c" (the maximum), "samples"}; None without samples near them."""
        samples = self.samples()
        inside = [s for s in samples if any(t0 <= s[0] <= t1 for t0, t1 in spans)]
        if not inside and samples:  # windows shorter than the period: the sample nearest each middle
            for t0, t1 in spans:
                mid = (t0 + t1) / 2
                near = min(samples, key=lambda s: abs(s[0] - mid))
                if abs(near[0] - mid) <= max(self.period_ms / 1000, (t1 - t0) / 2) * 2:
                    inside.append(near)
        if not inside:
            return None

        def mean(i: int) -> float | None:
            vals = [s[i] for s in inside if s[i] is not None]
            return round(statistics.fmean(vals), 1) if vals else None

        temps = [s[3] for s in inside if s[3] is not None]
        return {"sm_mhz": mean(1), "watts": mean(2), "temp_c": max(temps) if temps else None, "samples": len(inside)}

"""The GPU's SM clock and board power sampled by nvidia-smi while a benchmark runs (every 50 ms), so a
spread between runs (a lower clock on another machine start) can be told apart from a difference
between variants. From diag_dg7.py (benchmarks/results/2026-12-01/dg7/; runs DG7, DG13: the same
kernel timed 193 us in one run and 208 us in the next); `benchmarks.gemm --clock` records it per row."""

from __future__ import annotations

import statistics
import subprocess
import threading
import time


class ClockSampler:
    """nvidia-smi in the background: (host time, SM MHz, watts) samples; window() summarises a span."""

    def __init__(self, period_ms: int = 50) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                      "-lms", str(period_ms)], stdout=subprocess.PIPE, text=True)
        self.slack_s = period_ms / 1000 + 0.01
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            parsed = parse(line)
            if parsed:
                self.samples.append((time.time(), *parsed))

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """Median SM clock and power over [t0, t1] (host time.time()); {} when no sample fell inside."""
        inside = [(c, p) for t, c, p in self.samples if t0 <= t <= t1 + self.slack_s]
        if not inside:
            return {}
        return {"sm_mhz": statistics.median(c for c, _ in inside), "sm_mhz_min": min(c for c, _ in inside),
                "watts": statistics.median(p for _, p in inside)}

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def parse(line: str) -> tuple[float, float] | None:
    """'1980, 412.35' -> (1980.0, 412.35); None for a line nvidia-smi could not fill ('[N/A]')."""
    try:
        mhz, watts = (float(v) for v in line.split(","))
    except ValueError:
        return None
    return mhz, watts

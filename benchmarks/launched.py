"""`tandem serve` launched by a benchmark: its own process session, ready when /ready answers, stopped
with SIGTERM (it drains and stops its workers), then whatever is left of the session killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from common.errors import WorkerUnavailable
from launcher.ports import free_base_port, free_port


KEPT_LOG_BYTES = 4 << 20


class LaunchedService:
    """`tandem serve` in its own session (so a stuck shutdown can take its workers down with it)."""

    def __init__(self, mode: str, num_prefill: int, num_decode: int, serve_args: list[str], ready_timeout_s: float,
                 keep_log: Path | None = None):
        """`keep_log`: where the service's log (router and workers) is copied when it stops, its last
        KEPT_LOG_BYTES: a run's outliers are explained by its workers' lines (slow steps, compiles)."""
        self.mode, self.ready_timeout_s, self.keep_log = mode, ready_timeout_s, keep_log
        port, base = free_port(), free_base_port(num_prefill + num_decode)
        n_pre, n_dec = (0, num_prefill + num_decode) if mode == "colocated" else (num_prefill, num_decode)
        self.workers = ([f"tcp://127.0.0.1:{base + 100 + i}" for i in range(n_pre)]
                        + [f"tcp://127.0.0.1:{base + 200 + i}" for i in range(n_dec)])
        self.url = f"http://127.0.0.1:{port}"
        workers = (["--colocated", "--num-decode", str(num_prefill + num_decode)] if mode == "colocated"
                   else ["--num-prefill", str(num_prefill), "--num-decode", str(num_decode)])
        self.cmd = [sys.executable, "-m", "launcher.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                    "--base-port", str(base), *workers, *serve_args]
        self.log = tempfile.NamedTemporaryFile(prefix=f"tandem-bench-{mode}-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LaunchedService:
        print(f"launching ({self.mode}): {' '.join(self.cmd[2:])}  [log {self.log.name}]", flush=True)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        t_end = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < t_end:
            self.check_alive("start-up")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.__exit__(None, None, None)
        raise WorkerUnavailable(f"tandem serve ({self.mode}) was not ready within {self.ready_timeout_s:.0f} s; "
                                f"log tail:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # tandem serve drains and stops its workers
            try:
                self.proc.wait(45)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the session we created at launch (nothing else is in it)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        if self.keep_log is not None:
            self.keep_log.parent.mkdir(parents=True, exist_ok=True)
            self.keep_log.write_text(self.log_tail(KEPT_LOG_BYTES))

    def check_alive(self, during: str) -> None:
        """A service that exited shows to a load as connection errors: say so, with its log."""
        if self.proc is not None and self.proc.poll() is not None:
            raise WorkerUnavailable(f"tandem serve ({self.mode}) exited with code {self.proc.returncode} during "
                                    f"{during}; log tail:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-n:]

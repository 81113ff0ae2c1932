"""common/stall.py: a loop iteration longer than TANDEM_STALL_DUMP_S dumps every thread's stack to
stderr; a loop that keeps ticking, or the variable unset, dumps nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CODE = """
import time
from common.stall import StallWatch
w = StallWatch()
for _ in range(int({ticks})):
    w.tick()
    time.sleep({sleep})
w.stop()
time.sleep(0.5)
"""


def _run(env_s: str | None, ticks: int, sleep: float) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_STALL_DUMP_S"}
    if env_s is not None:
        env["TANDEM_STALL_DUMP_S"] = env_s
    r = subprocess.run([sys.executable, "-c", CODE.format(ticks=ticks, sleep=sleep)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_a_stalled_iteration_dumps_stacks():
    err = _run("0.3", 1, 1.0)
    assert "Timeout" in err and "most recent call first" in err and "<string>" in err


def test_a_ticking_loop_or_no_setting_dumps_nothing():
    assert _run("0.5", 10, 0.05) == ""
    assert _run(None, 1, 0.6) == ""


IO_CODE = """
import random, time
from common.worker_io import WorkerIO
io = WorkerIO("tcp://127.0.0.1:0", lambda: None)
io.start()
time.sleep(0.3)
xs = [random.random() for _ in range({n})]
t0 = time.monotonic()
xs.sort()  # one C call that never gives the GIL up: the network thread cannot run meanwhile
print("held", time.monotonic() - t0)
io.close()
"""


def _run_io(env_s: str | None, n: int) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("TANDEM_STALL_DUMP_S", "TANDEM_IO_STALL_DUMP_S")}
    if env_s is not None:
        env["TANDEM_IO_STALL_DUMP_S"] = env_s
    r = subprocess.run([sys.executable, "-c", IO_CODE.format(n=n)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stderr, float(r.stdout.split()[-1])


def test_a_network_thread_that_cannot_run_dumps_stacks():
    err, held = _run_io("0.2", 3_000_000)
    assert held > 0.4, "the GIL was not held long enough to test anything"
    assert "Timeout" in err and "worker_io.py" in err and "<string>" in err  # both threads, where they are
    err, _ = _run_io(None, 3_000_000)
    assert "Timeout" not in err

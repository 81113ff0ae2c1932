"""Stall reports for a worker loop: with TANDEM_STALL_DUMP_S set, every thread's Python stack goes to
stderr (the worker log) when one loop iteration takes longer than that many seconds.

TANDEM_IO_STALL_DUMP_S watches the worker's network thread instead (common/worker_io.py ticks it
every poll, at least every 0.1 s): a dump then means the thread that answers the router's status
polls could not run for that long (the process-wide GIL held by a C call, the host starved), and
it repeats every that many seconds while the stall lasts. faulthandler keeps one timer per
process: set one of the two.

faulthandler's watchdog runs in C without the GIL, so it reports even when the loop (or a C call
holding the GIL) is what blocks the I/O thread from answering status polls. Re-arming per
iteration costs microseconds; off by default."""

from __future__ import annotations

import faulthandler
import os
import sys


class StallWatch:
    def __init__(self, env: str = "TANDEM_STALL_DUMP_S", repeat: bool = False) -> None:
        raw = os.environ.get(env, "")
        self.seconds = float(raw) if raw else 0.0
        self.repeat = repeat

    def tick(self) -> None:
        """Call once per loop iteration: restarts the countdown."""
        if self.seconds > 0:
            faulthandler.dump_traceback_later(self.seconds, repeat=self.repeat, file=sys.stderr)

    def stop(self) -> None:
        if self.seconds > 0:
            faulthandler.cancel_dump_traceback_later()

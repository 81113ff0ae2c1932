"""Stall reports for a worker loop: with TANDEM_STALL_DUMP_S set, every thread's Python stack goes to
stderr (the worker log) when one loop iteration takes longer than that many seconds.

faulthandler's watchdog runs in C without the GIL, so it reports even when the loop (or a C call
holding the GIL) is what blocks the I/O thread from answering status polls. Re-arming per
iteration costs microseconds; off by default."""

from __future__ import annotations

import faulthandler
import os
import sys


class StallWatch:
    def __init__(self) -> None:
        raw = os.environ.get("TANDEM_STALL_DUMP_S", "")
        self.seconds = float(raw) if raw else 0.0

    def tick(self) -> None:
        """Call once per loop iteration: restarts the countdown."""
        if self.seconds > 0:
            faulthandler.dump_traceback_later(self.seconds, file=sys.stderr)

    def stop(self) -> None:
        if self.seconds > 0:
            faulthandler.cancel_dump_traceback_later()

"""common/gc_pauses.py: every collection is timed into the histogram by generation, and a frozen
start-up heap leaves the full collection's walk (run in a subprocess: freezing pytest's own heap would
keep every later test's garbage cycles alive)."""

from __future__ import annotations

import gc
import subprocess
import sys

from prometheus_client import CollectorRegistry

from common.gc_pauses import GcPauses


def _sample(reg: CollectorRegistry, gen: str) -> float:
    return reg.get_sample_value("tandem_gc_pause_seconds_count", {"generation": gen}) or 0.0


def test_gc_pauses_observes_each_collection_by_generation() -> None:
    reg = CollectorRegistry()
    pauses = GcPauses(reg).install()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        pauses.remove()
    assert _sample(reg, "0") >= 1 and _sample(reg, "2") >= 2
    assert (reg.get_sample_value("tandem_gc_pause_seconds_sum", {"generation": "2"}) or 0.0) > 0
    n = _sample(reg, "2")
    gc.collect(2)  # removed: no longer observed
    assert _sample(reg, "2") == n and pauses not in gc.callbacks


def test_frozen_startup_heap_shortens_full_collections() -> None:
    code = """
import gc, time
from common.gc_pauses import freeze_startup_heap
heap = [{"i": i, "l": [i]} for i in range(300_000)]  # a start-up's long-lived containers
def full():
    t = time.perf_counter(); gc.collect(); return time.perf_counter() - t
before = min(full() for _ in range(3))
freeze_startup_heap("test")
after = min(full() for _ in range(3))
print(gc.get_freeze_count(), before, after)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    frozen, before, after = out.stdout.split()
    assert int(frozen) >= 600_000
    assert float(after) < float(before) / 4, (before, after)

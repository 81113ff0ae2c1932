"""The garbage collector in a serving process: freeze what start-up built, and time every pause.

A worker's start-up leaves ~200k container objects the cyclic collector tracks (torch, triton, the
model's modules, the tokenizer tables: 196k with the tiny CPU model; more with FlashInfer and DeepGEMM
imported on a GPU), and none of them ever becomes garbage. A full (generation 2) collection walks all
of them: 48 ms on the CPU machine for the tiny model's worker, stalling the step loop, or the router's
event loop, mid-stream. `freeze_startup_heap()` runs one collection and moves the survivors into the
permanent generation (`gc.freeze`, what vLLM's engine core does after start-up), so later collections
walk only what serving allocated since. Objects frozen here are never collected: a cycle created by
start-up and dropped later stays in memory, a one-off cost bounded by what start-up built.

`GcPauses` times each collection through `gc.callbacks` into a histogram by generation
(tandem_gc_pause_seconds) in the process's metrics registry: a latency spike that lines up with a
generation-2 pause is the collector's. The callback runs in whichever thread triggered the collection;
it reads two clocks and observes one value.
"""

from __future__ import annotations

import gc
import logging
import os
import time

from prometheus_client import REGISTRY, CollectorRegistry, Histogram

log = logging.getLogger("tandem.gc")

_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class GcPauses:
    """Every collection's pause, observed into `tandem_gc_pause_seconds{generation}`."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.hist = Histogram("tandem_gc_pause_seconds", "cyclic garbage collector pause, by generation",
                              ["generation"], buckets=_BUCKETS, registry=registry)
        self._by_gen = [self.hist.labels(generation=str(g)) for g in range(3)]
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        self._by_gen[min(int(info.get("generation", 0)), 2)].observe(dt)

    def install(self) -> GcPauses:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


_PROCESS: GcPauses | None = None


def process_pauses() -> GcPauses:
    """The process's one GcPauses, in the default registry (a worker's /metrics), installed once."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = GcPauses().install()
    return _PROCESS


def freeze_startup_heap(what: str) -> float:
    """Collect once, then freeze everything alive (call when start-up is done, before serving).
    Returns the collection's seconds; logs the frozen object count. TANDEM_GC_FREEZE=0 skips it (the A/B's
    other arm, and a way out should a deployment's start-up leave garbage it wants back)."""
    if os.environ.get("TANDEM_GC_FREEZE", "1") == "0":
        log.info("%s: start-up heap not frozen (TANDEM_GC_FREEZE=0)", what)
        return 0.0
    t0 = time.perf_counter()
    gc.collect()
    dt = time.perf_counter() - t0
    gc.freeze()
    log.info("%s: %d start-up objects frozen out of the garbage collector's walks (a full collection took "
             "%.1f ms)", what, gc.get_freeze_count(), dt * 1e3)
    return dt

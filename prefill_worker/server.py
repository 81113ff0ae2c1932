"""The prefill worker's one loop (batch 1, DP1):

    while not (draining and queue empty):
        take messages: PrefillRequest -> queue; Abort -> drop from queue (or abort the running one)
        run the oldest queued request -> reply PrefillResult
        publish status (queue depth, queued prompt tokens, busy time)
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections import deque

from prometheus_client import Counter, Gauge, Histogram

from common.stall import StallWatch
from common.worker_io import WorkerIO
from engine.prefix_metrics import PrefixMetrics, status_fields, with_events
from model.kv_cache import PageGroup
from prefill_worker.engine import PrefillEngine
from wire.protocol import Abort, PrefillRequest, PrefillResult, StatusRequest, WorkerStatus

log = logging.getLogger("tandem.prefill")

PREFILL = Histogram("tandem_prefill_worker_seconds", "prefill compute time",
                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
PROMPT_TOKENS = Counter("tandem_prefill_tokens_total", "prompt tokens prefilled (computed: prefix-cache hits excluded)")
QUEUE = Gauge("tandem_worker_queue_depth", "queued prefill requests")


class PrefillServer:
    def __init__(self, engine: PrefillEngine, io: WorkerIO, worker_id: str, epoch: int) -> None:
        self.engine, self.io, self.worker_id, self.epoch = engine, io, worker_id, epoch
        self.queue: deque[tuple[bytes, PrefillRequest]] = deque()
        self.aborted: set[str] = set()
        self.arrived: dict[str, float] = {}  # request id -> when it was queued (TTFT breakdown)
        self.draining = threading.Event()
        self.ready = False
        self.busy_seconds = 0.0
        self.prefix_metrics = PrefixMetrics(engine.kv, "prefill")
        self._status = self._snapshot()

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.draining.set())
        signal.signal(signal.SIGINT, lambda *_: self.draining.set())

    def status(self, req: StatusRequest | None = None) -> WorkerStatus:
        return with_events(self.engine.kv, self._status, req)

    def ready_check(self) -> tuple[bool, str]:
        if self.draining.is_set():
            return False, "draining"
        return (True, "") if self.ready else (False, "starting")

    def _snapshot(self) -> WorkerStatus:
        kv = self.engine.kv
        return WorkerStatus(
            role="prefill", worker_id=self.worker_id, epoch=self.epoch, ready=self.ready,
            draining=self.draining.is_set(), queue_depth=len(self.queue),
            queued_tokens=sum(len(m.prompt_ids) for _, m in self.queue), running=0,
            kv_free_pages=kv.num_free()[PageGroup.FULL], kv_total_pages=kv.spec.num_pages[PageGroup.FULL],
            kv_free_sliding_pages=kv.num_free()[PageGroup.SLIDING],
            kv_total_sliding_pages=kv.spec.num_pages[PageGroup.SLIDING],
            page_size=kv.spec.page_size, max_num_seqs=1, busy_seconds=self.busy_seconds, **status_fields(kv))

    def _take_messages(self, timeout_s: float) -> None:
        for peer, msg in self.io.drain(timeout_s):
            if isinstance(msg, PrefillRequest):
                if self.draining.is_set():
                    self.io.send(peer, PrefillResult(msg.request_id, False, -1, None, [], "worker is draining",
                                                     0.0, 0, 0.0))
                else:
                    self.queue.append((peer, msg))
                    self.arrived[msg.request_id] = time.monotonic()
            elif isinstance(msg, Abort):
                self.aborted.add(msg.request_id)
            else:
                log.warning("prefill worker ignores %s", type(msg).__name__)
        self._status = self._snapshot()

    def run(self) -> None:
        self.ready = True
        watch = StallWatch()
        while not (self.draining.is_set() and not self.queue):
            watch.tick()
            self._take_messages(0.0 if self.queue else 0.02)
            QUEUE.set(len(self.queue))
            if not self.queue:
                continue
            peer, m = self.queue.popleft()
            queued = time.monotonic() - self.arrived.pop(m.request_id, time.monotonic())
            if m.request_id in self.aborted:
                self.aborted.discard(m.request_id)
                continue
            t0 = time.perf_counter()
            result = self.engine.run(m, aborted=lambda rid=m.request_id: self._check_abort(rid))
            result = dataclasses.replace(result, queue_seconds=queued)
            dt = time.perf_counter() - t0
            self.busy_seconds += dt
            PREFILL.observe(dt)
            PROMPT_TOKENS.inc(len(m.prompt_ids) - result.cached_tokens)
            self.prefix_metrics.update()
            self.aborted.discard(m.request_id)
            self.io.send(peer, result)
            self._status = self._snapshot()
        watch.stop()
        log.info("drained; exiting")

    def _check_abort(self, rid: str) -> bool:
        self._take_messages(0.0)
        return rid in self.aborted

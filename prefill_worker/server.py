"""The prefill worker's one loop (batch 1, DP1):

    while not (draining and queue empty):
        take messages: PrefillRequest -> queue; Abort -> drop it from the queue, or cancel the running one
        past the drain deadline: fail what is queued
        run the oldest queued request -> reply PrefillResult
        publish status (queue depth, queued prompt tokens, busy time)

The running request checks for cancellation (an Abort for it, the drain deadline) between chunks,
between layers and while its transfer drains (prefill_worker.engine). SIGTERM drains: new requests
are refused, queued ones still run until `drain_timeout_s` after the signal; then what remains
fails with "worker drain deadline reached" and the process exits.
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
DRAIN_DEADLINE = "worker drain deadline reached"


def _failed(rid: str, error: str) -> PrefillResult:
    return PrefillResult(rid, False, -1, None, [], error, 0.0, 0, 0.0)


class PrefillServer:
    def __init__(self, engine: PrefillEngine, io: WorkerIO, worker_id: str, epoch: int,
                 drain_timeout_s: float = 30.0) -> None:
        self.engine, self.io, self.worker_id, self.epoch = engine, io, worker_id, epoch
        self.queue: deque[tuple[bytes, PrefillRequest]] = deque()
        self.running: str | None = None  # the request being prefilled
        self.cancelled = ""  # why the running request must stop ("" = it goes on)
        self.arrived: dict[str, float] = {}  # request id -> when it was queued (TTFT breakdown)
        self.draining = threading.Event()
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline = float("inf")  # monotonic; set by begin_drain
        self.ready = False
        self.busy_seconds = 0.0
        self.prefix_metrics = PrefixMetrics(engine.kv, "prefill")
        self._status = self._snapshot()

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.begin_drain())
        signal.signal(signal.SIGINT, lambda *_: self.begin_drain())

    def begin_drain(self) -> None:
        if not self.draining.is_set():
            log.info("draining: refusing new requests, finishing %d queued within %.0f s",
                     len(self.queue) + (self.running is not None), self.drain_timeout_s)
            self.drain_deadline = time.monotonic() + self.drain_timeout_s
            self.draining.set()

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
            queued_tokens=sum(len(m.prompt_ids) for _, m in self.queue), running=int(self.running is not None),
            kv_free_pages=kv.num_free()[PageGroup.FULL], kv_total_pages=kv.spec.num_pages[PageGroup.FULL],
            kv_free_sliding_pages=kv.num_free()[PageGroup.SLIDING],
            kv_total_sliding_pages=kv.spec.num_pages[PageGroup.SLIDING],
            page_size=kv.spec.page_size, max_num_seqs=1, busy_seconds=self.busy_seconds,
            max_model_len=self.engine.parts.scheduler.cfg.max_model_len, **status_fields(kv))

    def _past_drain_deadline(self) -> bool:
        return self.draining.is_set() and time.monotonic() >= self.drain_deadline

    def _take_messages(self, timeout_s: float) -> None:
        msgs = self.io.drain_timed(timeout_s)
        for peer, msg, received in msgs:
            if isinstance(msg, PrefillRequest):
                if self.draining.is_set():
                    self.io.send(peer, _failed(msg.request_id, "worker is draining"))
                else:
                    self.queue.append((peer, msg))
                    self.arrived[msg.request_id] = received  # the queue wait counts from the I/O thread
            elif isinstance(msg, Abort):
                self._abort(msg)
            else:
                log.warning("prefill worker ignores %s", type(msg).__name__)
        if self._past_drain_deadline():
            if self.running is not None and not self.cancelled:
                self.cancelled = DRAIN_DEADLINE
            while self.queue:
                peer, m = self.queue.popleft()
                self.arrived.pop(m.request_id, None)
                self.io.send(peer, _failed(m.request_id, DRAIN_DEADLINE))
        if msgs or self._past_drain_deadline():
            self._status = self._snapshot()

    def _abort(self, msg: Abort) -> None:
        """The running request stops at its next check; a queued one is dropped now (its reply
        would go to a router that stopped waiting); an unknown id is ignored (nothing is kept)."""
        if msg.request_id == self.running:
            self.cancelled = f"aborted by the router: {msg.reason}"
            return
        kept = deque(item for item in self.queue if item[1].request_id != msg.request_id)
        if len(kept) != len(self.queue):
            self.queue = kept
            self.arrived.pop(msg.request_id, None)
            log.info("dropped queued request %s: %s", msg.request_id, msg.reason)

    def run(self) -> None:
        self.ready = True
        self._status = self._snapshot()
        watch = StallWatch()
        while not (self.draining.is_set() and not self.queue):
            watch.tick()
            self._take_messages(0.0 if self.queue else 0.02)
            QUEUE.set(len(self.queue))
            if not self.queue:
                continue
            peer, m = self.queue.popleft()
            queued = time.monotonic() - self.arrived.pop(m.request_id, time.monotonic())
            self.running, self.cancelled = m.request_id, ""
            self._status = self._snapshot()
            t0 = time.perf_counter()
            result = self.engine.run(m, cancelled=self._cancel_reason)
            result = dataclasses.replace(result, queue_seconds=queued)
            dt = time.perf_counter() - t0
            self.running = None
            self.busy_seconds += dt
            PREFILL.observe(dt)
            PROMPT_TOKENS.inc(len(m.prompt_ids) - result.cached_tokens)
            self.prefix_metrics.update()
            self.io.send(peer, result)
            self._status = self._snapshot()
        watch.stop()
        log.info("drained; exiting")

    def _cancel_reason(self) -> str:
        """Why the running request must stop now ("" = go on); called between layers and chunks."""
        self._take_messages(0.0)
        return self.cancelled

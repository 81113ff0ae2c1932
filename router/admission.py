"""The admission queue: the router's one place of waiting (DESIGN: "The router owns waiting").

A request asks for a placement; when placement (pure, router.placement) finds KV room and a free
sequence slot now and nobody is queued ahead, it gets one at once. Otherwise it waits here, ordered
by (priority, arrival): lower priority values first, FIFO within one (vLLM's `priority`).

    placement = await queue.admit(ticket)     # may wait; raises QueueFull (429), WorkerUnavailable (503),
                                              # InvalidRequest (400: larger than any worker's KV)
    ...                                       # the request runs on placement.decode
    queue.prefill_done(placement.prefill, rid)  # its prefill answered: that worker takes the next one
    queue.release(placement, rid)             # it ended: the reservations go, waiters wake

Bounds: at most `max_queued` waiting (more: 429 at once) and at most `max_wait_s` in the queue,
counted from the first arrival across re-queues (then 429). Both carry a Retry-After estimate.
A request whose client leaves is cancelled in `admit` and leaves the queue there.

A request also waits, rather than failing with 503, while a needed role has no live worker but a
late one (placement.WorkerLate: marked down for missed status polls, answered within
--worker-grace-s): the fleet's polls wake the queue, so the wait ends when the worker answers again
(placed), when the grace period runs out (the next placement raises WorkerUnavailable: 503) or at
the wait bound (429). Requests that enter the queue are counted by the reason the head waits:
`no_room` or `worker_late` (tandem_router_queued_requests_total).

Wake-ups: `release` (a request ended: its slot and pages are back), `prefill_done`, `wake` (the
fleet polled: called through Fleet.on_poll), and `admit` itself. A placement also needs a prefill
worker with fewer than `max_prefill_queue` requests: a backlog there would spend the decode
reservation's transfer deadline (the first overload test on CPU lost half its requests that way). The head is placed first; when it does not fit, nobody
behind it overtakes it (FIFO), except that a request whose placement fails for good (no live
worker, too large) is answered and removed. Every placement is reserved in the fleet
(Fleet.reserve) until `release`, so a burst between two polls does not over-admit one worker; a
decode worker that still answers Rejected (a race with another router) is marked full until its
next poll and the request re-enters at its original place in the order (its arrival number).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field

from common.errors import AdmissionRejected, TandemError, WorkerLate
from router.errors import QueueFull
from router.fleet import Fleet
from router.metrics import RouterMetrics
from router.placement import Placement, pages_for, place
from router.prefill_cost import PrefillCost
from router.prefix_index import PromptHashes


@dataclass(slots=True)
class Ticket:
    request_id: str
    prompt_len: int
    max_tokens: int
    priority: int = 0
    arrival: int = -1  # order among equal priorities; kept when re-queued
    exclude: frozenset[str] = frozenset()
    first_queued: float | None = None  # monotonic time it first waited (the wait bound counts from here)
    waited_s: float = 0.0  # time spent queued over all its admissions (reported per request)
    hashes: PromptHashes | None = field(default=None, repr=False)  # the prompt's block hashes (prefix matches)
    fut: asyncio.Future | None = field(default=None, repr=False)

    def __lt__(self, other: Ticket) -> bool:
        return (self.priority, self.arrival) < (other.priority, other.arrival)


def _reason(e: AdmissionRejected) -> str:
    return "worker_late" if isinstance(e, WorkerLate) else "no_room"


class AdmissionQueue:
    def __init__(self, fleet: Fleet, metrics: RouterMetrics, *, max_queued: int, max_wait_s: float,
                 colocated: bool = False, max_prefill_queue: int | None = None,
                 cost: PrefillCost = PrefillCost()) -> None:
        self.fleet, self.metrics, self.cost = fleet, metrics, cost
        self.max_queued, self.max_wait_s, self.colocated = max_queued, max_wait_s, colocated
        self.max_prefill_queue = max_prefill_queue
        self._heap: list[Ticket] = []
        self._waiting = 0  # tickets in the heap whose future is not settled
        self._arrivals = itertools.count()
        self._recent_wait_s = 0.0  # EWMA of queue waits, for Retry-After
        self._blocked = "no_room"  # why the head of the queue waits (metrics label, timeout message)
        fleet.on_poll.append(self.wake)

    @property
    def depth(self) -> int:
        return self._waiting

    def oldest_wait_s(self) -> float:
        now = time.monotonic()
        return max((now - t.first_queued for t in self._heap if t.fut and not t.fut.done()
                    and t.first_queued is not None), default=0.0)

    def _place(self, t: Ticket) -> Placement:
        matches = self.fleet.prefix_matches(t.hashes, t.prompt_len) if t.hashes is not None else {}
        p = place(t.prompt_len, t.max_tokens, self.fleet.snapshot(), t.exclude, colocated=self.colocated,
                  max_prefill_queue=self.max_prefill_queue, matches=matches, cost=self.cost)
        st = self.fleet.workers.get(p.decode)
        page_size = st.status.page_size if st is not None and st.status is not None else 16
        cached = matches.get(p.decode, 0)
        cached_pages = cached // page_size  # decode maps these from its cache
        self.fleet.reserve(p.decode, t.request_id, pages_for(t.prompt_len, page_size) - cached_pages,
                           t.prompt_len - cached if p.prefill is None else 0)
        if p.prefill is not None:
            self.fleet.reserve_prefill(p.prefill, t.request_id, t.prompt_len)
        return p

    def _retry_after(self) -> int:
        return max(1, math.ceil(min(self._recent_wait_s, self.max_wait_s) or 1.0))

    async def admit(self, t: Ticket) -> Placement:
        if t.arrival < 0:
            t.arrival = next(self._arrivals)
        if not self._waiting:  # nobody ahead: place now if there is room
            try:
                p = self._place(t)
            except AdmissionRejected as e:
                self._blocked = _reason(e)
            else:
                self._observe(t, 0.0)
                return p
        now = time.monotonic()
        if t.first_queued is None:
            t.first_queued = now
        left = t.first_queued + self.max_wait_s - now
        if self._waiting >= self.max_queued:
            raise QueueFull(f"the admission queue is full ({self.max_queued} requests waiting for room); "
                            "retry later", self._retry_after())
        if left <= 0:
            raise self._timeout()
        self.metrics.router_queued.labels(self._blocked).inc()
        t.fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, t)
        self._waiting += 1
        self.metrics.router_queue.set(self._waiting)
        entered = now
        try:
            done, _ = await asyncio.wait({t.fut}, timeout=left)
        except asyncio.CancelledError:  # the client left (or the request was cancelled): leave the queue
            self._abandon(t)
            raise
        t.waited_s += time.monotonic() - entered
        if not done:
            self._abandon(t)
            raise self._timeout()
        p = t.fut.result()  # raises what placement raised for good (503 / 400)
        self._observe(t, t.waited_s)
        return p

    def _timeout(self) -> QueueFull:
        what = "no worker of a needed role answered" if self._blocked == "worker_late" else "no room for this request"
        return QueueFull(f"{what} within the queue's wait bound ({self.max_wait_s:g} s); retry later",
                         self._retry_after())

    def _observe(self, t: Ticket, waited_s: float) -> None:
        self.metrics.router_queue_wait.observe(waited_s)
        if waited_s > 0:
            self._recent_wait_s = 0.8 * self._recent_wait_s + 0.2 * waited_s

    def _settle(self, t: Ticket) -> None:
        self._waiting -= 1
        self.metrics.router_queue.set(self._waiting)

    def _abandon(self, t: Ticket) -> None:
        """Cancelled or timed out while queued. A placement made in the same instant is given back."""
        assert t.fut is not None
        if not t.fut.done():
            t.fut.cancel()
            self._settle(t)
        elif not t.fut.cancelled() and t.fut.exception() is None:
            self.release(t.fut.result(), t.request_id)

    def release(self, p: Placement, request_id: str) -> None:
        """The request ended on its decode worker (idempotent; its prefill share too, if still held)."""
        self.fleet.release(p.decode, request_id)
        if p.prefill is not None:
            self.fleet.release_prefill(p.prefill, request_id)
        self.wake()

    def prefill_done(self, prefill: str, request_id: str) -> None:
        """Its prefill answered: the prefill worker can take the next request."""
        if self.fleet.release_prefill(prefill, request_id):
            self.wake()

    def wake(self) -> None:
        """Place waiters in order while the head fits."""
        while self._heap:
            t = self._heap[0]
            assert t.fut is not None
            if t.fut.done():  # abandoned: already settled
                heapq.heappop(self._heap)
                continue
            try:
                p = self._place(t)
            except AdmissionRejected as e:
                self._blocked = _reason(e)
                return  # the head waits for room (or a late worker); nobody overtakes it
            except TandemError as e:  # a needed role has no live and no late worker, or too large for any
                heapq.heappop(self._heap)
                self._settle(t)
                t.fut.set_exception(e)
                continue
            heapq.heappop(self._heap)
            self._settle(t)
            t.fut.set_result(p)

"""The admission queue (router/admission.py) against a fleet whose worker status we set by hand:
requests wait for room instead of failing, leave in (priority, arrival) order when room appears,
are bounded by count and by wait (429 with Retry-After), leave the queue when cancelled, a
burst between two polls is held to the worker's slots by the router-side reservations, and a
worker marked down for missed polls is waited for within the grace period (503 after it)."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

from common.errors import WorkerUnavailable
from router.fleet import MISSES_TO_DOWN
from router.admission import AdmissionQueue, Ticket
from router.errors import QueueFull
from router.fleet import Discovery, Fleet, WorkerState
from router.metrics import RouterMetrics
from router.placement import Placement
from wire.protocol import WorkerStatus


def status(running=0, queue=0, free=1000, max_seqs=4, ready=True) -> WorkerStatus:
    return WorkerStatus(role="decode", worker_id="d", epoch=1, ready=ready, draining=False, queue_depth=queue,
                        queued_tokens=0, running=running, kv_free_pages=free, kv_total_pages=1000,
                        kv_free_sliding_pages=100, kv_total_sliding_pages=100, page_size=16, max_num_seqs=max_seqs,
                        busy_seconds=0.0)


def make(max_queued=8, max_wait_s=5.0, grace_s=30.0, **st) -> tuple[AdmissionQueue, Fleet]:
    fleet = Fleet(Discovery(decode=["d1"]), ctx=None, worker_grace_s=grace_s)  # type: ignore[arg-type]  # no sockets
    client = SimpleNamespace(last_disconnect=-math.inf)  # what liveness reads of the connection
    fleet.workers["d1"] = WorkerState(client=client, status=status(**st), last_ok=time.monotonic())  # type: ignore[arg-type]
    fleet.roles["d1"] = "decode"
    return AdmissionQueue(fleet, RouterMetrics(), max_queued=max_queued, max_wait_s=max_wait_s), fleet


def poll(fleet: Fleet, **st) -> None:
    """What Fleet._poll_one does with a fresh answer, then the on_poll wake-up."""
    w = fleet.workers["d1"]
    w.status, w.events, w.full_until_poll = status(**st), [], False
    for fn in fleet.on_poll:
        fn()


def test_a_burst_is_held_to_the_free_slots_then_leaves_in_priority_order():
    async def main():
        q, fleet = make(max_seqs=2)
        # 2 slots: the first two are placed at once (reservations count before any poll), the rest wait
        tickets = [Ticket(f"r{i}", 10, 4, priority=p) for i, p in enumerate([0, 0, 5, 0, -1, 5])]
        tasks = [asyncio.create_task(q.admit(t)) for t in tickets]
        await asyncio.sleep(0.01)
        assert [t.done() for t in tasks] == [True, True, False, False, False, False] and q.depth == 4
        order = []
        for _ in range(4):  # one request ends: its slot goes to the best waiter
            ended = next(t.request_id for t in tickets if tasks[tickets.index(t)].done() and t.request_id not in order)
            order.append(ended)
            q.release(Placement("d1", None), ended)
            await asyncio.sleep(0.01)
        placed = [t.request_id for t in tickets[2:] if tasks[tickets.index(t)].done()]
        assert sorted(placed) == ["r2", "r3", "r4", "r5"]
        # priority -1 first, then 0, then the two 5s in arrival order
        waits = {t.request_id: t.waited_s for t in tickets}
        assert waits["r4"] < waits["r3"] < waits["r2"] < waits["r5"]
        assert q.depth == 0 and all(t.done() and t.result().decode == "d1" for t in tasks)

    asyncio.run(main())


def test_a_poll_wakes_waiters_and_reservations_outlive_a_stale_status():
    async def main():
        q, fleet = make(max_seqs=2, running=2)  # full on the last poll
        task = asyncio.create_task(q.admit(Ticket("r", 10, 4)))
        await asyncio.sleep(0.01)
        assert not task.done()
        poll(fleet, running=0)  # room appeared: the poll wakes the waiter
        await asyncio.sleep(0.01)
        assert task.done()
        # an older-looking status (0 running) does not hide our own live request: 1 of 2 slots left
        poll(fleet, running=0)
        assert fleet.snapshot().decode[0].running == 1
        q.release(Placement("d1", None), "r")
        assert fleet.snapshot().decode[0].running == 0

    asyncio.run(main())


def test_bounds_by_count_and_by_wait_give_429_with_retry_after():
    async def main():
        q, _ = make(max_queued=2, max_wait_s=0.2, running=4)  # no room at all
        waiting = [asyncio.create_task(q.admit(Ticket(f"w{i}", 10, 4))) for i in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull, match="queue is full") as full:
            await q.admit(Ticket("x", 10, 4))
        assert full.value.http_status == 429 and int(full.value.headers["Retry-After"]) >= 1
        for t in waiting:
            with pytest.raises(QueueFull, match="wait bound"):
                await t
        assert q.depth == 0

    asyncio.run(main())


def test_cancelled_waiters_leave_the_queue_and_no_worker_is_503():
    async def main():
        q, fleet = make(max_seqs=1, running=1)
        a = asyncio.create_task(q.admit(Ticket("a", 10, 4)))
        b = asyncio.create_task(q.admit(Ticket("b", 10, 4)))
        await asyncio.sleep(0.01)
        a.cancel()  # the client left while queued
        await asyncio.sleep(0.01)
        assert q.depth == 1
        poll(fleet, running=0)
        await asyncio.sleep(0.01)
        assert b.done() and b.result().decode == "d1" and q.depth == 0
        # no live decode worker: a queued request fails with 503, it does not wait for the bound
        q.release(Placement("d1", None), "b")
        poll(fleet, running=1, max_seqs=1)
        c = asyncio.create_task(q.admit(Ticket("c", 10, 4)))
        await asyncio.sleep(0.01)
        poll(fleet, ready=False)
        with pytest.raises(WorkerUnavailable):
            await c

    asyncio.run(main())


def miss(fleet: Fleet, disconnected: bool = False) -> None:
    """What Fleet._poll_one does when the worker misses its polls until it is marked down."""
    w = fleet.workers["d1"]
    w.misses = MISSES_TO_DOWN
    if disconnected:
        w.client.last_disconnect = time.monotonic()
    for fn in fleet.on_poll:
        fn()


def test_a_late_worker_is_waited_for_then_placed_or_503_after_the_grace():
    async def main():
        q, fleet = make(grace_s=0.3)
        miss(fleet)  # marked down, answered ready just now: late
        a = asyncio.create_task(q.admit(Ticket("a", 10, 4)))
        b = asyncio.create_task(q.admit(Ticket("b", 10, 4)))
        await asyncio.sleep(0.01)
        assert not a.done() and not b.done() and q.depth == 2
        assert q.metrics.router_queued.labels("worker_late")._value.get() == 2
        a.cancel()  # a client that leaves while waiting for a late worker still leaves the queue
        await asyncio.sleep(0.01)
        assert q.depth == 1
        w = fleet.workers["d1"]
        w.misses, w.last_ok = 0, time.monotonic()  # it answered again: placed
        poll(fleet)
        await asyncio.sleep(0.01)
        assert b.done() and b.result().decode == "d1" and q.depth == 0
        # silent past the grace period: the next poll's wake-up ends the waiter with 503
        q.release(b.result(), "b")
        miss(fleet)
        c = asyncio.create_task(q.admit(Ticket("c", 10, 4)))
        await asyncio.sleep(0.05)
        miss(fleet)
        assert not c.done()
        await asyncio.sleep(0.3)
        miss(fleet)
        with pytest.raises(WorkerUnavailable, match="no decode worker"):
            await c
        assert q.depth == 0

    asyncio.run(main())


def test_a_dropped_connection_or_a_late_wait_past_the_bound_end_it():
    async def main():
        q, fleet = make(max_wait_s=0.2)
        miss(fleet, disconnected=True)  # the process exited: gone at once, no wait
        with pytest.raises(WorkerUnavailable):
            await q.admit(Ticket("a", 10, 4))
        q, fleet = make(max_wait_s=0.2)
        miss(fleet)
        with pytest.raises(QueueFull, match="no worker of a needed role answered"):  # the queue's own bound: 429
            await q.admit(Ticket("b", 10, 4))
        assert q.depth == 0

    asyncio.run(main())

"""The router's view of its workers: discovery (static flags or a Kubernetes headless Service
resolved through DNS), status polling with deadlines, and router-side load accounting between polls.

Loop: every poll interval, ask each worker for WorkerStatus (deadline = 2 x interval, >= 1 s); three
misses in a row mark it down and fail its in-flight requests at once; an answer marks it up again
(a worker restarted on the same address: the DEALER reconnects by itself, the first answered poll
takes it back, and the requests of its previous epoch already failed when the connection dropped). A
poll that times out while the worker sent something since the previous poll (token chunks, a late
status reply; also what a starved router finds queued when it wakes) is not a miss: slow is not
gone. A worker marked down stays "late" for --worker-grace-s after its last answer
(placement.is_late): requests wait in the admission queue for it instead of failing. `snapshot()`
feeds the pure placement policy. Each poll also carries the worker's prefix-cache events after the
router's cursor into its PrefixIndex (router/prefix_index.py).

Router-side reservations: a burst can place many requests between two polls. Each placement on a
decode worker and each end of one is an event; `snapshot()` applies the events newer than the
poll that produced the worker's last status (sequence slots and prompt pages), and never shows
fewer slots or pages taken than this router's own live requests hold. A decode worker that
answered Rejected is shown full until its next poll. After every poll round `on_poll` callbacks
run (the admission queue wakes its waiters).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq.asyncio

from router.placement import FleetSnapshot, WorkerView, is_late
from router.prefix_index import PrefixIndex, PromptHashes
from wire.protocol import WorkerStatus
from router.worker_client import WorkerClient

log = logging.getLogger("tandem.router.fleet")
MISSES_TO_DOWN = 3
MIN_STATUS_TIMEOUT_S = 1.0  # a loaded host can be slow to answer; liveness, not latency


@dataclass(slots=True)
class WorkerState:
    client: WorkerClient
    status: WorkerStatus | None = None
    misses: int = 0
    pending: dict[str, int] = field(default_factory=dict)  # prefill: this router's requests placed here, not
    # yet answered -> prompt tokens (from placement on: a burst sees what it already sent)
    last_poll: float = 0.0  # monotonic time the previous status poll was sent
    last_ok: float = -math.inf  # monotonic time of the last answered status poll
    live: dict[str, int] = field(default_factory=dict)  # decode: this router's requests -> prompt pages
    # (event no, +1 placed / -1 ended, pages, prompt tokens the worker prefills itself: local placements)
    events: list[tuple[int, int, int, int]] = field(default_factory=list)
    next_event: int = 0
    full_until_poll: bool = False  # answered Rejected: no room until a fresh status says otherwise
    prefix: PrefixIndex = field(default_factory=PrefixIndex)

    @property
    def healthy(self) -> bool:
        return self.status is not None and self.misses < MISSES_TO_DOWN

    def late(self, now: float, grace_s: float) -> bool:
        s = self.status
        return is_late(healthy=self.healthy, was_ready=bool(s and s.ready and not s.draining),
                       answered_ago_s=now - self.last_ok, disconnected=self.client.last_disconnect > self.last_ok,
                       grace_s=grace_s)


@dataclass(slots=True)
class Discovery:
    """Static addresses, or DNS names of headless Services (`host:port`, all A records used)."""

    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    dns: bool = False

    def resolve(self) -> tuple[list[str], list[str]]:
        if not self.dns:
            return self.prefill, self.decode
        return _resolve_all(self.prefill), _resolve_all(self.decode)


def _resolve_all(names: list[str]) -> list[str]:
    out = []
    for name in names:
        host, port = name.removeprefix("tcp://").rsplit(":", 1)
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror:
            continue  # no endpoints yet (pods starting): the next refresh retries
        out += sorted({f"tcp://{i[4][0]}:{port}" for i in infos})
    return out


class Fleet:
    def __init__(self, discovery: Discovery, ctx: zmq.asyncio.Context, poll_interval_s: float = 1.0,
                 worker_grace_s: float = 30.0) -> None:
        self.discovery, self.ctx, self.interval, self.grace_s = discovery, ctx, poll_interval_s, worker_grace_s
        self.workers: dict[str, WorkerState] = {}
        self.roles: dict[str, str] = {}
        self._task: asyncio.Task | None = None
        self.first_poll = asyncio.Event()
        self.on_poll: list[Callable[[], None]] = []

    # ---- router-side reservations on decode workers ------------------------------------------
    def reserve(self, address: str, request_id: str, pages: int, local_tokens: int = 0) -> None:
        """A placement on decode worker `address`: `pages` reserved there, `local_tokens` of the
        prompt it prefills itself (0 when a prefill worker computes them)."""
        st = self.workers.get(address)
        if st is None:
            return
        st.live[request_id] = pages
        st.events.append((st.next_event, 1, pages, local_tokens))
        st.next_event += 1

    def release(self, address: str, request_id: str) -> None:
        st = self.workers.get(address)
        if st is None or request_id not in st.live:
            return
        pages = st.live.pop(request_id)
        st.events.append((st.next_event, -1, pages, 0))
        st.next_event += 1

    def reserve_prefill(self, address: str, request_id: str, tokens: int) -> None:
        st = self.workers.get(address)
        if st is not None:
            st.pending[request_id] = tokens

    def release_prefill(self, address: str, request_id: str) -> bool:
        st = self.workers.get(address)
        return st is not None and st.pending.pop(request_id, None) is not None

    def mark_full(self, address: str) -> None:
        st = self.workers.get(address)
        if st is not None:
            st.full_until_poll = True

    def client(self, address: str) -> WorkerClient:
        return self.workers[address].client

    def state(self, address: str) -> WorkerState:
        return self.workers[address]

    async def start(self) -> None:
        self._refresh_members()
        self._task = asyncio.get_running_loop().create_task(self._poll_loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for w in self.workers.values():
            await w.client.close()

    def _refresh_members(self) -> None:
        prefill, decode = self.discovery.resolve()
        want = {a: "prefill" for a in prefill} | {a: "decode" for a in decode}
        for addr, role in want.items():
            if addr not in self.workers:
                c = WorkerClient(addr, role, self.ctx)
                c.start()
                self.workers[addr] = WorkerState(c)
                self.roles[addr] = role
        for addr in [a for a in self.workers if a not in want]:
            st = self.workers.pop(addr)
            st.client.fail_all("removed from discovery")
            asyncio.get_running_loop().create_task(st.client.close())
            self.roles.pop(addr, None)

    async def _poll_one(self, addr: str, st: WorkerState) -> None:
        since, st.last_poll = st.last_poll, time.monotonic()  # heard from it since the previous poll?
        mark = st.next_event  # events before this are taken as reflected in the answer
        timeout_s = max(MIN_STATUS_TIMEOUT_S, 2 * self.interval)
        try:
            old, st.status = st.status, await st.client.status(timeout_s, st.prefix.cursor)
            if old is not None and old.epoch != st.status.epoch:  # its requests failed when the connection dropped
                log.warning("%s worker %s restarted (epoch %d -> %d)", st.client.role, addr, old.epoch, st.status.epoch)
            st.prefix.apply(st.status)
            st.events = [e for e in st.events if e[0] >= mark]
            st.full_until_poll = False
            if st.misses >= MISSES_TO_DOWN:
                log.info("%s worker %s is back (epoch %d)", st.client.role, addr, st.status.epoch)
            st.misses, st.last_ok = 0, time.monotonic()
            st.client.mark_alive()
        except asyncio.TimeoutError:
            # A router whose own loop was starved (a burst of requests to render) sees the deadline
            # fire before it reads replies already in the socket: read them, and do not blame a
            # worker for a deadline that fired late.
            await asyncio.sleep(0.05)
            if st.client.last_heard >= since:
                return  # slow, not gone: it streamed tokens or answered the last poll late (a loaded host)
            if time.monotonic() - st.last_poll > 1.25 * timeout_s + 0.05:
                return  # the deadline fired late: the router was stalled, not (necessarily) the worker
            st.misses += 1
            if st.misses == MISSES_TO_DOWN:
                log.warning("%s worker %s missed %d status polls: marking it down", st.client.role, addr, st.misses)
                st.client.fail_all("no status answer")

    async def _poll_loop(self) -> None:
        n = 0
        while True:
            if self.discovery.dns and n % 10 == 0:
                self._refresh_members()
            await asyncio.gather(*(self._poll_one(a, s) for a, s in list(self.workers.items())))
            self.first_poll.set()
            for fn in self.on_poll:
                fn()
            n += 1
            await asyncio.sleep(self.interval)

    def context_limit(self) -> int | None:
        """The most tokens (prompt + output) a sequence may reach on any ready decode worker: the smaller of
        its max_model_len and its whole KV cache, over the workers; None until one has said."""
        limits = []
        for addr, st in self.workers.items():
            s = st.status
            if self.roles[addr] == "decode" and st.healthy and s is not None and s.ready and s.max_model_len > 0:
                kv = s.kv_total_pages * s.page_size
                limits.append(min(s.max_model_len, kv) if kv > 0 else s.max_model_len)
        return min(limits) if limits else None

    def snapshot(self) -> FleetSnapshot:
        views: dict[str, list[WorkerView]] = {"prefill": [], "decode": []}
        now = time.monotonic()
        for addr, st in self.workers.items():
            s = st.status
            if self.roles[addr] == "decode":
                views["decode"].append(self._decode_view(addr, st, st.late(now, self.grace_s)))
                continue
            # the status counts what waits on the worker (others' too); ours counts what we sent that
            # it may not have seen yet, and the one it runs: the larger is the better estimate
            views["prefill"].append(WorkerView(
                address=addr, healthy=st.healthy, ready=bool(s and s.ready and not s.draining),
                queue_depth=max(s.queue_depth if s else 0, len(st.pending)),
                queued_tokens=max(s.queued_tokens if s else 0, sum(st.pending.values())),
                running=s.running if s else 0, kv_free_pages=s.kv_free_pages if s else 0,
                page_size=s.page_size if s else 16, max_num_seqs=s.max_num_seqs if s else 0,
                late=st.late(now, self.grace_s)))
        return FleetSnapshot(tuple(views["prefill"]), tuple(views["decode"]))

    @staticmethod
    def _decode_view(addr: str, st: WorkerState, late: bool) -> WorkerView:
        s = st.status
        if s is None:
            return WorkerView(addr, st.healthy, False, 0, 0, 0, 0, 16, 0)
        seqs = s.running + s.queue_depth + sum(kind for _, kind, _, _ in st.events)
        free = s.kv_free_pages - sum(kind * pages for _, kind, pages, _ in st.events)
        # prompt tokens placed here to prefill locally since the poll: a burst sees its own backlog
        queued = s.queued_tokens + sum(tokens for _, _, _, tokens in st.events)
        # Our own live requests are certainly there, whatever an older status says.
        seqs = max(seqs, len(st.live))
        free = min(free, s.kv_total_pages - sum(st.live.values()))
        if st.full_until_poll:
            seqs = s.max_num_seqs
        return WorkerView(address=addr, healthy=st.healthy, ready=s.ready and not s.draining,
                          queue_depth=s.queue_depth, queued_tokens=queued, running=max(seqs, 0),
                          kv_free_pages=max(free, 0), page_size=s.page_size, max_num_seqs=s.max_num_seqs,
                          kv_total_pages=s.kv_total_pages, cached_pages=s.cached_pages, late=late)

    def prefix_matches(self, hashes: PromptHashes, num_tokens: int) -> dict[str, int]:
        """address -> prompt tokens that worker's prefix cache holds (as the router knows it)."""
        out = {}
        for addr, st in self.workers.items():
            if st.healthy and st.prefix.enabled:
                m = st.prefix.match(hashes.of(st.prefix), num_tokens)
                if m:
                    out[addr] = m
        return out

    def predict(self, address: str, hashes: PromptHashes, tokens: list[int], num_valid: int) -> None:
        """A request ended on `address`: what it is about to cache there (until its events say)."""
        st = self.workers.get(address)
        if st is not None and st.prefix.enabled:
            st.prefix.predict(hashes.of(st.prefix, tokens), num_valid)

    def prefix_evictions(self) -> dict[str, int]:
        """role -> pages the workers of that role reported evicted (since the router knew them)."""
        out = {"prefill": 0, "decode": 0}
        for addr, st in self.workers.items():
            out[self.roles[addr]] += st.prefix.evicted
        return out

    def liveness_counts(self) -> dict[tuple[str, str], int]:
        """(phase, live | late | gone) -> workers (for /metrics); live = healthy and ready."""
        out = {(phase, state): 0 for phase in ("prefill", "decode") for state in ("live", "late", "gone")}
        snap = self.snapshot()
        for v in (*snap.prefill, *snap.decode):
            state = "live" if v.healthy and v.ready else "late" if v.late else "gone"
            out[(self.roles[v.address], state)] += 1
        return out

    def phase_gauges(self) -> dict[str, tuple[float, float, float]]:
        """phase -> (queue depth, KV usage ratio, running) summed over live workers (for /metrics).
        A phase with no live worker reports NaN: unknown, not idle (the autoscaler must not shrink it)."""
        out: dict[str, tuple[float, float, float]] = {}
        for phase in ("prefill", "decode"):
            sts = [st.status for a, st in self.workers.items() if self.roles[a] == phase and st.healthy and st.status]
            if not sts:
                out[phase] = (math.nan, math.nan, math.nan)
                continue
            total = sum(s.kv_total_pages for s in sts)
            free = sum(s.kv_free_pages for s in sts)
            out[phase] = (sum(s.queue_depth for s in sts), (1 - free / total) if total else 0.0,
                          sum(s.running for s in sts))
        return out

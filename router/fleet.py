"""The router's view of its workers: discovery (static flags or a Kubernetes headless Service
resolved through DNS), status polling with deadlines, and router-side load accounting between polls.

Loop: every poll interval, ask each worker for WorkerStatus (deadline = 2 x interval, >= 1 s); three
misses in a row mark it down and fail its in-flight requests at once; an answer marks it up again. A
poll that times out while the worker sent something since the previous poll (token chunks, a late
status reply; also what a starved router finds queued when it wakes) is not a miss: slow is not
gone. `snapshot()` feeds the pure placement policy. Each poll also carries the worker's prefix-cache
events after the router's cursor into its PrefixIndex (router/prefix_index.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from dataclasses import dataclass, field

import zmq.asyncio

from router.placement import FleetSnapshot, WorkerView
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
    pending_tokens: int = 0  # prompt tokens sent to this prefill worker, not yet answered
    pending_requests: int = 0
    last_poll: float = 0.0  # monotonic time the previous status poll was sent
    prefix: PrefixIndex = field(default_factory=PrefixIndex)

    @property
    def healthy(self) -> bool:
        return self.status is not None and self.misses < MISSES_TO_DOWN


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
    def __init__(self, discovery: Discovery, ctx: zmq.asyncio.Context, poll_interval_s: float = 1.0) -> None:
        self.discovery, self.ctx, self.interval = discovery, ctx, poll_interval_s
        self.workers: dict[str, WorkerState] = {}
        self.roles: dict[str, str] = {}
        self._task: asyncio.Task | None = None
        self.first_poll = asyncio.Event()

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
        try:
            st.status = await st.client.status(max(MIN_STATUS_TIMEOUT_S, 2 * self.interval), st.prefix.cursor)
            st.prefix.apply(st.status)
            if st.misses >= MISSES_TO_DOWN:
                log.info("%s worker %s is back (epoch %d)", st.client.role, addr, st.status.epoch)
            st.misses = 0
            st.client.mark_alive()
        except asyncio.TimeoutError:
            if st.client.last_heard >= since:
                return  # slow, not gone: it streamed tokens or answered the last poll late (a loaded host)
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
            n += 1
            await asyncio.sleep(self.interval)

    def snapshot(self) -> FleetSnapshot:
        views: dict[str, list[WorkerView]] = {"prefill": [], "decode": []}
        for addr, st in self.workers.items():
            s = st.status
            views[self.roles[addr]].append(WorkerView(
                address=addr, healthy=st.healthy, ready=bool(s and s.ready and not s.draining),
                queue_depth=(s.queue_depth if s else 0) + st.pending_requests,
                queued_tokens=(s.queued_tokens if s else 0) + st.pending_tokens,
                running=s.running if s else 0, kv_free_pages=s.kv_free_pages if s else 0,
                page_size=s.page_size if s else 16, max_num_seqs=s.max_num_seqs if s else 0))
        return FleetSnapshot(tuple(views["prefill"]), tuple(views["decode"]))

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

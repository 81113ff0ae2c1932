"""Async RPC to one worker over ZMQ (DEALER -> the worker's ROUTER), with deadlines everywhere.

One socket per worker; a background task receives every frame and routes it: replies to the future
waiting on (kind, request_id), TokenChunks (one TokenBatch per decode step) to each request's stream
queue, status to the poller. A stream that hears nothing for its stall deadline gets WorkerUnavailable
from a watchdog (one timer per client, not one per token: a `wait_for` per token cost a task and a
timer each, for ~60 streams per decode step).

First tokens first: a decode step's batch carries new requests' first tokens beside ~60 running
streams' next ones. A running stream's token takes two event-loop iterations to its socket, a first
token seven (the request's task ends, the handler returns the StreamingResponse, Starlette starts its
writer tasks, the stream pump starts), so in arrival order a first token left only after the whole
step's other events. The receive loop hands first chunks to their streams and lets the loop run until
each of them is out (`Stream.sent_first`, set by the HTTP layer) or FIRST_TOKEN_MAX_HOPS iterations
passed, then hands out the rest. On the CPU machine, 64 streams at 15 ms steps: first token's worker
-> client 3.5 -> 0.9 ms p50 (`benchmarks/router_stream.py`).
When the fleet marks a worker dead, `fail_all` wakes every waiter with WorkerUnavailable, so no
client request outlives its worker by more than one poll interval. A dropped connection (the worker
process died or restarted: its kernel closes the socket) fails the in-flight requests at once: a
reconnected DEALER is a new peer to the worker, which could never answer them. The DEALER keeps
reconnecting every RECONNECT_IVL, so a worker restarted on the same address serves new requests
as soon as it is up (the fleet marks it live again at its next answered poll).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
import typing

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from common.errors import ProtocolError, WorkerUnavailable
from wire.protocol import (
    MAX_FRAME_BYTES,
    Ack,
    Admitted,
    PrefillResult,
    Rejected,
    StatusRequest,
    TokenBatch,
    TokenChunk,
    WorkerStatus,
    decode,
    encode,
)

log = logging.getLogger("tandem.router.client")

_REPLIES = (Admitted, Rejected, PrefillResult, Ack)
RECONNECT_IVL_MS = 100  # a restarted worker is reached again within this of binding its port
# Loop iterations the other chunks wait at most for first tokens to go out (7 measured); 0 = no priority (the A/B).
FIRST_TOKEN_MAX_HOPS = int(os.environ.get("TANDEM_ROUTER_FIRST_TOKEN_HOPS", "16"))


class FirstOut(typing.Protocol):
    first_out: bool  # the request's first token was handed to its HTTP writer


class Stream:
    """One request's token stream: its queue, when it last heard from the worker, its stall deadline."""

    __slots__ = ("queue", "heard", "stall_s", "fresh", "stalled", "out")

    def __init__(self, stall_s: float, out: FirstOut | None) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.heard, self.stall_s, self.out = time.monotonic(), stall_s, out  # stall_s inf: not armed yet
        self.fresh, self.stalled = True, False  # fresh: no chunk yet (the next one is its first token)

    def sent_first(self) -> bool:
        return self.out is None or self.out.first_out


class WorkerClient:
    def __init__(self, address: str, role: str, ctx: zmq.asyncio.Context) -> None:
        self.address, self.role = address, role
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 10_000)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # larger frames drop the connection
        self.sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MS)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)
        self._pending: dict[str, asyncio.Future] = {}
        self._streams: dict[str, Stream] = {}
        self._status: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self._monitor_task: asyncio.Task | None = None
        self._watchdog_task: asyncio.Task | None = None
        self._dead_reason = ""
        self.last_heard = -math.inf  # monotonic time of the last frame from the worker, of any kind
        self.last_disconnect = -math.inf  # monotonic time the connection last dropped (the process exited)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._recv_loop())
        self._monitor_task = loop.create_task(self._watch_connection())
        self._watchdog_task = loop.create_task(self._watch_streams())

    async def close(self) -> None:
        for task in (self._task, self._monitor_task, self._watchdog_task):
            if task:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.sock.disable_monitor()
        self._monitor.close(0)
        self.sock.close(0)

    async def _watch_connection(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                log.warning("connection to %s worker %s lost", self.role, self.address)
                self.last_disconnect = time.monotonic()
                self.fail_in_flight("connection lost (the worker exited or restarted)")

    async def _recv_loop(self) -> None:
        while True:
            data = await self.sock.recv()
            try:
                msg = decode(data)
            except ProtocolError as e:
                log.error("bad frame from %s: %s", self.address, e)
                continue
            self.last_heard = time.monotonic()  # liveness: token chunks and late status replies count
            if isinstance(msg, TokenBatch):
                await self._deliver(msg.chunks)
            elif isinstance(msg, TokenChunk):
                await self._deliver([msg])
            elif isinstance(msg, WorkerStatus):
                if self._status is not None and not self._status.done():
                    self._status.set_result(msg)
            elif isinstance(msg, _REPLIES):
                fut = self._pending.pop(msg.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    async def _deliver(self, chunks: list[TokenChunk]) -> None:
        now = self.last_heard
        later: list[tuple[Stream, TokenChunk]] = []
        first: list[Stream] = []
        for chunk in chunks:
            s = self._streams.get(chunk.request_id)
            if s is None:
                continue
            s.heard = now
            if s.fresh:
                s.fresh = False
                s.queue.put_nowait(chunk)
                if not s.sent_first():
                    first.append(s)
            else:
                later.append((s, chunk))
        if later:  # the first tokens reach their sockets before the step's other events start
            for _ in range(FIRST_TOKEN_MAX_HOPS if first else 0):
                await asyncio.sleep(0)
                if all(s.sent_first() for s in first):
                    break
        for s, chunk in later:
            s.queue.put_nowait(chunk)

    async def _watch_streams(self) -> None:
        """Wake a stream whose worker sent nothing for its stall deadline (checked at a tenth of the
        shortest deadline, at most every second)."""
        while True:
            period = min((s.stall_s for s in self._streams.values()), default=10.0) / 10
            await asyncio.sleep(min(max(period, 0.01), 1.0))
            now = time.monotonic()
            for s in list(self._streams.values()):
                if not s.stalled and now - s.heard > s.stall_s:
                    s.stalled = True
                    s.queue.put_nowait(WorkerUnavailable(f"{self.role} worker {self.address} sent nothing for "
                                                         f"{s.stall_s:g} s"))

    async def send(self, msg: object) -> None:
        await self.sock.send(encode(msg))

    async def call(self, msg: object, request_id: str, timeout_s: float) -> object:
        """Send a request and wait for its reply (any of Admitted/Rejected/PrefillResult/Ack)."""
        if self._dead_reason:
            raise WorkerUnavailable(f"{self.role} worker {self.address} is down: {self._dead_reason}")
        fut = asyncio.get_running_loop().create_future()
        self._pending[request_id] = fut
        try:
            await self.send(msg)
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise WorkerUnavailable(f"{self.role} worker {self.address} did not answer within {timeout_s:.0f} s") from None
        finally:
            self._pending.pop(request_id, None)

    def open_stream(self, request_id: str, stall_s: float = math.inf, out: FirstOut | None = None) -> asyncio.Queue:
        """The queue of this request's chunks; WorkerUnavailable arrives in it when the worker sends
        nothing for stall_s from now (or from `arm_stream`), or is lost. `out`: whose first_out says its
        first token is out (streams; None: no first-token priority)."""
        s = self._streams[request_id] = Stream(stall_s, out)
        return s.queue

    def arm_stream(self, request_id: str, stall_s: float) -> None:
        """Start the stream's stall deadline now: a stream opened before a remote prefill must not count
        the prefill (which has its own, longer deadline) as the decode worker's silence."""
        s = self._streams.get(request_id)
        if s is not None:
            s.heard, s.stall_s, s.stalled = time.monotonic(), stall_s, False

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def status(self, timeout_s: float, cache_cursor: int = -1) -> WorkerStatus:
        self._status = asyncio.get_running_loop().create_future()
        await self.send(StatusRequest(cache_cursor))
        try:
            return await asyncio.wait_for(self._status, timeout_s)
        finally:
            self._status = None

    def mark_alive(self) -> None:
        self._dead_reason = ""

    def fail_all(self, reason: str) -> None:
        """The worker is gone: wake every waiter now instead of at its deadline, and refuse new
        calls until it answers a status poll again (mark_alive)."""
        self._dead_reason = reason
        self.fail_in_flight(reason)

    def fail_in_flight(self, reason: str) -> None:
        """Wake every request in flight on this worker with WorkerUnavailable."""
        err = WorkerUnavailable(f"{self.role} worker {self.address} is down: {reason}")
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        for s in self._streams.values():
            s.queue.put_nowait(err)

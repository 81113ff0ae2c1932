"""A worker's network side, on its own thread, so a long forward pass never makes it look dead.

The I/O thread owns the ZMQ ROUTER socket the router talks to. It answers StatusRequest itself from
the snapshot the worker loop publishes (status_fn(request): the prefix-cache events after the
requester's cursor are added per request), hands every other message to the loop through `inbox`, and
sends what the loop puts in the outbox (an inproc PUSH/PULL pair, the thread-safe way into ZMQ).

    io = WorkerIO("tcp://0.0.0.0:7200", status_fn)
    io.start()
    for peer, msg in io.drain(timeout_s): ...   # worker loop
    io.send(peer, TokenChunk(...))

The GIL: the loop holds it while it launches a step (Python: 2-20 ms on a GPU worker), and every message in
either direction needs this thread to run. CPython hands the GIL to a waiting thread only after its switch
interval, 5 ms by default, so each hop of a request's first token could wait up to that long; `start` sets it
to IO_SWITCH_INTERVAL_S (benchmarks/router_stream.py --launch-ms measures the hop with a launch-like loop).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable

import zmq

from common.errors import ProtocolError
from common.stall import StallWatch
from wire.protocol import MAX_FRAME_BYTES, StatusRequest, WorkerStatus, decode, encode

log = logging.getLogger("tandem.worker.io")
# The GIL's hand-over wait for this thread (CPython's default: 0.005); TANDEM_IO_SWITCH_INTERVAL_MS for the A/B.
IO_SWITCH_INTERVAL_S = float(os.environ.get("TANDEM_IO_SWITCH_INTERVAL_MS", "0.5")) / 1e3


class WorkerIO:
    def __init__(self, bind: str, status_fn: Callable[[StatusRequest], WorkerStatus]) -> None:
        self.bind, self.status_fn = bind, status_fn
        self.ctx = zmq.Context.instance()
        self.inbox: queue.Queue[tuple[bytes, object, float]] = queue.Queue()  # (peer, msg, monotonic arrival)
        self._outbox_addr = f"inproc://outbox-{uuid.uuid4().hex}"
        self._push = self.ctx.socket(zmq.PUSH)
        self._push.bind(self._outbox_addr)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-io", daemon=True)
        self._ready = threading.Event()
        self._error: Exception | None = None
        self.bad_frames = 0
        self._last_bad_log = -1.0

    def start(self) -> None:
        sys.setswitchinterval(IO_SWITCH_INTERVAL_S)  # process-wide: this thread is why the process has threads
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._push.close(0)

    def send(self, peer: bytes, msg: object) -> None:
        """Called from the worker loop thread only."""
        self._push.send_multipart([peer, encode(msg)])

    def drain(self, timeout_s: float) -> list[tuple[bytes, object]]:
        """Every message that arrived; waits up to timeout_s for the first when there is none."""
        return [(peer, msg) for peer, msg, _ in self.drain_timed(timeout_s)]

    def drain_timed(self, timeout_s: float) -> list[tuple[bytes, object, float]]:
        """drain() with each message's arrival time (time.monotonic() when this thread received it:
        the loop picks messages up between steps, and a request's wait counts from here)."""
        out = []
        try:
            out.append(self.inbox.get(timeout=timeout_s) if timeout_s > 0 else self.inbox.get_nowait())
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def _dropped(self, why: str) -> None:
        """A malformed frame: dropped, counted, logged at most once a second (a flood must not
        become a flood of log lines)."""
        self.bad_frames += 1
        now = time.monotonic()
        if now - self._last_bad_log >= 1.0:
            log.warning("dropped a malformed frame (%d so far): %s", self.bad_frames, why)
            self._last_bad_log = now

    def _run(self) -> None:
        try:
            self._serve()
        except Exception:  # a bug: without this thread the worker is alive but deaf; end it loudly
            log.exception("the worker's network thread failed; exiting so the supervisor restarts it")
            os._exit(70)  # EX_SOFTWARE

    def _serve(self) -> None:
        try:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished router: drop, don't block
            # A frame over the protocol's bound drops the sender's connection (ZMQ checks the declared
            # size before buffering it); the router's DEALER reconnects by itself.
            router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            router.bind(self.bind)
            pull = self.ctx.socket(zmq.PULL)
            pull.connect(self._outbox_addr)
        except zmq.ZMQError as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        watch = StallWatch("TANDEM_IO_STALL_DUMP_S", repeat=True)
        while not self._stop.is_set():
            watch.tick()
            events = dict(poller.poll(100))
            if pull in events:
                while True:
                    try:
                        peer, data = pull.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    router.send_multipart([peer, data])
            if router in events:
                while True:
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) != 2:  # not [identity, payload]
                        self._dropped(f"a message of {len(frames) - 1} parts")
                        continue
                    peer, data = frames
                    try:
                        msg = decode(data)
                    except ProtocolError as e:
                        self._dropped(e.message)
                        continue
                    if isinstance(msg, StatusRequest):
                        router.send_multipart([peer, encode(self.status_fn(msg))])
                    else:
                        self.inbox.put((peer, msg, time.monotonic()))
        watch.stop()
        router.close(0)
        pull.close(0)

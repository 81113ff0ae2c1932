"""A fake prefill or decode worker on a real ZMQ ROUTER socket, served from a thread: it answers the
router's status polls and request path the way a worker does, with knobs for the failures router tests
need. Used by router tests that run the real router (in-process app or a `tandem router` process).

- `frozen`: it stops reading its socket at all (the connection stays up, as for a process that cannot
  get the CPU);
- `full=True`: its status shows every sequence slot taken (requests wait in the router's queue);
- `stall=True`: a decode worker sends a request's first token and then nothing more for it, while it
  keeps answering status polls (a stuck step loop, not a dead process).
Every decoded message it received is kept in `seen`.
"""

from __future__ import annotations

import threading
import time

import zmq

from wire.protocol import (AdmitRequest, Admitted, GenerateRequest, PrefillRequest, PrefillResult, StartDecode,
                           StatusRequest, TokenChunk, WorkerStatus, decode, encode)

TOKENS = [9906, 11, 1917]  # what the fake decode worker "generates"
MAX_NUM_SEQS = 8


class FakeWorker:
    def __init__(self, role: str, *, full: bool = False, stall: bool = False) -> None:
        self.role, self.full, self.stall = role, full, stall
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.seen: list[object] = []
        self.frozen, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _status(self) -> WorkerStatus:
        return WorkerStatus(role=self.role, worker_id=self.role, epoch=1, ready=True, draining=False, queue_depth=0,
                            queued_tokens=0, running=MAX_NUM_SEQS if self.full else 0, kv_free_pages=1000,
                            kv_total_pages=1000, kv_free_sliding_pages=100, kv_total_sliding_pages=100, page_size=16,
                            max_num_seqs=MAX_NUM_SEQS, busy_seconds=0.0)

    def _answer(self, msg: object) -> object | None:
        if isinstance(msg, StatusRequest):
            return self._status()
        if isinstance(msg, AdmitRequest):
            return Admitted(msg.request_id, 1, b"kv-target")
        if isinstance(msg, PrefillRequest):
            return PrefillResult(msg.request_id, True, TOKENS[0], None, [], "", 0.01, 0, 0.0)
        if isinstance(msg, StartDecode):
            if self.stall:
                return TokenChunk(msg.request_id, TOKENS[1:2], [], [], False, "", "")
            return TokenChunk(msg.request_id, TOKENS[1:], [], [], True, "length", "")
        if isinstance(msg, GenerateRequest):
            if self.stall:
                return TokenChunk(msg.request_id, TOKENS[:1], [], [], False, "", "")
            return TokenChunk(msg.request_id, TOKENS, [], [], True, "length", "")
        return None  # Abort

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.frozen.is_set() or not self.sock.poll(10):
                time.sleep(0.01)
                continue
            peer, data = self.sock.recv_multipart()
            msg = decode(data)
            self.seen.append(msg)
            reply = self._answer(msg)
            if reply is not None:
                self.sock.send_multipart([peer, encode(reply)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)

"""The router's liveness view (router/fleet.py) against fake workers on real ZMQ sockets: a worker
that never answers is marked down within MISSES_TO_DOWN polls and its in-flight requests fail at
once; a worker that answers every status poll too late, or streams tokens without answering, is
clearly alive and is never marked down, so a loaded host does not lose its requests."""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from common.errors import WorkerUnavailable
from router import fleet as fleet_mod
from router.fleet import Discovery, Fleet
from wire.protocol import StatusRequest, TokenChunk, WorkerStatus, decode, encode

LATE_S = 0.75

STATUS = WorkerStatus(role="decode", worker_id="fake", epoch=1, ready=True, draining=False, queue_depth=0,
                      queued_tokens=0, running=0, kv_free_pages=100, kv_total_pages=100, kv_free_sliding_pages=10,
                      kv_total_sliding_pages=10, page_size=16, max_num_seqs=8, busy_seconds=0.0)


async def _fake_worker(sock: zmq.asyncio.Socket, mode: str) -> None:
    """dead: never answers; late: answers each StatusRequest after LATE_S (past its deadline, before
    the next poll); chatty: never answers status but streams a token chunk every 0.2 s."""
    async def reply(peer: bytes) -> None:
        await asyncio.sleep(LATE_S)
        await sock.send_multipart([peer, encode(STATUS)])

    async def chat(peer: bytes) -> None:
        while True:
            await sock.send_multipart([peer, encode(TokenChunk("r", [1], [], [], False, "", ""))])
            await asyncio.sleep(0.2)

    chatting = False
    while True:
        peer, data = await sock.recv_multipart()
        if not isinstance(decode(data), StatusRequest):
            continue
        if mode == "late":
            asyncio.get_running_loop().create_task(reply(peer))
        elif mode == "chatty" and not chatting:
            chatting = True
            asyncio.get_running_loop().create_task(chat(peer))


def test_dead_worker_marked_down_slow_and_busy_workers_kept(monkeypatch):
    # polls every 0.9 s with a 0.6 s deadline: a reply 0.75 s late misses its own poll and comes
    # before the next one, so only "heard since the previous poll" tells it from a dead worker
    monkeypatch.setattr(fleet_mod, "MIN_STATUS_TIMEOUT_S", 0.6)

    async def main() -> dict:
        ctx = zmq.asyncio.Context()
        socks = {}
        for name in ("dead", "late", "chatty"):
            s = ctx.socket(zmq.ROUTER)
            port = s.bind_to_random_port("tcp://127.0.0.1")
            socks[name] = (s, f"tcp://127.0.0.1:{port}")
        tasks = [asyncio.create_task(_fake_worker(s, name)) for name, (s, _) in socks.items()]
        fleet = Fleet(Discovery(decode=[a for _, a in socks.values()]), ctx, poll_interval_s=0.3)
        await fleet.start()
        clients = {name: fleet.client(a) for name, (_, a) in socks.items()}
        waiter = asyncio.create_task(clients["dead"].call(StatusRequest(), "r1", timeout_s=60))  # in flight
        t0, out = time.monotonic(), {"down_after": None}
        while time.monotonic() - t0 < 4.5:
            await asyncio.sleep(0.05)
            if out["down_after"] is None and waiter.done():
                out["down_after"] = time.monotonic() - t0
        out["err"] = waiter.exception() if waiter.done() else None
        out["reasons"] = {name: c._dead_reason for name, c in clients.items()}
        out["misses"] = {name: fleet.state(a).misses for name, (_, a) in socks.items()}
        await fleet.close()
        for t in tasks:
            t.cancel()
        for s, _ in socks.values():
            s.close(0)
        ctx.term()
        return out

    out = asyncio.run(main())
    assert isinstance(out["err"], WorkerUnavailable) and out["reasons"]["dead"] == "no status answer"
    assert out["down_after"] is not None and out["down_after"] < 4.0, out  # 3 polls x 0.9 s
    assert out["reasons"]["late"] == "" and out["reasons"]["chatty"] == "", out
    assert out["misses"]["chatty"] == 0, out


"""router/worker_client.py against a fake worker on a real ZMQ socket: when the worker's socket goes
away (its process died or restarted), requests in flight fail at once with a clear error instead of
at their deadline, and the same client reaches a worker bound again on the same address."""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from common.errors import WorkerUnavailable
from router.worker_client import WorkerClient
from wire.protocol import Ack, StatusRequest, decode, encode


async def _serve_one(sock: zmq.asyncio.Socket) -> None:
    """Answer one request with an Ack for the id it carries (StatusRequest: a fixed id)."""
    peer, data = await sock.recv_multipart()
    assert isinstance(decode(data), StatusRequest)
    await sock.send_multipart([peer, encode(Ack("ping"))])


def test_a_dropped_connection_fails_in_flight_requests_and_the_client_reconnects():
    async def main() -> tuple[float, str, object]:
        ctx = zmq.asyncio.Context()
        worker = ctx.socket(zmq.ROUTER)
        port = worker.bind_to_random_port("tcp://127.0.0.1")
        addr = f"tcp://127.0.0.1:{port}"
        client = WorkerClient(addr, "decode", ctx)
        client.start()
        server = asyncio.create_task(_serve_one(worker))
        assert await client.call(StatusRequest(), "ping", timeout_s=10) == Ack("ping")
        await server
        stream = client.open_stream("r")
        waiting = asyncio.create_task(client.call(StatusRequest(), "never", timeout_s=60))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        worker.close(0)  # the worker process is gone: its kernel closes the connection
        try:
            await asyncio.wait_for(waiting, 5)
            err = ""
        except WorkerUnavailable as e:
            err = e.message
        failed_after = time.monotonic() - t0
        streamed = await asyncio.wait_for(stream.get(), 1)
        restarted = ctx.socket(zmq.ROUTER)  # a new incarnation on the same address
        restarted.bind(addr)
        server = asyncio.create_task(_serve_one(restarted))
        again = await client.call(StatusRequest(), "ping", timeout_s=10)
        await server
        await client.close()
        restarted.close(0)
        ctx.term()
        return failed_after, err, (streamed, again)

    failed_after, err, (streamed, again) = asyncio.run(main())
    assert "connection lost" in err and failed_after < 2.0, (err, failed_after)
    assert isinstance(streamed, WorkerUnavailable)
    assert again == Ack("ping")

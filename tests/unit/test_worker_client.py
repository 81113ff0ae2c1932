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
        stream = client.open_stream("r", 60.0)
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


def test_a_silent_worker_fails_the_stream_at_its_stall_deadline():
    """The stall watchdog (one timer per client) wakes a stream whose worker, still connected, sends
    nothing for its deadline; a stream that hears from the worker in time does not fail; a stream opened
    before a remote prefill counts its deadline from arm_stream (StartDecode), not from its opening."""
    async def main() -> tuple[float, object, bool]:
        ctx = zmq.asyncio.Context()
        worker = ctx.socket(zmq.ROUTER)
        addr = f"tcp://127.0.0.1:{worker.bind_to_random_port('tcp://127.0.0.1')}"
        client = WorkerClient(addr, "decode", ctx)
        client.start()
        t0 = time.monotonic()
        silent = client.open_stream("silent", 0.3)
        patient = client.open_stream("patient", 30.0)
        unarmed = client.open_stream("prefilling")  # a remote prefill runs: no decode deadline yet
        item = await asyncio.wait_for(silent.get(), 5)
        stalled_after = time.monotonic() - t0
        client.arm_stream("prefilling", 0.3)  # StartDecode sent: from now on
        t1 = time.monotonic()
        late = await asyncio.wait_for(unarmed.get(), 5)
        armed_after = time.monotonic() - t1
        await client.close()
        worker.close(0)
        ctx.term()
        return stalled_after, item, patient.empty(), (late, armed_after)

    stalled_after, item, patient_empty, (late, armed_after) = asyncio.run(main())
    assert isinstance(item, WorkerUnavailable) and "sent nothing for" in item.message, item
    assert 0.3 <= stalled_after < 1.5, stalled_after
    assert patient_empty
    assert isinstance(late, WorkerUnavailable) and 0.3 <= armed_after < 1.5, armed_after


class _Out:
    first_out = False


def test_a_steps_first_tokens_go_out_before_its_other_tokens():
    """A batch with a new request's first token holds the running streams' tokens back until the new
    stream's first token is out (its `first_out`), or at most FIRST_TOKEN_MAX_HOPS loop iterations."""
    from router import worker_client as wc
    from wire.protocol import TokenChunk

    def chunk(rid: str) -> TokenChunk:
        return TokenChunk(rid, [7], [], [], False, "", "")

    async def main(writer_hops: int | None) -> tuple[bool, int]:
        ctx = zmq.asyncio.Context()
        client = WorkerClient("tcp://127.0.0.1:1", "decode", ctx)  # never started: _deliver is called directly
        running = client.open_stream("running", 60.0, _Out())
        await client._deliver([chunk("running")])  # its first chunk: no longer fresh
        running.get_nowait()
        out = _Out()
        new = client.open_stream("new", 60.0, out)
        seen: dict[str, object] = {}

        async def writer() -> None:  # the new request's path to its socket: a few loop iterations
            await new.get()
            seen["running_empty_at_first"] = running.empty()
            if writer_hops is None:
                return  # never marks its first token out: the bound applies
            for _ in range(writer_hops):
                await asyncio.sleep(0)
            seen["running_empty_at_out"] = running.empty()
            out.first_out = True

        task = asyncio.create_task(writer())
        await asyncio.sleep(0)
        hops = 0

        async def count() -> None:
            nonlocal hops
            while running.empty():
                hops += 1
                await asyncio.sleep(0)

        counter = asyncio.create_task(count())
        await client._deliver([chunk("running"), chunk("new")])
        await asyncio.wait_for(asyncio.gather(task, counter), 5)
        client.sock.close(0)
        client._monitor.close(0)
        ctx.term()
        return bool(seen["running_empty_at_first"]) and bool(seen.get("running_empty_at_out", True)), hops

    held, hops = asyncio.run(main(writer_hops=5))
    assert held and 5 <= hops < wc.FIRST_TOKEN_MAX_HOPS, hops
    held, hops = asyncio.run(main(writer_hops=None))
    assert held and hops >= wc.FIRST_TOKEN_MAX_HOPS, hops

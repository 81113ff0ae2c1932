"""benchmarks/multi_turn.py's load client (aiohttp) against an in-process SSE server in the router's
completions format: turns chain their answers into the next prompt, TTFT / usage / the router's headers
are read, and an HTTP error and a deadline end a conversation with the error recorded."""

import asyncio
import json

from aiohttp import web

from benchmarks.loadgen import LengthRange
from benchmarks.multi_turn import MultiTurnSpec, run_conversations, run_load

SEEN: list[list[int]] = []


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    SEEN.append(body["prompt"])
    if body["prompt"][0] == -1:
        return web.json_response({"error": {"message": "nope"}}, status=503)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-tandem-decode": "tcp://d:1",
                                       "x-tandem-queue-wait-s": "0.25",
                                       "x-tandem-ttft-breakdown": "local_queue=0.001;local_prefill=0.002"})
    await resp.prepare(request)
    n = body["max_tokens"]
    for i in range(n):
        chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [7000 + i], "finish_reason": None}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if body["prompt"][0] == -2:
            await asyncio.sleep(2)  # past the request deadline
    usage = {"usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                       "prompt_tokens_details": {"cached_tokens": 11},
                       "tandem": {"computed_tokens": 5, "kv_bytes_shipped": 0, "prefill": "local"}}, "choices": []}
    await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return resp


async def _serve(spec_kw: dict, system: int, load=None):
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        spec = MultiTurnSpec(base_url=f"http://127.0.0.1:{port}", model="m", system_len=system, **spec_kw)
        if load is not None:  # a synchronous load (client processes): off this loop, which serves them
            return await asyncio.to_thread(load, spec)
        return await run_conversations(spec)
    finally:
        await runner.cleanup()


def test_multi_turn_client_chains_turns_and_reads_usage_and_headers():
    SEEN.clear()
    results, _ = asyncio.run(_serve(dict(conversations=2, turns=3, user_len=LengthRange(3, 3),
                                         output_len=LengthRange(4, 4), token_id_range=(1000, 2000)), 8))
    assert len(results) == 6 and all(r.ok for r in results), [r.error for r in results]
    for r in results:
        assert r.ttft_s is not None and r.ttft_s <= r.e2e_s
        assert r.output_ids == [7000, 7001, 7002, 7003]
        assert (r.cached_tokens, r.computed_tokens, r.prefill) == (11, 5, "local")
        assert r.decode_worker == "tcp://d:1" and r.queue_wait_s == 0.25
        assert r.ttft_parts == {"local_queue": 0.001, "local_prefill": 0.002}
    # turn k + 1's prompt = turn k's prompt + its answer + 3 new user tokens
    by_len = sorted(SEEN, key=len)
    assert [len(p) for p in by_len] == [11, 11, 18, 18, 25, 25]
    assert any(p[11:15] == [7000, 7001, 7002, 7003] for p in SEEN if len(p) == 18)


def test_multi_turn_client_records_http_errors_and_deadlines(monkeypatch):
    from benchmarks import multi_turn

    # no system prompt; conversation 0 gets a 503, conversation 1 streams past its deadline
    monkeypatch.setattr(multi_turn, "plan", lambda spec: ([], [[([-1], 2)], [([-2], 2)]]))
    results, _ = asyncio.run(_serve(dict(conversations=2, turns=1, request_timeout_s=1.0), 0))
    errs = sorted(r.error.split(":")[0] for r in results)
    assert not any(r.ok for r in results)
    assert errs == ["TimeoutError", "http_503"]


def test_multi_turn_client_processes_deal_the_conversations():
    """--client-procs 2: the conversations run in two spawned client processes, dealt round-robin, and come
    back merged in conversation order with the same prompts a single client sends."""
    import pytest

    from common.errors import ConfigError

    kw = dict(conversations=3, turns=2, user_len=LengthRange(3, 3), output_len=LengthRange(4, 4),
              token_id_range=(1000, 2000))
    SEEN.clear()
    asyncio.run(_serve(kw, 8))
    single = sorted(map(tuple, SEEN))
    SEEN.clear()
    results, duration = asyncio.run(_serve(kw | {"client_procs": 2}, 8, load=run_load))
    assert duration > 0 and all(r.ok for r in results), [r.error for r in results]
    assert [(r.conversation, r.turn) for r in results] == [(c, t) for c in range(3) for t in (1, 2)]
    assert sorted(map(tuple, SEEN)) == single  # the same requests, from two processes
    with pytest.raises(ConfigError, match="client-procs"):
        MultiTurnSpec(base_url="http://x", model="m", conversations=2, client_procs=3)

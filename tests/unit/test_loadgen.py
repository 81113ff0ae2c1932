"""The serving load generator: arrival process statistics, request planning, percentile and goodput
math, SSE parsing, and per-token timing and failure kinds against a real (fake) SSE server."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest

from benchmarks.loadgen import (LengthRange, LoadSpec, RequestResult, SSEParser, arrival_offsets, plan_requests,
                                request_body, run_load, stream_one)
from benchmarks.serve_bench import SLO, percentiles, summarize
from common.errors import ConfigError


# ---- arrival process ---------------------------------------------------------------------------------
def test_poisson_arrivals_have_exponential_gaps_and_poisson_counts():
    rate, n = 50.0, 20_000
    t = arrival_offsets(n, rate, 1.0, np.random.default_rng(7))
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert abs(gaps.mean() * rate - 1) < 0.03  # mean 1/rate; sd of the estimate ~0.7%
    assert abs(gaps.std() / gaps.mean() - 1) < 0.04  # exponential: coefficient of variation 1
    assert abs((gaps < 1 / rate).mean() - (1 - math.exp(-1))) < 0.015  # P(gap < mean) = 1 - 1/e
    counts = np.histogram(t, bins=np.arange(0, t[-1] // 1, 1.0))[0]  # arrivals per 1 s window
    assert abs(counts.mean() / rate - 1) < 0.03
    assert 0.8 < counts.var() / counts.mean() < 1.2  # Poisson: variance equals the mean


def test_burstiness_sets_the_gap_spread_and_seed_reproduces():
    rng = np.random.default_rng(3)
    gaps = np.diff(arrival_offsets(20_000, 10.0, 0.25, rng))
    assert abs(gaps.mean() * 10 - 1) < 0.06
    assert abs(gaps.std() / gaps.mean() - 2.0) < 0.15  # gamma(k): CV = 1/sqrt(k) = 2
    a = arrival_offsets(100, 5.0, 1.0, np.random.default_rng(1))
    assert np.array_equal(a, arrival_offsets(100, 5.0, 1.0, np.random.default_rng(1)))
    assert not np.array_equal(a, arrival_offsets(100, 5.0, 1.0, np.random.default_rng(2)))
    assert np.array_equal(arrival_offsets(4, math.inf, 1.0, rng), np.zeros(4))


def test_plan_requests_lengths_ids_and_determinism():
    spec = LoadSpec("http://x", "m", num_requests=200, request_rate=10, input_len=LengthRange(5, 9),
                    output_len=LengthRange(3, 3), seed=11, token_id_range=(100, 200))
    plan = plan_requests(spec)
    assert plan == plan_requests(spec)
    assert {len(p.prompt_ids) for p in plan} == {5, 6, 7, 8, 9}
    assert all(p.max_tokens == 3 and all(100 <= t < 200 for t in p.prompt_ids) for p in plan)
    assert [p.offset_s for p in plan] == sorted(p.offset_s for p in plan)
    path, body = request_body(spec, plan[0])
    assert path == "/v1/completions" and body["prompt"] == list(plan[0].prompt_ids)
    assert body["stream"] and body["ignore_eos"] and body["return_token_ids"] and body["max_tokens"] == 3
    chat = LoadSpec("http://x", "m", api="chat", num_requests=2, input_len=LengthRange(12, 12), extras=False)
    path, body = request_body(chat, plan_requests(chat)[0])
    assert path == "/v1/chat/completions" and len(body["messages"][0]["content"].split()) == 12
    assert "ignore_eos" not in body
    assert body["temperature"] == 0.0
    _, body = request_body(LoadSpec("http://x", "m", temperature=1.0), plan[0])
    assert body["temperature"] == 1.0


@pytest.mark.parametrize("text", ["0", "5:4", "a", "1:2:3", "-3"])
def test_bad_lengths_and_specs_raise_config_errors(text):
    with pytest.raises(ConfigError):
        LengthRange.parse(text)


def test_spec_validation():
    assert LengthRange.parse("64:256") == LengthRange(64, 256) and LengthRange.parse("8") == LengthRange(8, 8)
    for kw in ({"request_rate": 0}, {"api": "embeddings"}, {"max_concurrency": 0}, {"num_requests": 0},
               {"temperature": -1}):
        with pytest.raises(ConfigError):
            LoadSpec("http://x", "m", **kw)


# ---- metrics -----------------------------------------------------------------------------------------
def test_percentiles_interpolate_linearly():
    p = percentiles([float(x) for x in range(1, 101)])
    assert p["mean"] == pytest.approx(50.5) and p["p50"] == pytest.approx(50.5)
    assert p["p90"] == pytest.approx(90.1) and p["p99"] == pytest.approx(99.01)
    assert percentiles([3.0]) == {"mean": 3.0, "p50": 3.0, "p90": 3.0, "p99": 3.0}
    assert percentiles([])["p99"] is None


def _result(i, ttft, tokens, itl, ok=True, kind=None):
    r = RequestResult(i, prompt_tokens=10, expected_output_tokens=tokens, scheduled_s=0.0)
    if not ok:
        return r.fail(kind, "x")
    r.ok, r.ttft_s, r.output_tokens, r.itl_s = True, ttft, tokens, [itl] * (tokens - 1)
    r.last_token_s = ttft + itl * (tokens - 1)
    r.e2e_s = r.last_token_s + 0.01
    return r


def test_summary_throughput_goodput_and_failures():
    results = [_result(0, 0.1, 5, 0.02), _result(1, 0.5, 5, 0.02),  # TTFT 0.5 misses a 0.3 s SLO
               _result(2, 0.3, 5, 0.05),  # TPOT exactly at the SLO: met
               _result(3, 0.1, 5, 0.06),  # TPOT over
               _result(4, 0.2, 1, 0.0),  # one token: no TPOT, TTFT decides
               _result(5, 0, 0, 0, ok=False, kind="http_503"), _result(6, 0, 0, 0, ok=False, kind="http_503"),
               _result(7, 0, 0, 0, ok=False, kind="stream_closed")]
    s = summarize(results, 2.0, SLO(ttft_s=0.3, tpot_s=0.05))
    assert (s["completed"], s["failed"]) == (5, 3)
    assert s["failures"] == {"http_503": 2, "stream_closed": 1}
    assert s["goodput"]["requests_met"] == 3 and s["goodput"]["requests_per_s"] == pytest.approx(1.5)
    assert s["goodput"]["fraction"] == pytest.approx(3 / 8)
    assert s["request_throughput"] == pytest.approx(2.5)
    assert s["output_tokens"] == 21 and s["output_token_throughput"] == pytest.approx(10.5)
    assert s["total_token_throughput"] == pytest.approx((21 + 50) / 2)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx((20 + 20 + 50 + 60) / 4)
    assert s["itl_ms"]["p50"] == pytest.approx(35.0)  # 8 x 20, 4 x 50, 4 x 60 ms: between 20 and 50
    assert s["output_len_mismatches"] == 0


# ---- SSE -----------------------------------------------------------------------------------------------
def test_sse_parser_events_comments_multiline_and_crlf():
    p = SSEParser()
    got = [p.feed(x) for x in [": keep-alive", "", "data: {\"a\": 1}\r\n", "\r\n", "event: x", "data: one",
                               "data:two", "", "id: 3", "", "data: [DONE]"]]
    assert [g for g in got if g is not None] == ['{"a": 1}', "one\ntwo"]
    assert p.flush() == "[DONE]" and p.flush() is None


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Streams completions; what it does depends on the requested model name."""

    protocol_version = "HTTP/1.1"
    cycle = iter(())

    def log_message(self, *a):
        pass

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _event(self, obj) -> None:
        self._chunk(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = body["model"] if body["model"] != "cycle" else next(self.cycle)
        if mode == "503":
            msg = b'{"error": {"message": "overloaded", "code": 503}}'
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        ids = "token_ids" if mode != "plain" else None
        time.sleep(0.3)  # time to first token
        for k in (1, 1, 2, 1):  # the third event carries two tokens
            self._event({"choices": [{"index": 0, "text": "x" * k, **({ids: list(range(k))} if ids else {})}]})
            if mode == "close":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)  # mid-stream, no terminating chunk
                return
            if mode == "error":
                self._event({"error": {"message": "decode worker died", "code": 503}})
                break
            if mode == "hang":
                time.sleep(3)
            time.sleep(0.2)
        self._event({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 5}})
        self._event(b"[DONE]")
        self._chunk(b"")


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        """The "close" mode shuts its socket mid-stream on purpose: the handler's read of the next request then
        meets a reset connection, which is expected here, not a traceback for the test log."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture(scope="module")
def fake_url():
    srv = _QuietServer(("127.0.0.1", 0), _FakeOpenAI)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def _one(url, model, timeout_s=10.0):
    spec = LoadSpec(url, model, num_requests=1, input_len=LengthRange(4, 4), output_len=LengthRange(5, 5),
                    request_timeout_s=timeout_s)

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s, connect=2)) as c:
            return await stream_one(c, spec, plan_requests(spec)[0], time.perf_counter())

    return asyncio.run(go())


def test_stream_timing_per_token(fake_url):
    r = _one(fake_url, "ok")
    assert r.ok, r.error
    assert r.output_tokens == 5 and r.usage_completion_tokens == 5 and r.usage_prompt_tokens == 4
    assert 0.28 <= r.ttft_s < 2.0
    assert len(r.itl_s) == 4
    assert r.itl_s[1] == r.itl_s[2]  # the two-token event splits its gap evenly
    assert 0.18 <= r.itl_s[0] < 1.5 and 0.09 <= r.itl_s[1] < 0.75 and 0.18 <= r.itl_s[3] < 1.5
    assert r.ttft_s + sum(r.itl_s) == pytest.approx(r.last_token_s) and r.last_token_s <= r.e2e_s
    assert r.tpot_s == pytest.approx(sum(r.itl_s) / 4)


def test_stream_without_token_ids_counts_text_chunks(fake_url):
    r = _one(fake_url, "plain")
    assert r.ok and r.output_tokens == 4 and len(r.itl_s) == 3  # one per chunk: the 2-token chunk counts once


@pytest.mark.parametrize("mode,kind", [("503", "http_503"), ("close", "stream_closed"), ("error", "server_error")])
def test_failures_have_kinds(fake_url, mode, kind):
    r = _one(fake_url, mode)
    assert not r.ok and r.error_kind == kind, (r.error_kind, r.error)


def test_deadline_and_refused_connection_never_hang(fake_url):
    t0 = time.monotonic()
    r = _one(fake_url, "hang", timeout_s=1.0)
    assert r.error_kind == "timeout" and time.monotonic() - t0 < 2.5
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        assert _one(dead, "ok").error_kind == "connect_error"


def test_open_loop_run_counts_failures_by_kind(fake_url):
    _FakeOpenAI.cycle = iter(["ok", "503", "close"] * 2)
    spec = LoadSpec(fake_url, "cycle", num_requests=6, request_rate=40.0, input_len=LengthRange(3, 3),
                    output_len=LengthRange(5, 5), request_timeout_s=10)
    out = asyncio.run(run_load(spec, plan_requests(spec)))
    s = summarize(out.results, out.duration_s, SLO(5.0, 1.0))
    assert s["failures"] == {"http_503": 2, "stream_closed": 2} and s["completed"] == 2
    assert s["goodput"]["requests_met"] == 2 and s["output_tokens"] == 10
    # Open loop: requests were sent on schedule, not after the earlier ones finished (each takes > 0.9 s).
    assert max(r.dispatch_s for r in out.results) < 0.9
    assert all(r.dispatch_s >= r.scheduled_s - 1e-3 for r in out.results)


def test_replay_classification_and_queue_waits():
    from benchmarks.serve_checks import classify, queue_waits

    ref = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert classify(list(ref), ref) == "equal"
    assert classify(ref[:7], ref) == "lost"  # the stream stopped early
    assert classify(ref + [15], ref) == "duplicated"
    assert classify([5, 6, 6, 7, 8, 9, 10, 11, 12, 13], ref) == "duplicated"  # a token delivered twice
    assert classify([5, 6, 8, 9, 10, 11, 12, 13, 14, 15], ref) == "lost"  # a token skipped
    assert classify([5, 6, 99, 8, 9, 10, 11, 12, 13, 14], ref) == "different"
    rs = [RequestResult(i, 1, 1, 0.0, queue_wait_s=w) for i, w in enumerate([0.0, 0.5, 2.0, None])]
    q = queue_waits(rs)
    assert q["count"] == 3 and q["max_s"] == 2.0 and q["p50_s"] == 0.5

"""A real `tandem router` process, started with the flags under test, against fake workers on real ZMQ
sockets (tests/support/fake_worker.py: they answer status polls and the request path, full or stuck
on demand):

- --max-queued-requests 1 --max-queue-wait-s 2: with every slot on the worker taken, a request waits
  in the queue and gets 429 ("wait bound (2 s)") after about 2 s; one arriving while it waits finds
  the queue full and gets 429 at once; both with OpenAI's rate_limit_exceeded body and Retry-After;
- --stream-timeout-s 1: a decode worker that sends a stream's first token and then nothing (while it
  keeps answering status polls) ends the client's stream with an error event naming it about 1 s
  later, not after the default 300 s, and the router sends the worker an Abort for the request.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tests.support.fake_worker import FakeWorker
from tests.support.ports import free_port
from wire.protocol import Abort

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def start_router():
    """start(decode_addrs, flags) -> base URL of a ready router process (stopped after the test)."""
    procs: list[tuple[subprocess.Popen, str]] = []

    def start(decode: list[str], flags: list[str]) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "launcher.cli", "router", "--port", str(port), "--model-name", "m",
               "--colocated", "--poll-interval-s", "0.1", "--drain-timeout-s", "1",
               *[x for d in decode for x in ("--decode", d)], *flags]
        log = tempfile.NamedTemporaryFile(prefix="tandem-router-flags-", suffix=".log", delete=False)
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        procs.append((p, log.name))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert p.poll() is None, open(log.name, errors="replace").read()[-3000:]
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "router not ready:\n" + open(log.name, errors="replace").read()[-3000:]
            time.sleep(0.1)

    yield start
    for p, log in procs:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        os.unlink(log)


@pytest.fixture
def worker(request):
    w = FakeWorker("decode", **request.param)
    yield w
    w.close()


def _queue_depth(url: str) -> float:
    m = re.search(r"^tandem_router_queue_depth (\S+)$", httpx.get(url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def _complete(url: str) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 3}, timeout=30)
    return r, time.monotonic() - t0


def _assert_429(r: httpx.Response, message: str) -> None:
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["type"] == "rate_limit_exceeded" and err["code"] == 429 and message in err["message"], err
    assert int(r.headers["retry-after"]) >= 1


@pytest.mark.parametrize("worker", [{"full": True}], indirect=True, ids=["full"])
def test_queue_bounds_from_the_command_line_give_429(start_router, worker):
    url = start_router([worker.addr], ["--max-queued-requests", "1", "--max-queue-wait-s", "2"])
    with cf.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_complete, url)
        deadline = time.monotonic() + 10
        while _queue_depth(url) != 1:  # the first request waits for room
            assert not waiting.done() and time.monotonic() < deadline, waiting.result()[0].text
            time.sleep(0.05)
        r, took = _complete(url)  # the queue holds 1 already: the bound by count answers at once
        _assert_429(r, "the admission queue is full (1 requests waiting for room)")
        assert took < 1.5, took  # not after the 2 s wait bound
        r, took = waiting.result(timeout=20)
    _assert_429(r, "no room for this request within the queue's wait bound (2 s)")
    assert 2.0 <= took < 6.0, took
    assert _queue_depth(url) == 0


@pytest.mark.parametrize("worker", [{"stall": True}], indirect=True, ids=["stalls"])
def test_a_silent_decode_worker_ends_the_stream_at_the_stream_timeout(start_router, worker):
    url = start_router([worker.addr], ["--stream-timeout-s", "1"])
    events, t_first, t_end = [], None, None
    body = {"model": "m", "prompt": "hello", "max_tokens": 50, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=15) as r:  # the default would hang
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                t_end = time.monotonic()
                break
            events.append(json.loads(line[6:]))
            if t_first is None:
                t_first = time.monotonic()
    assert t_first is not None and t_end is not None, events
    assert "choices" in events[0] and events[0]["choices"][0]["text"], events  # the first token came through
    err = events[-1]["error"]
    assert err["type"] == "service_unavailable"
    assert f"decode worker {worker.addr} sent nothing for 1 s" in err["message"], err
    assert 0.5 <= t_end - t_first < 5.0, t_end - t_first  # the 1 s stall deadline runs from the first token
    deadline = time.monotonic() + 5  # the router gives the request up on the worker too
    while not any(isinstance(m, Abort) for m in worker.seen):
        assert time.monotonic() < deadline, worker.seen
        time.sleep(0.05)

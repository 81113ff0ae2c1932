"""A worker that is merely late does not turn requests into 503s (router/fleet.py, placement.is_late):
the real router app (HTTP, fleet polls, admission queue, orchestrator) against fake workers on real
ZMQ sockets that can be frozen, as a starved process is (alive, connection up, silent).

- the only prefill or decode worker goes silent until the router marks it down: /ready stays 200, a
  request arriving then waits in the queue (counted under reason worker_late) and succeeds once the
  worker answers again;
- it stays silent: the waiting request gets 503 once the grace period after its last answer is over.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import time

import pytest
from fastapi.testclient import TestClient

from router import fleet as fleet_mod
from router.config import RouterConfig
from router.fleet import Discovery
from router.main import make_app
from tests.support.fake_worker import TOKENS, FakeWorker


@pytest.fixture
def fast_polls(monkeypatch):
    # polls every 0.1 s with a 0.2 s deadline: a silent worker is marked down within about a second
    monkeypatch.setattr(fleet_mod, "MIN_STATUS_TIMEOUT_S", 0.2)


def _cluster(late_role: str, grace_s: float):
    workers = {"decode": FakeWorker("decode")}
    if late_role == "prefill":
        workers["prefill"] = FakeWorker("prefill")
    prefill = (workers["prefill"].addr,) if "prefill" in workers else ()
    cfg = RouterConfig(model_name="m", prefill=prefill, decode=(workers["decode"].addr,), poll_interval_s=0.1,
                       max_model_len=2048, worker_grace_s=grace_s)
    return workers, TestClient(make_app(cfg, Discovery(list(prefill), [workers["decode"].addr])))


def _metric(c: TestClient, name: str, **labels: str) -> float:
    sel = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    m = re.search(rf"^{name}{re.escape(sel)} (\S+)$", c.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def _freeze_until_late(c: TestClient, w: FakeWorker) -> float:
    deadline = time.monotonic() + 20
    while c.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "the router never saw the workers ready"
        time.sleep(0.05)
    t_frozen = time.monotonic()
    w.frozen.set()
    while _metric(c, "tandem_router_workers", phase=w.role, state="late") != 1:
        assert time.monotonic() < deadline, "the frozen worker was never marked down"
        time.sleep(0.05)
    return t_frozen


def _complete(c: TestClient):
    return c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 3, "temperature": 0})


@pytest.mark.parametrize("late_role", ["prefill", "decode"])
def test_a_request_waits_for_a_late_worker_and_succeeds(fast_polls, late_role):
    workers, client = _cluster(late_role, grace_s=30.0)
    try:
        with client as c, cf.ThreadPoolExecutor(1) as pool:
            _freeze_until_late(c, workers[late_role])
            assert c.get("/ready").status_code == 200  # late is not gone: the router keeps taking requests
            fut = pool.submit(_complete, c)
            time.sleep(1.0)
            assert not fut.done(), fut.result().text  # waiting, not a 503
            assert _metric(c, "tandem_router_queue_depth") == 1
            assert _metric(c, "tandem_router_queued_requests_total", reason="worker_late") == 1
            workers[late_role].frozen.clear()  # it answers again: the request is placed and served
            r = fut.result(timeout=20)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == len(TOKENS)
            assert float(r.headers["x-tandem-queue-wait-s"]) >= 1.0
    finally:
        for w in workers.values():
            w.close()


def test_a_worker_silent_past_the_grace_period_is_503(fast_polls):
    grace_s = 2.5
    workers, client = _cluster("prefill", grace_s=grace_s)
    try:
        with client as c, cf.ThreadPoolExecutor(1) as pool:
            t_frozen = _freeze_until_late(c, workers["prefill"])
            t_sent = time.monotonic()
            assert t_sent - t_frozen < grace_s - 0.5, "marked down too late for this test to show a wait"
            r = pool.submit(_complete, c).result(timeout=20)
            t_done = time.monotonic()
            assert r.status_code == 503, r.text
            assert "no prefill worker is up and ready" in r.json()["error"]["message"]
            # its last answer came at most a poll round (0.3 s) before the freeze: not before the grace ran out
            assert t_done - t_frozen > grace_s - 0.3 and t_done - t_sent > 0.3
            assert c.get("/ready").status_code == 503  # gone now
    finally:
        for w in workers.values():
            w.close()

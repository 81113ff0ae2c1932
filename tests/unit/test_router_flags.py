"""Router flags through their command line (router/main.py parse_args -> RouterConfig -> make_app), not
through hand-built configs: --max-queued-requests and --max-queue-wait-s reach the AdmissionQueue the
app serves with (a router started with --max-queued-requests 0 answers 429 at once when the workers have
no room), --stream-timeout-s reaches the config the orchestrator arms streams with, and
--remote-prefill-min-tokens goes from `tandem serve` onto the router's command line (only when given)
and from there into the placement's PrefillCost (0 = always on a prefill worker).
The served behaviour of a router process with these flags: tests/integration/test_router_flags_served.py."""

from __future__ import annotations

import argparse
import time

import pytest
from fastapi.testclient import TestClient

from common.errors import ConfigError
from launcher import cmd_serve
from router import main as router_main
from router.admission import AdmissionQueue
from router.main import make_app, parse_args
from router.placement import FleetSnapshot, WorkerView, place
from router.prefill_cost import DEFAULT_REMOTE_PREFILL_MIN_TOKENS, PrefillCost
from tests.support.fake_worker import FakeWorker

DEAD = "tcp://127.0.0.1:1"


@pytest.fixture
def built_queues(monkeypatch):
    """The AdmissionQueue objects make_app builds, as built."""
    made: list[AdmissionQueue] = []

    class Recording(AdmissionQueue):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            made.append(self)

    monkeypatch.setattr(router_main, "AdmissionQueue", Recording)
    return made


def _build(argv: list[str]) -> None:
    cfg, disc = parse_args(["--decode", DEAD, "--poll-interval-s", "0.05", *argv])
    with TestClient(make_app(cfg, disc)):  # started and stopped: its ZMQ context is closed again
        pass


def test_queue_bounds_and_prefill_cost_reach_the_admission_queue(built_queues):
    _build(["--max-queued-requests", "3", "--max-queue-wait-s", "2.5", "--remote-prefill-min-tokens", "0"])
    _build([])
    given, default = built_queues
    assert (given.max_queued, given.max_wait_s, given.cost) == (3, 2.5, PrefillCost(0))
    assert (default.max_queued, default.max_wait_s) == (1024, 600.0)
    assert default.cost == PrefillCost(DEFAULT_REMOTE_PREFILL_MIN_TOKENS) and DEFAULT_REMOTE_PREFILL_MIN_TOKENS > 0


def test_queue_bound_values_are_checked():
    assert parse_args(["--decode", DEAD, "--max-queued-requests", "0"])[0].max_queued_requests == 0  # no queueing
    for bad in (["--max-queued-requests", "-1"], ["--max-queue-wait-s", "0"], ["--max-queue-wait-s", "-2"]):
        with pytest.raises(ConfigError, match="max-queue-wait-s"):
            parse_args(["--decode", DEAD, *bad])
    with pytest.raises(SystemExit):  # argparse: not an int
        parse_args(["--decode", DEAD, "--max-queued-requests", "1.5"])


@pytest.mark.timeout(30)  # without the flag it would wait for the default bound (600 s)
def test_a_router_started_with_max_queued_requests_0_answers_429_at_once_when_full():
    worker = FakeWorker("decode", full=True)  # every sequence slot taken: a request would have to wait
    try:
        cfg, disc = parse_args(["--decode", worker.addr, "--colocated", "--poll-interval-s", "0.1",
                                "--max-queued-requests", "0", "--model-name", "m"])
        with TestClient(make_app(cfg, disc)) as c:
            deadline = time.monotonic() + 10
            while c.get("/ready").status_code != 200:
                assert time.monotonic() < deadline, "the router never saw the fake worker ready"
                time.sleep(0.05)
            t0 = time.monotonic()
            r = c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 3})
            took = time.monotonic() - t0
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["type"] == "rate_limit_exceeded" and err["code"] == 429
        assert "admission queue is full (0 requests waiting for room)" in err["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert took < 2.0, took  # at once, not after a wait bound
    finally:
        worker.close()


def test_stream_timeout_reaches_the_config():
    assert parse_args(["--decode", DEAD, "--stream-timeout-s", "2.5"])[0].stream_timeout_s == 2.5
    assert parse_args(["--decode", DEAD])[0].stream_timeout_s == 300.0


# ---- --remote-prefill-min-tokens: tandem serve -> router argv -> PrefillCost -> placement -------------------------
def _serve_args(**kw) -> argparse.Namespace:
    base = dict(device="cpu", host="127.0.0.1", kv_backend="nixl", max_num_seqs=8, fp8=False, kv_cache_gib=None,
                num_prefill=1, num_decode=1, base_port=17000, port=18000, model_name="m", colocated=False,
                prefill_tp=1, decode_tp=1, decode_moe_mode="tp")
    return argparse.Namespace(**(base | kw))


def _router_cfg(cmd: list[str]):
    i = cmd.index("router")
    return parse_args(cmd[i + 1:])[0]


@pytest.mark.parametrize("given,flag", [(None, None), (0, "0"), (250, "250")])
def test_serve_puts_remote_prefill_min_tokens_on_the_router_command_line_only_when_given(given, flag):
    cmds = cmd_serve.build_commands(_serve_args(remote_prefill_min_tokens=given), "/ckpt")
    router = cmds[-1]
    assert router[3] == "router" and all(c[3] != "router" for c in cmds[:-1])
    if flag is None:
        assert "--remote-prefill-min-tokens" not in router
    else:
        assert router[router.index("--remote-prefill-min-tokens") + 1] == flag
    assert not any("--remote-prefill-min-tokens" in c for c in cmds[:-1])  # a router flag only
    want = DEFAULT_REMOTE_PREFILL_MIN_TOKENS if given is None else given
    assert _router_cfg(router).prefill_cost == PrefillCost(want)


def test_serve_flag_is_parsed_into_the_commands(monkeypatch):
    """`tandem serve --remote-prefill-min-tokens 0` itself (its parser), stopped before any process starts."""
    seen: list[list[list[str]]] = []

    class Stop(Exception):
        pass

    def build(a, checkpoint):
        seen.append(real(a, checkpoint))
        raise Stop

    real = cmd_serve.build_commands
    monkeypatch.setattr(cmd_serve, "build_commands", build)
    monkeypatch.setattr(cmd_serve, "check_ports", lambda a: None)
    for argv in (["--remote-prefill-min-tokens", "0"], []):
        with pytest.raises(Stop):
            cmd_serve.serve(["--checkpoint", "/ckpt", *argv])
    given, omitted = (c[-1] for c in seen)
    assert given[given.index("--remote-prefill-min-tokens") + 1] == "0"
    assert "--remote-prefill-min-tokens" not in omitted
    assert _router_cfg(given).prefill_cost.remote_min_tokens == 0


def test_remote_prefill_min_tokens_decides_where_a_cached_prompt_prefills():
    """Both workers hold 2,800 of a 3,000-token prompt on an idle fleet: the 200-token suffix prefills on
    the decode worker iff it is shorter than --remote-prefill-min-tokens (router/prefill_cost.py: local
    2 x 200 against remote T + 200); 0 = always on the prefill worker."""
    fleet = FleetSnapshot(prefill=(WorkerView("p1", True, True, 0, 0, 0, 0, 16, 8),),
                          decode=(WorkerView("d1", True, True, 0, 0, 0, 10_000, 16, 128),))
    held = {"d1": 2800, "p1": 2800}
    for argv, prefill in (([], None), (["--remote-prefill-min-tokens", "300"], None),
                          (["--remote-prefill-min-tokens", "100"], "p1"), (["--remote-prefill-min-tokens", "0"], "p1")):
        cost = parse_args(["--decode", DEAD, *argv])[0].prefill_cost
        assert place(3000, 10, fleet, matches=held, cost=cost).prefill == prefill, argv

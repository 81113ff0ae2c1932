"""The autoscaler loop with an in-memory connector: apply, partial failure, dry run, bad scrapes,
flags -> config."""

from __future__ import annotations

import socket
import sys
import threading

import pytest

from autoscaler.config import build_parser, config_from_args
from autoscaler.connector import ScaleOutcome, ScalingError
from autoscaler.core import Phase, Reason, ReplicaCounts
from autoscaler.main import Autoscaler, main
from common.errors import ConfigError, WorkerUnavailable

BASE = ["--connector", "kubernetes", "--namespace", "ns", "--prefill-deployment", "p",
        "--decode-deployment", "d", "--router-metrics-url", "http://router:8000/metrics",
        "--scale-up-cooldown-s", "0"]

BUSY = """\
tandem_queue_depth{phase="prefill"} 20
tandem_queue_depth{phase="decode"} 100
tandem_kv_usage_ratio{phase="decode"} 0.95
"""


class MemoryConnector:
    """A platform that applies what it is told at once; pods are ready immediately."""

    def __init__(self, prefill: int, decode: int) -> None:
        self.replicas = {Phase.PREFILL: prefill, Phase.DECODE: decode}
        self.fail: set[Phase] = set()
        self.calls: list[tuple[Phase, int, int]] = []

    def get_replicas(self, phase: Phase) -> ReplicaCounts:
        n = self.replicas[phase]
        return ReplicaCounts(desired=n, ready=n)

    def set_replicas(self, phase: Phase, replicas: int, *, expected: int) -> ScaleOutcome:
        self.calls.append((phase, replicas, expected))
        if phase in self.fail:
            raise ScalingError(f"{phase.value}: forbidden")
        if self.replicas[phase] != expected:
            return ScaleOutcome.SUPERSEDED
        self.replicas[phase] = replicas
        return ScaleOutcome.APPLIED


def scaler(argv: list[str], conn: MemoryConnector, text: str = BUSY) -> Autoscaler:
    cfg = config_from_args(build_parser().parse_args(BASE + argv))
    clock = iter(float(t) for t in range(0, 10_000, 15))
    return Autoscaler(cfg, conn, fetch=lambda: {"router": text}, clock=lambda: next(clock))


def test_step_applies_both_phases() -> None:
    conn = MemoryConnector(prefill=1, decode=2)
    s = scaler([], conn)
    d = s.step()
    assert d.prefill.reason is Reason.SCALE_UP and d.decode.reason is Reason.SCALE_UP
    assert conn.replicas == {Phase.PREFILL: 3, Phase.DECODE: 4}  # +2 step limit each
    assert s.state.prefill.last_scale_up_s == 0.0


def test_failure_in_one_phase_does_not_block_the_other() -> None:
    conn = MemoryConnector(prefill=1, decode=2)
    conn.fail.add(Phase.DECODE)
    s = scaler([], conn)
    s.step()
    assert conn.replicas == {Phase.PREFILL: 3, Phase.DECODE: 2}
    assert s.state.decode.last_scale_up_s is None  # no cooldown for a change that never landed


def test_dry_run_decides_but_never_writes() -> None:
    conn = MemoryConnector(prefill=1, decode=2)
    s = scaler(["--dry-run"], conn)
    d = s.step()
    assert d.prefill.desired == 3 and conn.calls == []
    assert conn.replicas == {Phase.PREFILL: 1, Phase.DECODE: 2}


def test_run_survives_bad_ticks_and_stops() -> None:
    conn = MemoryConnector(prefill=1, decode=1)
    answers = iter(["not { prometheus", BUSY])
    stop = threading.Event()

    def fetch() -> dict[str, str]:
        try:
            return {"router": next(answers)}
        except StopIteration:
            stop.set()
            raise WorkerUnavailable("router gone") from None

    cfg = config_from_args(build_parser().parse_args(BASE + ["--interval-s", "0.01",
                                                             "--window-s", "0.02"]))
    s = Autoscaler(cfg, conn, fetch=fetch)
    s.run(stop)
    assert conn.replicas == {Phase.PREFILL: 3, Phase.DECODE: 3}
    ticks = {tuple(m.labels.values()): m.value
             for m in s.telemetry.ticks.collect()[0].samples if m.name.endswith("_total")}
    assert ticks == {("error",): 2.0, ("ok",): 1.0}


@pytest.mark.parametrize("extra, message", [
    (["--interval-s", "0"], "interval"),
    (["--window-s", "5", "--interval-s", "15"], "window"),
    (["--decode-min-replicas", "4", "--decode-max-replicas", "2"], "max_replicas"),
    (["--decode-kv-down", "0.9"], "kv_down_ratio"),
])
def test_bad_flags_raise_config_error(extra: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_args(build_parser().parse_args(BASE + extra))


def test_main_returns_2_on_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    bad_url = [a if a != "http://router:8000/metrics" else "router:8000" for a in BASE]
    assert main(bad_url) == 2
    # A build without the Ray connector module: a clear error, not a traceback.
    monkeypatch.setitem(sys.modules, "autoscaler.ray_connector", None)
    assert main(["--connector", "ray"] + BASE[2:]) == 2


def test_dns_discovery_scrapes_every_router(monkeypatch: pytest.MonkeyPatch) -> None:
    from autoscaler.config import RouterDiscovery
    from autoscaler.main import router_targets

    url = "http://tandem-router-pods.serving.svc:8000/metrics"
    assert router_targets(url, RouterDiscovery.STATIC) == [url]
    answers = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", 8000)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.3", 8000)),
               (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::5", 8000, 0, 0))]
    seen = []

    def fake_getaddrinfo(host: str, port: int, **kw: object) -> list:
        seen.append((host, port))
        return answers

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    assert router_targets(url, RouterDiscovery.DNS) == [
        "http://10.0.0.3:8000/metrics", "http://10.0.0.7:8000/metrics",
        "http://[fd00::5]:8000/metrics"]
    assert seen == [("tandem-router-pods.serving.svc", 8000)]


def test_fetch_skips_dead_routers_and_fails_when_none_answers() -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from autoscaler.config import RouterDiscovery
    from autoscaler.main import fetch_router_metrics

    class Ok(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            body = BUSY.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/metrics"
    try:
        live = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        assert fetch_router_metrics(live, RouterDiscovery.STATIC, 2.0) == {live: BUSY}
        with pytest.raises(WorkerUnavailable, match="no router answered"):
            fetch_router_metrics(dead, RouterDiscovery.STATIC, 2.0)
    finally:
        server.shutdown()
        server.server_close()

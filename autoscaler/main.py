"""`tandem autoscaler`: the loop that scales prefill and decode separately.

Role: the only I/O-driving part of the autoscaler. Each tick reads every router replica's
/metrics (latency histograms and the per-phase gauges), reads replica counts through the
connector, asks the pure core what to do, and applies it through the connector.

Lifecycle:
    main(argv) -> AutoscalerConfig -> connector -> Autoscaler.run(stop)
    every interval_s:  scrape routers (deadlines) -> RouterWindows -> build_tick_input -> core.tick
                       -> connector.set_replicas per changed phase (deadline, compare-and-set)
                       -> core.settle -> sleep until the next tick or until stopped
    SIGTERM/SIGINT set `stop`; the current tick finishes (every call in it has a deadline) and
    main returns 0. A failed tick (router or API server down) is logged and skipped: holding the
    current replica counts is always safe.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from urllib.parse import urlsplit, urlunsplit

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from autoscaler.config import (AutoscalerConfig, ConnectorKind, RouterDiscovery, build_parser,
                               config_from_args)
from autoscaler.connector import ScaleOutcome, ScalingConnector, ScalingError
from autoscaler.core import Decision, Phase, State, settle, tick
from autoscaler.metrics import RouterWindows, build_tick_input, parse_router_metrics
from common.errors import ConfigError, ProtocolError, TandemError, WorkerUnavailable

log = logging.getLogger("tandem.autoscaler")


def router_targets(url: str, discovery: RouterDiscovery) -> list[str]:
    """The metrics URLs to scrape: the URL itself, or one per address its host resolves to."""
    if discovery is RouterDiscovery.STATIC:
        return [url]
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise WorkerUnavailable(f"router metrics: cannot resolve {parts.hostname}: {exc}") from exc
    hosts = sorted({f"[{i[4][0]}]" if i[0] == socket.AF_INET6 else str(i[4][0]) for i in infos})
    return [urlunsplit((parts.scheme, f"{h}:{port}", parts.path, parts.query, "")) for h in hosts]


def fetch_router_metrics(url: str, discovery: RouterDiscovery,
                         timeout_s: float) -> dict[str, str]:
    """One scrape of every router replica, each with a hard deadline. Routers that fail are
    left out of this tick; it fails only when none answers."""
    texts: dict[str, str] = {}
    errors: list[str] = []
    for target in router_targets(url, discovery):
        try:
            resp = httpx.get(target, timeout=timeout_s)
        except httpx.HTTPError as exc:
            errors.append(f"{target}: {exc!r}")
            continue
        if resp.status_code != 200:
            errors.append(f"{target}: HTTP {resp.status_code}")
            continue
        texts[target] = resp.text
    if errors:
        log.warning("router metrics: %s", "; ".join(errors))
    if not texts:
        raise WorkerUnavailable(f"router metrics: no router answered ({'; '.join(errors)})")
    return texts


class _Telemetry:
    """The autoscaler's own metrics, in a private registry (served only with --metrics-port)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.desired = Gauge("tandem_autoscaler_desired_replicas", "Target replicas per phase",
                             ["phase"], registry=self.registry)
        self.ticks = Counter("tandem_autoscaler_ticks", "Ticks by outcome", ["outcome"],
                             registry=self.registry)
        self.scale_events = Counter("tandem_autoscaler_scale_events",
                                    "Replica changes by phase and outcome",
                                    ["phase", "outcome"], registry=self.registry)


class Autoscaler:
    """Holds what must survive between ticks: the scrape windows and the core's State.
    `fetch` returns the metrics text of every router replica that answered, by address."""

    def __init__(self, cfg: AutoscalerConfig, connector: ScalingConnector,
                 fetch: Callable[[], dict[str, str]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.connector = connector
        self.fetch = fetch
        self.clock = clock
        self.windows = RouterWindows(cfg.window_s)
        self.state = State()
        self.telemetry = _Telemetry()

    def step(self) -> Decision:
        """One tick. Raises TandemError when the router or the platform cannot be read."""
        now = self.clock()
        texts = self.fetch()
        self.windows.add({target: parse_router_metrics(text, now)
                          for target, text in texts.items()})
        prefill = self.connector.get_replicas(Phase.PREFILL)
        decode = self.connector.get_replicas(Phase.DECODE)
        decision = tick(build_tick_input(self.windows, prefill, decode, now), self.state,
                        self.cfg.policy)

        applied: dict[Phase, bool] = {}
        for phase in Phase:
            d = decision.of(phase)
            self.telemetry.desired.labels(phase.value).set(d.desired)
            # Changes at INFO; the steady-state reasons (hold, cooldown, ...) at DEBUG.
            log.log(logging.INFO if d.changed else logging.DEBUG,
                    "%s: %d -> %d (%s, worst signal %.2f of threshold%s)", phase.value,
                    d.current, d.desired, d.reason.value, d.worst_ratio,
                    ", SLO breached" if d.breaching_slo else "")
            if not d.changed or self.cfg.dry_run:
                continue
            try:
                outcome = self.connector.set_replicas(phase, d.desired, expected=d.current)
            except ScalingError as exc:
                # The other phase is independent: still try it this tick.
                log.warning("%s: scaling to %d failed: %s", phase.value, d.desired, exc)
                self.telemetry.scale_events.labels(phase.value, "error").inc()
                continue
            applied[phase] = outcome is ScaleOutcome.APPLIED
            self.telemetry.scale_events.labels(phase.value, outcome.value).inc()
        self.state = settle(self.state, decision, applied)
        return decision

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            started = self.clock()
            try:
                self.step()
                self.telemetry.ticks.labels("ok").inc()
            except (WorkerUnavailable, ProtocolError, ScalingError) as exc:
                log.warning("tick skipped, replicas unchanged: %s", exc)
                self.telemetry.ticks.labels("error").inc()
            stop.wait(max(0.0, self.cfg.interval_s - (self.clock() - started)))


def make_connector(cfg: AutoscalerConfig) -> ScalingConnector:
    if cfg.connector is ConnectorKind.KUBERNETES:
        from autoscaler.kubernetes import KubernetesConnector, KubernetesTargets, load_api

        targets = KubernetesTargets(namespace=cfg.namespace,
                                    prefill_deployment=cfg.prefill_deployment,
                                    decode_deployment=cfg.decode_deployment)
        return KubernetesConnector(load_api(cfg.kubeconfig), targets,
                                   request_timeout_s=cfg.api_timeout_s)
    try:  # the Ray connector lives in its own module and imports ray lazily
        from autoscaler.ray_connector import RayConnector
    except ImportError as exc:
        raise ConfigError(f"--connector ray is not available: {exc}") from exc
    return RayConnector.from_config(cfg)


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape is noise
    try:
        cfg = config_from_args(ns)
        connector = make_connector(cfg)
    except TandemError as exc:
        log.error("%s", exc.message)
        return 2

    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping after the current tick", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    scaler = Autoscaler(cfg, connector, lambda: fetch_router_metrics(
        cfg.router_metrics_url, cfg.router_discovery, cfg.http_timeout_s))
    server = None
    if cfg.metrics_port:
        server, _thread = start_http_server(cfg.metrics_port, registry=scaler.telemetry.registry)
    log.info("autoscaling %s/%s and %s/%s every %gs via %s%s", cfg.namespace,
             cfg.prefill_deployment, cfg.namespace, cfg.decode_deployment, cfg.interval_s,
             cfg.connector.value, " (dry run)" if cfg.dry_run else "")
    try:
        scaler.run(stop)
    finally:
        if server is not None:
            server.shutdown()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))

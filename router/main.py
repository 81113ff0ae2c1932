"""`tandem router`: flags -> RouterConfig -> fleet + admission queue + orchestrator + handlers -> uvicorn.

Never imports torch (a test enforces it): the router runs on CPU-only pods.

Shutdown (SIGTERM or SIGINT): drain. New requests get 503 and /ready 503 at once (the Kubernetes
endpoint goes), requests in flight (queued or running) get up to --drain-timeout-s to finish, what
remains then ends with finish_reason "abort" and a message, Aborts reach the workers, and the
process exits. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time

import uvicorn
import zmq.asyncio

from common.errors import ConfigError
from common.event_loop import loop_and_parser
from common.gc_pauses import GcPauses, freeze_startup_heap
from router.admission import AdmissionQueue
from router.api import Serving, build_app
from router.prefill_cost import DEFAULT_REMOTE_PREFILL_MIN_TOKENS, PrefillCost
from router.responses_tools import BUILTIN_POLICIES
from router.config import RouterConfig
from router.edge import ApiKeys, BodyLimit
from router.errors import ServiceDraining
from router.fleet import Discovery, Fleet
from router.handlers import Handlers
from router.harmony import HarmonyFormat
from router.lifecycle import InFlight
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from wire.protocol import MAX_RESERVATION_S

log = logging.getLogger("tandem.router")
# After the drain deadline: the aborted streams' tails get TAIL_S to reach slow readers, the Aborts SETTLE_S,
# open sockets CLOSE_S; 15 s in all, the chart's drain.marginSeconds.
TAIL_S, SETTLE_S, CLOSE_S = 8.0, 2.0, 5.0


def parse_args(argv: list[str]) -> tuple[RouterConfig, Discovery]:
    p = argparse.ArgumentParser(prog="tandem router", description="OpenAI-compatible router for tandem workers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default="gpt-oss")
    p.add_argument("--prefill", action="append", default=[], help="prefill worker tcp://HOST:PORT (repeat)")
    p.add_argument("--decode", action="append", default=[], help="decode worker tcp://HOST:PORT (repeat)")
    p.add_argument("--discovery", choices=["static", "k8s"], default="static",
                   help="k8s: resolve the workers' headless Services through cluster DNS")
    p.add_argument("--namespace", default="default")
    p.add_argument("--prefill-service", default=None)
    p.add_argument("--decode-service", default=None)
    p.add_argument("--prefill-port", type=int, default=7100)
    p.add_argument("--decode-port", type=int, default=7200)
    p.add_argument("--colocated", action="store_true", help="prefill on the decode workers")
    p.add_argument("--max-model-len", type=int, default=131072)
    p.add_argument("--default-max-tokens", type=int, default=0,
                   help="max_tokens of a request that names none; 0 (default) = the room its context leaves, as "
                        "OpenAI and vLLM: the smaller of --max-model-len and the decode workers' context and KV "
                        "cache (before 2026-12-06: 4096, which cut long reasoning)")
    p.add_argument("--poll-interval-s", type=float, default=1.0)
    p.add_argument("--transfer-deadline-s", type=float, default=60.0,
                   help="a prefill's KV transfer from its start (the network part; compute is not counted)")
    p.add_argument("--prefill-timeout-s", type=float, default=600.0,
                   help="a prefill worker's answer (queue + compute + transfer); a decode worker holds the "
                        "pages it reserved this long plus --transfer-deadline-s")
    p.add_argument("--stream-timeout-s", type=float, default=300.0)
    o = p.add_argument_group("overload, cancellation and shutdown")
    o.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests that may wait for KV room / a sequence slot; past it, 429")
    o.add_argument("--max-queue-wait-s", type=float, default=600.0, help="longest wait in the queue; past it, 429")
    o.add_argument("--max-prefill-queue", type=int, default=4,
                   help="requests a prefill worker may hold (running + queued); more wait in the router, "
                        "where no decode reservation's transfer deadline runs")
    o.add_argument("--worker-grace-s", type=float, default=30.0,
                   help="a worker marked down for missed status polls (a loaded host) is late, not gone, this "
                        "long after its last answer: requests wait in the queue for it instead of getting 503. "
                        "Marking down takes 3 missed polls (~9 s at the 1 s poll interval); 0 = no grace")
    o.add_argument("--request-timeout-s", type=float, default=0.0,
                   help="abort a request running longer than this (arrival to last token); 0 = no limit")
    o.add_argument("--drain-timeout-s", type=float, default=60.0,
                   help="on SIGTERM: how long requests in flight may still run before they end with 'abort'")
    o.add_argument("--max-request-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    o.add_argument("--api-key", action="append", default=[],
                   help="require Authorization: Bearer KEY on /v1/* (repeat for several; also env TANDEM_API_KEYS, "
                        "comma-separated)")
    o.add_argument("--remote-prefill-min-tokens", type=int, default=DEFAULT_REMOTE_PREFILL_MIN_TOKENS,
                   help="a decode worker holding a cached prefix prefills the rest itself when the uncached "
                        "suffix is shorter than this (on an idle fleet; queues shift it: router/prefill_cost.py); "
                        "0 = always on a prefill worker. Default from measured H200 figures")
    o.add_argument("--responses-store-size", type=int, default=1024,
                   help="stored /v1/responses (for previous_response_id), least recently used dropped first")
    o.add_argument("--builtin-tools", choices=BUILTIN_POLICIES, default="ignore",
                   help="/v1/responses tools OpenAI runs itself (web_search, file_search, ...; Codex sends web_search "
                        "on every request): ignore = the model is not offered them, the response's "
                        "x-tandem-ignored-tools header names them; refuse = 400")
    a = p.parse_args(argv)
    if a.max_prefill_queue < 1:
        raise ConfigError("--max-prefill-queue must be >= 1")
    if (a.max_queued_requests < 0 or a.max_queue_wait_s <= 0 or a.drain_timeout_s < 0 or a.request_timeout_s < 0
            or a.worker_grace_s < 0):
        raise ConfigError("--max-queued-requests, --request-timeout-s, --drain-timeout-s and --worker-grace-s "
                          "must be >= 0, --max-queue-wait-s > 0")
    if not (a.transfer_deadline_s > 0 and a.prefill_timeout_s > 0
            and a.transfer_deadline_s + a.prefill_timeout_s <= MAX_RESERVATION_S):
        raise ConfigError(f"--transfer-deadline-s and --prefill-timeout-s must be > 0, their sum (a decode "
                          f"reservation's life) at most {MAX_RESERVATION_S:.0f} s")
    if a.default_max_tokens < 0:
        raise ConfigError("--default-max-tokens must be >= 0 (0: the room the context leaves)")
    if a.max_request_bytes < 1024:
        raise ConfigError("--max-request-bytes must be at least 1024")
    keys = tuple(k for k in [*a.api_key, *os.environ.get("TANDEM_API_KEYS", "").split(",")] if k.strip())
    if a.discovery == "k8s":
        if not a.decode_service:
            raise ConfigError("--discovery k8s needs --decode-service (and --prefill-service unless colocated)")
        prefill = [f"{a.prefill_service}.{a.namespace}.svc:{a.prefill_port}"] if a.prefill_service else []
        decode = [f"{a.decode_service}.{a.namespace}.svc:{a.decode_port}"]
        disc = Discovery(prefill, decode, dns=True)
    else:
        if not a.decode:
            raise ConfigError("give at least one --decode worker address (or --discovery k8s)")
        disc = Discovery(list(a.prefill), list(a.decode))
    cfg = RouterConfig(host=a.host, port=a.port, model_name=a.model_name, prefill=tuple(disc.prefill),
                       decode=tuple(disc.decode), dns_discovery=disc.dns, colocated=a.colocated,
                       poll_interval_s=a.poll_interval_s, transfer_deadline_s=a.transfer_deadline_s,
                       prefill_timeout_s=a.prefill_timeout_s, stream_timeout_s=a.stream_timeout_s,
                       max_model_len=a.max_model_len, default_max_tokens=a.default_max_tokens,
                       max_queued_requests=a.max_queued_requests,
                       max_queue_wait_s=a.max_queue_wait_s, max_prefill_queue=a.max_prefill_queue,
                       worker_grace_s=a.worker_grace_s,
                       request_timeout_s=a.request_timeout_s,
                       drain_timeout_s=a.drain_timeout_s, max_request_bytes=a.max_request_bytes,
                       api_keys=tuple(k.strip() for k in keys), prefill_cost=PrefillCost(a.remote_prefill_min_tokens),
                       responses_store_size=a.responses_store_size, builtin_tools=a.builtin_tools)
    return cfg, disc


def make_app(cfg: RouterConfig, disc: Discovery):
    """The ASGI app; `app.state.drain()` (a coroutine) drains it for shutdown."""
    ctx = zmq.asyncio.Context()
    fleet = Fleet(disc, ctx, cfg.poll_interval_s, cfg.worker_grace_s)
    metrics = RouterMetrics()
    admission = AdmissionQueue(fleet, metrics, max_queued=cfg.max_queued_requests, max_wait_s=cfg.max_queue_wait_s,
                               colocated=cfg.colocated, max_prefill_queue=cfg.max_prefill_queue,
                               cost=cfg.prefill_cost)
    orch = Orchestrator(fleet, cfg, metrics, admission)
    handlers = Handlers(cfg, orch, metrics, HarmonyFormat())

    def ready() -> tuple[bool, str]:
        # A late worker counts: requests sent now wait for it in the queue, and a router taken out of
        # the Service while its workers are merely slow would turn them into connection errors instead.
        snap = fleet.snapshot()
        if not any(w.healthy and w.ready or w.late for w in snap.decode):
            return False, "no decode worker ready"
        if snap.prefill and not cfg.colocated and not any(w.healthy and w.ready or w.late for w in snap.prefill):
            return False, "no prefill worker ready"
        return True, ""

    serving = Serving(ready, lambda: metrics.render(fleet.phase_gauges(), fleet.prefix_evictions(),
                                                    fleet.liveness_counts()),
                      InFlight(cfg.request_timeout_s, metrics.inflight.set))
    app = build_app(handlers, serving)

    async def drain() -> None:
        if serving.draining:
            return
        serving.draining = True
        metrics.draining.set(1)
        t_end = time.monotonic() + cfg.drain_timeout_s
        log.info("draining: no new requests; %d in flight get up to %g s", len(serving.inflight), cfg.drain_timeout_s)
        while len(serving.inflight) and time.monotonic() < t_end:
            await asyncio.sleep(0.05)
        n = serving.inflight.cancel_all(ServiceDraining(
            f"the server is shutting down: the request was still running at the end of the drain period "
            f"({cfg.drain_timeout_s:g} s) and was aborted"))
        if n:
            log.warning("drain deadline: ended %d requests with finish_reason abort", n)
        # their tails written (a slow reader first gets the tokens queued before its tail), their Aborts sent
        t_end = time.monotonic() + TAIL_S
        while len(serving.inflight) and time.monotonic() < t_end:
            await asyncio.sleep(0.02)
        await orch.settle(SETTLE_S)

    pauses = GcPauses(metrics.registry)  # tandem_gc_pause_seconds: the loop stalls they cause

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        pauses.install()
        await fleet.start()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(fleet.first_poll.wait(), cfg.poll_interval_s * 3)
        yield
        pauses.remove()
        await fleet.close()
        ctx.term()

    app.router.lifespan_context = lifespan
    app.state.drain = drain
    app.state.serving = serving
    outer = BodyLimit(app, cfg.max_request_bytes)
    outer = ApiKeys(outer, cfg.api_keys)
    outer.state = app.state  # type: ignore[attr-defined]  # for main() and tests
    return outer


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains (router keeps its socket and answers 503)
    before the server stops; a second signal stops it at once."""

    def __init__(self, config: uvicorn.Config, drain) -> None:
        super().__init__(config)
        self._drain, self._draining = drain, False

    def handle_exit(self, sig: int, frame) -> None:
        if self._draining:
            self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True


def main(argv: list[str]) -> int:
    cfg, disc = parse_args(argv)
    app = make_app(cfg, disc)
    log.info("router on http://%s:%d, prefill %s, decode %s%s%s", cfg.host, cfg.port, list(cfg.prefill),
             list(cfg.decode), " (colocated)" if cfg.colocated else "", ", API keys required" if cfg.api_keys else "")
    # The router's one event loop carries every stream's SSE events. uvloop + httptools against asyncio's
    # loop + h11 (multi-turn-colocated-pw-7/8): the HTTP part of uncached TTFTs fell from 12-15 to 5-9 ms,
    # cached turns did not move. Named explicitly, so the log says which pair runs.
    loop, http = loop_and_parser()
    log.info("event loop %s, HTTP parser %s", loop, http)
    server = DrainingServer(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", loop=loop,
                                           http=http, timeout_graceful_shutdown=CLOSE_S), app.state.drain)
    freeze_startup_heap("router")  # the process only (not make_app: test processes build many apps)
    server.run()
    return 0

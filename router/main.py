"""`tandem router`: flags -> RouterConfig -> fleet + orchestrator + handlers -> uvicorn.

Never imports torch (a test enforces it): the router runs on CPU-only pods.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

import uvicorn
import zmq.asyncio

from common.errors import ConfigError
from router.api import build_app
from router.config import RouterConfig
from router.fleet import Discovery, Fleet
from router.handlers import Handlers
from router.harmony import HarmonyFormat
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator

log = logging.getLogger("tandem.router")


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
    p.add_argument("--poll-interval-s", type=float, default=1.0)
    p.add_argument("--transfer-deadline-s", type=float, default=60.0)
    p.add_argument("--prefill-timeout-s", type=float, default=600.0)
    p.add_argument("--stream-timeout-s", type=float, default=300.0)
    p.add_argument("--responses-store-size", type=int, default=1024,
                   help="stored /v1/responses (for previous_response_id), least recently used dropped first")
    a = p.parse_args(argv)
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
                       max_model_len=a.max_model_len, responses_store_size=a.responses_store_size)
    return cfg, disc


def make_app(cfg: RouterConfig, disc: Discovery):
    ctx = zmq.asyncio.Context()
    fleet = Fleet(disc, ctx, cfg.poll_interval_s)
    metrics = RouterMetrics()
    handlers = Handlers(cfg, Orchestrator(fleet, cfg, metrics), metrics, HarmonyFormat())

    def ready() -> tuple[bool, str]:
        snap = fleet.snapshot()
        if not any(w.healthy and w.ready for w in snap.decode):
            return False, "no decode worker ready"
        if snap.prefill and not cfg.colocated and not any(w.healthy and w.ready for w in snap.prefill):
            return False, "no prefill worker ready"
        return True, ""

    app = build_app(handlers, ready, lambda: metrics.render(fleet.phase_gauges()))

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await fleet.start()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(fleet.first_poll.wait(), cfg.poll_interval_s * 3)
        yield
        await fleet.close()
        ctx.term()

    app.router.lifespan_context = lifespan
    return app


def main(argv: list[str]) -> int:
    cfg, disc = parse_args(argv)
    app = make_app(cfg, disc)
    log.info("router on http://%s:%d, prefill %s, decode %s%s", cfg.host, cfg.port, list(cfg.prefill),
             list(cfg.decode), " (colocated)" if cfg.colocated else "")
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=30)
    return 0

"""Autoscaler configuration: CLI flags -> one frozen `AutoscalerConfig` (with the core's `Policy`).

Role: the only place flags are read. Built once by main.py; the helm chart's `autoscaler:` values
map onto these flags 1:1 (templates/autoscaler-deployment.yaml). Invalid combinations raise
`ConfigError` here, before the loop starts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from enum import Enum

from autoscaler.core import PhasePolicy, Policy
from common.errors import ConfigError


class ConnectorKind(str, Enum):
    KUBERNETES = "kubernetes"
    RAY = "ray"


class RouterDiscovery(str, Enum):
    STATIC = "static"  # scrape --router-metrics-url as given (one router)
    DNS = "dns"        # its host is a headless Service: scrape every address it resolves to


@dataclass(frozen=True, slots=True)
class AutoscalerConfig:
    connector: ConnectorKind
    namespace: str
    prefill_deployment: str
    decode_deployment: str
    router_metrics_url: str
    router_discovery: RouterDiscovery
    interval_s: float
    window_s: float
    http_timeout_s: float      # deadline for each router scrape
    api_timeout_s: float       # deadline for each platform API call
    kubeconfig: str | None     # None: in-cluster credentials, else ~/.kube/config
    metrics_port: int          # 0: do not serve the autoscaler's own /metrics
    dry_run: bool              # decide and log, never change replicas
    policy: Policy


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem autoscaler",
                                description="Scale tandem's prefill and decode phases separately.")
    p.add_argument("--connector", choices=[k.value for k in ConnectorKind], required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--prefill-deployment", required=True)
    p.add_argument("--decode-deployment", required=True)
    p.add_argument("--router-metrics-url", required=True, help="e.g. http://router:8000/metrics")
    p.add_argument("--router-discovery", choices=[d.value for d in RouterDiscovery],
                   default=RouterDiscovery.STATIC.value,
                   help="dns: the URL's host is a headless Service; scrape every router replica "
                        "(each has its own latency histograms)")
    p.add_argument("--interval-s", type=float, default=15.0)
    p.add_argument("--window-s", type=float, default=60.0,
                   help="latency quantiles are computed over this trailing window")
    p.add_argument("--http-timeout-s", type=float, default=5.0)
    p.add_argument("--api-timeout-s", type=float, default=10.0)
    p.add_argument("--kubeconfig", default=None)
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    slo = p.add_argument_group("SLO targets (seconds)")
    slo.add_argument("--ttft-p50-slo-s", type=float, default=1.0)
    slo.add_argument("--ttft-p90-slo-s", type=float, default=2.5)
    slo.add_argument("--itl-p50-slo-s", type=float, default=0.05)
    slo.add_argument("--itl-p90-slo-s", type=float, default=0.1)
    slo.add_argument("--latency-up-fraction", type=float, default=0.9,
                     help="scale up once p50 or p90 reaches this fraction of its SLO")
    slo.add_argument("--latency-down-fraction", type=float, default=0.5,
                     help="scale down only while both are below this fraction of their SLO")

    lim = p.add_argument_group("limits and load thresholds")
    for phase, queue_up, queue_down in (("prefill", 2.0, 0.25), ("decode", 8.0, 1.0)):
        lim.add_argument(f"--{phase}-min-replicas", type=int, default=1)
        lim.add_argument(f"--{phase}-max-replicas", type=int, default=8)
        lim.add_argument(f"--{phase}-queue-up", type=float, default=queue_up,
                         help="queued requests per ready replica that trigger scale-up")
        lim.add_argument(f"--{phase}-queue-down", type=float, default=queue_down,
                         help="queued requests per ready replica below which scale-down may run")
    lim.add_argument("--decode-router-queue-up", type=float, default=4.0,
                     help="requests in the routers' admission queues per ready decode replica that trigger "
                          "decode scale-up (they wait for decode KV room or a slot)")
    lim.add_argument("--decode-router-queue-down", type=float, default=0.5)
    lim.add_argument("--decode-router-wait-up-s", type=float, default=5.0,
                     help="p90 wait in the routers' admission queues that triggers decode scale-up")
    lim.add_argument("--decode-router-wait-down-s", type=float, default=0.5)
    lim.add_argument("--decode-kv-up", type=float, default=0.85)
    lim.add_argument("--decode-kv-down", type=float, default=0.5)
    lim.add_argument("--max-step-up", type=int, default=2)
    lim.add_argument("--max-step-down", type=int, default=1)
    lim.add_argument("--scale-up-cooldown-s", type=float, default=30.0)
    lim.add_argument("--scale-down-cooldown-s", type=float, default=300.0)
    lim.add_argument("--scale-down-stabilization-s", type=float, default=120.0)
    return p


def config_from_args(ns: argparse.Namespace) -> AutoscalerConfig:
    for flag in ("interval_s", "window_s", "http_timeout_s", "api_timeout_s"):
        if getattr(ns, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be > 0")
    if ns.window_s < ns.interval_s:
        raise ConfigError("--window-s must be at least --interval-s (a window needs two scrapes)")
    if not ns.router_metrics_url.startswith(("http://", "https://")):
        raise ConfigError(f"--router-metrics-url must be an http(s) URL: {ns.router_metrics_url}")
    if not 0 <= ns.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port out of range: {ns.metrics_port}")

    shared = dict(latency_up_fraction=ns.latency_up_fraction,
                  latency_down_fraction=ns.latency_down_fraction,
                  max_step_up=ns.max_step_up, max_step_down=ns.max_step_down,
                  scale_up_cooldown_s=ns.scale_up_cooldown_s,
                  scale_down_cooldown_s=ns.scale_down_cooldown_s,
                  scale_down_stabilization_s=ns.scale_down_stabilization_s)
    policy = Policy(
        prefill=PhasePolicy(min_replicas=ns.prefill_min_replicas,
                            max_replicas=ns.prefill_max_replicas,
                            slo_p50_s=ns.ttft_p50_slo_s, slo_p90_s=ns.ttft_p90_slo_s,
                            queue_up_per_replica=ns.prefill_queue_up,
                            queue_down_per_replica=ns.prefill_queue_down, **shared),
        decode=PhasePolicy(min_replicas=ns.decode_min_replicas,
                           max_replicas=ns.decode_max_replicas,
                           slo_p50_s=ns.itl_p50_slo_s, slo_p90_s=ns.itl_p90_slo_s,
                           queue_up_per_replica=ns.decode_queue_up,
                           queue_down_per_replica=ns.decode_queue_down,
                           kv_up_ratio=ns.decode_kv_up, kv_down_ratio=ns.decode_kv_down,
                           router_queue_up_per_replica=ns.decode_router_queue_up,
                           router_queue_down_per_replica=ns.decode_router_queue_down,
                           router_wait_up_s=ns.decode_router_wait_up_s,
                           router_wait_down_s=ns.decode_router_wait_down_s, **shared),
    )
    return AutoscalerConfig(
        connector=ConnectorKind(ns.connector), namespace=ns.namespace,
        prefill_deployment=ns.prefill_deployment, decode_deployment=ns.decode_deployment,
        router_metrics_url=ns.router_metrics_url,
        router_discovery=RouterDiscovery(ns.router_discovery), interval_s=ns.interval_s,
        window_s=ns.window_s, http_timeout_s=ns.http_timeout_s, api_timeout_s=ns.api_timeout_s,
        kubeconfig=ns.kubeconfig, metrics_port=ns.metrics_port, dry_run=ns.dry_run,
        policy=policy)

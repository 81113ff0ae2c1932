"""`tandem ray-launch`: a tandem fleet on a running Ray cluster; the entrypoint of
`ray job submit -- tandem ray-launch ...`.

    ray job submit --address http://HEAD:8265 \
        --runtime-env-json '{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}}' \
        -- tandem ray-launch --device cuda --checkpoint /shared/gpt-oss-120b \
           --num-prefill 2 --prefill-tp 2 --num-decode 1 --decode-tp 4 --decode-moe-mode ep --autoscale
    ray job stop --address http://HEAD:8265 JOB_ID

Lifecycle (this process is the Ray driver; its loop is `Reconciler.step`, launcher/ray_fleet.py):
    ray.init(address="auto") -> fleet registry actor (named, autoscaler/ray_connector.py): the
      replicas asked for per phase
    bring-up: step() until every worker is ready (each in its own placement group) -> router
      actor on this node with their addresses -> until its /ready answers (deadline) -> URL
    serve:    read the asked-for counts -> step() (~0.5 s) -> publish the ready counts. With
      --autoscale, the autoscaler loop (autoscaler/main.py) runs in a thread of this process
      and changes the asked-for counts; `tandem autoscaler --connector ray` can do it from
      elsewhere in the cluster.
    stop (SIGTERM from `ray job stop`, or SIGINT): the router stops taking requests, every
      worker drains at once (SIGTERM; in-flight requests finish), then actors and placement
      groups are removed. `ray job stop` SIGKILLs after RAY_JOB_STOP_WAIT_TIME_S (default 3 s):
      set it in the job's runtime env to cover --drain-grace-s. If this process is killed
      anyway, Ray removes the job's actors and placement groups, and every worker process dies
      with its actor (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autoscaler.connector import ScalingError
from autoscaler.core import Phase
from common.errors import ConfigError, WorkerUnavailable
from launcher import ports
from launcher.ray_actors import RouterLaunch, WorkerLaunch
from launcher.ray_fleet import MemberKey, Reconciler, Timing

if TYPE_CHECKING:  # ray is imported only once the command runs
    from ray.actor import ActorHandle

    from autoscaler.config import AutoscalerConfig
    from autoscaler.ray_connector import RayConnector
    from launcher.ray_actors import RayPlatform

log = logging.getLogger("tandem.ray_launch")


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """How to launch a worker of each phase (built once from the flags)."""

    prefill_flags: tuple[str, ...]
    decode_flags: tuple[str, ...]
    device: str
    base_port: int  # 0: each worker picks free ports on its node
    prefill_bundle: dict[str, float]
    decode_bundle: dict[str, float]

    def launch(self, key: MemberKey) -> WorkerLaunch:
        prefill = key.phase is Phase.PREFILL
        # The same layout as `tandem serve` (launcher.ports.worker_ports); slots past 99 would run into the
        # other phase's range: they take free ports.
        fixed = self.base_port and key.slot < 100
        port, metrics_port = ports.worker_ports(self.base_port, key.phase.value, key.slot) if fixed else (0, 0)
        return WorkerLaunch(role=key.phase.value, slot=key.slot,
                            flags=self.prefill_flags if prefill else self.decode_flags,
                            device=self.device, port=port, metrics_port=metrics_port,
                            bundle=self.prefill_bundle if prefill else self.decode_bundle)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem ray-launch",
                                description="run a tandem fleet on the Ray cluster this job runs in")
    p.add_argument("--checkpoint", default=None,
                   help="HF-layout directory every node can read (default: the embedded demo model, "
                        "written on this node: single-node clusters only)")
    p.add_argument("--model-name", default="gpt-oss-tiny")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (each worker gets TP GPUs from Ray)")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--host", default="0.0.0.0", help="router bind address (on the launcher's node)")
    p.add_argument("--port", type=int, default=8000, help="router port; 0 = a free port")
    p.add_argument("--base-port", type=int, default=0,
                   help="worker i < 100 uses base+100+i (prefill) / base+200+i (decode), metrics "
                        "+1000; 0 = free ports on each node")
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--colocated", action="store_true", help="no prefill workers: decode workers prefill")
    p.add_argument("--prefill-tp", type=int, default=1, help="GPUs per prefill worker")
    p.add_argument("--decode-tp", type=int, default=1,
                   help="GPUs per decode worker (its EP group when --decode-moe-mode ep)")
    p.add_argument("--decode-moe-mode", choices=["tp", "ep"], default="tp")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs in each worker's bundle")
    p.add_argument("--kv-cache-gib", type=float, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-backend", choices=["nixl", "ipc"], default="nixl",
                   help="ipc: KV bytes copied straight into IPC-mapped decode pools between workers on one "
                        "node (NIXL WRITEs between nodes)")
    p.add_argument("--worker-args", default="", help="extra worker flags, one shell-quoted string")
    p.add_argument("--namespace", default="tandem",
                   help="Ray namespace of the fleet registry (`tandem autoscaler --connector ray "
                        "--namespace` finds the fleet by it)")
    p.add_argument("--ready-timeout-s", type=float, default=300)
    p.add_argument("--drain-grace-s", type=float, default=30)
    p.add_argument("--router-poll-interval-s", type=float, default=1.0,
                   help="router status polls; it adopts fleet changes every 10 polls")
    p.add_argument("--autoscale", action="store_true", help="run the autoscaler loop in this job")
    p.add_argument("--autoscale-args", default="",
                   help="extra `tandem autoscaler` flags (SLOs, limits), one shell-quoted string")
    return p


def fleet_spec(a: argparse.Namespace, checkpoint: str) -> FleetSpec:
    cuda = a.device.startswith("cuda")
    common = ["--checkpoint", checkpoint, "--device", a.device, "--max-num-seqs", str(a.max_num_seqs)]
    if a.fp8:
        common.append("--fp8")
    if a.kv_cache_gib:
        common += ["--kv-cache-gib", str(a.kv_cache_gib)]
    if not cuda:
        common += ["--cpu-threads", str(max(1, int(a.cpus_per_worker)))]
    extra = shlex.split(a.worker_args)  # last, so they win over ours
    prefill = (*common, "--kv-backend", a.kv_backend, "--tp", str(a.prefill_tp), *extra)
    decode = (*common, "--kv-backend", "none" if a.colocated else a.kv_backend, "--tp", str(a.decode_tp),
              "--moe-mode", a.decode_moe_mode, *extra)

    def bundle(tp: int) -> dict[str, float]:
        return {"CPU": a.cpus_per_worker, **({"GPU": float(tp)} if cuda else {})}

    return FleetSpec(prefill, decode, a.device, a.base_port, bundle(a.prefill_tp), bundle(a.decode_tp))


def check_args(a: argparse.Namespace) -> None:
    if a.num_decode < 1 or (not a.colocated and a.num_prefill < 1):
        raise ConfigError("a fleet needs >= 1 decode worker and, unless --colocated, >= 1 prefill worker")
    if a.prefill_tp < 1 or a.decode_tp < 1 or a.cpus_per_worker <= 0:
        raise ConfigError("--prefill-tp/--decode-tp must be >= 1 and --cpus-per-worker > 0")
    if a.autoscale and a.colocated:
        raise ConfigError("--autoscale scales prefill and decode separately; a --colocated fleet "
                          "has no prefill phase")
    if min(a.ready_timeout_s, a.drain_grace_s, a.router_poll_interval_s) <= 0:
        raise ConfigError("timeouts and intervals must be > 0")


def _router_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def bring_up(a: argparse.Namespace, rec: Reconciler, platform: RayPlatform, desired: dict[Phase, int],
             stop: threading.Event) -> str | None:
    """Workers ready, then the router with their addresses, then its /ready; None when stopped
    first. The router starts last so it never sees workers that are still loading as down."""
    deadline = time.monotonic() + a.ready_timeout_s

    def keep_going(what: str) -> bool:
        if stop.is_set():
            return False
        if time.monotonic() > deadline:
            raise WorkerUnavailable(f"{what} within {a.ready_timeout_s:.0f} s (`ray status` shows "
                                    "whether the cluster has room for every worker's bundle)")
        return True

    while not rec.all_ready(desired):
        if not keep_going("the workers were not ready"):
            return None
        rec.step(desired)
    prefill, decode = rec.addresses()
    flags = ("--model-name", a.model_name, "--poll-interval-s", str(a.router_poll_interval_s),
             *(("--colocated",) if a.colocated else ()))
    url = platform.start_router(RouterLaunch(a.host, a.port, flags, prefill, decode,
                                             graceful_s=a.drain_grace_s), timeout_s=60)
    rec.router_live = True
    while not _router_ready(url):
        if not keep_going("the service was not ready"):
            return None
        rec.step(desired)
    return url


def autoscaler_config(a: argparse.Namespace, router_url: str) -> AutoscalerConfig:
    from autoscaler.config import build_parser as autoscaler_parser
    from autoscaler.config import config_from_args

    ns = autoscaler_parser().parse_args([
        "--connector", "ray", "--namespace", a.namespace, "--prefill-deployment", "prefill",
        "--decode-deployment", "decode", "--router-metrics-url", router_url + "/metrics",
        *shlex.split(a.autoscale_args)])
    return config_from_args(ns)


def start_autoscaler(a: argparse.Namespace, registry: ActorHandle, url: str,
                     stop: threading.Event) -> threading.Thread:
    from autoscaler.main import Autoscaler, fetch_router_metrics
    from autoscaler.ray_connector import RayConnector

    cfg = autoscaler_config(a, url)
    scaler = Autoscaler(cfg, RayConnector(registry, timeout_s=cfg.api_timeout_s), lambda: fetch_router_metrics(
        cfg.router_metrics_url, cfg.router_discovery, cfg.http_timeout_s))
    thread = threading.Thread(target=scaler.run, args=(stop,), name="autoscaler", daemon=True)
    thread.start()
    log.info("autoscaler running every %g s", cfg.interval_s)
    return thread


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    check_args(a)
    if a.autoscale:
        autoscaler_config(a, "http://router")  # flag errors now, not after the fleet is up
    if a.checkpoint is None:
        from launcher.cmd_serve import DEFAULT_CACHE
        from model.checkpoint_io import ensure_demo_checkpoint

        a.checkpoint = str(ensure_demo_checkpoint(DEFAULT_CACHE))
    import ray

    from autoscaler.ray_connector import FLEET_ACTOR, FleetRegistry, RayConnector
    from launcher.ray_actors import RayPlatform

    try:
        ray.init(address="auto", namespace=a.namespace)
    except ConnectionError as exc:
        raise ConfigError(f"no Ray cluster to join (run it as `ray job submit -- tandem "
                          f"ray-launch ...`, or on a node of a running cluster): {exc}") from exc
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: draining and stopping", signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which sets its own
        signal.signal(sig, on_signal)
    desired = {Phase.PREFILL: 0 if a.colocated else a.num_prefill, Phase.DECODE: a.num_decode}
    try:
        registry = ray.remote(FleetRegistry).options(
            name=FLEET_ACTOR, num_cpus=0, max_restarts=0).remote(desired, colocated=a.colocated)
    except ValueError as exc:
        raise ConfigError(f"a tandem fleet is already running in Ray namespace {a.namespace!r}; "
                          "stop it or pass another --namespace") from exc
    connector = RayConnector(registry, timeout_s=10)
    platform = RayPlatform()
    rec = Reconciler(platform, fleet_spec(a, a.checkpoint).launch,
                     Timing(ready_timeout_s=a.ready_timeout_s, drain_grace_s=a.drain_grace_s))
    scaler = None
    try:
        url = bring_up(a, rec, platform, desired, stop)
        if url is None:
            return 0
        rec.strict = False  # from now on a dead worker is replaced, not fatal
        connector.publish(rec.ready_counts(), url)  # consistent before the URL is announced
        print(f"tandem is serving {a.model_name} at {url}/v1  ({desired[Phase.PREFILL]} prefill + "
              f"{desired[Phase.DECODE]} decode workers on {a.device}; `ray job stop` stops it)",
              flush=True)
        if a.autoscale:
            scaler = start_autoscaler(a, registry, url, stop)
        serve(rec, platform, connector, desired, url, stop)
    finally:
        stop.set()
        shutdown(rec, platform, scaler, a.drain_grace_s)
        ray.kill(registry, no_restart=True)
    return 0


def serve(rec: Reconciler, platform: RayPlatform, registry: RayConnector, desired: dict[Phase, int],
          url: str, stop: threading.Event) -> None:
    """Until stopped: follow the asked-for counts, report the ready ones. A registry call that
    fails keeps the last counts (holding the fleet as it is is always safe)."""
    while not stop.is_set():
        why = platform.router_exit()
        if why is not None:
            raise WorkerUnavailable(f"the router ended ({why}); stopping the fleet")
        try:
            desired = registry.desired()
        except ScalingError as exc:
            log.warning("fleet registry: %s", exc)
        rec.step(desired)
        try:
            registry.publish(rec.ready_counts(), url)
        except ScalingError as exc:
            log.warning("fleet registry: %s", exc)


def shutdown(rec: Reconciler, platform: RayPlatform, scaler: threading.Thread | None, grace_s: float) -> None:
    """Router first (no new requests), every worker drains at the same time, then the actors
    and placement groups go. Kills only what outlives the grace."""
    if scaler is not None:
        scaler.join(timeout=15)  # it stops after its current tick (every call has a deadline)
    t0 = time.monotonic()
    platform.begin_router_stop()
    rec.drain_all(deadline_s=t0 + grace_s)
    platform.close(timeout_s=max(1.0, t0 + grace_s + 5 - time.monotonic()))
    log.info("stopped: every worker drained or killed, actors and placement groups removed "
             "(%.1f s)", time.monotonic() - t0)

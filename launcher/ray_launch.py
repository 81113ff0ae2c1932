"""`tandem ray-launch`: a tandem fleet on a running Ray cluster; the entrypoint of
`ray job submit -- tandem ray-launch ...`.

Lifecycle (this process is the Ray driver; one loop, `Reconciler.step`, paced by its polls):
    ray.init(address="auto") -> fleet registry actor (named, autoscaler/ray_connector.py) holding
      the replicas asked for per phase
    bring-up: step() until every worker has started -> router actor on this node with their
      addresses -> step() until the router's /ready answers (deadline) -> print the URL
    serve:    every ~0.5 s: read the asked-for counts -> step(): observe workers (started, ready,
      exited), start missing ones, drain surplus ones, remove drained ones, push the address
      lists to the router -> publish the ready counts. With --autoscale, the autoscaler loop
      (autoscaler/main.py) runs in a thread and changes the asked-for counts.
    stop (SIGTERM from `ray job stop`, or SIGINT): the router stops taking requests, every
      worker drains (SIGTERM; in-flight requests finish), then actors and placement groups are
      removed. `ray job stop` waits RAY_JOB_STOP_WAIT_TIME_S (default 3 s) before SIGKILL, so
      raise it in the job's runtime env to the drain grace you want. If this process dies
      anyway, Ray removes the job's actors and placement groups, and each worker process dies
      with its actor (PR_SET_PDEATHSIG).

Scale-down never kills in-flight work: a surplus worker gets SIGTERM, keeps its place in the
router's lists while it drains (the router sees it `draining` and sends it nothing new), and its
actor and placement group are removed only after its process exited (or after --drain-grace-s).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import shlex
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from autoscaler.connector import ScalingError
from autoscaler.core import Phase
from common.errors import ConfigError, WorkerUnavailable
from launcher.ray_actors import Observation, RouterLaunch, WorkerEndpoint, WorkerLaunch

log = logging.getLogger("tandem.ray_launch")


class MemberState(str, Enum):
    STARTING = "starting"   # placement group pending, or process started and not ready yet
    READY = "ready"         # its /ready answered once; serving
    DRAINING = "draining"   # told to finish its work and exit


@dataclass(frozen=True, slots=True)
class MemberKey:
    phase: Phase
    slot: int

    def __str__(self) -> str:
        return f"{self.phase.value} worker {self.slot}"


@dataclass(slots=True)
class Member:
    key: MemberKey
    state: MemberState = MemberState.STARTING
    endpoint: WorkerEndpoint | None = None
    started_s: float | None = None       # when its process was spawned
    drain_deadline_s: float | None = None
    exit_note: str | None = None         # set once its process exited or its actor failed


@dataclass(frozen=True, slots=True)
class PhasePlan:
    start: tuple[int, ...]  # slots to launch
    drain: tuple[int, ...]  # slots to drain


def plan_phase(desired: int, members: Sequence[Member]) -> PhasePlan:
    """Pure policy for one phase: launch into the lowest free slots, or drain the surplus,
    choosing workers that are not serving yet first (nothing in flight), then the highest slots.
    Draining workers do not count: they are on their way out."""
    active = [m for m in members if m.state is not MemberState.DRAINING]
    if len(active) < desired:
        used = {m.key.slot for m in members}
        free = (s for s in itertools.count() if s not in used)
        return PhasePlan(tuple(itertools.islice(free, desired - len(active))), ())
    order = sorted(active, key=lambda m: (m.state is MemberState.READY, -m.key.slot))
    return PhasePlan((), tuple(m.key.slot for m in order[:len(active) - desired]))


class Platform(Protocol):
    """What the loop needs from Ray (launcher/ray_actors.py: RayPlatform); tests use a fake."""

    def launch(self, key: MemberKey, spec: WorkerLaunch) -> None: ...
    def poll(self, keys: list[MemberKey], timeout_s: float) -> dict[MemberKey, Observation]: ...
    def drain(self, key: MemberKey) -> None: ...
    def remove(self, key: MemberKey, *, kill: bool) -> None: ...
    def set_router_workers(self, prefill: tuple[str, ...], decode: tuple[str, ...]) -> None: ...


@dataclass(frozen=True, slots=True)
class Timing:
    poll_s: float = 0.5           # one loop iteration waits this long for worker answers
    ready_timeout_s: float = 300  # a started process must report ready within this
    drain_grace_s: float = 30     # a draining worker is killed after this


class Reconciler:
    """Brings the workers of each phase to the asked-for count. `strict` (during bring-up): a
    worker that dies or misses its start deadline fails the launch instead of being replaced."""

    def __init__(self, platform: Platform, launch_spec: Callable[[MemberKey], WorkerLaunch],
                 timing: Timing, clock: Callable[[], float] = time.monotonic) -> None:
        self.platform, self.launch_spec, self.timing, self.clock = platform, launch_spec, timing, clock
        self.members: dict[MemberKey, Member] = {}
        self.strict = True
        self.router_live = False  # push address lists only once the router runs
        self._pushed: tuple[tuple[str, ...], tuple[str, ...]] | None = None

    def step(self, desired: dict[Phase, int]) -> None:
        now = self.clock()
        for key, obs in self.platform.poll(list(self.members), self.timing.poll_s).items():
            self._observe(self.members[key], obs, now)
        for m in list(self.members.values()):
            self._reap(m, now)
        for phase in Phase:
            plan = plan_phase(desired[phase], [m for m in self.members.values() if m.key.phase is phase])
            for slot in plan.start:
                key = MemberKey(phase, slot)
                log.info("%s: launching", key)
                self.members[key] = Member(key)
                self.platform.launch(key, self.launch_spec(key))
            for slot in plan.drain:
                self._drain(self.members[MemberKey(phase, slot)], now)
        self._sync_router()

    def _observe(self, m: Member, obs: Observation, now: float) -> None:
        if obs.endpoint is not None and m.endpoint is None:
            m.endpoint, m.started_s = obs.endpoint, now
            log.info("%s: process %d started on %s (%s)", m.key, obs.endpoint.pid,
                     obs.endpoint.node_ip, obs.endpoint.address)
        if obs.failed is not None:
            m.exit_note = obs.failed
        elif obs.probe is not None and obs.probe.exit_code is not None:
            m.exit_note = f"exit code {obs.probe.exit_code}"
        elif obs.probe is not None and obs.probe.ready and m.state is MemberState.STARTING:
            m.state = MemberState.READY
            log.info("%s: ready", m.key)

    def _reap(self, m: Member, now: float) -> None:
        if m.exit_note is not None:
            if m.state is MemberState.DRAINING:
                log.info("%s: drained (%s); removing", m.key, m.exit_note)
                self._remove(m, kill=False)
                return
            if self.strict:
                raise WorkerUnavailable(f"{m.key} failed during start-up: {m.exit_note}")
            log.error("%s: died (%s); removing it, a replacement follows", m.key, m.exit_note)
            self._remove(m, kill=False)
        elif m.state is MemberState.DRAINING and now >= m.drain_deadline_s:
            log.warning("%s: still running %.0f s after SIGTERM; killing it", m.key,
                        self.timing.drain_grace_s)
            self._remove(m, kill=True)
        elif (m.state is MemberState.STARTING and m.started_s is not None
              and now - m.started_s > self.timing.ready_timeout_s):
            if self.strict:
                raise WorkerUnavailable(f"{m.key} was not ready within "
                                        f"{self.timing.ready_timeout_s:.0f} s")
            log.error("%s: not ready within %.0f s; removing it", m.key, self.timing.ready_timeout_s)
            self._remove(m, kill=True)

    def _drain(self, m: Member, now: float) -> None:
        if m.endpoint is None:  # still waiting for its placement group: no process, no work
            log.info("%s: not started yet; removing it", m.key)
            self._remove(m, kill=True)
            return
        log.info("%s: draining (SIGTERM; in-flight requests finish)", m.key)
        m.state, m.drain_deadline_s = MemberState.DRAINING, now + self.timing.drain_grace_s
        self.platform.drain(m.key)

    def _remove(self, m: Member, *, kill: bool) -> None:
        del self.members[m.key]
        self.platform.remove(m.key, kill=kill)

    def addresses(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(prefill, decode) addresses the router should know: every worker that has a process,
        draining ones included (they finish their streams; the router sends them nothing new)."""
        by_phase = {phase: tuple(m.endpoint.address for m in sorted(self.members.values(),
                                                                   key=lambda m: m.key.slot)
                                 if m.key.phase is phase and m.endpoint is not None)
                    for phase in Phase}
        return by_phase[Phase.PREFILL], by_phase[Phase.DECODE]

    def _sync_router(self) -> None:
        lists = self.addresses()
        if self.router_live and lists != self._pushed:
            self.platform.set_router_workers(*lists)
            self._pushed = lists

    def all_ready(self, desired: dict[Phase, int]) -> bool:
        return all(self.ready_counts()[phase] >= desired[phase] for phase in Phase)

    def ready_counts(self) -> dict[Phase, int]:
        return {phase: sum(1 for m in self.members.values()
                           if m.key.phase is phase and m.state is MemberState.READY)
                for phase in Phase}

    def drain_all(self, deadline_s: float) -> None:
        """Shutdown: drain every worker, wait for them (until the deadline), kill the rest."""
        zero = {phase: 0 for phase in Phase}
        self.strict = False
        while self.members and self.clock() < deadline_s:
            self.step(zero)
        for m in list(self.members.values()):
            log.warning("%s: not drained by the shutdown deadline; killing it", m.key)
            self._remove(m, kill=True)


# ---- the command ---------------------------------------------------------------------------

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
        # The same port layout as `tandem serve`: base+100+i prefill, base+200+i decode, +1000 metrics.
        port = self.base_port + (100 if prefill else 200) + key.slot if self.base_port else 0
        return WorkerLaunch(role=key.phase.value, slot=key.slot,
                            flags=self.prefill_flags if prefill else self.decode_flags,
                            device=self.device, port=port, metrics_port=port + 1000 if port else 0,
                            bundle=self.prefill_bundle if prefill else self.decode_bundle)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem ray-launch",
                                description="run a tandem fleet on the Ray cluster this job runs in")
    p.add_argument("--checkpoint", default=None,
                   help="HF-layout directory every node can read (default: the embedded tiny model, "
                        "written on this node: single-node clusters only)")
    p.add_argument("--model-name", default="gpt-oss-tiny")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (each worker gets TP GPUs from Ray)")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--host", default="0.0.0.0", help="router bind address (on the launcher's node)")
    p.add_argument("--port", type=int, default=8000, help="router port; 0 = a free port")
    p.add_argument("--base-port", type=int, default=0,
                   help="worker i uses base+100+i (prefill) / base+200+i (decode), metrics +1000; "
                        "0 = free ports on each node")
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
    prefill = (*common, "--kv-backend", "nixl", "--tp", str(a.prefill_tp), *extra)
    decode = (*common, "--kv-backend", "none" if a.colocated else "nixl", "--tp", str(a.decode_tp),
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


def bring_up(a: argparse.Namespace, rec: Reconciler, platform, desired: dict[Phase, int],
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


def autoscaler_config(a: argparse.Namespace, router_url: str):
    from autoscaler.config import build_parser as autoscaler_parser
    from autoscaler.config import config_from_args

    ns = autoscaler_parser().parse_args([
        "--connector", "ray", "--namespace", a.namespace, "--prefill-deployment", "prefill",
        "--decode-deployment", "decode", "--router-metrics-url", router_url + "/metrics",
        *shlex.split(a.autoscale_args)])
    return config_from_args(ns)


def start_autoscaler(a: argparse.Namespace, registry, url: str, stop: threading.Event) -> threading.Thread:
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
        from model.checkpoint_io import ensure_checkpoint

        a.checkpoint = str(ensure_checkpoint("tiny", DEFAULT_CACHE))
    import ray

    from autoscaler.ray_connector import FLEET_ACTOR, FleetRegistry, RayConnector
    from launcher.ray_actors import RayPlatform

    ray.init(address="auto", namespace=a.namespace)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: draining and stopping", signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which sets its own
        signal.signal(sig, on_signal)
    desired = {Phase.PREFILL: 0 if a.colocated else a.num_prefill, Phase.DECODE: a.num_decode}
    try:
        registry = ray.remote(FleetRegistry).options(name=FLEET_ACTOR, num_cpus=0, max_restarts=0).remote(
            desired, colocated=a.colocated)
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
        rec.strict = False
        connector.publish(rec.ready_counts(), url)
        print(f"tandem is serving {a.model_name} at {url}/v1  ({desired[Phase.PREFILL]} prefill + "
              f"{desired[Phase.DECODE]} decode workers on {a.device}; `ray job stop` stops it)", flush=True)
        if a.autoscale:
            scaler = start_autoscaler(a, registry, url, stop)
        while not stop.is_set():
            why = platform.router_exit()
            if why is not None:
                raise WorkerUnavailable(f"the router ended ({why}); stopping the fleet")
            try:
                desired = connector.desired()
            except ScalingError as exc:  # holding the current counts is always safe
                log.warning("fleet registry: %s", exc)
            rec.step(desired)
            try:
                connector.publish(rec.ready_counts(), url)
            except ScalingError as exc:
                log.warning("fleet registry: %s", exc)
    finally:
        stop.set()
        shutdown(rec, platform, scaler, a.drain_grace_s)
        ray.kill(registry, no_restart=True)
    return 0


def shutdown(rec: Reconciler, platform, scaler: threading.Thread | None, grace_s: float) -> None:
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

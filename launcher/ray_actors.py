"""The Ray side of `tandem ray-launch`: the actors, and `RayPlatform`, which creates and removes
them for the launcher's loop.

Actors (shown by `ray list actors` under these class names):
- `TandemWorker`: owns one `tandem prefill-worker|decode-worker` process on the node Ray placed it
  on, inside that worker's placement group (one bundle: TP GPUs, or CPUs with --device cpu). It
  picks free ports on its node when asked for port 0, spawns the process (which inherits the
  GPUs Ray gave the actor through CUDA_VISIBLE_DEVICES), answers probes (exit code, /ready),
  forwards SIGTERM to drain, SIGKILLs on demand. The process is tied to the actor: if the actor
  dies, the kernel kills it (PR_SET_PDEATHSIG), so a lost actor never leaves a worker behind.
- `TandemRouter`: runs the router in the actor's own process on its asyncio loop (uvicorn), on
  the launcher's node, with `LiveDiscovery`: the launcher replaces the worker lists as the fleet
  changes and the router adopts them at its next discovery refresh.

Lifecycle of one worker (driven by the loop in launcher/ray_fleet.py):
    launch: placement group -> TandemWorker in bundle 0 -> start() returns its endpoint
    poll:   probe() -> (exit code, ready)            drain: SIGTERM, the worker finishes and exits
    remove: kill() if told to -> ray.kill(actor) -> remove_placement_group
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.errors import WorkerUnavailable
from launcher import ports
from launcher.cmd_serve import worker_env
from router.fleet import Discovery

if TYPE_CHECKING:
    from launcher.ray_fleet import MemberKey

log = logging.getLogger("tandem.ray")

PR_SET_PDEATHSIG = 1
ROUTER_ACTOR = "tandem-router"  # named in the fleet's namespace, so operators and tests find it


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """Everything a TandemWorker needs to start its process. Ports 0: pick free ones."""

    role: str                 # "prefill" | "decode"
    slot: int                 # index within the phase; names the worker
    flags: tuple[str, ...]    # worker flags shared by the phase (checkpoint, device, tp, ...)
    device: str
    port: int
    metrics_port: int
    bundle: dict[str, float]  # the placement-group bundle (Ray resources) this worker needs


@dataclass(frozen=True, slots=True)
class WorkerEndpoint:
    address: str      # tcp://NODE_IP:PORT, what the router dials
    health_url: str   # http://NODE_IP:METRICS_PORT (/ready, /metrics)
    node_ip: str
    pid: int


@dataclass(frozen=True, slots=True)
class WorkerProbe:
    exit_code: int | None  # None while the process runs
    ready: bool


@dataclass(frozen=True, slots=True)
class RouterLaunch:
    bind_host: str
    port: int                # 0: a free port on the router's node
    flags: tuple[str, ...]   # `tandem router` flags other than --host/--port/--prefill/--decode
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    graceful_s: float        # in-flight requests get this long when the router stops


def worker_argv(spec: WorkerLaunch, host: str, port: int, metrics_port: int) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", f"{spec.role}-worker", *spec.flags,
            "--host", host, "--port", str(port), "--metrics-port", str(metrics_port),
            "--worker-id", f"{spec.role}-{spec.slot}-{host}-{port}"]


def free_port(host: str) -> int:
    """A port free on `host` now, below the ephemeral range (launcher/ports.py). Another process may
    still take it before the worker binds; the worker then exits at start-up and the launcher replaces it."""
    return ports.free_port(host)


def _die_with_parent() -> None:
    # Runs in the child between fork and exec. PDEATHSIG follows the forking thread: actor
    # methods run on the actor process's main thread, which lives as long as the actor.
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class TandemWorker:
    """Ray actor (sync: one method at a time, on the main thread) owning one worker process."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._endpoint: WorkerEndpoint | None = None

    def start(self, spec: WorkerLaunch) -> WorkerEndpoint:
        import ray

        assert self._proc is None, "start() is called once per actor"
        host = ray.util.get_node_ip_address()
        port = spec.port or free_port(host)
        metrics_port = spec.metrics_port or free_port(host)
        # stdout/stderr stay the actor's: Ray forwards them to the job's log.
        self._proc = subprocess.Popen(worker_argv(spec, host, port, metrics_port),
                                      env=worker_env(spec.device), preexec_fn=_die_with_parent)
        self._endpoint = WorkerEndpoint(f"tcp://{host}:{port}", f"http://{host}:{metrics_port}",
                                        host, self._proc.pid)
        return self._endpoint

    def probe(self) -> WorkerProbe:
        assert self._proc is not None and self._endpoint is not None
        code = self._proc.poll()
        if code is not None:
            return WorkerProbe(code, False)
        try:
            # 2 s: a worker loading its model answers slowly (GIL); a drain() waits behind this.
            with urllib.request.urlopen(self._endpoint.health_url + "/ready", timeout=2) as r:
                return WorkerProbe(None, r.status == 200)
        except OSError:  # not listening yet, 503 while loading or draining, slow answer
            return WorkerProbe(None, False)

    def drain(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def kill(self) -> int | None:
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.kill()
        return self._proc.wait(10)


class LiveDiscovery(Discovery):
    """Worker addresses the launcher replaces while the router runs. `dns=True` is what makes
    the router's Fleet call `resolve()` again (every 10 status polls); the addresses are IP
    literals, so no name is looked up. `adopted` is what the router took at its last refresh."""

    def __init__(self, prefill: tuple[str, ...], decode: tuple[str, ...]) -> None:
        super().__init__(list(prefill), list(decode), dns=True)
        self.adopted: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())

    def resolve(self) -> tuple[list[str], list[str]]:
        prefill, decode = list(self.prefill), list(self.decode)
        self.adopted = (tuple(prefill), tuple(decode))
        return prefill, decode


class TandemRouter:
    """Ray async actor: every method runs on one event loop, the router's too, so replacing the
    worker lists needs no lock."""

    def __init__(self) -> None:
        self._server: Any = None  # uvicorn.Server
        self._task: asyncio.Task[None] | None = None
        self._discovery: LiveDiscovery | None = None
        self._drain: Any = None  # the router's drain coroutine (new requests 503, in-flight ones finish)

    async def start(self, spec: RouterLaunch, timeout_s: float) -> str:
        import ray
        import uvicorn

        from router.main import make_app, parse_args

        # The same flag parsing and checks as `tandem router` (needs >= 1 decode address).
        argv = [*spec.flags, "--host", spec.bind_host, "--port", str(spec.port)]
        argv += [f for a in spec.prefill for f in ("--prefill", a)]
        argv += [f for a in spec.decode for f in ("--decode", a)]
        cfg, _static = parse_args(argv)
        self._discovery = LiveDiscovery(spec.prefill, spec.decode)
        app = make_app(cfg, self._discovery)
        self._drain = app.state.drain
        # Bind here, not in uvicorn: a busy port is an OSError to report, not a sys.exit in
        # uvicorn's start-up, and port 0 tells us which port we got.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((spec.bind_host, spec.port))
        self._server = uvicorn.Server(uvicorn.Config(
            app, log_level="warning", timeout_graceful_shutdown=max(1, int(spec.graceful_s))))
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        t_end = asyncio.get_running_loop().time() + timeout_s
        while not self._server.started:
            if self._task.done() or asyncio.get_running_loop().time() > t_end:
                raise WorkerUnavailable("the router did not start listening within "
                                        f"{timeout_s:.0f} s")
            await asyncio.sleep(0.05)
        host = ray.util.get_node_ip_address() if spec.bind_host == "0.0.0.0" else spec.bind_host
        return f"http://{host}:{sock.getsockname()[1]}"

    async def set_workers(self, prefill: tuple[str, ...], decode: tuple[str, ...]) -> None:
        assert self._discovery is not None
        self._discovery.prefill, self._discovery.decode = list(prefill), list(decode)

    async def adopted(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The (prefill, decode) addresses the router took at its last discovery refresh."""
        assert self._discovery is not None
        return self._discovery.adopted

    async def closed(self) -> str:
        """Resolves when the server ends (stopped, or crashed: then the error's text)."""
        assert self._task is not None
        try:
            await asyncio.shield(self._task)
        except Exception as exc:  # noqa: BLE001 - reported to the launcher, which stops the job
            return f"{type(exc).__name__}: {exc}"
        return "stopped"

    async def stop(self) -> None:
        """Drain (new requests 503, in-flight ones finish up to the router's --drain-timeout-s, the
        rest end with "abort"), then stop the server and close the fleet."""
        if self._server is None or self._task is None:
            return
        if self._drain is not None and not self._task.done():
            await self._drain()
        self._server.should_exit = True
        await self._task


class RayPlatform:
    """Creates and removes the fleet's Ray objects for the launcher's loop. Calls return at once;
    `poll` waits (at most `timeout_s`) for the answers of this round."""

    def __init__(self) -> None:
        import ray

        self._ray = ray
        self._worker_cls = ray.remote(TandemWorker)
        self._router_cls = ray.remote(TandemRouter)
        self._workers: dict[MemberKey, _RayWorker] = {}
        self._router: Any = None
        self._router_closed: Any = None  # ObjectRef of TandemRouter.closed()
        self._router_stop: Any = None

    def launch(self, key: MemberKey, spec: WorkerLaunch) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # One bundle per worker; STRICT_PACK keeps it on one node (all TP/EP ranks on NVLink).
        pg = placement_group([dict(spec.bundle)], strategy="STRICT_PACK",
                             name=f"tandem-{spec.role}-{spec.slot}")
        actor = self._worker_cls.options(
            num_cpus=spec.bundle.get("CPU", 0), num_gpus=spec.bundle.get("GPU", 0),
            max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0),
        ).remote()
        # Pending until the placement group is placed: waiting for capacity is not a failure.
        self._workers[key] = _RayWorker(actor, pg, actor.start.remote(spec))

    def poll(self, keys: list[MemberKey], timeout_s: float) -> dict[MemberKey, Observation]:
        """Whatever answers arrive within `timeout_s`; always takes `timeout_s` (it paces the
        loop: at most one probe per worker per poll)."""
        ray = self._ray
        t_end = time.monotonic() + timeout_s
        pending: dict[Any, MemberKey] = {}  # ObjectRef -> worker
        for key in keys:
            w = self._workers[key]
            if w.endpoint is None:
                pending[w.start_ref] = key
            else:
                if w.probe_ref is None:
                    w.probe_ref = w.actor.probe.remote()
                pending[w.probe_ref] = key
        done = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)[0] if pending else []
        out: dict[MemberKey, Observation] = {}
        for ref in done:
            key = pending[ref]
            w = self._workers[key]
            try:
                value = ray.get(ref)
            except ray.exceptions.RayError as exc:
                out[key] = Observation(w.endpoint, None, f"{type(exc).__name__}: {exc}"[:500])
                continue
            if isinstance(value, WorkerEndpoint):
                w.endpoint = value
                out[key] = Observation(value, None, None)
            else:
                w.probe_ref = None
                out[key] = Observation(w.endpoint, value, None)
        time.sleep(max(0.0, t_end - time.monotonic()))
        return out

    def drain(self, key: MemberKey) -> None:
        self._workers[key].actor.drain.remote()

    def remove(self, key: MemberKey, *, kill: bool) -> None:
        from ray.util.placement_group import remove_placement_group

        w = self._workers.pop(key)
        if kill and w.endpoint is not None:
            try:  # SIGKILL the process ourselves; ray.kill alone would leave it to PDEATHSIG
                self._ray.get(w.actor.kill.remote(), timeout=15)
            except (self._ray.exceptions.RayError, TimeoutError):
                pass  # the actor is gone or stuck: ray.kill below, PDEATHSIG takes the process
        self._ray.kill(w.actor, no_restart=True)
        remove_placement_group(w.pg)

    def start_router(self, spec: RouterLaunch, timeout_s: float) -> str:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # On the launcher's node, so the printed URL is the head node's address.
        here = self._ray.get_runtime_context().get_node_id()
        self._router = self._router_cls.options(
            name=ROUTER_ACTOR, num_cpus=0, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()
        try:
            url = self._ray.get(self._router.start.remote(spec, timeout_s), timeout=timeout_s + 30)
        except self._ray.exceptions.RayError as exc:
            raise WorkerUnavailable(f"the router did not start: {exc}") from exc
        self._router_closed = self._router.closed.remote()
        return url

    def router_exit(self) -> str | None:
        """None while the router serves; why it ended otherwise."""
        if self._router_closed is None:
            return None
        done, _ = self._ray.wait([self._router_closed], timeout=0)
        if not done:
            return None
        try:
            return self._ray.get(done[0])
        except self._ray.exceptions.RayError as exc:
            return f"router actor failed: {exc}"

    def set_router_workers(self, prefill: tuple[str, ...], decode: tuple[str, ...]) -> None:
        if self._router is not None:
            self._router.set_workers.remote(prefill, decode)

    def router_adopted(self, timeout_s: float) -> tuple[tuple[str, ...], tuple[str, ...]]:
        assert self._router is not None
        return self._ray.get(self._router.adopted.remote(), timeout=timeout_s)

    def begin_router_stop(self) -> None:
        if self._router is not None and self._router_stop is None:
            self._router_stop = self._router.stop.remote()

    def close(self, timeout_s: float) -> None:
        """After the workers are gone: wait for the router's graceful stop, then remove it."""
        if self._router is None:
            return
        self.begin_router_stop()
        try:
            self._ray.get(self._router_stop, timeout=timeout_s)
        except (self._ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("router did not stop cleanly: %s", exc)
        self._ray.kill(self._router, no_restart=True)
        self._router = None


@dataclass(slots=True)
class _RayWorker:
    actor: Any        # ActorHandle of TandemWorker
    pg: Any           # PlacementGroup
    start_ref: Any    # ObjectRef of start(): resolves to the WorkerEndpoint
    endpoint: WorkerEndpoint | None = None
    probe_ref: Any = None  # the probe in flight, at most one per worker


@dataclass(frozen=True, slots=True)
class Observation:
    """What one poll learnt about one worker: its endpoint once started, a probe answer, or a
    failure of the actor itself (start raised, actor died)."""

    endpoint: WorkerEndpoint | None
    probe: WorkerProbe | None
    failed: str | None

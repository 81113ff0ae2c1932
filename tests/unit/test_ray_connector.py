"""The Ray connector and the launcher's reconciling loop, without a cluster: the fleet registry's
compare-and-set rules, the connector's deadlines and error mapping (Ray calls through an
injected `get`), the pure scaling plan, and the loop against a fake platform (drain before
remove, the router keeps a draining worker until it exited, kills only after the grace), and the
tie between a worker process and its actor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from autoscaler.connector import ScaleOutcome, ScalingConnector, ScalingError
from autoscaler.core import Phase, ReplicaCounts
from autoscaler.ray_connector import FleetRegistry, RayConnector
from common.errors import ConfigError, WorkerUnavailable
from launcher.ray_actors import Observation, WorkerEndpoint, WorkerLaunch, WorkerProbe
from launcher.ray_fleet import Member, MemberKey, MemberState, Reconciler, Timing, plan_phase
from launcher.ray_launch import FleetSpec, autoscaler_config, build_parser, check_args, fleet_spec

P, D = Phase.PREFILL, Phase.DECODE
REPO = str(Path(__file__).resolve().parents[2])


# ---- fleet registry: the compare-and-set rules -------------------------------------------------

def test_registry_compare_and_set() -> None:
    reg = FleetRegistry({P: 1, D: 2})
    assert reg.get(P) == ReplicaCounts(desired=1, ready=0)
    assert reg.compare_and_set(P, 3, expected=2) is ScaleOutcome.SUPERSEDED  # stale decision
    assert reg.desired() == {P: 1, D: 2}
    assert reg.compare_and_set(P, 3, expected=1) is ScaleOutcome.APPLIED
    assert reg.compare_and_set(P, 3, expected=1) is ScaleOutcome.UNCHANGED  # already there
    assert reg.compare_and_set(D, 1, expected=2) is ScaleOutcome.APPLIED
    assert reg.desired() == {P: 3, D: 1}
    reg.publish({P: 2, D: 1}, "http://10.0.0.1:8000")
    assert reg.get(P) == ReplicaCounts(desired=3, ready=2)
    assert reg.router_url() == "http://10.0.0.1:8000"


def test_registry_refuses_a_fleet_that_cannot_serve() -> None:
    reg = FleetRegistry({P: 1, D: 1})
    with pytest.raises(ScalingError, match="at least 1"):
        reg.compare_and_set(D, 0, expected=1)
    with pytest.raises(ScalingError, match="at least 1"):
        reg.compare_and_set(P, 0, expected=1)
    assert reg.desired() == {P: 1, D: 1}
    colocated = FleetRegistry({P: 0, D: 1}, colocated=True)
    with pytest.raises(ScalingError, match="colocated"):
        colocated.compare_and_set(P, 1, expected=0)
    assert colocated.compare_and_set(P, 0, expected=0) is ScaleOutcome.UNCHANGED
    with pytest.raises(ConfigError):
        FleetRegistry({P: 0, D: 1})
    with pytest.raises(ConfigError):
        FleetRegistry({P: 1, D: 1}, colocated=True)


# ---- the connector over an actor handle ---------------------------------------------------------

class _Method:
    """`actor.method.remote(...)` of a fake handle: the 'ref' is a thunk that `get` runs."""

    def __init__(self, fn, log: list[str], name: str) -> None:
        self.fn, self.log, self.name = fn, log, name

    def remote(self, *args):
        self.log.append(self.name)
        return lambda: self.fn(*args)


class FakeRegistryActor:
    def __init__(self, registry: FleetRegistry) -> None:
        self.calls: list[str] = []
        for name in ("get", "compare_and_set", "desired", "publish", "router_url"):
            setattr(self, name, _Method(getattr(registry, name), self.calls, name))


def _connector(registry: FleetRegistry, fail: Exception | None = None, deadlines: list | None = None):
    def get(ref, timeout):
        if deadlines is not None:
            deadlines.append(timeout)
        if fail is not None:
            raise fail
        try:
            return ref()
        except ScalingError as exc:  # what ray.get raises for an exception inside the actor
            raise RayTaskError("FleetRegistry.compare_and_set", "traceback", exc) from exc
    return RayConnector(FakeRegistryActor(registry), timeout_s=3.0, get=get)


def test_connector_compare_and_set_through_the_actor() -> None:
    deadlines: list[float] = []
    conn = _connector(FleetRegistry({P: 1, D: 1}), deadlines=deadlines)
    assert isinstance(conn, ScalingConnector)
    assert conn.get_replicas(D) == ReplicaCounts(desired=1, ready=0)
    assert conn.set_replicas(D, 2, expected=1) is ScaleOutcome.APPLIED
    assert conn.set_replicas(D, 3, expected=1) is ScaleOutcome.SUPERSEDED
    assert conn.set_replicas(D, 2, expected=2) is ScaleOutcome.UNCHANGED
    conn.publish({P: 1, D: 2}, "http://r:1")
    assert conn.get_replicas(D) == ReplicaCounts(desired=2, ready=2)
    assert conn.desired() == {P: 1, D: 2} and conn.router_url() == "http://r:1"
    assert deadlines and all(t == 3.0 for t in deadlines)  # every call has the deadline


def test_connector_maps_ray_failures_to_scaling_error() -> None:
    reg = FleetRegistry({P: 1, D: 1})
    with pytest.raises(ScalingError, match="at least 1"):  # refused inside the actor
        _connector(reg).set_replicas(D, 0, expected=1)
    with pytest.raises(ScalingError, match="within 3.0s"):
        _connector(reg, fail=GetTimeoutError("slow")).get_replicas(P)
    with pytest.raises(ScalingError, match="unreachable"):
        _connector(reg, fail=RayActorError()).set_replicas(P, 2, expected=1)
    assert reg.desired() == {P: 1, D: 1}
    with pytest.raises(ConfigError):
        RayConnector(object(), timeout_s=0)


def test_from_config_without_a_fleet(monkeypatch) -> None:
    import ray

    def no_actor(name, namespace=None):
        raise ValueError(f"Failed to look up actor {name}")

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_actor", no_actor)
    with pytest.raises(ConfigError, match="no tandem fleet in Ray namespace 'prod'"):
        RayConnector.from_config(SimpleNamespace(namespace="prod", api_timeout_s=5.0))


# ---- the pure plan ---------------------------------------------------------------------------

def _m(slot: int, state: MemberState, phase: Phase = P) -> Member:
    return Member(MemberKey(phase, slot), state)


def test_plan_starts_into_free_slots_and_drains_not_serving_first() -> None:
    R, S, X = MemberState.READY, MemberState.STARTING, MemberState.DRAINING
    assert plan_phase(3, [_m(0, R), _m(2, X)]).start == (1, 3)  # slot 2 is still draining
    assert plan_phase(1, [_m(0, R)]).start == () and plan_phase(1, [_m(0, R)]).drain == ()
    assert plan_phase(2, [_m(0, R), _m(1, R), _m(2, S), _m(3, R)]).drain == (2, 3)
    assert plan_phase(1, [_m(0, R), _m(1, X), _m(2, R)]).drain == (2,)  # draining ones don't count
    assert plan_phase(0, [_m(0, R), _m(1, X)]).drain == (0,)


# ---- the loop against a fake platform -------------------------------------------------------

@dataclass
class FakeProc:
    endpoint: WorkerEndpoint | None
    exit_code: int | None = None
    ready: bool = False


@dataclass
class FakePlatform:
    clock: list[float]
    calls: list[tuple[str, MemberKey | None, object]] = field(default_factory=list)
    procs: dict[MemberKey, FakeProc] = field(default_factory=dict)
    pending_resources: bool = False  # new workers wait for their placement group
    router: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    sigterm_exits: bool = False      # a drained process exits at once

    def launch(self, key: MemberKey, spec: WorkerLaunch) -> None:
        self.calls.append(("launch", key, spec))
        ep = None if self.pending_resources else WorkerEndpoint(
            f"tcp://10.0.0.1:{7000 + spec.slot + (100 if key.phase is P else 200)}", "http://h", "10.0.0.1", 1)
        self.procs[key] = FakeProc(ep)

    def poll(self, keys, timeout_s):
        self.clock[0] += timeout_s
        return {k: Observation(self.procs[k].endpoint,
                               WorkerProbe(self.procs[k].exit_code, self.procs[k].ready)
                               if self.procs[k].endpoint else None, None) for k in keys}

    def drain(self, key: MemberKey) -> None:
        self.calls.append(("drain", key, None))
        if self.sigterm_exits:
            self.procs[key].exit_code = 0

    def remove(self, key: MemberKey, *, kill: bool) -> None:
        self.calls.append(("remove", key, kill))
        del self.procs[key]

    def set_router_workers(self, prefill, decode) -> None:
        self.router = (prefill, decode)

    def names(self) -> list[tuple[str, MemberKey | None]]:
        return [(c[0], c[1]) for c in self.calls]


SPEC = FleetSpec(("--checkpoint", "/c"), ("--checkpoint", "/c"), "cpu", 0, {"CPU": 1.0}, {"CPU": 1.0})


def _loop(pending: bool = False) -> tuple[Reconciler, FakePlatform]:
    clock = [0.0]
    fake = FakePlatform(clock, pending_resources=pending)
    rec = Reconciler(fake, SPEC.launch, Timing(poll_s=0.5, ready_timeout_s=30, drain_grace_s=10),
                     clock=lambda: clock[0])
    return rec, fake


def _all_ready(fake: FakePlatform) -> None:
    for p in fake.procs.values():
        p.ready = True


def test_scale_up_launches_and_reports_ready() -> None:
    rec, fake = _loop()
    rec.router_live = True
    rec.step({P: 1, D: 1})
    assert fake.names() == [("launch", MemberKey(P, 0)), ("launch", MemberKey(D, 0))]
    rec.step({P: 1, D: 1})
    assert rec.ready_counts() == {P: 0, D: 0}
    assert fake.router == ((), ())  # started, not ready: the router does not see them yet
    _all_ready(fake)
    rec.step({P: 1, D: 1})
    rec.step({P: 1, D: 1})
    assert rec.ready_counts() == {P: 1, D: 1} and rec.all_ready({P: 1, D: 1})
    assert fake.router == (("tcp://10.0.0.1:7100",), ("tcp://10.0.0.1:7200",))
    rec.step({P: 2, D: 1})
    launched = [c[2] for c in fake.calls if c[0] == "launch"]
    assert launched[-1].role == "prefill" and launched[-1].slot == 1 and launched[-1].port == 0
    rec.step({P: 2, D: 1})
    assert fake.router[0] == ("tcp://10.0.0.1:7100",)
    _all_ready(fake)
    rec.step({P: 2, D: 1})
    rec.step({P: 2, D: 1})
    assert rec.ready_counts() == {P: 2, D: 1}
    assert fake.router[0] == ("tcp://10.0.0.1:7100", "tcp://10.0.0.1:7101")


def test_scale_down_drains_before_removing() -> None:
    rec, fake = _loop()
    rec.router_live = True
    for _ in range(2):
        rec.step({P: 2, D: 1})
        _all_ready(fake)
    rec.step({P: 2, D: 1})
    victim = MemberKey(P, 1)
    rec.step({P: 1, D: 1})
    assert fake.names()[-1] == ("drain", victim)
    assert rec.ready_counts()[P] == 1  # a draining worker no longer counts as ready
    # Still running its in-flight requests: it stays, in the router's list too.
    for _ in range(5):
        rec.step({P: 1, D: 1})
    assert ("remove", victim) not in fake.names()
    assert "tcp://10.0.0.1:7101" in fake.router[0]
    fake.procs[victim].exit_code = 0  # finished its work and exited
    rec.step({P: 1, D: 1})
    assert fake.calls[-1] == ("remove", victim, False)  # no kill: it exited on its own
    assert fake.router[0] == ("tcp://10.0.0.1:7100",)
    assert [n for n in fake.names() if n[1] == victim] == [("launch", victim), ("drain", victim),
                                                           ("remove", victim)]


def test_a_worker_that_does_not_drain_is_killed_after_the_grace() -> None:
    rec, fake = _loop()
    rec.strict = False
    rec.step({P: 1, D: 2})
    _all_ready(fake)
    rec.step({P: 1, D: 2})
    rec.step({P: 1, D: 1})
    victim = MemberKey(D, 1)
    assert fake.names()[-1] == ("drain", victim)
    while ("remove", victim) not in fake.names():
        assert fake.clock[0] < 20
        rec.step({P: 1, D: 1})
    assert fake.clock[0] >= 10  # not before the grace
    assert fake.calls[-1] == ("remove", victim, True)


def test_scaling_down_a_worker_still_waiting_for_resources_removes_it_at_once() -> None:
    rec, fake = _loop(pending=True)
    rec.step({P: 1, D: 2})
    rec.step({P: 1, D: 1})
    assert (("drain", MemberKey(D, 1)) not in fake.names()  # it has no process to signal
            and fake.calls[-1] == ("remove", MemberKey(D, 1), True))


def test_start_up_failures_fail_the_launch_but_are_replaced_later() -> None:
    rec, fake = _loop()
    rec.step({P: 1, D: 1})
    fake.procs[MemberKey(P, 0)].exit_code = 1
    with pytest.raises(WorkerUnavailable, match="prefill worker 0 failed during start-up: exit code 1"):
        rec.step({P: 1, D: 1})

    rec, fake = _loop()
    rec.step({P: 1, D: 1})
    _all_ready(fake)
    rec.step({P: 1, D: 1})
    rec.strict = False  # serving: a crashed worker is removed and replaced
    fake.procs[MemberKey(D, 0)].exit_code = -9
    rec.step({P: 1, D: 1})
    assert fake.names()[-2:] == [("remove", MemberKey(D, 0)), ("launch", MemberKey(D, 0))]


def test_ready_deadline() -> None:
    rec, fake = _loop()
    with pytest.raises(WorkerUnavailable, match="not ready within 30 s"):
        for _ in range(100):
            rec.step({P: 1, D: 1})
    assert fake.clock[0] <= 32


def test_drain_all_waits_for_exits_then_kills_the_rest() -> None:
    rec, fake = _loop()
    rec.step({P: 1, D: 2})
    _all_ready(fake)
    rec.step({P: 1, D: 2})
    fake.sigterm_exits = True
    stuck = MemberKey(D, 1)
    fake_drain = fake.drain

    def drain(key: MemberKey) -> None:  # this one ignores SIGTERM
        fake.calls.append(("drain", key, None)) if key == stuck else fake_drain(key)

    fake.drain = drain
    rec.drain_all(deadline_s=fake.clock[0] + 5)
    assert not rec.members and not fake.procs
    removes = {c[1]: c[2] for c in fake.calls if c[0] == "remove"}
    assert removes == {MemberKey(P, 0): False, MemberKey(D, 0): False, stuck: True}


# ---- flags -> launch specs ---------------------------------------------------------------------

def test_autoscaler_flags_pass_through() -> None:
    from autoscaler.config import ConnectorKind

    a = build_parser().parse_args(["--autoscale", "--namespace", "prod", "--autoscale-args",
                                   "--interval-s 2 --prefill-max-replicas 3 --dry-run"])
    cfg = autoscaler_config(a, "http://10.0.0.1:8000")
    assert cfg.connector is ConnectorKind.RAY and cfg.namespace == "prod" and cfg.dry_run
    assert cfg.router_metrics_url == "http://10.0.0.1:8000/metrics" and cfg.interval_s == 2
    assert cfg.policy.prefill.max_replicas == 3
    with pytest.raises(ConfigError, match="colocated"):
        check_args(build_parser().parse_args(["--autoscale", "--colocated"]))
    with pytest.raises(ConfigError):
        check_args(build_parser().parse_args(["--num-prefill", "0"]))


def test_fleet_spec_from_flags() -> None:
    a = build_parser().parse_args(["--device", "cuda", "--prefill-tp", "2", "--decode-tp", "4",
                                   "--decode-moe-mode", "ep", "--base-port", "9000", "--cpus-per-worker", "4",
                                   "--worker-args", "--cuda-graphs --max-num-seqs 128"])
    spec = fleet_spec(a, "/ckpt")
    pf = spec.launch(MemberKey(P, 1))
    assert (pf.port, pf.metrics_port, pf.bundle) == (9101, 10101, {"CPU": 4.0, "GPU": 2.0})
    dc = spec.launch(MemberKey(D, 0))
    assert (dc.port, dc.bundle) == (9200, {"CPU": 4.0, "GPU": 4.0})
    assert spec.launch(MemberKey(P, 100)).port == 0  # would collide with decode's range
    assert dc.flags[-3:] == ("--cuda-graphs", "--max-num-seqs", "128")  # user flags last: they win
    assert "--moe-mode" in dc.flags and dc.flags[dc.flags.index("--moe-mode") + 1] == "ep"
    assert "--cpu-threads" not in dc.flags
    cpu = fleet_spec(build_parser().parse_args(["--colocated", "--cpus-per-worker", "0.5"]), "/c")
    dc = cpu.launch(MemberKey(D, 0))
    assert dc.port == 0 and dc.bundle == {"CPU": 0.5}
    assert dc.flags[dc.flags.index("--kv-backend") + 1] == "none"


# ---- a worker process never outlives its actor --------------------------------------------------

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_worker_process_dies_with_the_process_that_spawned_it() -> None:
    # The middle process plays the TandemWorker actor; SIGKILL is what ray.kill does to it.
    actor = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         "from launcher.ray_actors import _die_with_parent\n"
         "p = subprocess.Popen(['sleep', '120'], preexec_fn=_die_with_parent)\n"
         "print(p.pid, flush=True)\ntime.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    worker = int(actor.stdout.readline())
    try:
        assert _alive(worker)
        actor.kill()
        actor.wait(10)
        t_end = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < t_end:
            time.sleep(0.05)
        assert not _alive(worker)
    finally:
        actor.kill()
        if _alive(worker):  # only when the test failed: leave nothing behind
            os.kill(worker, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"  # a zombie has exited
    except OSError:
        return False

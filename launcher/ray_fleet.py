"""The loop of `tandem ray-launch`: brings the worker actors of each phase to the replica counts
the fleet registry asks for. No Ray in here: the Ray calls sit behind `Platform`
(launcher/ray_actors.py: RayPlatform), so the rules are unit-tested against a fake.

One `step(desired)`:
    poll every worker (waits up to Timing.poll_s: this paces the loop) -> observe: started,
    ready, exited -> reap: remove drained/dead workers, kill those past the drain grace or the
    ready deadline -> plan (pure, per phase): launch into free slots, or drain the surplus ->
    push the (prefill, decode) address lists to the router when they changed.

Scale-down never kills in-flight work: a surplus worker gets SIGTERM and keeps its place in the
router's lists while it drains (the router sees it `draining` and sends it nothing new); its
actor and placement group are removed only after its process exited, or after the grace.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from autoscaler.core import Phase
from common.errors import WorkerUnavailable
from launcher.ray_actors import Observation, WorkerEndpoint, WorkerLaunch

log = logging.getLogger("tandem.ray_fleet")


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
        """(prefill, decode) addresses the router should know: ready workers, and draining ones
        until they exit (they finish their streams; the router sends them nothing new). Starting
        ones join once ready, so the router never counts a loading worker as down."""
        members = sorted(self.members.values(), key=lambda m: m.key.slot)
        by_phase = {phase: tuple(m.endpoint.address for m in members if m.key.phase is phase
                                 and m.endpoint is not None and m.state is not MemberState.STARTING)
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

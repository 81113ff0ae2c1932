"""Per-phase autoscaling policy: the pure decision core.

Role: given what one tick observed (`TickInput`: router metrics over the last window plus the
replica counts the connector read) and what the core remembers between ticks (`State`), decide
how many prefill and how many decode replicas there should be (`Decision`). No I/O and no clock:
time arrives as `TickInput.now_s`, so a test can replay a whole load trajectory exactly.

Lifecycle of one tick (driven by autoscaler/main.py):
    scrape router /metrics -> metrics.build_tick_input -> tick(input, state, policy) -> Decision
    -> connector.set_replicas(phase, ...) for each phase whose target changed
    -> settle(state, decision, applied) -> the state for the next tick

Policy, the same for both phases (each phase has its own `PhasePolicy`):
- Signals. prefill: TTFT p50/p90 against its SLO (TTFT after admission: time in the router's
  queue is decode's doing, not prefill's), queue per ready replica. decode: ITL p50/p90 against
  its SLO, KV usage, queue per ready replica, and the router's admission queue: requests waiting
  there wait for decode KV room or a sequence slot, so its depth per ready decode replica and its
  p90 wait vote for decode, unless prefill is backed up itself (then decode slots are held by
  requests waiting for prefill, and more decode would not help). A signal with no data (`None`)
  never votes for scale-up; missing latency means no traffic (so it does not block scale-down), a
  missing gauge means we cannot tell (so it does); the router-queue signals come from routers
  that export them and, when absent, neither vote nor block.
- Hysteresis. Every signal has an up threshold and a lower down threshold. Up if any signal is at
  or above its up threshold; down only if every signal is at or below its down threshold *and*
  queue/KV, projected onto one step fewer replicas, stay below their up thresholds (otherwise the
  next tick would scale straight back up). In between: hold.
- Timing. Scale-up is fast (`scale_up_cooldown_s` since the last scale-up). Scale-down is slow:
  the low condition must hold for `scale_down_stabilization_s` and `scale_down_cooldown_s` must
  have passed since any scale event of that phase.
- Size. Up is proportional to the worst signal ratio, computed on *ready* replicas (pods still
  loading the model do not serve yet, so they must not be counted twice), and bounded by
  `max_step_up`. Down removes `max_step_down` replicas. Both stay inside [min, max].
- Safety. A phase breaching its SLO (p50 or p90 above target) is never scaled down. The one
  exception is a count already above `max_replicas` (say, the limit was lowered): it is clamped
  back, because max is a hard budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

from common.errors import ConfigError


class Phase(str, Enum):
    """The two scalable roles; the values match the helm keys and the `phase` metric label."""

    PREFILL = "prefill"
    DECODE = "decode"


class Reason(str, Enum):
    """Why a phase got its target; logged and exported, and asserted on by the tests."""

    HOLD = "hold"                        # signals between the down and up thresholds
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"
    UP_COOLDOWN = "up_cooldown"          # wants up, too soon after the last scale-up
    WAITING_FOR_READY = "waiting_for_ready"  # wants up, but pods already starting will cover it
    STABILIZING = "stabilizing"          # low, but not for long enough yet
    DOWN_COOLDOWN = "down_cooldown"      # low for long enough, too soon after a scale event
    AT_MAX = "at_max"
    AT_MIN = "at_min"
    CLAMPED = "clamped"                  # current replicas were outside [min, max]


@dataclass(frozen=True, slots=True)
class ReplicaCounts:
    """What the platform reports for one phase: replicas asked for, and replicas serving."""

    desired: int
    ready: int


@dataclass(frozen=True, slots=True)
class LatencyQuantiles:
    """Latency over the last window (TTFT for prefill, ITL for decode), seconds."""

    p50_s: float
    p90_s: float


@dataclass(frozen=True, slots=True)
class PhaseObservation:
    """One phase at one tick. `latency` is None when no request completed in the window;
    `queue_depth`/`kv_usage_ratio` are None when the router did not report them. The router-queue
    fields (requests waiting in the routers' admission queues, summed over routers, and the p90
    of their waits over the window) are filled for the phase they wait on: decode."""

    replicas: ReplicaCounts
    latency: LatencyQuantiles | None
    queue_depth: float | None
    kv_usage_ratio: float | None
    router_queue_depth: float | None = None
    router_queue_wait_p90_s: float | None = None


@dataclass(frozen=True, slots=True)
class TickInput:
    now_s: float  # monotonic seconds; only differences matter
    prefill: PhaseObservation
    decode: PhaseObservation

    def of(self, phase: Phase) -> PhaseObservation:
        return self.prefill if phase is Phase.PREFILL else self.decode


@dataclass(frozen=True, slots=True)
class PhasePolicy:
    """Targets and limits for one phase. Latency thresholds are fractions of the SLO."""

    min_replicas: int
    max_replicas: int
    slo_p50_s: float
    slo_p90_s: float
    latency_up_fraction: float = 0.9     # add capacity a little before the SLO is breached
    latency_down_fraction: float = 0.5
    queue_up_per_replica: float = 4.0
    queue_down_per_replica: float = 0.5
    kv_up_ratio: float | None = None     # None: KV usage is not a signal for this phase
    kv_down_ratio: float | None = None
    router_queue_up_per_replica: float | None = None  # None: the router queue is not a signal
    router_queue_down_per_replica: float | None = None
    router_wait_up_s: float | None = None  # p90 wait in the router queue
    router_wait_down_s: float | None = None
    max_step_up: int = 2
    max_step_down: int = 1
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 300.0
    scale_down_stabilization_s: float = 120.0

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ConfigError(f"min_replicas must be >= 1 (a disaggregated fleet needs both "
                              f"phases), got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise ConfigError(f"max_replicas {self.max_replicas} < min_replicas "
                              f"{self.min_replicas}")
        if self.slo_p50_s <= 0 or self.slo_p90_s <= 0:
            raise ConfigError("latency SLOs must be > 0")
        if not 0 < self.latency_down_fraction < self.latency_up_fraction:
            raise ConfigError("need 0 < latency_down_fraction < latency_up_fraction")
        if not 0 <= self.queue_down_per_replica < self.queue_up_per_replica:
            raise ConfigError("need 0 <= queue_down_per_replica < queue_up_per_replica")
        if (self.kv_up_ratio is None) != (self.kv_down_ratio is None):
            raise ConfigError("kv_up_ratio and kv_down_ratio are set together or not at all")
        if self.kv_up_ratio is not None and self.kv_down_ratio is not None:
            if not 0 <= self.kv_down_ratio < self.kv_up_ratio <= 1:
                raise ConfigError("need 0 <= kv_down_ratio < kv_up_ratio <= 1")
        for up, down, name in ((self.router_queue_up_per_replica, self.router_queue_down_per_replica, "router_queue"),
                               (self.router_wait_up_s, self.router_wait_down_s, "router_wait")):
            if (up is None) != (down is None):
                raise ConfigError(f"{name} up and down thresholds are set together or not at all")
            if up is not None and down is not None and not 0 <= down < up:
                raise ConfigError(f"need 0 <= {name} down < up")
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise ConfigError("max_step_up and max_step_down must be >= 1")
        if min(self.scale_up_cooldown_s, self.scale_down_cooldown_s,
               self.scale_down_stabilization_s) < 0:
            raise ConfigError("cooldowns and stabilization must be >= 0")


@dataclass(frozen=True, slots=True)
class Policy:
    prefill: PhasePolicy
    decode: PhasePolicy

    def of(self, phase: Phase) -> PhasePolicy:
        return self.prefill if phase is Phase.PREFILL else self.decode


@dataclass(frozen=True, slots=True)
class PhaseState:
    last_scale_up_s: float | None = None
    last_scale_down_s: float | None = None
    low_since_s: float | None = None  # start of the current run of "all signals low"


@dataclass(frozen=True, slots=True)
class State:
    prefill: PhaseState = PhaseState()
    decode: PhaseState = PhaseState()

    def of(self, phase: Phase) -> PhaseState:
        return self.prefill if phase is Phase.PREFILL else self.decode


@dataclass(frozen=True, slots=True)
class PhaseDecision:
    current: int
    desired: int
    reason: Reason
    breaching_slo: bool
    worst_ratio: float  # the strongest signal relative to its up threshold (1.0 = at threshold)

    @property
    def changed(self) -> bool:
        return self.desired != self.current


@dataclass(frozen=True, slots=True)
class Decision:
    prefill: PhaseDecision
    decode: PhaseDecision
    state: State  # the next state, assuming every change is applied (see `settle`)

    def of(self, phase: Phase) -> PhaseDecision:
        return self.prefill if phase is Phase.PREFILL else self.decode


@dataclass(frozen=True, slots=True)
class _Signals:
    """Ratios of each signal to its up threshold, and the verdicts derived from them."""

    worst_ratio: float
    any_high: bool
    all_low: bool
    breaching_slo: bool


def _signals(obs: PhaseObservation, pol: PhasePolicy, current: int, upstream_backed_up: bool = False) -> _Signals:
    ratios: list[float] = []
    all_low = True
    breaching = False

    if obs.latency is not None:
        slo_ratio = max(obs.latency.p50_s / pol.slo_p50_s, obs.latency.p90_s / pol.slo_p90_s)
        breaching = slo_ratio > 1.0
        ratios.append(slo_ratio / pol.latency_up_fraction)
        all_low &= slo_ratio <= pol.latency_down_fraction

    # Queue and KV are loads shared by the serving replicas; a scale-down of one step raises
    # each survivor's share by current / (current - step).
    shrink = current / max(current - pol.max_step_down, 1)
    serving = max(obs.replicas.ready, 1)
    if obs.queue_depth is None:
        all_low = False
    else:
        per_replica = obs.queue_depth / serving
        ratios.append(per_replica / pol.queue_up_per_replica)
        all_low &= (per_replica <= pol.queue_down_per_replica
                    and per_replica * shrink < pol.queue_up_per_replica)

    if pol.kv_up_ratio is not None and pol.kv_down_ratio is not None:
        if obs.kv_usage_ratio is None:
            all_low = False
        else:
            ratios.append(obs.kv_usage_ratio / pol.kv_up_ratio)
            all_low &= (obs.kv_usage_ratio <= pol.kv_down_ratio
                        and obs.kv_usage_ratio * shrink < pol.kv_up_ratio)

    # The router's admission queue (absent on older routers: no vote, no block). It waits for this
    # phase's room unless the phase upstream is backed up (`upstream_backed_up`): then it only votes down.
    if pol.router_queue_up_per_replica is not None and obs.router_queue_depth is not None:
        assert pol.router_queue_down_per_replica is not None
        per_replica = obs.router_queue_depth / serving
        if not upstream_backed_up:
            ratios.append(per_replica / pol.router_queue_up_per_replica)
        all_low &= per_replica <= pol.router_queue_down_per_replica
    if pol.router_wait_up_s is not None and obs.router_queue_wait_p90_s is not None:
        assert pol.router_wait_down_s is not None
        if not upstream_backed_up:
            ratios.append(obs.router_queue_wait_p90_s / pol.router_wait_up_s)
        all_low &= obs.router_queue_wait_p90_s <= pol.router_wait_down_s

    worst = max(ratios, default=0.0)
    return _Signals(worst_ratio=worst, any_high=worst >= 1.0, all_low=all_low and not breaching,
                    breaching_slo=breaching)


def _since(now_s: float, then_s: float | None) -> float:
    return math.inf if then_s is None else now_s - then_s


def _decide_phase(obs: PhaseObservation, pol: PhasePolicy, st: PhaseState,
                  now_s: float, upstream_backed_up: bool = False) -> tuple[PhaseDecision, PhaseState]:
    current = obs.replicas.desired
    sig = _signals(obs, pol, current, upstream_backed_up)
    low_since = (st.low_since_s if st.low_since_s is not None else now_s) if sig.all_low else None
    target, reason = current, Reason.HOLD

    if sig.any_high:
        ready = obs.replicas.ready
        # Sized on ready replicas: pods still loading are capacity already on its way.
        wanted = math.ceil(max(ready, 1) * sig.worst_ratio - 1e-9)
        if ready >= current:
            wanted = max(wanted, current + 1)
        wanted = min(wanted, current + pol.max_step_up, pol.max_replicas)
        if current >= pol.max_replicas:
            reason = Reason.AT_MAX
        elif wanted <= current:
            reason = Reason.WAITING_FOR_READY
        elif _since(now_s, st.last_scale_up_s) < pol.scale_up_cooldown_s:
            reason = Reason.UP_COOLDOWN
        else:
            target, reason = wanted, Reason.SCALE_UP
    elif sig.all_low:
        assert low_since is not None
        last_event = max((t for t in (st.last_scale_up_s, st.last_scale_down_s) if t is not None),
                         default=None)
        if current <= pol.min_replicas:
            reason = Reason.AT_MIN
        elif now_s - low_since < pol.scale_down_stabilization_s:
            reason = Reason.STABILIZING
        elif _since(now_s, last_event) < pol.scale_down_cooldown_s:
            reason = Reason.DOWN_COOLDOWN
        else:
            target = max(current - pol.max_step_down, pol.min_replicas)
            reason = Reason.SCALE_DOWN

    # The SLO rule; only the clamp below (current above a lowered max_replicas) may cut further.
    assert not (sig.breaching_slo and target < current)
    clamped = min(max(target, pol.min_replicas), pol.max_replicas)
    if clamped != target:  # only when current itself is outside [min, max]
        target, reason = clamped, Reason.CLAMPED

    next_state = replace(st, low_since_s=low_since)
    if target > current:
        next_state = replace(next_state, last_scale_up_s=now_s)
    elif target < current:
        next_state = replace(next_state, last_scale_down_s=now_s)
    decision = PhaseDecision(current=current, desired=target, reason=reason,
                             breaching_slo=sig.breaching_slo, worst_ratio=sig.worst_ratio)
    return decision, next_state


def tick(inp: TickInput, state: State, policy: Policy) -> Decision:
    """One autoscaling decision for both phases; each phase is decided independently."""
    prefill, prefill_state = _decide_phase(inp.prefill, policy.prefill, state.prefill, inp.now_s)
    backed_up = (inp.prefill.queue_depth is not None and inp.prefill.queue_depth / max(inp.prefill.replicas.ready, 1)
                 >= policy.prefill.queue_up_per_replica)
    decode, decode_state = _decide_phase(inp.decode, policy.decode, state.decode, inp.now_s, backed_up)
    return Decision(prefill=prefill, decode=decode,
                    state=State(prefill=prefill_state, decode=decode_state))


def settle(previous: State, decision: Decision, applied: dict[Phase, bool]) -> State:
    """The state to carry forward once the connector has (or has not) applied each change.

    A change that was not applied (API error, or superseded by someone else's edit) must not
    start a cooldown; the low-load bookkeeping is kept either way, because it describes load.
    """
    phases: dict[Phase, PhaseState] = {}
    for phase in Phase:
        new = decision.state.of(phase)
        if decision.of(phase).changed and not applied.get(phase, False):
            old = previous.of(phase)
            new = replace(new, last_scale_up_s=old.last_scale_up_s,
                          last_scale_down_s=old.last_scale_down_s)
        phases[phase] = new
    return State(prefill=phases[Phase.PREFILL], decode=phases[Phase.DECODE])

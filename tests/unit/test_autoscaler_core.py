"""The pure autoscaling core: replica trajectories over time, tick by tick.

Tables give, per tick, what the metrics said and what the core must answer (replicas and reason);
the replica count the next tick sees is the one decided before (pods become ready when a row says
so). A small load model then drives whole ramps and oscillations through `tick`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest

from autoscaler.core import (Decision, LatencyQuantiles, Phase, PhaseObservation, PhasePolicy, Policy,
                             Reason, ReplicaCounts, State, TickInput, settle, tick)
from common.errors import ConfigError

PREFILL = PhasePolicy(min_replicas=1, max_replicas=6, slo_p50_s=1.0, slo_p90_s=2.0,
                      queue_up_per_replica=2.0, queue_down_per_replica=0.25)
DECODE = PhasePolicy(min_replicas=1, max_replicas=8, slo_p50_s=0.05, slo_p90_s=0.1,
                     queue_up_per_replica=8.0, queue_down_per_replica=1.0,
                     kv_up_ratio=0.85, kv_down_ratio=0.5)
POLICY = Policy(prefill=PREFILL, decode=DECODE)

IDLE_DECODE = dict(lat=None, queue=0.0, kv=0.1)


def obs(current: int, ready: int | None = None, lat: tuple[float, float] | None = None,
        queue: float | None = 0.0, kv: float | None = None) -> PhaseObservation:
    return PhaseObservation(
        replicas=ReplicaCounts(desired=current, ready=current if ready is None else ready),
        latency=None if lat is None else LatencyQuantiles(p50_s=lat[0], p90_s=lat[1]),
        queue_depth=queue, kv_usage_ratio=kv)


@dataclass(frozen=True)
class Row:
    t: float
    lat: tuple[float, float] | None
    queue: float | None
    want: int
    reason: Reason
    kv: float | None = None
    not_ready: int = 0  # replicas still loading the model at this tick


def run_phase(phase: Phase, rows: list[Row], start: int = 1, policy: Policy = POLICY,
              other: dict | None = None) -> list[tuple[float, int, Reason]]:
    """Drive one phase through the rows (the other phase idles at `start`); returns the trace."""
    other = other if other is not None else IDLE_DECODE
    state, current, other_current, trace = State(), start, start, []
    for row in rows:
        mine = obs(current, current - row.not_ready, row.lat, row.queue, row.kv)
        theirs = obs(other_current, **other)
        inp = (TickInput(row.t, mine, theirs) if phase is Phase.PREFILL
               else TickInput(row.t, theirs, mine))
        decision = tick(inp, state, policy)
        state = settle(state, decision, {p: True for p in Phase})
        d = decision.of(phase)
        trace.append((row.t, d.desired, d.reason))
        current = d.desired
        other_current = decision.of(Phase.DECODE if phase is Phase.PREFILL else Phase.PREFILL).desired
    return trace


def expect(rows: list[Row]) -> list[tuple[float, int, Reason]]:
    return [(r.t, r.want, r.reason) for r in rows]


# Prefill: TTFT SLO p50 1 s / p90 2 s, up at 90 % of SLO, down below 50 %; queue up at 2 per
# ready replica, down at 0.25; up cooldown 30 s, down: stable for 120 s and 300 s since any event.
RAMP_UP_AND_DOWN = [
    Row(0, (0.3, 0.6), 0, 1, Reason.AT_MIN),
    Row(15, (0.8, 1.9), 0, 2, Reason.SCALE_UP),            # p90 at 95 % of SLO
    Row(30, (1.1, 2.4), 3, 2, Reason.WAITING_FOR_READY, not_ready=1),  # new pod still loading
    Row(45, (1.0, 2.2), 6, 3, Reason.SCALE_UP),            # 6 queued / 2 ready = 1.5x threshold
    Row(60, (1.0, 2.2), 12, 3, Reason.UP_COOLDOWN, not_ready=1),
    Row(75, (1.0, 2.2), 12, 5, Reason.SCALE_UP),           # wants 6, step limit is +2
    Row(90, (0.6, 1.2), 2, 5, Reason.HOLD),                # between the thresholds
    Row(105, (1.2, 3.0), 30, 6, Reason.SCALE_UP),          # wants 7, max is 6
    Row(120, (1.2, 3.0), 30, 6, Reason.AT_MAX),
    Row(135, (0.3, 0.8), 0, 6, Reason.STABILIZING),        # load gone: low run starts
    Row(240, (0.3, 0.8), 0, 6, Reason.STABILIZING),
    Row(255, (0.3, 0.8), 0, 6, Reason.DOWN_COOLDOWN),      # stable 120 s, last event 150 s ago
    Row(405, None, 0, 5, Reason.SCALE_DOWN),               # idle (no requests) counts as low
    Row(420, None, 0, 5, Reason.DOWN_COOLDOWN),
    Row(705, None, 0, 4, Reason.SCALE_DOWN),
    Row(1005, None, 0, 3, Reason.SCALE_DOWN),
    Row(1305, None, 0, 2, Reason.SCALE_DOWN),
    Row(1605, None, 0, 1, Reason.SCALE_DOWN),
    Row(1905, None, 0, 1, Reason.AT_MIN),
]

@pytest.mark.parametrize("rows", [RAMP_UP_AND_DOWN], ids=["prefill-ramp"])
def test_prefill_trajectory(rows: list[Row]) -> None:
    assert run_phase(Phase.PREFILL, rows) == expect(rows)


def test_decode_scales_on_kv_usage_with_projection() -> None:
    rows = [
        Row(0, (0.02, 0.04), 0, 2, Reason.HOLD, kv=0.6),
        Row(15, (0.02, 0.04), 0, 3, Reason.SCALE_UP, kv=0.9),  # KV alone triggers scale-up
        Row(30, (0.02, 0.04), 0, 3, Reason.HOLD, kv=0.55, not_ready=1),
        # KV 0.5 is at the down threshold, but 3 -> 2 replicas would push it to 0.75 per
        # replica; still below 0.85, so it counts as low and the stabilization run starts.
        Row(45, (0.01, 0.02), 0, 3, Reason.STABILIZING, kv=0.5),
        Row(345, (0.01, 0.02), 0, 2, Reason.SCALE_DOWN, kv=0.5),
        # Now 2 -> 1 would double KV to 1.0 per replica: not low, hold for good.
        Row(660, (0.01, 0.02), 0, 2, Reason.HOLD, kv=0.5),
        Row(2000, (0.01, 0.02), 0, 2, Reason.HOLD, kv=0.5),
    ]
    assert run_phase(Phase.DECODE, rows, start=2) == expect(rows)


def test_slo_breach_in_one_phase_scales_only_that_phase() -> None:
    state = State()
    prefill = decode = 2
    history = []
    for t in range(0, 300, 15):
        inp = TickInput(
            now_s=t,
            # prefill is comfortable: TTFT well inside SLO, nothing queued
            prefill=obs(prefill, lat=(0.6, 1.2), queue=1.0),
            # decode breaches its ITL SLO (p90 150 ms vs 100 ms) with KV and queue fine
            decode=obs(decode, lat=(0.04, 0.15), queue=4.0, kv=0.6),
        )
        d = tick(inp, state, POLICY)
        state = settle(state, d, {p: True for p in Phase})
        assert d.decode.breaching_slo and not d.prefill.breaching_slo
        prefill, decode = d.prefill.desired, d.decode.desired
        history.append((prefill, decode))
    assert {p for p, _ in history} == {2}
    decodes = [d for _, d in history]
    assert decodes == sorted(decodes) and decodes[-1] == DECODE.max_replicas


def test_breaching_phase_is_never_scaled_down() -> None:
    # up_fraction 1.5 makes room for "breaching but not high enough to scale up"; queue and KV
    # are idle, so only the SLO rule stands between this phase and a scale-down.
    lax = replace(DECODE, latency_up_fraction=1.5, latency_down_fraction=0.5)
    policy = Policy(prefill=PREFILL, decode=lax)
    rows = [Row(t, (0.03, 0.12), 0, 4, Reason.HOLD, kv=0.0) for t in range(0, 3600, 60)]
    trace = run_phase(Phase.DECODE, rows, start=4, policy=policy)
    assert trace == expect(rows)
    # ...whereas the same idle phase inside its SLO does go down.
    calm = [Row(t, (0.01, 0.02), 0, 0, Reason.HOLD, kv=0.0) for t in range(0, 3600, 60)]
    replicas = [want for _, want, _ in run_phase(Phase.DECODE, calm, start=4, policy=policy)]
    assert replicas[-1] == 1 and replicas == sorted(replicas, reverse=True)


@pytest.mark.parametrize("current, signal, want, reason", [
    (9, dict(lat=(0.9, 1.9), queue=20.0), 6, Reason.CLAMPED),   # above max: back to max
    (9, dict(lat=None, queue=0.0), 6, Reason.CLAMPED),
    (6, dict(lat=(2.0, 4.0), queue=50.0), 6, Reason.AT_MAX),    # breaching, but at budget
    (1, dict(lat=None, queue=0.0), 1, Reason.AT_MIN),
    (5, dict(lat=(1.0, 2.2), queue=100.0), 6, Reason.SCALE_UP),  # step +2 capped by max
])
def test_min_max_clamps(current: int, signal: dict, want: int, reason: Reason) -> None:
    low_min = replace(PREFILL, min_replicas=1)
    d = tick(TickInput(0.0, obs(current, **signal), obs(1, **IDLE_DECODE)), State(),
             Policy(prefill=low_min, decode=DECODE))
    assert (d.prefill.desired, d.prefill.reason) == (want, reason)


def test_below_min_is_raised_to_min() -> None:
    raised = Policy(prefill=replace(PREFILL, min_replicas=3), decode=DECODE)
    d = tick(TickInput(0.0, obs(1, lat=None), obs(1, **IDLE_DECODE)), State(), raised)
    assert (d.prefill.desired, d.prefill.reason) == (3, Reason.CLAMPED)


def test_unknown_gauges_block_scale_down() -> None:
    rows = [Row(t, None, None, 4, Reason.HOLD) for t in range(0, 2000, 100)]
    assert run_phase(Phase.PREFILL, rows, start=4) == expect(rows)


def test_change_not_applied_starts_no_cooldown() -> None:
    high = TickInput(0.0, obs(2, lat=(1.0, 2.5), queue=10.0), obs(1, **IDLE_DECODE))
    d = tick(high, State(), POLICY)
    assert d.prefill.reason is Reason.SCALE_UP
    state = settle(State(), d, {Phase.PREFILL: False})
    assert state.prefill.last_scale_up_s is None
    # 5 s later the same pressure scales up at once (not blocked by a cooldown).
    again = tick(replace(high, now_s=5.0), state, POLICY)
    assert again.prefill.reason is Reason.SCALE_UP


@pytest.mark.parametrize("bad", [
    dict(min_replicas=0), dict(max_replicas=0), dict(slo_p90_s=0.0),
    dict(latency_down_fraction=0.95), dict(queue_down_per_replica=5.0),
    dict(kv_up_ratio=0.8), dict(max_step_up=0), dict(scale_down_cooldown_s=-1.0),
])
def test_invalid_policy_is_rejected(bad: dict) -> None:
    with pytest.raises(ConfigError):
        replace(PREFILL, **bad)


# ----- a load model: whole trajectories --------------------------------------------------------

PREFILL_CAPACITY_RPS = 4.0  # requests/s one prefill replica serves at batch 1
STARTUP_S = 45.0            # a new replica loads the model for this long before it is ready


def simulate(load_rps: list[float], policy: Policy = POLICY, dt: float = 15.0) -> list[int]:
    """Prefill replicas over time for a given offered load (one value per tick)."""
    state, replicas, ready_at = State(), PREFILL.min_replicas, [0.0]
    out = []
    for i, load in enumerate(load_rps):
        now = i * dt
        ready = sum(1 for r in ready_at[:replicas] if r <= now)
        util = load / max(ready * PREFILL_CAPACITY_RPS, 1e-9)
        # M/M/1-like: latency grows as utilisation approaches 1; overload queues up.
        p50 = 0.25 / max(1.0 - min(util, 0.95), 0.05)
        queue = max(0.0, (util - 0.9) * 10.0 * ready)
        inp = TickInput(now, obs(replicas, ready, (p50, 2.2 * p50) if load else None, queue),
                        obs(1, **IDLE_DECODE))
        d = tick(inp, state, policy)
        state = settle(state, d, {p: True for p in Phase})
        if d.prefill.desired > replicas:
            ready_at = ready_at[:replicas] + [now + STARTUP_S] * (d.prefill.desired - replicas)
        replicas = d.prefill.desired
        out.append(replicas)
    return out


def direction_changes(traj: list[int]) -> int:
    steps = [b - a for a, b in zip(traj, traj[1:]) if b != a]
    return sum(1 for a, b in zip(steps, steps[1:]) if (a > 0) != (b > 0))


def test_ramp_up_then_down_follows_load() -> None:
    ramp = [2.0] * 4 + [2.0 + 2.0 * i for i in range(10)] + [20.0] * 20 + [1.0] * 160
    roomy = Policy(prefill=replace(PREFILL, max_replicas=12), decode=DECODE)
    traj = simulate(ramp, roomy)
    peak = max(traj)
    # Enough capacity for 20 rps at < 90 % utilisation, and set by the load, not by max.
    assert math.ceil(20.0 / (0.9 * PREFILL_CAPACITY_RPS)) <= peak < 12
    top = traj.index(peak)
    assert traj[:top + 1] == sorted(traj[:top + 1])      # only up while load rises
    assert traj[top:] == sorted(traj[top:], reverse=True)  # only down once it falls
    assert traj[-1] == 1 and direction_changes(traj) == 1


def test_oscillating_load_does_not_flap() -> None:
    wave = ([14.0] * 2 + [3.0] * 2) * 40  # load swings every 30 s for 40 minutes
    traj = simulate(wave)
    assert direction_changes(traj) == 0
    assert traj[-1] == max(traj) >= 4  # capacity for the peaks is kept, not dropped each trough
    # The same wave without hysteresis or cooldowns flaps: the mechanism is what prevents it.
    twitchy = replace(PREFILL, latency_down_fraction=0.85, queue_down_per_replica=1.9,
                      scale_up_cooldown_s=0.0, scale_down_cooldown_s=0.0,
                      scale_down_stabilization_s=0.0)
    assert direction_changes(simulate(wave, Policy(prefill=twitchy, decode=DECODE))) >= 10


ROUTER_QUEUE_DECODE = replace(DECODE, router_queue_up_per_replica=4.0, router_queue_down_per_replica=0.5,
                              router_wait_up_s=5.0, router_wait_down_s=0.5)


def _decode_with_router_queue(depth: float | None, wait: float | None, prefill_queue: float = 0.0,
                              current: int = 2) -> Decision:
    pol = Policy(prefill=PREFILL, decode=ROUTER_QUEUE_DECODE)
    decode = replace(obs(current, queue=0.0, kv=0.3), router_queue_depth=depth, router_queue_wait_p90_s=wait)
    return tick(TickInput(1000.0, obs(1, queue=prefill_queue), decode), State(), pol)


def test_router_queue_scales_decode_unless_prefill_is_backed_up() -> None:
    # 16 requests wait in the routers for decode room: 8 per ready decode replica, twice the threshold
    d = _decode_with_router_queue(16.0, 1.0).decode
    assert (d.reason, d.desired, d.worst_ratio) == (Reason.SCALE_UP, 4, 2.0)
    # the p90 wait alone (10 s against 5 s) says the same
    assert _decode_with_router_queue(0.0, 10.0).decode.desired == 4
    # prefill backed up (3 queued per prefill replica >= 2): decode slots hold requests waiting for
    # prefill, so the router queue is prefill's doing: decode holds, prefill scales
    both = _decode_with_router_queue(16.0, 10.0, prefill_queue=3.0)
    assert both.decode.reason is Reason.HOLD and both.prefill.reason is Reason.SCALE_UP


def test_router_queue_blocks_decode_scale_down_and_absent_means_no_vote() -> None:
    # everything else idle, but requests still wait in the routers: decode must not shrink
    assert _decode_with_router_queue(2.0, 0.1).decode.reason is Reason.HOLD
    assert _decode_with_router_queue(0.0, 2.0).decode.reason is Reason.HOLD
    # no router-queue data (older routers): it neither votes up nor blocks the scale-down path
    assert _decode_with_router_queue(None, None).decode.reason is Reason.STABILIZING
    with pytest.raises(ConfigError):
        replace(DECODE, router_queue_up_per_replica=1.0)

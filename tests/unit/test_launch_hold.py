"""engine/launch_hold.py (--launch-hold): the next launch waits until shortly before the step in flight is
predicted to end, so arrivals join it; the estimates, the margin's self-correction, and the loop on a
simulated GPU timeline (the tiny CPU model computes; a clock says when each step "ends")."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from engine.build import EngineConfig, build_engine_parts
from engine.core import EngineCore
from engine.launch_hold import BASE_MARGIN_S, MAX_MARGIN_S, LaunchHold, hold_seconds
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence


def test_hold_seconds_until_lead_before_the_predicted_end():
    assert hold_seconds(10.0, 0.012, 0.004, 10.001) == pytest.approx(0.007)
    assert hold_seconds(10.0, 0.012, 0.004, 10.009) == 0.0  # the moment passed
    assert hold_seconds(None, 0.012, 0.004, 10.0) == 0.0 and hold_seconds(10.0, None, 0.004, 10.0) == 0.0


def _learned(span=0.012, launch_dec=0.002, launch_mix=0.003) -> LaunchHold:
    h = LaunchHold()
    h.launched(launch_mix, mixed=True)
    t = 100.0
    h.collected(t, queued=True, prev_decode_only=False, next_decode_only=True, held=False)
    for _ in range(4):
        h.launched(launch_dec, mixed=False)
        t += span
        h.collected(t, queued=True, prev_decode_only=True, next_decode_only=True, held=False)
    return h


def test_prediction_from_decode_spans_and_leads_from_each_launch_kind():
    h = _learned()
    assert list(h.spans) == pytest.approx([0.012] * 4)  # the first decode step began when the mixed one ended
    assert h.lead(False) == pytest.approx(0.002 + BASE_MARGIN_S)
    assert h.lead(True) == pytest.approx(0.003 + BASE_MARGIN_S)
    now = h.started + 0.001
    hold = h.hold(now)  # until a decode launch's lead before the end; prompts admitted while a mixed one fits
    assert hold.until == pytest.approx(h.started + 0.012 - 0.002 - BASE_MARGIN_S)
    assert hold.admit_until == pytest.approx(h.started + 0.012 - 0.003 - BASE_MARGIN_S)
    h.margin_s = 4 * BASE_MARGIN_S  # widened by late decode launches: the decode deadline moves, admission not
    assert h.hold(now).until == pytest.approx(h.started + 0.012 - 0.002 - 4 * BASE_MARGIN_S)
    assert h.hold(now).admit_until == pytest.approx(hold.admit_until)
    assert h.hold(h.started + 0.012 - 0.002 - BASE_MARGIN_S + 1e-4) is None  # the moment passed


def test_a_bubble_share_admits_prompts_later():
    h = _learned()
    h.bubble_frac = 0.25
    hold = h.hold(h.started + 0.001)
    # admitted while a median mixed launch (3 ms) ends no more than a quarter step (3 ms) after the end
    assert hold.admit_until == pytest.approx(h.started + 0.012 - 0.003 - BASE_MARGIN_S + 0.25 * 0.012)
    assert hold.until == pytest.approx(h.started + 0.012 - 0.002 - BASE_MARGIN_S)


def test_no_hold_without_what_the_prediction_needs():
    h = LaunchHold()
    for _ in range(5):
        h.launched(0.002, mixed=False)
        h.collected(time.perf_counter(), True, True, True, False)
    assert h.hold(h.started) is None  # no mixed launch seen: the lead an arrival needs is unknown
    h = _learned()
    h.collected(h.started + 0.012, queued=True, prev_decode_only=True, next_decode_only=False, held=False)
    assert h.hold(h.started) is None  # a mixed step in flight: its span is not predicted
    h = _learned()
    h.collected(h.started + 0.02, queued=False, prev_decode_only=True, next_decode_only=True, held=False)
    assert h.started is None and h.hold(time.perf_counter()) is None  # the in-flight step's start was not seen


def test_a_late_held_launch_widens_the_margin_and_timely_ones_narrow_it():
    h = _learned()
    h.collected(h.started + 0.012, queued=False, prev_decode_only=True, next_decode_only=True, held=True)
    assert h.late == 1 and h.margin_s == pytest.approx(2 * BASE_MARGIN_S)
    h.idle(held=True)  # a held step's predecessor found done before the launch: late too
    assert h.late == 2 and h.margin_s == pytest.approx(4 * BASE_MARGIN_S)
    for _ in range(10):
        h.idle(held=True)
    assert h.margin_s == MAX_MARGIN_S
    for _ in range(200):
        h.collected(1.0, queued=True, prev_decode_only=True, next_decode_only=True, held=True)
    assert h.margin_s == BASE_MARGIN_S and h.late == 12
    h.idle(held=False)  # not held: the margin is not judged
    assert h.margin_s == BASE_MARGIN_S


class SimulatedGPU:
    """Wraps a CPU runner: each launched step 'runs' SPAN seconds after the one before it (or after its
    launch, on an idle GPU); ready/collect follow that clock. Records the GPU's idle time between steps."""

    def __init__(self, runner, span: float) -> None:
        self.runner, self.span = runner, span
        self.end: dict[int, float] = {}
        self.last_end = 0.0
        self.idle_s = 0.0
        launch, collect = runner.launch, runner.collect

        def sim_launch(items, prev=None, no=0, **kw):
            h = launch(items, prev, no, **kw)
            now = time.perf_counter()
            if self.last_end and now > self.last_end:
                self.idle_s += now - self.last_end
            self.end[no] = self.last_end = max(now, self.last_end) + span
            return h

        def sim_collect(h):
            while time.perf_counter() < self.end[h.no]:
                time.sleep(0.0002)
            return collect(h)

        runner.launch, runner.collect = sim_launch, sim_collect
        runner.ready = lambda h: time.perf_counter() >= self.end[h.no]


def _core(span: float, hold: bool):
    # torch kernels only (fusions off: no Triton interpreter), so a launch takes milliseconds against the span
    parts = build_engine_parts(EngineConfig(random_preset="tiny-a", kv_cache_bytes=4 << 20, fusions="off",
                                            scheduler=SchedulerConfig(8, 64, 256)))
    core = EngineCore(Scheduler(parts.scheduler.cfg, parts.kv, ()), parts.runner)
    core.overlap = True  # the simulated runner overlaps as a GPU's does
    gpu = SimulatedGPU(parts.runner, span)
    core.launch_hold = LaunchHold() if hold else None
    return core, gpu


def _serve(core, arrivals: dict[int, Sequence], holds: list):
    """The decode server's loop, reduced: hold (sleeping), step; arrivals come between iterations."""
    outputs, n = {}, 0
    pending = dict(arrivals)
    while core.has_work or pending:
        n += 1
        if n in pending:  # arrives before this iteration's hold
            core.scheduler.add(pending.pop(n))
        hold = core.hold()
        if hold is not None:
            core.held_s = max(0.0, hold.until - time.perf_counter())
            time.sleep(core.held_s)
        holds.append(core.held_s)
        for seq in core.step():
            outputs[seq.request_id] = list(seq.output_ids)
    return outputs


def _seqs(vocab=400, n=4, new_at=(6, 12)):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    base = {i: Sequence(f"r{i}", [(7 * i + j) % vocab + 1 for j in range(10)], params) for i in range(n)}
    later = {k: Sequence(f"late{k}", [(3 * k + j) % vocab + 1 for j in range(12)], params) for k in new_at}
    return base, later


def test_launch_hold_on_a_simulated_gpu_holds_without_idling_it_and_keeps_the_tokens(one_torch_thread):
    span = 0.05  # long against the tiny CPU model's launch (~1-5 ms; more on a loaded 2-core CI machine)
    results = {}
    for hold in (False, True):
        core, gpu = _core(span, hold)
        base, later = _seqs()
        for s in base.values():
            core.scheduler.add(s)
        holds = []
        results[hold] = (_serve(core, later, holds), gpu, core, holds)
    (out_off, gpu_off, _, holds_off), (out_on, gpu_on, core_on, holds_on) = results[False], results[True]
    assert out_on == out_off and len(out_on) == 6  # greedy: the same tokens with the hold
    assert not any(holds_off)
    h = core_on.launch_hold
    assert list(h.spans) and all(abs(s - span) < 0.01 for s in h.spans), list(h.spans)
    held = [x for x in holds_on if x > 0]
    assert len(held) >= 5 and max(held) < span, holds_on  # it held, never past a predicted step
    # held launches mostly came before the step in flight ended (the lead covers most launches, not the
    # tail: a 2-core CI machine has one), and the GPU idled about as long as without holding
    assert h.late <= max(2, len(held) // 3), (h.late, len(held))
    assert gpu_on.idle_s <= gpu_off.idle_s + 0.05, (gpu_on.idle_s, gpu_off.idle_s)


def test_an_arrival_during_the_hold_joins_the_next_launch(one_torch_thread):
    """What the hold is for: a request that comes while a decode step runs is in the very next launch."""
    core, gpu = _core(0.05, hold=True)
    base, _ = _seqs(n=2)
    for s in base.values():
        core.scheduler.add(s)
    launched = []
    launch = core.runner.launch
    core.runner.launch = lambda items, prev=None, no=0, **kw: (launched.append({it.seq.request_id for it in items}),
                                                              launch(items, prev, no, **kw))[1]
    while core.hold() is None:  # until the estimates allow a hold (a mixed launch, decode spans)
        core.step()
        if len(launched) == 3:  # a mixed launch: a short prompt joins the batch
            core.scheduler.add(Sequence("warm", [5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0)))
        assert len(launched) < 30
    n = len(launched)
    newcomer = Sequence("new", [9, 8, 7, 6], SamplingParams(max_tokens=2, temperature=0.0))
    core.scheduler.add(newcomer)  # arrives during the hold (the server's _hold ends it: a prompt waits)
    assert core.hold() is None
    core.held_s = 0.001
    core.step()
    assert "new" in launched[n]
    while core.hold() is None:
        core.step()
    late = Sequence("late", [4, 3, 2], SamplingParams(max_tokens=2, temperature=0.0))
    core.scheduler.add(late)  # after admit_until: the hold defers it to the step after
    core.admit, core.held_s = False, 0.001
    core.step()
    assert "late" not in launched[-1] and late in core.scheduler.waiting and core.admit
    core.step()
    assert "late" in launched[-1]
    while core.has_work:
        core.step()


def _server(msgs):
    waiting, calls = [], []
    core = SimpleNamespace(held_s=0.0, admit=True, inflight_done=lambda: False)
    engine = SimpleNamespace(scheduler=SimpleNamespace(waiting=waiting), core=core, poll_transfers=lambda: [])
    io = SimpleNamespace(drain_timed=lambda t: (calls.append(t), msgs.pop(0) if msgs else [])[1])
    return SimpleNamespace(engine=engine, io=io, handle=lambda peer, msg, received: waiting.append(msg)), calls


def test_server_hold_ends_when_a_prompt_arrives_in_time_and_defers_a_late_one():
    from decode_worker.server import DecodeServer
    from engine.launch_hold import Hold

    server, calls = _server([[], [], [("peer", "generate", 0.0)], []])
    t0 = time.perf_counter()
    DecodeServer._hold(server, Hold(t0 + 1.0, t0 + 1.0))
    assert time.perf_counter() - t0 < 0.5 and server.engine.scheduler.waiting == ["generate"] and len(calls) == 3
    assert all(t <= 0.0005 for t in calls) and 0 < server.engine.core.held_s < 0.5 and server.engine.core.admit
    server, calls = _server([[("peer", "generate", 0.0)]])
    t0 = time.perf_counter()
    DecodeServer._hold(server, Hold(t0 + 0.02, t0 - 1.0))  # its mixed launch no longer fits: held to the end
    assert server.engine.core.held_s >= 0.0195 and not server.engine.core.admit
    server, calls = _server([])
    server.engine.core.inflight_done = lambda: len(calls) >= 2  # the step in flight ends early
    t0 = time.perf_counter()
    DecodeServer._hold(server, Hold(t0 + 1.0, t0 + 1.0))
    assert len(calls) == 2 and server.engine.core.held_s < 0.5

"""EngineCore: the step loop the offline engine and the decode worker share, overlapped.

    step():  items = scheduler.schedule()            # step N+1, planned with the lengths the host knows
             h = runner.launch(items, inflight)      # its inputs, forward and sampling queued on the GPU
             done = collect(inflight)                # step N's tokens (the GPU finished it meanwhile)
             inflight = h

The GPU never waits for the host between steps: while step N runs, the host schedules step N+1,
builds its metadata and plans attention; step N's sampled tokens feed step N+1 on the device and
reach the host one step later (engine.runner). Consequences, handled in engine.scheduler:
  * a stop token is seen one step late: the token sampled meanwhile is dropped;
  * a length stop (max_tokens, context) is known at launch: no surplus step;
  * pages released while a step is in flight return once it completed (a KV transfer must not land
    in a page that step still writes);
  * a preemption needs the in-flight step completed first (it frees pages at once).
A step N already done when the iteration begins is collected *before* N+1 is planned (collect_ready:
the host set the pace, the host work is the same either way, its tokens leave one launch earlier).
Optionally (`first_token_wait_s`, --first-token-wait-ms, off by default) a step N that sampled prompts'
first tokens is waited for, bounded, before N+1 is planned: in the multi-turn suite's run 9, 55 % of mixed
steps were not done when the next iteration began although their GPU span ended within ~1 ms of their
launch, and their first tokens waited for the next launch (~12 ms p50). Measured worse served both times:
waiting without a bound (multi-turn-colocated-pw-6) and with 3 ms, in both orders (run 10: cached TTFT p50
51.6 vs 42.3 ms, p99 498 vs 84; run 11: 69.0 vs 57.6; queue and local prefill both longer). Kept as the A/B's switch.
With `launch_hold` (--launch-hold, engine/launch_hold.py) the decode worker's loop holds the next
launch until shortly before the step in flight is predicted to end, so requests arriving meanwhile
join the next step instead of the one after it; this class keeps the estimates (`hold`).
With `overlap=False` (or a runner that cannot overlap, such as a tensor-parallel group's) every
step is collected right after its launch: the same code, synchronous.
"""

from __future__ import annotations

import logging
import time

from engine.launch_hold import Hold, LaunchHold
from engine.runner import ModelRunner, StepHandle
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence

log = logging.getLogger("tandem.engine")

# A step this long is logged with its shape: a one-off stall (a kernel compiled for a new shape, a
# graph captured late) shows up in serving as a TTFT outlier the request's own figures cannot name.
SLOW_STEP_S = 1.0


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, overlap: bool = True) -> None:
        self.scheduler, self.runner = scheduler, runner
        self.overlap = overlap and getattr(runner, "supports_overlap", False)
        scheduler.share_prompts = getattr(runner, "supports_page_copies", False)
        self.inflight: StepHandle | None = None
        self.num_steps = 0
        self.trace = None  # engine.step_trace.StepTrace (--step-trace): one line per step
        # Collect a finished step before planning the next (its tokens leave one launch earlier); off:
        # always launch first (the A/B of benchmarks/mixed_step.py). Needs a runner that can tell.
        self.collect_ready = hasattr(runner, "ready")
        self.first_token_wait_s = 0.0  # --first-token-wait-ms (decode worker, off by default: measured worse)
        self.launch_hold: LaunchHold | None = None  # --launch-hold (decode worker; a GPU runner that overlaps)
        self.held_s = 0.0  # how long the caller held this iteration's launch (the step trace's hold_ms)
        self.admit = True  # False: the caller's hold deferred a late arrival to the step after this one
        self._t_tokens = 0.0  # perf_counter when the last collect's tokens reached the host

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.inflight is not None

    def hold(self) -> Hold | None:
        """The hold the caller may take (handling arrivals) before calling step(), or None: only with
        holding on, a decode-only step in flight and nothing waiting to be scheduled."""
        h = self.launch_hold
        if h is None or self.inflight is None or self.scheduler.waiting or not self.overlap:
            return None
        return h.hold(time.perf_counter())

    def inflight_done(self) -> bool:
        """The step in flight finished on the GPU (a hold that outlasts it stops: the GPU is idle)."""
        return self.inflight is not None and self.runner.ready(self.inflight)

    def step(self) -> list[Sequence]:
        """One iteration. Returns the sequences that received a token (finished ones included)."""
        t0 = time.perf_counter()
        t_mono = time.monotonic()
        prev = collected = self.inflight
        done: list[Sequence] = []
        first = prev is not None and self.collect_ready and (
            self.runner.ready(prev) or (self.first_token_wait_s > 0 and self._first_tokens(prev)
                                        and self.runner.wait_ready(prev, self.first_token_wait_s)))
        if first:
            # The GPU already finished the step in flight (the host, not the GPU, sets the pace): its
            # tokens go out now instead of after the next launch. The host's work per iteration is the
            # same in either order, so this costs no throughput; a step still running keeps the overlap.
            # Waiting for a running step that sampled first tokens measured worse in serving (the host
            # idled up to 10-20 ms, then the GPU idled while it planned: multi-turn-colocated-pw-6).
            done += self._collect(prev)
            prev = None
            if self.launch_hold is not None:
                self.launch_hold.idle(self.held_s > 0)
        t_planned = time.perf_counter()
        parts = None
        if self.trace is not None:  # where the iteration's host time goes, for the step trace
            parts = {"collect_first": (time.perf_counter() - t0) * 1e3} if first else {}
            if self.held_s > 0:
                parts["hold"] = self.held_s * 1e3
            if hasattr(self.runner, "launch_parts"):
                self.runner.launch_parts = parts
        self._queue_copies()  # indexed between steps (a decode worker's landed prompt, n > 1): before this launch
        items = self.scheduler.schedule(preempt_ok=prev is None, admit=self.admit)
        if items is None:  # a preemption is due: complete the step in flight, then preempt
            assert prev is not None
            done += self._collect(prev)
            prev = None
            if self.launch_hold is not None:
                self.launch_hold.idle(self.held_s > 0)
            items = self.scheduler.schedule(preempt_ok=True)
        handle = None
        t1 = t2 = time.perf_counter()
        cpu = time.thread_time if self.trace is not None else float  # float() = 0.0: no clock read untraced
        c1 = c2 = cpu()
        if items:
            self.num_steps += 1
            now = time.monotonic()  # before the launch: on a CPU the launch is the whole forward
            for it in items:
                if it.seq.first_launch is None:
                    it.seq.first_launch = now
            handle = self.runner.launch(items, prev, self.num_steps)
            self.scheduler.on_launch(items, self.num_steps)
            self._queue_copies()
            t2, c2 = time.perf_counter(), cpu()
        hold = self.launch_hold
        if hold is not None and handle is not None:
            hold.launched(t2 - t_planned, any(it.chunk for it in items))
        # the step in flight still running once the next is queued: the host blocks on it, and the next
        # step begins on the GPU when its tokens come (engine/launch_hold.py's clock)
        queued = hold is not None and prev is not None and handle is not None and not self.runner.ready(prev)
        if prev is not None:
            done += self._collect(prev)
            if hold is not None:
                if handle is None:
                    hold.idle(self.held_s > 0)
                else:
                    hold.collected(self._t_tokens, queued, not any(it.chunk for it in prev.items),
                                   not any(it.chunk for it in items), self.held_s > 0)
        elif hold is not None and handle is not None:
            hold.idle(held=False)  # launched onto an idle GPU (nothing in flight to hold behind): start unseen
        if self.trace is not None and (items or collected is not None):
            self.trace.record(self.num_steps if items else 0, t_mono, items or (), t1 - t0, t2 - t1,
                              time.perf_counter() - t2, collected.no if collected is not None else None,
                              c2 - c1, collected.gpu_ms if collected is not None else None,
                              first, parts)
        if handle is not None and handle.deferred is not None:  # grammar rows: masks need prev's tokens
            self.runner.finish_sample(handle)
        self.inflight = handle
        self.held_s, self.admit = 0.0, True
        if handle is not None and not self.overlap:
            done += self._collect(handle)
        if self.inflight is None and self.scheduler.has_fenced and hasattr(self.runner, "sync_copies"):
            # nothing in flight, yet pages fenced behind page copies no step followed: settle them now
            self.runner.sync_copies()
            self.scheduler.release_fenced()
        if (dt := time.perf_counter() - t0) > SLOW_STEP_S:
            log.warning("slow step %d: %.2f s; launched %d seqs, %d tokens (largest chunk %d)", self.num_steps, dt,
                        len(items or ()), sum(it.q_len for it in items or ()), max((it.q_len for it in items or ()),
                                                                                 default=0))
        return done

    def _queue_copies(self) -> None:
        """Prompts indexed in the prefix cache while their sequences run (n > 1 choices, branch points): their ring
        blocks are copied into the cache's pages right behind the step that wrote them (or, indexed between steps,
        before the next launch), so before any later step writes the ring."""
        for src, dst in self.scheduler.pending_copies:
            self.runner.copy_sliding_pages(src, dst)
        self.scheduler.pending_copies.clear()

    def flush(self) -> list[Sequence]:
        """Complete the step in flight (drain, shutdown)."""
        return self._collect(self.inflight) if self.inflight is not None else []

    def abort(self, seq: Sequence) -> None:
        """End a sequence now; its pages return once no launched step can still write them."""
        self.scheduler.finish(seq, FinishReason.ABORT)

    @staticmethod
    def _first_tokens(h: StepHandle) -> bool:
        """The step samples some prompt's first token (a chunk that completes its prompt)."""
        return any(it.sample and it.start < len(it.seq.prompt_ids) for it in h.items)

    def _collect(self, h: StepHandle | None) -> list[Sequence]:
        assert h is not None
        tokens, lps = self.runner.collect(h)
        self._t_tokens = time.perf_counter()
        if self.inflight is h:
            self.inflight = None
        done = self.scheduler.postprocess(h.items, tokens, lps)
        self.scheduler.release_completed(h.no)
        return done

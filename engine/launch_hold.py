"""When the overlapped loop launches the next step: as late as is safe, so arrivals join it (--launch-hold).

The overlapped loop (engine/core.py) launches step N+1 as soon as step N is launched, so the GPU never
waits for the host. The price is paid by a request that arrives while N runs: N+1 is already queued
behind N without it, so its first token comes after N's remainder, all of N+1 and its own step N+2:
2.5 step periods on average. Holding N+1's launch until shortly before N is predicted to end lets a
request arriving in the hold join N+1: with steps of period P and a hold of D, the mean wait falls
from 2.5 P to 2.5 P - D (multi-turn-colocated-ab-1, H100: decode steps of ~63 sequences at ~3.6k
context took ~11-13 ms and a cached turn's TTFT p50 was 40.8 ms, ~3 periods with the launches).

What is kept before N's predicted end (the lead) is the next launch's host time (scheduler and launch) plus
a margin: a decode step's launch when nothing arrives, which is where the hold ends. An arrival makes the
next step mixed, whose launch is longer (10 ms p50 with attention as islands, 3.3 in the graphs): one that
comes while a mixed launch (at its median, with the base margin) still fits before N's end ends the hold and
joins the next step; a later one waits for the step after (`admit_until`), as it would have without the
hold, rather than leave the GPU idle while its step launches. With `bubble_frac` > 0 (--launch-hold-bubble)
a prompt is admitted while its launch at the median would leave the GPU idle for at most that share of a
step: one request's first token a whole step earlier against every running sequence's next token a little
later. A hold is taken only when both are known: N is a decode-only step (its span is predicted by the spans
of recent decode-only steps) and N's start on the GPU was seen (N was queued behind N-1, and the host
blocked on N-1's tokens: N began when they came). A launch that came too late shows as the step before it
already done when the host looked: the GPU idled. The margin then doubles (up to MAX_MARGIN_S) and decays
back while holds land in time.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

BASE_MARGIN_S = 0.0015
MAX_MARGIN_S = 0.010
MIN_SPANS = 3  # decode-only spans seen before holding at all
SPANS_KEPT = 5  # the prediction: the median of the last few (decode steps change slowly, step to step)
LAUNCHES_KEPT = 32  # per kind (decode-only, mixed): the lead covers their LAUNCH_Q quantile
LAUNCH_Q = 0.8  # host launches have a tail (GC, the network thread's GIL): covering it all would leave no hold


def hold_seconds(started: float | None, span: float | None, lead: float, now: float) -> float:
    """How long to wait before scheduling the next step: until `lead` before the in-flight step's
    predicted end (started + span, host clock); 0 when either is unknown or the moment has passed."""
    if started is None or span is None:
        return 0.0
    return max(0.0, started + span - lead - now)


@dataclass(frozen=True, slots=True)
class Hold:
    until: float  # perf_counter: launch then (a decode step's lead before the step in flight ends)
    admit_until: float  # a prompt arriving before this joins the next step (its mixed launch still fits)


def _quantile(xs, q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass
class LaunchHold:
    margin_s: float = BASE_MARGIN_S
    spans: deque = field(default_factory=lambda: deque(maxlen=SPANS_KEPT))  # decode-only steps' GPU spans (s)
    launch_s: dict = field(default_factory=dict)  # mixed: bool -> recent schedule + launch host times (s)
    started: float | None = None  # host time the in-flight step began on the GPU (None: not seen)
    decode_only: bool = False  # the in-flight step has no prompt chunk
    holds: int = 0  # launches held
    late: int = 0  # held launches that came after the GPU went idle
    bubble_frac: float = 0.0  # --launch-hold-bubble: idle GPU time an admitted prompt may cost, share of a step

    def lead(self, mixed: bool) -> float:
        """Host time kept before the predicted end for the next launch (decode-only or mixed)."""
        return _quantile(self.launch_s[mixed], LAUNCH_Q) + self.margin_s

    def hold(self, now: float) -> Hold | None:
        """The hold to take now, or None: launch at once."""
        if not self.decode_only or len(self.spans) < MIN_SPANS or len(self.launch_s) < 2:
            return None  # both kinds of launch seen: the leads are known
        span = statistics.median(self.spans)
        wait = hold_seconds(self.started, span, self.lead(False), now)
        if wait <= 0:
            return None
        # an arrival's mixed launch at the median, with the base margin: launch-hold-ab-1 (H100) held 770 launches
        # with the decode lead's p80 and adaptive margin for both, and deferred every arrival (they came ~5 ms
        # into ~12 ms steps; attention in the graphs launches a mixed step in 3.7 ms p50)
        admit_lead = statistics.median(self.launch_s[True]) + BASE_MARGIN_S - self.bubble_frac * span
        return Hold(now + wait, self.started + span - admit_lead)

    def launched(self, seconds: float, mixed: bool) -> None:
        """A step was scheduled and launched in `seconds` of host time."""
        self.launch_s.setdefault(mixed, deque(maxlen=LAUNCHES_KEPT)).append(seconds)

    def collected(self, t_end: float, queued: bool, prev_decode_only: bool, next_decode_only: bool,
                  held: bool) -> None:
        """The previous step's tokens came at `t_end` (host clock), after the next step's launch (`held`:
        that launch was held). `queued`: the previous step was still running when the launch returned,
        so the host blocked on it and the next step began on the GPU at t_end; otherwise the GPU had
        finished it first and idled."""
        if queued and prev_decode_only and self.started is not None:
            self.spans.append(t_end - self.started)
        self._judge(held, late=not queued)
        self.started = t_end if queued else None
        self.decode_only = next_decode_only

    def idle(self, held: bool) -> None:
        """The step in flight was collected before a launch (it was done when the iteration began, or a
        preemption needed it): the next launch starts on an idle GPU, its start unseen."""
        self._judge(held, late=True)
        self.started, self.decode_only = None, False

    def _judge(self, held: bool, late: bool) -> None:
        if not held:
            return
        self.holds += 1
        if late:  # the hold outlasted the step in flight: the GPU idled; keep more before the next end
            self.late += 1
            self.margin_s = min(MAX_MARGIN_S, 2 * self.margin_s)
        else:
            self.margin_s = max(BASE_MARGIN_S, self.margin_s * 0.98)

"""Router metrics -> autoscaler inputs.

Role: turn the router's Prometheus text exposition into typed values, and two scrapes of it into
the `TickInput` the pure core decides on. One scrape of the router is enough: it serves the
latency histograms it measures itself and re-exports the per-phase gauges it polls from workers.
No I/O here: the HTTP fetch lives in main.py, so tests feed text straight in.

Lifecycle: main.py fetches the text each tick -> `parse_router_metrics(text, at_s)` ->
`ScrapeWindow.add()` keeps recent scrapes -> `build_tick_input()` diffs the newest scrape against
the one about `window_s` older, so latency quantiles describe the last window, not the router's
lifetime (histograms are cumulative counters).

Metric names (fixed by the router): `tandem_ttft_seconds`, `tandem_itl_seconds` (histograms);
`tandem_queue_depth{phase}`, `tandem_kv_usage_ratio{phase}`, `tandem_running_seqs{phase}`
(gauges). Gauges may carry more labels (e.g. one series per worker): if a series has only the
`phase` label it is taken as the phase aggregate; otherwise queue depth and running seqs are
summed and KV usage is averaged over the phase's series.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from autoscaler.core import LatencyQuantiles, Phase, PhaseObservation, ReplicaCounts, TickInput
from common.errors import ConfigError, ProtocolError

TTFT = "tandem_ttft_seconds"
ITL = "tandem_itl_seconds"
QUEUE_DEPTH = "tandem_queue_depth"
KV_USAGE = "tandem_kv_usage_ratio"
RUNNING_SEQS = "tandem_running_seqs"


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative bucket counts; `bounds` ascend and end with +inf (Prometheus `le`)."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    @property
    def total(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def since(self, older: Histogram) -> Histogram:
        """Observations made after `older` was scraped. A counter that went down means the router
        restarted in between; then everything it counted since its restart is the window."""
        if not older.bounds:
            return self
        if not self.bounds:
            return self  # the router restarted and has not observed anything yet
        if older.bounds != self.bounds:
            raise ProtocolError(f"histogram buckets changed between scrapes: {older.bounds} -> "
                                f"{self.bounds}")
        deltas = tuple(new - old for new, old in zip(self.counts, older.counts))
        if any(d < 0 for d in deltas):
            return self
        return Histogram(self.bounds, deltas)

    def quantile(self, q: float) -> float | None:
        """Prometheus `histogram_quantile`: linear interpolation inside the bucket holding the
        q-th observation; a rank in the +Inf bucket answers the highest finite bound."""
        assert 0.0 <= q <= 1.0
        if self.total <= 0:
            return None
        rank = q * self.total
        prev_bound, prev_count = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts):
            if count >= rank and count > prev_count:
                if math.isinf(bound):
                    return prev_bound
                return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
            prev_bound, prev_count = bound, count
        return prev_bound


EMPTY_HISTOGRAM = Histogram((), ())


@dataclass(frozen=True, slots=True)
class PhaseGauges:
    queue_depth: float | None
    kv_usage_ratio: float | None
    running_seqs: float | None


@dataclass(frozen=True, slots=True)
class RouterScrape:
    at_s: float  # monotonic time of the scrape
    ttft: Histogram
    itl: Histogram
    prefill: PhaseGauges
    decode: PhaseGauges

    def of(self, phase: Phase) -> PhaseGauges:
        return self.prefill if phase is Phase.PREFILL else self.decode


def _histogram(buckets: dict[float, float], name: str) -> Histogram:
    if not buckets:
        return EMPTY_HISTOGRAM
    bounds = tuple(sorted(buckets))
    if not math.isinf(bounds[-1]):
        raise ProtocolError(f"{name} has no +Inf bucket")
    counts = tuple(buckets[b] for b in bounds)
    if any(b < a for a, b in zip(counts, counts[1:])):
        raise ProtocolError(f"{name} buckets are not cumulative")
    return Histogram(bounds, counts)


def _phase_gauge(series: list[tuple[dict[str, str], float]], phase: Phase,
                 average: bool) -> float | None:
    mine = [(labels, value) for labels, value in series if labels.get("phase") == phase.value]
    aggregate = [value for labels, value in mine if set(labels) == {"phase"}]
    if aggregate:
        return aggregate[-1]
    values = [value for _, value in mine if not math.isnan(value)]
    if not values:
        return None
    return sum(values) / len(values) if average else sum(values)


def parse_router_metrics(text: str, at_s: float) -> RouterScrape:
    """Parse one scrape of the router. Histograms are summed over their label sets (one
    histogram per model, say); a histogram the router has not created yet reads as empty."""
    buckets: dict[str, dict[float, float]] = {TTFT: {}, ITL: {}}
    gauges: dict[str, list[tuple[dict[str, str], float]]] = {
        QUEUE_DEPTH: [], KV_USAGE: [], RUNNING_SEQS: []}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if family.name in buckets and sample.name == family.name + "_bucket":
                    le = float(sample.labels["le"])
                    per_le = buckets[family.name]
                    per_le[le] = per_le.get(le, 0.0) + sample.value
                elif family.name in gauges and sample.name == family.name:
                    gauges[family.name].append((dict(sample.labels), sample.value))
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"malformed router metrics: {exc}") from exc

    def phase(p: Phase) -> PhaseGauges:
        return PhaseGauges(queue_depth=_phase_gauge(gauges[QUEUE_DEPTH], p, average=False),
                           kv_usage_ratio=_phase_gauge(gauges[KV_USAGE], p, average=True),
                           running_seqs=_phase_gauge(gauges[RUNNING_SEQS], p, average=False))

    return RouterScrape(at_s=at_s, ttft=_histogram(buckets[TTFT], TTFT),
                        itl=_histogram(buckets[ITL], ITL), prefill=phase(Phase.PREFILL),
                        decode=phase(Phase.DECODE))


class ScrapeWindow:
    """Recent scrapes, enough to reach back `window_s`. `baseline()` is the newest scrape at
    least `window_s` older than the latest one, or the oldest kept while history is shorter."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ConfigError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._scrapes: deque[RouterScrape] = deque()

    def add(self, scrape: RouterScrape) -> None:
        assert not self._scrapes or scrape.at_s >= self._scrapes[-1].at_s, "out of time order"
        self._scrapes.append(scrape)
        horizon = scrape.at_s - self.window_s
        # Keep exactly one scrape at or before the horizon: it is the baseline.
        while len(self._scrapes) >= 2 and self._scrapes[1].at_s <= horizon:
            self._scrapes.popleft()

    @property
    def latest(self) -> RouterScrape | None:
        return self._scrapes[-1] if self._scrapes else None

    def baseline(self) -> RouterScrape | None:
        return self._scrapes[0] if len(self._scrapes) >= 2 else None


def _latency(now: Histogram, then: Histogram | None) -> LatencyQuantiles | None:
    if then is None:
        return None  # a single scrape holds the router's whole lifetime, not a window
    window = now.since(then)
    p50, p90 = window.quantile(0.5), window.quantile(0.9)
    if p50 is None or p90 is None:
        return None
    return LatencyQuantiles(p50_s=p50, p90_s=p90)


def build_tick_input(window: ScrapeWindow, prefill: ReplicaCounts,
                     decode: ReplicaCounts, now_s: float) -> TickInput:
    """The core's input from the scrape window and the replica counts the connector read."""
    latest = window.latest
    assert latest is not None, "build_tick_input needs at least one scrape"
    base = window.baseline()

    def observe(phase: Phase, replicas: ReplicaCounts, now_h: Histogram,
                then_h: Histogram | None) -> PhaseObservation:
        gauges = latest.of(phase)
        return PhaseObservation(replicas=replicas, latency=_latency(now_h, then_h),
                                queue_depth=gauges.queue_depth,
                                kv_usage_ratio=gauges.kv_usage_ratio)

    return TickInput(
        now_s=now_s,
        prefill=observe(Phase.PREFILL, prefill, latest.ttft, base.ttft if base else None),
        decode=observe(Phase.DECODE, decode, latest.itl, base.itl if base else None),
    )

"""Router metrics -> autoscaler inputs.

Role: turn the router's Prometheus text exposition into typed values, and two scrapes of it into
the `TickInput` the pure core decides on. One scrape of the router is enough: it serves the
latency histograms it measures itself and re-exports the per-phase gauges it polls from workers.
No I/O here: the HTTP fetch lives in main.py, so tests feed text straight in.

Lifecycle: main.py fetches the text of every router replica each tick ->
`parse_router_metrics(text, at_s)` -> `RouterWindows.add()` keeps recent scrapes per router ->
`build_tick_input()` diffs each router's newest scrape against its scrape about `window_s` older
and sums the differences, so latency quantiles describe the last window of the whole router
fleet, not one router's lifetime (histograms are cumulative counters, one set per router).

Metric names (fixed by the router): `tandem_ttft_seconds`, `tandem_itl_seconds` (histograms);
`tandem_queue_depth{phase}`, `tandem_kv_usage_ratio{phase}`, `tandem_running_seqs{phase}`
(gauges). The router's admission queue: `tandem_router_queue_depth` (gauge; each router has its
own queue, so these are summed over routers, unlike the worker gauges every router repeats) and
`tandem_router_queue_wait_seconds` (histogram, windowed like the latencies) feed decode;
`tandem_ttft_placed_seconds` (TTFT after admission), when a router exports it, is prefill's
latency signal instead of the raw TTFT, which includes the queue wait. Gauges may carry more labels (e.g. one series per worker): if a series has only the
`phase` label it is taken as the phase aggregate; otherwise queue depth and running seqs are
summed and KV usage is averaged over the phase's series.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

from autoscaler.core import LatencyQuantiles, Phase, PhaseObservation, ReplicaCounts, TickInput
from common.errors import ConfigError, ProtocolError

TTFT = "tandem_ttft_seconds"
TTFT_PLACED = "tandem_ttft_placed_seconds"
ITL = "tandem_itl_seconds"
ROUTER_QUEUE = "tandem_router_queue_depth"
ROUTER_WAIT = "tandem_router_queue_wait_seconds"
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
                share = (rank - prev_count) / (count - prev_count)
                return prev_bound + (bound - prev_bound) * share
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
    ttft: Histogram  # after admission when the router exports it, else the client-side TTFT
    itl: Histogram
    prefill: PhaseGauges
    decode: PhaseGauges
    router_queue_depth: float | None = None
    router_wait: Histogram = Histogram((), ())

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
    # NaN (a gauge set to "no data") reads as unknown, like a missing series.
    mine = [(labels, value) for labels, value in series
            if labels.get("phase") == phase.value and not math.isnan(value)]
    aggregate = [value for labels, value in mine if set(labels) == {"phase"}]
    if aggregate:
        return aggregate[-1]
    values = [value for _, value in mine]
    if not values:
        return None
    return sum(values) / len(values) if average else sum(values)


def parse_router_metrics(text: str, at_s: float) -> RouterScrape:
    """Parse one scrape of the router. Histograms are summed over their label sets (one
    histogram per model, say); a histogram the router has not created yet reads as empty."""
    buckets: dict[str, dict[float, float]] = {TTFT: {}, TTFT_PLACED: {}, ITL: {}, ROUTER_WAIT: {}}
    gauges: dict[str, list[tuple[dict[str, str], float]]] = {
        QUEUE_DEPTH: [], KV_USAGE: [], RUNNING_SEQS: [], ROUTER_QUEUE: []}
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

    queue = [v for _, v in gauges[ROUTER_QUEUE] if not math.isnan(v)]
    ttft = TTFT_PLACED if buckets[TTFT_PLACED] else TTFT
    return RouterScrape(at_s=at_s, ttft=_histogram(buckets[ttft], ttft),
                        itl=_histogram(buckets[ITL], ITL), prefill=phase(Phase.PREFILL),
                        decode=phase(Phase.DECODE), router_queue_depth=sum(queue) if queue else None,
                        router_wait=_histogram(buckets[ROUTER_WAIT], ROUTER_WAIT))


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


class RouterWindows:
    """One `ScrapeWindow` per router replica. Each router keeps its own histograms, so windows
    are differenced per router and only then summed; a router that did not answer this tick
    is forgotten (a pod that comes back at the same address is a new router)."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ConfigError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._windows: dict[str, ScrapeWindow] = {}

    def add(self, scrapes: dict[str, RouterScrape]) -> None:
        for target in list(self._windows):
            if target not in scrapes:
                del self._windows[target]
        for target, scrape in scrapes.items():
            self._windows.setdefault(target, ScrapeWindow(self.window_s)).add(scrape)

    @property
    def routers(self) -> list[str]:
        return sorted(self._windows)

    def window_of(self, target: str) -> ScrapeWindow:
        return self._windows[target]


def _sum(histograms: list[Histogram]) -> Histogram:
    nonempty = [h for h in histograms if h.bounds]
    if not nonempty:
        return EMPTY_HISTOGRAM
    bounds = nonempty[0].bounds
    if any(h.bounds != bounds for h in nonempty):
        raise ProtocolError("routers disagree on histogram buckets")
    return Histogram(bounds, tuple(map(sum, zip(*(h.counts for h in nonempty)))))


def _quantiles(window: Histogram) -> LatencyQuantiles | None:
    p50, p90 = window.quantile(0.5), window.quantile(0.9)
    if p50 is None or p90 is None:
        return None
    return LatencyQuantiles(p50_s=p50, p90_s=p90)


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def build_tick_input(windows: RouterWindows, prefill: ReplicaCounts,
                     decode: ReplicaCounts, now_s: float) -> TickInput:
    """The core's input from the routers' scrape windows and the connector's replica counts.

    Latency: per-router window deltas summed (a router with a single scrape has no window yet
    and is left out). Gauges: every router polls the same workers, so their views agree up to
    timing; the mean over routers is taken.
    """
    assert windows.routers, "build_tick_input needs at least one scrape"
    latest = [windows.window_of(t).latest for t in windows.routers]
    pairs = [(w.latest, w.baseline()) for w in map(windows.window_of, windows.routers)]
    ttft = [now.ttft.since(base.ttft) for now, base in pairs if now and base]
    itl = [now.itl.since(base.itl) for now, base in pairs if now and base]
    waits = _sum([now.router_wait.since(base.router_wait) for now, base in pairs if now and base])
    queues = [s.router_queue_depth for s in latest if s is not None and s.router_queue_depth is not None]

    def observe(phase: Phase, replicas: ReplicaCounts,
                deltas: list[Histogram]) -> PhaseObservation:
        gauges = [s.of(phase) for s in latest if s is not None]
        obs = PhaseObservation(
            replicas=replicas, latency=_quantiles(_sum(deltas)) if deltas else None,
            queue_depth=_mean([g.queue_depth for g in gauges]),
            kv_usage_ratio=_mean([g.kv_usage_ratio for g in gauges]))
        if phase is Phase.DECODE:  # the router queue waits for decode room
            # each router has its own queue: summed; no admission in the window: no wait to report
            obs = replace(obs, router_queue_depth=sum(queues) if queues else None,
                          router_queue_wait_p90_s=waits.quantile(0.9) if waits.bounds else None)
        return obs

    return TickInput(now_s=now_s, prefill=observe(Phase.PREFILL, prefill, ttft),
                     decode=observe(Phase.DECODE, decode, itl))

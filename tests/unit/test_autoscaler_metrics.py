"""Router metrics -> TickInput: parsing real prometheus_client output, window quantiles from
bucket differences, counter resets, per-worker gauge aggregation."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram as PromHistogram, generate_latest

from autoscaler.core import Phase, ReplicaCounts
from autoscaler.metrics import (EMPTY_HISTOGRAM, Histogram, RouterWindows, ScrapeWindow,
                                build_tick_input, parse_router_metrics)
from common.errors import ConfigError, ProtocolError

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class FakeRouter:
    """The router's metric families, made with the real client library."""

    def __init__(self, per_worker: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.ttft = PromHistogram("tandem_ttft_seconds", "TTFT", registry=self.registry,
                                  buckets=BUCKETS)
        self.itl = PromHistogram("tandem_itl_seconds", "ITL", registry=self.registry,
                                 buckets=BUCKETS)
        labels = ["phase", "worker"] if per_worker else ["phase"]
        self.queue = Gauge("tandem_queue_depth", "queue", labels, registry=self.registry)
        self.kv = Gauge("tandem_kv_usage_ratio", "kv", labels, registry=self.registry)
        self.running = Gauge("tandem_running_seqs", "running", labels, registry=self.registry)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def test_parses_gauges_and_histograms() -> None:
    r = FakeRouter()
    r.queue.labels("prefill").set(3)
    r.queue.labels("decode").set(7)
    r.kv.labels("decode").set(0.62)
    r.running.labels("decode").set(41)
    for v in (0.2, 0.3, 0.7):
        r.ttft.observe(v)
    s = parse_router_metrics(r.text(), at_s=10.0)
    assert s.prefill.queue_depth == 3 and s.decode.queue_depth == 7
    assert s.decode.kv_usage_ratio == pytest.approx(0.62) and s.prefill.kv_usage_ratio is None
    assert s.decode.running_seqs == 41
    assert s.ttft.total == 3 and s.itl.total == 0
    assert s.ttft.bounds[-1] == float("inf") and len(s.ttft.bounds) == len(BUCKETS) + 1


def test_per_worker_gauges_are_summed_and_averaged() -> None:
    r = FakeRouter(per_worker=True)
    for worker, (q, kv) in enumerate([(2, 0.5), (5, 0.9), (1, 0.1)]):
        r.queue.labels("decode", f"d{worker}").set(q)
        r.kv.labels("decode", f"d{worker}").set(kv)
    r.queue.labels("prefill", "p0").set(4)
    s = parse_router_metrics(r.text(), at_s=0.0)
    assert s.decode.queue_depth == 8
    assert s.decode.kv_usage_ratio == pytest.approx(0.5)
    assert s.prefill.queue_depth == 4


def test_quantile_matches_prometheus_interpolation() -> None:
    h = Histogram(bounds=(0.1, 0.5, 1.0, float("inf")), counts=(10.0, 30.0, 40.0, 40.0))
    # rank 20 sits halfway through the (0.1, 0.5] bucket, which holds ranks 10..30
    assert h.quantile(0.5) == pytest.approx(0.3)
    # rank 36 is 6/10 of the way through (0.5, 1.0]
    assert h.quantile(0.9) == pytest.approx(0.8)
    assert h.quantile(0.1) == pytest.approx(0.04)  # first bucket interpolates from 0
    tail = Histogram(bounds=(0.1, 0.5, float("inf")), counts=(1.0, 2.0, 10.0))
    assert tail.quantile(0.9) == 0.5  # in the +Inf bucket: the highest finite bound
    assert EMPTY_HISTOGRAM.quantile(0.5) is None


def test_window_quantiles_come_from_the_difference_of_two_scrapes() -> None:
    r = FakeRouter()
    windows = RouterWindows(window_s=60.0)
    for _ in range(1000):           # a long, fast history the window must forget
        r.ttft.observe(0.02)
    r.queue.labels("prefill").set(0)
    r.queue.labels("decode").set(0)
    r.kv.labels("decode").set(0.3)
    windows.add({"r0": parse_router_metrics(r.text(), at_s=0.0)})
    first = build_tick_input(windows, ReplicaCounts(1, 1), ReplicaCounts(1, 1), now_s=0.0)
    assert first.prefill.latency is None  # one scrape is a lifetime, not a window

    for t in (15.0, 30.0, 45.0, 60.0):
        for _ in range(25):
            r.ttft.observe(0.7)    # the last minute was slow
            r.itl.observe(0.03)
        windows.add({"r0": parse_router_metrics(r.text(), at_s=t)})
    inp = build_tick_input(windows, ReplicaCounts(2, 2), ReplicaCounts(3, 2), now_s=60.0)
    assert inp.prefill.latency is not None and inp.decode.latency is not None
    assert 0.5 < inp.prefill.latency.p50_s <= 1.0  # not dragged down by the 1000 fast ones
    assert 0.025 < inp.decode.latency.p90_s <= 0.05
    assert inp.decode.replicas == ReplicaCounts(3, 2)
    assert inp.decode.kv_usage_ratio == pytest.approx(0.3)

    # 75 s: the baseline moves to the 15 s scrape; a quiet window reports no latency at all.
    windows.add({"r0": parse_router_metrics(r.text(), at_s=75.0)})
    windows.add({"r0": parse_router_metrics(r.text(), at_s=135.0)})
    quiet = build_tick_input(windows, ReplicaCounts(2, 2), ReplicaCounts(3, 3), now_s=135.0)
    assert quiet.prefill.latency is None and quiet.decode.latency is None


def test_several_routers_are_differenced_one_by_one_then_summed() -> None:
    fast, slow = FakeRouter(), FakeRouter()
    for _ in range(5000):
        slow.ttft.observe(4.0)      # old history on one router only
    for r, kv in ((fast, 0.2), (slow, 0.4)):
        r.queue.labels("decode").set(6)
        r.kv.labels("decode").set(kv)
    windows = RouterWindows(window_s=30.0)
    windows.add({"a": parse_router_metrics(fast.text(), 0.0),
                 "b": parse_router_metrics(slow.text(), 0.0)})
    for _ in range(85):
        fast.ttft.observe(0.02)     # in the window: 85 fast on a, 15 slow-ish on b
    for _ in range(15):
        slow.ttft.observe(0.7)
    windows.add({"a": parse_router_metrics(fast.text(), 30.0),
                 "b": parse_router_metrics(slow.text(), 30.0)})
    inp = build_tick_input(windows, ReplicaCounts(1, 1), ReplicaCounts(1, 1), now_s=30.0)
    assert inp.prefill.latency is not None
    assert inp.prefill.latency.p50_s <= 0.025      # 85 of 100 were fast
    assert 0.5 < inp.prefill.latency.p90_s <= 1.0  # the 86th..100th are the 0.7 s ones
    assert inp.decode.queue_depth == 6             # routers agree: mean, not sum
    assert inp.decode.kv_usage_ratio == pytest.approx(0.3)

    # Router b disappears and a new one (c) appears: c has no window yet, b is forgotten.
    for _ in range(10):
        fast.ttft.observe(0.3)
    windows.add({"a": parse_router_metrics(fast.text(), 60.0),
                 "c": parse_router_metrics(FakeRouter().text(), 60.0)})
    assert windows.routers == ["a", "c"]
    inp = build_tick_input(windows, ReplicaCounts(1, 1), ReplicaCounts(1, 1), now_s=60.0)
    assert inp.prefill.latency is not None and 0.25 < inp.prefill.latency.p50_s <= 0.5


def test_router_restart_resets_the_window() -> None:
    old = Histogram(bounds=(0.1, 1.0, float("inf")), counts=(100.0, 500.0, 500.0))
    new = Histogram(bounds=(0.1, 1.0, float("inf")), counts=(0.0, 4.0, 4.0))
    assert new.since(old) == new
    grown = Histogram(bounds=(0.1, 1.0, float("inf")), counts=(101.0, 510.0, 510.0))
    assert grown.since(old).counts == (1.0, 10.0, 10.0)
    assert EMPTY_HISTOGRAM.since(old) == EMPTY_HISTOGRAM
    with pytest.raises(ProtocolError):
        grown.since(Histogram(bounds=(0.5, float("inf")), counts=(1.0, 1.0)))


def test_scrape_window_keeps_one_baseline() -> None:
    r = FakeRouter()
    w = ScrapeWindow(window_s=30.0)
    for t in range(0, 200, 10):
        w.add(parse_router_metrics(r.text(), at_s=float(t)))
    base = w.baseline()
    assert base is not None and base.at_s == 160.0 and w.latest is not None
    assert w.latest.at_s - base.at_s >= 30.0
    with pytest.raises(ConfigError):
        ScrapeWindow(window_s=0.0)
    with pytest.raises(ConfigError):
        RouterWindows(window_s=-1.0)


def test_missing_or_nan_gauges_read_as_unknown() -> None:
    r = FakeRouter()
    r.ttft.observe(0.1)
    r.kv.labels("decode").set(float("nan"))
    s = parse_router_metrics(r.text(), at_s=0.0)
    for phase in Phase:
        g = s.of(phase)
        assert g.queue_depth is None and g.kv_usage_ratio is None and g.running_seqs is None


@pytest.mark.parametrize("text", [
    "tandem_queue_depth{phase=\"prefill\" 3\n",                       # broken label set
    "# TYPE tandem_ttft_seconds histogram\n"
    "tandem_ttft_seconds_bucket{le=\"0.1\"} 5\n",                     # no +Inf bucket
    "# TYPE tandem_ttft_seconds histogram\n"
    "tandem_ttft_seconds_bucket{le=\"0.1\"} 5\n"
    "tandem_ttft_seconds_bucket{le=\"+Inf\"} 3\n",                    # not cumulative
])
def test_malformed_text_raises_protocol_error(text: str) -> None:
    with pytest.raises(ProtocolError):
        parse_router_metrics(text, at_s=0.0)


def test_router_queue_is_summed_over_routers_and_its_wait_windowed() -> None:
    def router(depth: float, waits: list[float], placed_ttft: list[float]) -> str:
        reg = CollectorRegistry()
        Gauge("tandem_router_queue_depth", "q", registry=reg).set(depth)
        h = PromHistogram("tandem_router_queue_wait_seconds", "w", registry=reg, buckets=(0.0, 1, 5, 10, 30))
        for w in waits:
            h.observe(w)
        t = PromHistogram("tandem_ttft_placed_seconds", "t", registry=reg, buckets=BUCKETS)
        raw = PromHistogram("tandem_ttft_seconds", "raw", registry=reg, buckets=BUCKETS)
        for v in placed_ttft:
            t.observe(v)
            raw.observe(v + 20.0)  # the raw TTFT includes the queue wait
        return generate_latest(reg).decode()

    windows = RouterWindows(window_s=30.0)
    windows.add({"a": parse_router_metrics(router(0, [0.0] * 10, [0.2]), 0.0),
                 "b": parse_router_metrics(router(0, [], []), 0.0)})
    windows.add({"a": parse_router_metrics(router(5, [0.0] * 10 + [20.0] * 10, [0.2] * 11), 30.0),
                 "b": parse_router_metrics(router(7, [25.0] * 10, [0.3] * 10), 30.0)})
    inp = build_tick_input(windows, ReplicaCounts(1, 1), ReplicaCounts(2, 2), now_s=30.0)
    assert inp.decode.router_queue_depth == 12  # 5 + 7: each router has its own queue
    assert 10.0 < inp.decode.router_queue_wait_p90_s <= 30.0  # only the 20 waits of the window count
    assert inp.prefill.router_queue_depth is None
    assert inp.prefill.latency is not None and inp.prefill.latency.p90_s < 1.0  # TTFT after admission
    # a router that does not export the queue: unknown, not zero
    assert build_tick_input(_one(FakeRouter().text()), ReplicaCounts(1, 1), ReplicaCounts(1, 1),
                            now_s=0.0).decode.router_queue_depth is None


def _one(text: str) -> RouterWindows:
    w = RouterWindows(window_s=30.0)
    w.add({"r": parse_router_metrics(text, 0.0)})
    return w

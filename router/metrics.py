"""Prometheus metrics of the router (its own registry, so several routers can live in one test
process). Per-phase worker gauges are refreshed from the fleet's last status poll at scrape time,
so one scrape of the router is enough for dashboards and the autoscaler."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from wire.protocol import ComputeSplit

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_WAIT = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("tandem_ttft_seconds", "time to first token, router view", buckets=_LAT, registry=r)
        self.itl = Histogram("tandem_itl_seconds", "inter-token latency", buckets=_ITL, registry=r)
        self.e2e = Histogram("tandem_e2e_latency_seconds", "request latency", buckets=_LAT, registry=r)
        self.requests = Counter("tandem_requests_total", "finished requests (ok, error, cancelled)", ["status"], registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens_total", "prompt tokens", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens_total", "generated tokens", registry=r)
        self.retries = Counter("tandem_retries_total", "transparent retries before the first token", registry=r)
        self.ignored_tools = Counter("tandem_ignored_builtin_tools_total", "built-in tools (web_search, ...) a "
                                     "/v1/responses request sent that the model was not offered (--builtin-tools "
                                     "ignore)", ["type"], registry=r)
        self.router_queue = Gauge("tandem_router_queue_depth", "requests waiting in the router's admission queue",
                                  registry=r)
        self.router_queued = Counter("tandem_router_queued_requests_total", "requests that entered the router's "
                                     "admission queue, by why the queue waited: no_room (KV, sequence slots, "
                                     "prefill backlog) or worker_late (a needed role's only workers missed their "
                                     "status polls, within --worker-grace-s)", ["reason"], registry=r)
        self.workers = Gauge("tandem_router_workers", "workers per phase as the router sees them: live, late "
                             "(missed its status polls, within --worker-grace-s: requests wait for it) or gone",
                             ["phase", "state"], registry=r)
        self.router_queue_wait = Histogram("tandem_router_queue_wait_seconds", "time a request waited in the "
                                           "router's admission queue (0: placed at once)", buckets=_WAIT, registry=r)
        self.ttft_placed = Histogram("tandem_ttft_placed_seconds", "time to first token after admission (TTFT "
                                     "less the router queue wait: what prefill scaling should see)",
                                     buckets=_LAT, registry=r)
        self.inflight = Gauge("tandem_router_inflight_requests", "requests the router is serving (queued or running)",
                              registry=r)
        self.draining = Gauge("tandem_router_draining", "1 while the router drains for shutdown", registry=r)
        self.queue = Gauge("tandem_queue_depth", "queued requests per phase", ["phase"], registry=r)
        self.kv_usage = Gauge("tandem_kv_usage_ratio", "KV pages in use per phase", ["phase"], registry=r)
        self.running = Gauge("tandem_running_seqs", "running sequences per phase", ["phase"], registry=r)
        self.prefill = Histogram("tandem_prefill_seconds", "prefill compute time", buckets=_LAT, registry=r)
        self.xfer_bytes = Counter("tandem_kv_transfer_bytes_total", "KV bytes pushed prefill -> decode", registry=r)
        self.xfer_seconds = Histogram("tandem_kv_transfer_seconds", "KV transfer duration", buckets=_LAT, registry=r)
        self.xfer_gbps = Gauge("tandem_kv_transfer_gbps", "throughput of the last KV transfer (GB/s)", registry=r)
        # Where a request's time to first token goes, one observation per component. Remote prefills:
        # decode_admission (reserve pages), prefill_queue, prefill_compute, kv_transfer_tail (what the
        # layer-by-layer transfer adds after compute), result_to_router (the reply's way back). Local
        # prefills (colocated, or a short suffix on decode): local_queue (the decode worker's I/O
        # thread received it -> its first step scheduled: the loop picks messages up between steps,
        # then the scheduler's own queue), local_prefill (that step's launch -> its token on the
        # worker's host: the step in flight before it, its own step(s), the loop's next launch; on a
        # CPU the forwards themselves), local_rpc (the router's send -> the first chunk back, less
        # those two: both hops). Both: router (the handler started the request -> its first token,
        # less the admission queue wait and the worker round trip: hashing, placement, the event loop).
        self.ttft_part = Histogram("tandem_ttft_breakdown_seconds", "time to first token by component",
                                   ["component"], buckets=_ITL[:3] + _LAT, registry=r)
        # prefill_compute by part (wire.protocol.ComputeSplit): admit + launch + hooks + wait = prefill_compute
        # on the host; gpu is the device's span of the same request and overlaps them (prefill_worker/compute_split.py)
        self.compute_part = Histogram("tandem_prefill_compute_split_seconds", "a remote prefill's compute time by "
                                      "part", ["part"], buckets=_ITL[:3] + _LAT, registry=r)
        # Prefix caching, by the role that computed the prompt (prefill = remote, decode = local):
        # hit rate = cached / prompt tokens; computed = prompt - cached.
        self.prefix_prompt = Counter("tandem_prefix_prompt_tokens", "prompt tokens by the role that prefilled them",
                                     ["role"], registry=r)
        self.prefix_cached = Counter("tandem_prefix_cached_tokens", "prompt tokens taken from a prefix cache",
                                     ["role"], registry=r)
        self.prefix_decode_cached = Counter("tandem_prefix_decode_held_tokens",
                                            "remote prefills: prompt tokens decode already held (not shipped)",
                                            registry=r)
        self.prefix_computed = Histogram("tandem_prefill_computed_tokens", "prompt tokens computed per request",
                                         ["role"], buckets=(16, 64, 256, 1024, 4096, 16384, 65536), registry=r)
        self.prefix_bytes = Histogram("tandem_kv_shipped_bytes", "KV bytes shipped per remote-prefilled request",
                                      buckets=tuple(4.0 ** k * 1024 for k in range(12)), registry=r)
        self.prefix_evicted = Gauge("tandem_prefix_evicted_pages", "cached pages the workers evicted (as reported)",
                                    ["role"], registry=r)

    def observe_ttft_parts(self, admission_s: float, queue_s: float, compute_s: float, tail_s: float,
                           rpc_s: float) -> dict[str, float]:
        """rpc_s: the prefill call as the router timed it; what the worker did not account for is the
        way back (network, the worker's reply, the router's event loop). Returns the parts observed."""
        return self._observe_parts((("decode_admission", admission_s), ("prefill_queue", queue_s),
                                    ("prefill_compute", compute_s), ("kv_transfer_tail", tail_s),
                                    ("result_to_router", rpc_s - queue_s - compute_s - tail_s)))

    def observe_compute_split(self, compute_s: float, split: ComputeSplit) -> dict[str, float]:
        """The parts of one remote prefill's compute time, keyed for the TTFT breakdown header
        (`prefill_compute.<part>`: sub-parts of prefill_compute, not components of their own)."""
        parts = (("admit", split.admit_seconds), ("launch", split.launch_seconds - split.hook_seconds),
                 ("hooks", split.hook_seconds),
                 ("wait", compute_s - split.admit_seconds - split.launch_seconds), ("gpu", split.gpu_seconds))
        out = {}
        for part, v in parts:
            out[f"prefill_compute.{part}"] = max(0.0, v)
            self.compute_part.labels(part).observe(max(0.0, v))
        return out

    def observe_local_ttft_parts(self, queue_s: float, prefill_s: float, rpc_s: float) -> dict[str, float]:
        return self._observe_parts((("local_queue", queue_s), ("local_prefill", prefill_s),
                                    ("local_rpc", rpc_s - queue_s - prefill_s)))

    def _observe_parts(self, parts) -> dict[str, float]:
        out = {}
        for part, v in parts:
            out[part] = max(0.0, v)
            self.ttft_part.labels(part).observe(out[part])
        return out

    def observe_prefill(self, prefill_s: float, xfer_bytes: int, xfer_s: float, total_s: float) -> None:
        self.prefill.observe(prefill_s)
        if xfer_bytes:
            self.xfer_bytes.inc(xfer_bytes)
            self.xfer_seconds.observe(xfer_s)
            if xfer_s > 0:
                self.xfer_gbps.set(xfer_bytes / xfer_s / 1e9)

    def observe_prefix(self, role: str, prompt_tokens: int, cached: int, kv_bytes: int) -> None:
        self.prefix_prompt.labels(role).inc(prompt_tokens)
        self.prefix_cached.labels(role).inc(cached)
        self.prefix_computed.labels(role).observe(prompt_tokens - cached)
        if role == "prefill":
            self.prefix_bytes.observe(kv_bytes)

    def render(self, phase_gauges: dict[str, tuple[float, float, float]],
               evicted: dict[str, int] | None = None, liveness: dict[tuple[str, str], int] | None = None) -> bytes:
        for (phase, state), n in (liveness or {}).items():
            self.workers.labels(phase, state).set(n)
        for role, n in (evicted or {}).items():
            self.prefix_evicted.labels(role).set(n)
        for phase, (queue, usage, running) in phase_gauges.items():
            self.queue.labels(phase).set(queue)
            self.kv_usage.labels(phase).set(usage)
            self.running.labels(phase).set(running)
        return generate_latest(self.registry)

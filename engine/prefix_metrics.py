"""A worker's prefix-cache metrics (Prometheus) and its share of WorkerStatus.

    tandem_prefix_cache_queried_tokens_total{role}       prompt tokens looked up
    tandem_prefix_cache_hit_tokens_total{role}           of those, taken from the cache (hit rate = hit / queried)
    tandem_prefix_cache_evicted_pages_total{role,group}  pages the LRU freed
    tandem_prefix_cache_pages{role,group}                pages indexed now (referenced or evictable)
    tandem_prefix_cache_branch_snapshots_total{role}     shared prefixes kept at a branch point (engine/prefix_branch.py)
"""

from __future__ import annotations

import dataclasses

from prometheus_client import Counter, Gauge

from model.kv_cache import KVManager, PageGroup
from wire.protocol import StatusRequest, WorkerStatus

QUERIED = Counter("tandem_prefix_cache_queried_tokens", "prompt tokens looked up in the prefix cache", ["role"])
HIT = Counter("tandem_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache", ["role"])
EVICTED = Counter("tandem_prefix_cache_evicted_pages", "cached pages evicted (LRU)", ["role", "group"])
BRANCHES = Counter("tandem_prefix_cache_branch_snapshots", "shared prefixes whose KV was kept at a branch point",
                   ["role"])
PAGES = Gauge("tandem_prefix_cache_pages", "pages indexed by the prefix cache", ["role", "group"])


class PrefixMetrics:
    """Mirrors the cache's counters into Prometheus (call `update` once per loop iteration)."""

    def __init__(self, kv: KVManager, role: str) -> None:
        self.kv, self.role = kv, role
        self._seen = (0, 0, 0, 0, 0)

    def update(self) -> None:
        c = self.kv.cache
        if c is None:
            return
        ev = c.num_evicted()
        now = (c.stats.queried_tokens, c.stats.hit_tokens, ev[0], ev[1], c.stats.branch_snapshots)
        d = [a - b for a, b in zip(now, self._seen)]
        if any(d):
            QUERIED.labels(self.role).inc(d[0])
            HIT.labels(self.role).inc(d[1])
            EVICTED.labels(self.role, "full").inc(d[2])
            EVICTED.labels(self.role, "sliding").inc(d[3])
            BRANCHES.labels(self.role).inc(d[4])
            self._seen = now
        cached = self.kv.num_cached()
        PAGES.labels(self.role, "full").set(cached[PageGroup.FULL])
        PAGES.labels(self.role, "sliding").set(cached[PageGroup.SLIDING])


def status_fields(kv: KVManager) -> dict:
    """The cache's static WorkerStatus fields (events are added per requester by `with_events`)."""
    spec = kv.spec
    per_token = sum(spec.page_bytes(g) for g in PageGroup) // spec.page_size
    c = kv.cache
    if c is None:
        return {"kv_bytes_per_token": per_token}
    ix = c.full
    return {"cache_identity": c.identity, "sliding_window": spec.sliding_window if spec.sliding_layers else 0,
            "cached_pages": ix.num_evictable if ix is not None else 0, "kv_bytes_per_token": per_token}


def with_events(kv: KVManager, status: WorkerStatus, req: StatusRequest | None) -> WorkerStatus:
    """The published snapshot plus the cache events after the requester's cursor (network thread:
    the event log is thread-safe; everything else comes from the loop's snapshot)."""
    c = kv.cache
    if c is None or req is None or req.cache_cursor < 0:
        return status
    reset, cursor, flat = c.events_since(req.cache_cursor)
    return dataclasses.replace(status, cache_cursor=cursor, cache_reset=reset, cache_events=flat)

"""The router's view of each worker's prefix cache, to place requests where their prefix is cached.

Source of truth: the worker's own cache events (stored / evicted block hashes per page group),
polled with WorkerStatus after a per-worker cursor (model/prefix_cache.py, wire.protocol). Events
were chosen over an index inferred from the router's own decisions because they see evictions,
other routers' traffic and restarts (a new epoch resets the mirror), and they are exact about the
sliding-window rule (which blocks a worker kept in each group). They lag by one poll interval, so
the router also records what a worker is about to cache when a request it placed there ends
(prompt + output on decode, the prompt on prefill) as provisional entries: they count for matching
until the worker's events confirm them or a few poll intervals pass.
"""

from __future__ import annotations

import time

from common.prefix_hash import block_hashes, extend_hashes, hit_blocks, identity_root, max_hit_blocks, released_sliding_blocks
from wire.protocol import WorkerStatus

STORED_FULL, EVICTED_FULL, STORED_SLIDING, EVICTED_SLIDING = 0, 1, 2, 3  # model.prefix_cache's kinds
PROVISIONAL_S = 5.0  # how long an unconfirmed prediction counts


class PrefixIndex:
    """One worker's cached blocks as the router last heard of them."""

    def __init__(self) -> None:
        self.identity = ""
        self.page_size = 16
        self.window = 0
        self.epoch: int | None = None
        self.cursor = 0
        self.full: set[int] = set()
        self.sliding: set[int] = set()
        self.provisional: dict[int, float] = {}  # (group tag ^ hash) -> expiry (monotonic)
        self.evicted = 0  # pages the worker reported evicted (both groups)

    @property
    def enabled(self) -> bool:
        return bool(self.identity)

    def apply(self, st: WorkerStatus) -> None:
        """A status poll's answer: identity, a restarted worker, and the events after our cursor."""
        if st.epoch != self.epoch or st.cache_identity != self.identity:
            self.__init__()  # a new process (or layout): nothing we knew holds
            self.epoch, self.identity = st.epoch, st.cache_identity
        self.page_size, self.window = st.page_size, st.sliding_window
        if not self.identity:
            return
        if st.cache_reset:
            self.full.clear()
            self.sliding.clear()
        ev = st.cache_events
        for kind, h in zip(ev[::2], ev[1::2]):
            if kind == STORED_FULL:
                self.full.add(h)
                self.provisional.pop(h, None)
            elif kind == STORED_SLIDING:
                self.sliding.add(h)
                self.provisional.pop(~h, None)
            elif kind == EVICTED_FULL:
                self.full.discard(h)
                self.evicted += 1
            elif kind == EVICTED_SLIDING:
                self.sliding.discard(h)
                self.evicted += 1
        self.cursor = st.cache_cursor
        now = time.monotonic()
        self.provisional = {k: t for k, t in self.provisional.items() if t >= now}

    def match(self, hashes: list[int], num_tokens: int) -> int:
        """Tokens of the prompt this worker would take from its cache (the same rule as the worker)."""
        if not self.identity:
            return 0
        now = time.monotonic()
        prov = self.provisional

        def full(h: int) -> bool:
            return h in self.full or prov.get(h, 0.0) > now

        def sliding(h: int) -> bool:
            return h in self.sliding or prov.get(~h, 0.0) > now

        return self.page_size * hit_blocks(hashes, max_hit_blocks(num_tokens, self.page_size), full,
                                           sliding if self.window else None, self.page_size, self.window)

    def predict(self, hashes: list[int], num_valid: int) -> None:
        """A request placed here ended with num_valid tokens computed: its blocks are (about to be)
        cached there."""
        if not self.identity:
            return
        t = time.monotonic() + PROVISIONAL_S
        p = self.page_size
        for h in hashes[:num_valid // p]:
            if h not in self.full:
                self.provisional[h] = t
        if self.window:
            for j in released_sliding_blocks(num_valid, p, self.window):
                if j < len(hashes) and hashes[j] not in self.sliding:
                    self.provisional[~hashes[j]] = t


class PromptHashes:
    """A request's block hashes, computed once per cache identity (every worker of one deployment
    normally shares one) and extended with the output for decode-side predictions."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = prompt_ids
        self._by_identity: dict[tuple[str, int], list[int]] = {}

    def of(self, index: PrefixIndex, tokens: list[int] | None = None) -> list[int]:
        key = (index.identity, index.page_size)
        got = self._by_identity.get(key)
        if got is None:
            got = self._by_identity[key] = block_hashes(self.prompt_ids, index.page_size, identity_root(index.identity))
        if tokens is not None and len(tokens) // index.page_size > len(got):
            return extend_hashes(list(got), tokens, index.page_size, identity_root(index.identity))
        return got

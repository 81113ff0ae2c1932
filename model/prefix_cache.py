"""Prefix cache: content-addressed KV pages with reference counts and LRU eviction, per page group.

Blocks are named by common.prefix_hash (a hash chain over P-token blocks seeded with the model and
layout identity). Each page group keeps an index hash -> page. The cache holds one reference on
every page it indexes; each sequence using the page holds one more. A cached page nobody else
references is *evictable*: it waits in LRU order and is freed only when an allocation would
otherwise fail (KVManager evicts before admission ever sees "no room"). An indexed page is never
written again: full-attention hits are shared by reference (a sequence writes only from its hit
boundary on, into its own pages); sliding-window hits are copied into the sequence's own ring
(model/kv_cache.py explains why), so a cached page is read-only for as long as it is indexed.

Which blocks are cached (registered when a sequence releases its pages; its references, which keep
them from eviction, go only once the last step that wrote them completed: engine/scheduler.py):
  * FULL: every complete block whose KV was computed (prompt and output);
  * SLIDING: the complete blocks the sequence's ring still holds valid (at most R = ceil(W/P)+1,
    the tail of the sequence): exactly what a later hit at that tail needs.
Tail blocks are evicted first: a sequence's pages enter the LRU last block first, so eviction does
not orphan the blocks below a chain's remaining prefix.

Not cached by release: sliding blocks in the middle of a sequence. The ring keeps only its last R blocks, and
a prefill chunk longer than the ring never stores most of its sliding KV at all. A hit is therefore
possible where a cached sequence ended (the next turn of a conversation, a repeated prompt), but two
conversations that share only a system prompt do not share its KV: the hit at its boundary lacks
those sliding blocks, unless a sequence kept them at that boundary: a prompt that extends a prefix
seen recently past its usable hit copies its ring's window there into pages of their own
(engine/prefix_branch.py, with model/prefix_share.py's snapshot).

Events (stored / evicted hashes per group) go into a bounded log the router reads through
WorkerStatus (wire.protocol) to keep its own per-worker index (router/prefix_index.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from common.prefix_hash import hit_blocks, identity_root, max_hit_blocks, sliding_first_block

# Event kinds in the log (flat [kind, hash, kind, hash, ...] on the wire).
STORED_FULL, EVICTED_FULL, STORED_SLIDING, EVICTED_SLIDING = 0, 1, 2, 3


class CacheEvents:
    """A bounded, thread-safe log of index changes. The worker loop appends; the network thread
    answers `since(cursor)` for each router. A router whose cursor fell out of the log gets a
    snapshot of the whole index instead (`reset`)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.lock = threading.Lock()  # also guards the indexes' dicts while a snapshot copies them
        self._log: deque[tuple[int, int]] = deque(maxlen=capacity)
        self.next_seq = 0  # events ever logged; the log holds [next_seq - len(log), next_seq)

    def record_locked(self, kind: int, h: int) -> None:
        self._log.append((kind, h))
        self.next_seq += 1

    def since(self, cursor: int, max_events: int, snapshot) -> tuple[bool, int, list[int]]:
        """(reset, new cursor, flat events). `snapshot()` -> [(kind, hash)] of the whole index,
        called under the lock when the cursor is unknown to the log."""
        with self.lock:
            first = self.next_seq - len(self._log)
            if cursor < first or cursor > self.next_seq:
                flat = [x for kh in snapshot() for x in kh]
                return True, self.next_seq, flat
            n = min(self.next_seq - cursor, max_events)
            start = cursor - first
            flat = [x for i in range(start, start + n) for x in self._log[i]]
            return False, cursor + n, flat


class BlockIndex:
    """One page group's cached blocks."""

    def __init__(self, alloc, events: CacheEvents, stored_kind: int) -> None:
        self.alloc, self.events = alloc, events
        self.stored_kind, self.evicted_kind = stored_kind, stored_kind + 1
        self.page_of: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # evictable pages, least recently used first
        self.num_evicted = 0

    def __contains__(self, h: int) -> bool:
        return h in self.page_of

    def __len__(self) -> int:
        return len(self.page_of)

    @property
    def num_evictable(self) -> int:
        return len(self.lru)

    def acquire(self, pages: list[int]) -> None:
        """A sequence starts using cached pages (a hit)."""
        self.alloc.incref(pages)
        for p in pages:
            self.lru.pop(p, None)

    def insert(self, h: int, page: int) -> None:
        """Index `page` (referenced by its sequence) under h; a block already cached keeps its page."""
        if h in self.page_of:
            return
        assert page not in self.hash_of, f"page {page} is already cached under another block"
        self.alloc.incref([page])
        with self.events.lock:
            self.page_of[h], self.hash_of[page] = page, h
            self.events.record_locked(self.stored_kind, h)

    def release(self, pages: list[int]) -> None:
        """A sequence drops its references; cached pages left with only the cache's become
        evictable, in the given order (the caller passes the tail first)."""
        self.alloc.free(pages)
        for p in pages:
            if p in self.hash_of and self.alloc.ref(p) == 1:
                self.lru[p] = None
                self.lru.move_to_end(p)

    def evict(self, n: int) -> int:
        """Free up to n evictable pages, least recently used first. Returns how many."""
        k = min(n, len(self.lru))
        with self.events.lock:
            for _ in range(k):
                page, _ = self.lru.popitem(last=False)
                h = self.hash_of.pop(page)
                del self.page_of[h]
                self.events.record_locked(self.evicted_kind, h)
                self.alloc.free_unreferenced(page)
        self.num_evicted += k
        return k

    def clear(self) -> int:
        return self.evict(len(self.lru))

    def snapshot_locked(self) -> list[tuple[int, int]]:
        return [(self.stored_kind, h) for h in self.page_of]


@dataclass(slots=True)
class Hit:
    """A lookup result: the first `num_tokens` tokens are cached. `full` are the pages of blocks
    [0, k); `sliding` maps block j -> cached page for the blocks the hit needs in the ring."""

    num_tokens: int = 0
    full: list[int] = field(default_factory=list)
    sliding: dict[int, int] = field(default_factory=dict)
    evictable: tuple[int, int] = (0, 0)  # of those pages, how many are evictable now (per group)


@dataclass(slots=True)
class CacheStats:
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, served from the cache
    stored_blocks: int = 0
    branch_snapshots: int = 0  # prefixes kept at a branch point (engine/prefix_branch.py)


class PrefixCache:
    """Both groups' indexes for one KVManager."""

    def __init__(self, spec, allocs, identity: str) -> None:
        from model.kv_cache import PageGroup  # kv_cache imports this module

        self.spec, self.identity = spec, identity
        self.root = identity_root(identity)
        self.events = CacheEvents()
        self.full = BlockIndex(allocs[PageGroup.FULL], self.events, STORED_FULL) if spec.full_layers else None
        self.sliding = (BlockIndex(allocs[PageGroup.SLIDING], self.events, STORED_SLIDING)
                        if spec.sliding_layers else None)
        self.stats = CacheStats()

    def group(self, g: int) -> BlockIndex | None:
        return self.full if g == 0 else self.sliding

    # ---- lookup ------------------------------------------------------------------------------------
    def match(self, hashes: list[int], num_tokens: int) -> Hit:
        p, w = self.spec.page_size, self.spec.sliding_window
        k = hit_blocks(hashes, max_hit_blocks(num_tokens, p),
                       self.full.__contains__ if self.full is not None else None,
                       self.sliding.__contains__ if self.sliding is not None else None, p, w)
        if k == 0:
            return Hit()
        full = [self.full.page_of[h] for h in hashes[:k]] if self.full is not None else []
        sliding = ({j: self.sliding.page_of[hashes[j]] for j in range(sliding_first_block(k, p, w), k)}
                   if self.sliding is not None else {})
        ev = (sum(x in self.full.lru for x in full) if self.full is not None else 0,
              sum(x in self.sliding.lru for x in sliding.values()) if self.sliding is not None else 0)
        return Hit(k * p, full, sliding, ev)

    def count(self, num_prompt_tokens: int, hit_tokens: int) -> None:
        self.stats.queried_tokens += num_prompt_tokens
        self.stats.hit_tokens += hit_tokens

    # ---- registration ------------------------------------------------------------------------------
    def register(self, hashes: list[int], full_pages: list[int], ring: list[int], num_valid: int,
                 ring_valid_from: int) -> None:
        """Index a releasing sequence's complete blocks: full blocks [0, num_valid // P), and the
        ring's blocks that are complete, valid (written at or after ring_valid_from) and not yet
        overwritten by a later block (the ring holds the last R blocks written)."""
        p = self.spec.page_size
        n_blocks = min(len(hashes), num_valid // p)
        if self.full is not None:
            for j in range(min(n_blocks, len(full_pages))):
                self.full.insert(hashes[j], full_pages[j])
        if self.sliding is not None and ring and num_valid > 0:
            r = self.spec.ring_pages
            last = (num_valid - 1) // p  # the last block written
            first = max(-(-ring_valid_from // p), last - r + 1, 0)
            for j in range(first, n_blocks):
                if j % r < len(ring):
                    self.sliding.insert(hashes[j], ring[j % r])
        self.stats.stored_blocks += n_blocks

    def snapshot(self) -> list[tuple[int, int]]:
        return [kh for ix in (self.full, self.sliding) if ix is not None for kh in ix.snapshot_locked()]

    def events_since(self, cursor: int, max_events: int = 1 << 14) -> tuple[bool, int, list[int]]:
        return self.events.since(cursor, max_events, self.snapshot)

    def num_evicted(self) -> tuple[int, int]:
        return tuple(ix.num_evicted if ix is not None else 0 for ix in (self.full, self.sliding))  # type: ignore[return-value]

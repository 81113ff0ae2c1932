"""Paged KV cache with two page groups.

Layout: each group owns one pool tensor [L_g, 2, NP_g, Hkv, P, D] (HND inside a page), so
  * a layer's K (or V) pages are one contiguous [NP, Hkv, P, D] view, which FlashInfer (kv_layout
    "HND") and our Triton kernels read through a page table, and which NIXL registers once;
  * one KV head of one page is a contiguous P*D run, so a transfer between different TP degrees
    maps head ranges with one descriptor per (page, head range).

Groups:
  * FULL: full-attention layers keep every token; a sequence owns ceil(len / P) pages.
  * SLIDING: sliding-window layers only ever read the last W tokens. A sequence owns a ring of at
    most R = ceil(W / P) + 1 pages; logical page j (tokens [jP, jP+P)) lives in ring[j % R]. Any W
    consecutive positions span at most R logical pages, so live tokens never collide.

Prefix caching and the ring (model/prefix_cache.py, common/prefix_hash.py). A hit at block boundary
L = kP needs full pages of blocks [0, k) and, in the sliding group, only the blocks a query at L can
see: [(L - W + 1) // P, k) (blocks k-8 .. k-1, i.e. [L-128, L), for W = 128, P = 16); the lookup
takes the largest L where both groups hit. Ring slots are reused modulo R: the sequence writes
block k+1 into ring[(k+1) % R], which is where block k-8 lives, and a prefill chunk larger than the
ring reads its prefix from slots it then overwrites. A shared page in a ring would be overwritten,
so a cached sliding page is never mapped into a ring: a hit gets a ring of fresh pages and the
cached blocks it needs are COPIED into ring[j % R] before its first step (SeqPages.copy_src/dst,
applied by the runner on the step's stream; 8 pages x sliding layers, ~3 MiB for 20b). Full pages
are shared by reference: they hold positions < L and the sequence only writes from L on. When a
sequence releases its ring, the ring's complete, valid blocks (its last <= R) become cached pages
as they are: the sequence is done with them. The partial last block of a sequence is never cached.

Page size 16 (default): the sliding ring is then 9 pages (144 slots for a 128-token window, 11 %
waste), the partial last page of a full-attention sequence wastes <= 15 tokens, and a page of one
layer's K for 8 heads x 64 dims is 16 KiB in bf16, large enough for efficient NIXL descriptors.

KV dtype (`resolve_kv_dtype`): the model dtype ("auto"), bf16, or FP8 e4m3 ("fp8"), which halves every
page against bf16; FP8 pools carry fp32 scales per layer and KV head beside the pages (model/kv_scales.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import torch

from common.errors import ConfigError
from model.config import GptOssConfig
from model.kv_scales import FP8_KV_DTYPE, KVScales, is_fp8
from model.page_allocator import OutOfPages, PageAllocator

KV_DTYPES = {"bf16": torch.bfloat16, "fp8": FP8_KV_DTYPE, "fp32": torch.float32}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: auto (= the model dtype) | bf16 | fp8 (e4m3) | fp32."""
    if name == "auto":
        return model_dtype
    if name not in KV_DTYPES:
        raise ConfigError(f"KV cache dtype must be auto or one of {sorted(KV_DTYPES)}, got {name!r}")
    return KV_DTYPES[name]


def kv_dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in KV_DTYPES.items()}.get(dtype, str(dtype).removeprefix("torch."))
from model.prefix_cache import PrefixCache


class PageGroup(IntEnum):
    FULL = 0
    SLIDING = 1


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    page_size: int
    num_kv_heads: int  # on this rank
    head_dim: int
    dtype: torch.dtype
    sliding_window: int
    full_layers: tuple[int, ...]
    sliding_layers: tuple[int, ...]
    num_pages: tuple[int, int]  # (FULL, SLIDING)

    @property
    def ring_pages(self) -> int:
        return math.ceil(self.sliding_window / self.page_size) + 1

    def layers(self, group: PageGroup) -> tuple[int, ...]:
        return self.full_layers if group == PageGroup.FULL else self.sliding_layers

    def group_of(self, layer: int) -> tuple[PageGroup, int]:
        if layer in self.full_layers:
            return PageGroup.FULL, self.full_layers.index(layer)
        return PageGroup.SLIDING, self.sliding_layers.index(layer)

    def page_bytes(self, group: PageGroup) -> int:
        """Bytes of one page id across all layers of its group, K and V."""
        elt = torch.empty((), dtype=self.dtype).element_size()
        return len(self.layers(group)) * 2 * self.num_kv_heads * self.page_size * self.head_dim * elt

    def total_bytes(self) -> int:
        return sum(self.page_bytes(g) * self.num_pages[g] for g in PageGroup)


def plan_kv_cache(cfg: GptOssConfig, budget_bytes: int, *, page_size: int = 16, max_num_seqs: int = 256,
                  tp_size: int = 1, dtype: torch.dtype = torch.bfloat16, cached_tails: float = 0.0) -> KVCacheSpec:
    """Split a byte budget between the groups: a full sliding ring for each of max_num_seqs
    sequences (capped at half the budget), the rest for full-attention pages, which grow with
    context length. With a prefix cache, `cached_tails` x that ring allowance is added to the
    sliding group: a cached sequence keeps its ring's last blocks there (model/prefix_cache.py),
    so without room beyond the live rings a full batch would evict every cached tail."""
    if cfg.num_key_value_heads % tp_size:
        raise ConfigError(f"{cfg.num_key_value_heads} KV heads cannot be split over TP {tp_size}")
    spec0 = KVCacheSpec(page_size, cfg.num_key_value_heads // tp_size, cfg.head_dim, dtype, cfg.sliding_window,
                        cfg.full_layers, cfg.sliding_layers, (0, 0))
    sliding_pages = int(max_num_seqs * spec0.ring_pages * (1 + cached_tails)) if cfg.sliding_layers else 0
    if sliding_pages:  # never more than half the budget: admission also checks sliding pages
        sliding_pages = min(sliding_pages, budget_bytes // 2 // spec0.page_bytes(PageGroup.SLIDING))
    if cfg.sliding_layers and sliding_pages < spec0.ring_pages:
        raise ConfigError(f"KV budget of {budget_bytes} bytes cannot hold one sliding-window ring "
                          f"({spec0.ring_pages} pages of {spec0.page_bytes(PageGroup.SLIDING)} bytes)")
    rest = budget_bytes - sliding_pages * spec0.page_bytes(PageGroup.SLIDING)
    full_bytes = spec0.page_bytes(PageGroup.FULL)
    full_pages = rest // full_bytes if full_bytes else 0
    if cfg.full_layers and full_pages < 1:
        raise ConfigError(f"KV budget of {budget_bytes} bytes leaves no full-attention pages "
                          f"(max_num_seqs={max_num_seqs} rings take {sliding_pages} sliding pages)")
    return KVCacheSpec(page_size, spec0.num_kv_heads, cfg.head_dim, dtype, cfg.sliding_window,
                       cfg.full_layers, cfg.sliding_layers, (int(full_pages), int(sliding_pages)))


class KVPool:
    """The cache tensors. pools[g]: [L_g, 2, NP_g, Hkv, P, D].

    FP8 pools also hold k_scale / v_scale [layers, Hkv] fp32 on the pool's device (indexed by the
    global layer id; this rank's heads `kv_heads` of the global table `scales`, default 1.0)."""

    def __init__(self, spec: KVCacheSpec, device: torch.device | str = "cpu", *, scales: KVScales | None = None,
                 kv_heads: range | None = None) -> None:
        self.spec = spec
        self.pools = [torch.zeros(len(spec.layers(g)), 2, spec.num_pages[g], spec.num_kv_heads, spec.page_size,
                                  spec.head_dim, dtype=spec.dtype, device=device) for g in PageGroup]
        self.scales: KVScales | None = None
        self.k_scale = self.v_scale = None
        if is_fp8(spec.dtype):
            num_layers = len(spec.full_layers) + len(spec.sliding_layers)
            heads = kv_heads if kv_heads is not None else range(spec.num_kv_heads)
            self.scales = scales or KVScales.default(num_layers, heads.stop)
            k, v = self.scales.heads(heads)
            if tuple(k.shape) != (num_layers, spec.num_kv_heads):
                raise ConfigError(f"KV scales {tuple(self.scales.k.shape)} do not cover {num_layers} layers x "
                                  f"KV heads {heads.start}..{heads.stop - 1}")
            self.k_scale, self.v_scale = k.contiguous().to(device), v.contiguous().to(device)

    @property
    def scales_tag(self) -> str:
        """Names the dequantisation scales in the KV handshake ("none" for bf16/fp32 pages)."""
        return self.scales.tag if self.scales is not None else "none"

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        g, i = self.spec.group_of(layer)
        return self.pools[g][i, 0], self.pools[g][i, 1]

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) [Hkv] fp32 of one layer, or None when the pages are not FP8."""
        if self.k_scale is None:
            return None
        return self.k_scale[layer], self.v_scale[layer]

    def copy_pages(self, group: PageGroup, src: list[int], dst: list[int]) -> None:
        """pages dst[i] := pages src[i] in every layer of the group, K and V (queued on the current
        stream, so it runs before any later step and after any earlier one)."""
        pool = self.pools[group]  # [L, 2, NP, Hkv, P, D]
        idx = torch.tensor([src, dst], dtype=torch.long)  # [2, N]
        if pool.device.type == "cuda":  # pinned: no stream sync in the overlapped loop
            idx = idx.pin_memory().to(pool.device, non_blocking=True)
        raw = pool.view(torch.uint8)  # pages are bytes (and CUDA has no index_copy_ for float8 types)
        raw.index_copy_(2, idx[1], raw.index_select(2, idx[0]))


@dataclass(slots=True)
class SeqPages:
    """One sequence's pages: `full` in logical order; `ring` holds up to R sliding pages.
    copy_src/copy_dst: cached sliding pages to copy into ring slots before the sequence's next
    step (a prefix hit); the sequence holds a reference on each copy_src page until that step
    completed."""

    full: list[int] = field(default_factory=list)
    ring: list[int] = field(default_factory=list)
    copy_src: list[int] = field(default_factory=list)
    copy_dst: list[int] = field(default_factory=list)
    _full_arr: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32), repr=False)

    def full_array(self) -> np.ndarray:
        """`full` as int32, kept incrementally: pages are only ever appended (or all released), so
        building a step's page table costs a memcpy per sequence, not a Python loop per page."""
        n, have = len(self.full), len(self._full_arr)
        stale = have and n and (self._full_arr[0] != self.full[0] or self._full_arr[min(n, have) - 1] != self.full[min(n, have) - 1])
        if stale:
            self._full_arr = np.empty(0, dtype=np.int32)
            have = 0
        if n != have:
            if n > have and (have == 0 or self._full_arr[-1] == self.full[have - 1]):
                self._full_arr = np.concatenate([self._full_arr, np.asarray(self.full[have:], dtype=np.int32)])
            else:
                self._full_arr = np.asarray(self.full, dtype=np.int32)
        return self._full_arr


class KVManager:
    """Page bookkeeping for all sequences of one engine (both groups), with the prefix cache when
    `cache_identity` is given. Free counts include evictable cached pages: allocation evicts them
    (LRU) before it would fail."""

    def __init__(self, spec: KVCacheSpec, cache_identity: str | None = None) -> None:
        self.spec = spec
        self.alloc = [PageAllocator(spec.num_pages[g]) for g in PageGroup]
        self.cache = PrefixCache(spec, self.alloc, cache_identity) if cache_identity is not None else None
        # pages_needed runs for every running sequence every step: the spec's derived values read once
        self._ring = spec.ring_pages if spec.sliding_layers else 0
        self._has_full = bool(spec.full_layers)

    def pages_needed(self, pages: SeqPages, total_len: int) -> tuple[int, int]:
        """Extra (full, sliding) pages for a sequence to hold `total_len` tokens."""
        n = -(-total_len // self.spec.page_size)
        full = max(0, n - len(pages.full)) if self._has_full else 0
        return full, max(0, min(self._ring, n) - len(pages.ring))

    def can_grow(self, pages: SeqPages, total_len: int) -> bool:
        f, s = self.pages_needed(pages, total_len)
        if not (f or s):  # most decode steps: no new page (checked per running sequence per step)
            return True
        free_full, free_sliding = self.num_free()
        return f <= free_full and s <= free_sliding

    def grow(self, pages: SeqPages, total_len: int) -> None:
        f, s = self.pages_needed(pages, total_len)
        if not (f or s):
            return
        free_full, free_sliding = self.num_free()
        if f > free_full or s > free_sliding:
            raise OutOfPages(f"need {f} full + {s} sliding pages")
        pages.full += self._allocate(PageGroup.FULL, f)
        pages.ring += self._allocate(PageGroup.SLIDING, s)

    def _allocate(self, g: PageGroup, n: int) -> list[int]:
        short = n - self.alloc[g].num_free
        if short > 0:
            ix = self.cache.group(g) if self.cache is not None else None
            assert ix is not None and ix.evict(short) == short, "free count promised evictable pages"
        return self.alloc[g].allocate(n)

    def room_for_hit(self, hit, total_len: int) -> tuple[int, int]:
        """(full, sliding) pages an empty sequence mapping `hit` still needs for `total_len` tokens,
        counting the hit's evictable pages as used (acquiring them takes them off the LRU)."""
        f, s = self.pages_needed(SeqPages(full=[0] * len(hit.full)), total_len)
        return f + hit.evictable[PageGroup.FULL], s + hit.evictable[PageGroup.SLIDING]

    def map_hit(self, pages: SeqPages, hit, total_len: int) -> None:
        """An empty sequence takes a prefix hit and grows to `total_len` tokens: the hit's full pages
        by reference, a ring of fresh pages, and copies of the hit's sliding blocks into their ring
        slots (applied before the sequence's next step)."""
        assert self.cache is not None and not pages.full and not pages.ring and not pages.copy_src
        if self.cache.full is not None:
            self.cache.full.acquire(hit.full)
        if self.cache.sliding is not None:
            self.cache.sliding.acquire(list(hit.sliding.values()))
        pages.full = list(hit.full)
        pages.copy_src = list(hit.sliding.values())
        try:
            self.grow(pages, total_len)
        except OutOfPages:
            self.release(pages)
            raise
        r = self.spec.ring_pages
        pages.copy_dst = [pages.ring[j % r] for j in hit.sliding]

    def register(self, pages: SeqPages, register: tuple[list[int], int, int] | None) -> None:
        """Index a sequence's complete blocks in the prefix cache. `register` = (block hashes, tokens
        with valid KV, first valid ring position). The sequence keeps its references."""
        c = self.cache
        if c is not None and register is not None:
            hashes, num_valid, ring_from = register  # a ring still waiting for its copies holds nothing valid
            c.register(hashes, pages.full, [] if pages.copy_src else pages.ring, num_valid, ring_from)

    def release(self, pages: SeqPages, register: tuple[list[int], int, int] | None = None) -> None:
        """Drop a sequence's references (after registering its blocks, when `register` is given)."""
        self.register(pages, register)
        c = self.cache
        for g, lst in ((PageGroup.FULL, pages.full[::-1]), (PageGroup.SLIDING, pages.ring[::-1] + pages.copy_src)):
            ix = c.group(g) if c is not None else None
            if ix is not None:
                ix.release(lst)  # tail first: the LRU evicts a chain from its end
            else:
                self.alloc[g].free(lst)
        pages.full, pages.ring, pages.copy_src, pages.copy_dst = [], [], [], []
        pages._full_arr = np.empty(0, dtype=np.int32)

    def release_copy_sources(self, pages: SeqPages) -> SeqPages:
        """After the step that copied them launched: the sources' references move into a
        SeqPages of their own (released once that step completed)."""
        out = SeqPages(ring=pages.copy_src)
        pages.copy_src, pages.copy_dst = [], []
        return out

    def assert_all_free(self) -> None:
        """No sequence holds a page: every page is free or held by the prefix cache alone."""
        for g, a in enumerate(self.alloc):
            ix = self.cache.group(g) if self.cache is not None else None
            cached = set(ix.hash_of) if ix is not None else set()
            held = np.flatnonzero(a._ref)
            leaked = [int(p) for p in held if int(p) not in cached or a._ref[p] != 1]
            assert not leaked and a.num_free + len(cached) == a.num_pages, \
                f"leaked {PageGroup(g).name} pages: {leaked[:16]}..."

    def clear_cache(self) -> None:
        """Evict every unreferenced cached page."""
        if self.cache is not None:
            for ix in (self.cache.full, self.cache.sliding):
                if ix is not None:
                    ix.clear()

    def reset_cache(self) -> None:
        """Evict everything and start a new, empty index (no stats, no events): after the start-up
        warm-up (engine/warmup.py), which must leave no trace a router or a metric could see."""
        if self.cache is not None:
            self.clear_cache()
            self.cache = PrefixCache(self.spec, self.alloc, self.cache.identity)

    def num_free(self) -> tuple[int, int]:
        """Pages an allocation can get per group: free plus evictable cached pages."""
        c = self.cache
        return tuple(a.num_free + (ix.num_evictable if (ix := (c.group(g) if c else None)) else 0)
                     for g, a in enumerate(self.alloc))  # type: ignore[return-value]

    def num_cached(self) -> tuple[int, int]:
        c = self.cache
        return tuple(len(ix) if (ix := (c.group(g) if c else None)) else 0 for g in PageGroup)  # type: ignore[return-value]


# ---- slot arithmetic -------------------------------------------------------------------------------
def full_slot(pages: list[int], pos: int, page_size: int) -> int:
    return pages[pos // page_size] * page_size + pos % page_size


def ring_slot(ring: list[int], pos: int, page_size: int, ring_pages: int) -> int:
    """Logical page j lives in ring[j % R]; while the ring is still growing j < len(ring) <= R."""
    return ring[(pos // page_size) % ring_pages] * page_size + pos % page_size


def ring_view(ring: list[int], first_pos: int, end: int, page_size: int, ring_pages: int) -> tuple[list[int], int]:
    """Ring pages in logical order covering positions [first_pos, end), and the view start
    (first_pos rounded down to a page). The caller guarantees the span fits the ring."""
    j0, j1 = first_pos // page_size, (end + page_size - 1) // page_size
    assert j1 - j0 <= ring_pages, "sliding view wider than the ring"
    return [ring[j % ring_pages] for j in range(j0, j1)], j0 * page_size

"""Transfer plan: which bytes a request copies, as pure functions of page geometry.

A pool of one page group on one rank is [L_g, 2, NP, Hkv, P, D] (model/kv_cache.py), so for a fixed
(layer, K/V, page) the Hkv heads are consecutive runs of P*D elements. A copy is therefore one byte
range per (layer, K/V, page pair, contiguous head run); adjacent ranges that are contiguous on BOTH
sides are merged (`coalesce`), which turns consecutive page ids and matching TP splits into few,
large descriptors.

Which pages (decode may already hold a cached prefix [0, F), F = first_token, page-aligned):
  * FULL: every logical page F / P <= j < ceil(n / P): src.full[j] -> dst.full[j].
  * SLIDING: only the tail the next decode step can attend to. A query at position n sees keys
    k > n - W, i.e. the last W - 1 prompt tokens, logical pages [(n - W + 1) // P, ceil(n / P)),
    and of those only j >= F / P (decode copies the others from its cache into its ring).
    Logical page j lives in ring[j % R] on both sides (R = ceil(W / P) + 1, same W and P).

Which heads (heterogeneous TP, both directions): with H KV heads in total, rank r of TP-t holds
global heads [r*H/t, (r+1)*H/t). A prefill rank writes the overlap of its range with every decode
rank's range; a decode rank hears from every prefill rank that overlaps it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from common.errors import ProtocolError
from kv_transfer.messages import TransferRequest
from model.kv_cache import KVCacheSpec, PageGroup, SeqPages


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """One rank's pool tensor of one page group: [num_layers, 2, num_pages, num_kv_heads, P, D]."""

    num_layers: int
    num_pages: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    elt_size: int

    @property
    def head_bytes(self) -> int:
        return self.page_size * self.head_dim * self.elt_size

    @property
    def page_bytes(self) -> int:
        return self.num_kv_heads * self.head_bytes

    @property
    def nbytes(self) -> int:
        return self.num_layers * 2 * self.num_pages * self.page_bytes

    def offsets(self, layer_idx: int, kv: int, pages: np.ndarray, head: int) -> np.ndarray:
        """Byte offsets of head `head` of `pages` ([N] int64) for one layer of the group and K (0) / V (1)."""
        assert 0 <= layer_idx < self.num_layers and kv in (0, 1) and 0 <= head < self.num_kv_heads
        return ((layer_idx * 2 + kv) * self.num_pages + pages) * self.page_bytes + head * self.head_bytes


@dataclass(frozen=True, slots=True)
class HeadRun:
    """Heads one source rank writes to one destination rank (rank-local head indices)."""

    dst_rank: int
    src_rank: int
    src_head: int
    dst_head: int
    num_heads: int


@dataclass(frozen=True, slots=True)
class Copies:
    """Byte ranges relative to each side's pool base: copy nbytes[i] from src[i] to dst[i]."""

    src: np.ndarray  # [N] int64
    dst: np.ndarray  # [N] int64
    nbytes: np.ndarray  # [N] int64

    def __len__(self) -> int:
        return len(self.src)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


def _heads(total: int, tp: int, rank: int) -> range:
    if tp <= 0 or total % tp:
        raise ProtocolError(f"{total} KV heads cannot be split over TP {tp}")
    if not 0 <= rank < tp:
        raise ProtocolError(f"rank {rank} outside TP {tp}")
    n = total // tp
    return range(rank * n, (rank + 1) * n)


def head_runs(total_heads: int, src_rank: int, src_tp: int, dst_tp: int) -> list[HeadRun]:
    """Every destination rank `src_rank` must write to, with the overlapping head range."""
    src = _heads(total_heads, src_tp, src_rank)
    runs = []
    for d in range(dst_tp):
        dst = _heads(total_heads, dst_tp, d)
        lo, hi = max(src.start, dst.start), min(src.stop, dst.stop)
        if lo < hi:
            runs.append(HeadRun(d, src_rank, lo - src.start, lo - dst.start, hi - lo))
    return runs


def src_ranks_for(total_heads: int, dst_rank: int, dst_tp: int, src_tp: int) -> list[int]:
    """The source ranks a destination rank receives from."""
    _heads(total_heads, dst_tp, dst_rank)
    return [r for r in range(src_tp) if any(h.dst_rank == dst_rank for h in head_runs(total_heads, r, src_tp, dst_tp))]


def logical_pages(group: PageGroup, num_tokens: int, page_size: int, window: int, first_token: int = 0) -> range:
    """Logical pages a transfer of tokens [first_token, num_tokens) must copy."""
    assert num_tokens > 0 and page_size > 0
    if first_token % page_size or not 0 <= first_token < num_tokens:
        raise ProtocolError(f"first_token {first_token} is not a page boundary below {num_tokens}")
    end = -(-num_tokens // page_size)
    first = first_token // page_size
    if group == PageGroup.FULL:
        return range(first, end)
    return range(max(first, max(0, num_tokens - window + 1) // page_size), end)


def ring_size(page_size: int, window: int) -> int:
    return math.ceil(window / page_size) + 1


def page_pairs(group: PageGroup, src: SeqPages, dst: SeqPages, num_tokens: int, page_size: int,
               window: int, src_num_pages: int, dst_num_pages: int, first_token: int = 0
               ) -> tuple[np.ndarray, np.ndarray]:
    """(src page ids, dst page ids), [N] int64 each, in logical order. Raises ProtocolError when a
    side holds too few pages for `num_tokens` or names a page outside its pool."""
    js = logical_pages(group, num_tokens, page_size, window, first_token)
    if group == PageGroup.FULL:
        s_list, d_list, idx = src.full, dst.full, np.arange(js.start, js.stop)
    else:
        r = ring_size(page_size, window)
        s_list, d_list, idx = src.ring, dst.ring, np.arange(js.start, js.stop) % r
        # The ring grows to min(R, pages touched); index j % R must exist on both sides.
    need = int(idx.max()) + 1
    for side, lst, limit in (("source", s_list, src_num_pages), ("destination", d_list, dst_num_pages)):
        if len(lst) < need:
            raise ProtocolError(f"{group.name} {side} has {len(lst)} pages, {num_tokens} tokens need {need}")
        used = [lst[i] for i in np.unique(idx)]
        if min(used) < 0 or max(used) >= limit:
            raise ProtocolError(f"{group.name} {side} page id outside its pool of {limit} pages")
    return np.asarray(s_list, dtype=np.int64)[idx], np.asarray(d_list, dtype=np.int64)[idx]


def check_source_pages(spec: KVCacheSpec, request: TransferRequest, pages: SeqPages) -> None:
    """Before a transfer starts: both page lists are long enough and the source ids fit the local
    pool (the destination ids are checked against the decode pool once its layout is known)."""
    dst = SeqPages(list(request.full_pages), list(request.ring_pages))
    for g in PageGroup:
        if spec.layers(g):
            page_pairs(g, pages, dst, request.num_tokens, spec.page_size, spec.sliding_window,
                       spec.num_pages[g], 1 << 62, request.first_token)


def layer_copies(src_geo: GroupGeometry, dst_geo: GroupGeometry, layer_idx: int, pairs: tuple[np.ndarray, np.ndarray],
                 run: HeadRun) -> Copies:
    """Byte ranges of one layer (K then V), one per (page pair, head run), coalesced."""
    assert src_geo.head_bytes == dst_geo.head_bytes, "page size, head dim and dtype must match"
    sp, dp = pairs
    nbytes = run.num_heads * src_geo.head_bytes
    src = np.concatenate([src_geo.offsets(layer_idx, kv, sp, run.src_head) for kv in (0, 1)])
    dst = np.concatenate([dst_geo.offsets(layer_idx, kv, dp, run.dst_head) for kv in (0, 1)])
    return coalesce(src, dst, np.full(len(src), nbytes, dtype=np.int64))


def coalesce(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> Copies:
    """Merge each range into its predecessor when it continues it on both sides (order kept)."""
    if len(src) == 0:
        return Copies(src.astype(np.int64), dst.astype(np.int64), nbytes.astype(np.int64))
    src, dst, nbytes = (np.asarray(a, dtype=np.int64) for a in (src, dst, nbytes))
    starts = np.ones(len(src), dtype=bool)
    starts[1:] = (src[1:] != src[:-1] + nbytes[:-1]) | (dst[1:] != dst[:-1] + nbytes[:-1])
    first = np.flatnonzero(starts)
    return Copies(src[first], dst[first], np.add.reduceat(nbytes, first))


@dataclass(frozen=True, slots=True)
class WritePlan:
    """One page group's WRITE plan towards one destination rank, made once per request: the
    descriptors ([N, 3] uint64: address, bytes, device) of the group's first layer; layer i of the
    group is the same list shifted by i * stride on each side (pool offsets are linear in the layer
    index, so coalescing is the same for every layer)."""

    src: np.ndarray  # [N, 3] uint64 (address, bytes, device)
    dst: np.ndarray  # [N, 3] uint64
    src_stride: int
    dst_stride: int
    layer_bytes: int

    def layer(self, li: int) -> tuple[np.ndarray, np.ndarray]:
        src, dst = self.src.copy(), self.dst.copy()
        src[:, 0] += np.uint64(li * self.src_stride)
        dst[:, 0] += np.uint64(li * self.dst_stride)
        return src, dst

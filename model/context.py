"""StepMeta: what one forward step tells every attention layer (built once per step, on the host).

A step runs B sequences; sequence b contributes q_lens[b] new tokens at absolute positions
[start_b, start_b + q_lens[b]). Attention of a new token at position t covers every earlier cached
token and the new tokens up to t (sliding layers: only positions > t - W).

Per page group the view of sequence b is the pages of `page_table[b]` in logical order, starting at
absolute position `view_start[b]`; `prefix_lens[b]` tokens of the view were cached before this step
and `kv_lens[b]` = prefix + new. When `pages_hold_all` is true the page table also covers the new
tokens, so a backend may store K/V first and read everything through pages (decode, and every
full-attention layer). When false (a sliding layer fed a prefill chunk larger than its ring), the
backend must attend over [prefix from pages ; new K/V as given] and only then store.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.interface import GroupMeta, StepMeta
from model.kv_cache import KVCacheSpec, PageGroup, SeqPages, ring_view


@dataclass(slots=True)
class SeqStep:
    """One sequence's share of a step: its pages, tokens already cached, new token count."""

    pages: SeqPages | None
    start: int
    q_len: int


def to_device(a: np.ndarray | list, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host data -> device without a stream sync: on CUDA through pinned memory (a pageable source
    can make the copy wait for the stream, which would stall the overlapped step loop; PyTorch's
    pinned caching allocator keeps the staging block until the copy ran)."""
    t = torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.tensor(a, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class Upload:
    """A step's host arrays gathered into one int32 and one int64 buffer: two host -> device copies
    instead of one per array (a decode step's metadata was a dozen tiny copies, each a few us of
    stream time between two graph replays). `add` returns a callable giving the device view after
    `run()`; segments start on 128-byte boundaries."""

    _ALIGN = {np.dtype(np.int32): 32, np.dtype(np.int64): 16}

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._parts: dict[np.dtype, list[np.ndarray]] = {np.dtype(np.int32): [], np.dtype(np.int64): []}
        self._size = {k: 0 for k in self._parts}
        self._dev: dict[np.dtype, torch.Tensor] = {}

    def add(self, a: np.ndarray | list, dtype=np.int32):
        a = np.asarray(a, dtype=dtype)
        dt = a.dtype
        off, n = self._size[dt], a.size
        self._parts[dt].append(a.reshape(-1))
        pad = -n % self._ALIGN[dt]
        if pad:
            self._parts[dt].append(np.zeros(pad, dtype=dt))
        self._size[dt] = off + n + pad
        shape = a.shape
        return lambda: self._dev[dt][off:off + n].view(shape)

    def run(self) -> None:
        for dt, parts in self._parts.items():
            if parts:
                self._dev[dt] = to_device(np.concatenate(parts), self.device)


def _table(rows: list) -> np.ndarray:
    width = max((len(r) for r in rows), default=0) or 1
    t = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        t[i, :len(r)] = r
    return t


def _flat(rows: list) -> np.ndarray:
    return np.concatenate([np.asarray(r, dtype=np.int32) for r in rows]) if rows else np.zeros(0, np.int32)


def _full_slots(pages: np.ndarray, start: int, end: int, p: int) -> np.ndarray:
    pos = np.arange(start, end)
    return pages[pos // p].astype(np.int64) * p + pos % p


def _ring_slots(ring: list[int], start: int, end: int, keep_from: int, p: int, r: int) -> np.ndarray:
    """Slot of each position in the ring (logical page j -> ring[j % R]); -1 before keep_from."""
    pos = np.arange(start, end)
    if not ring:
        return np.full(len(pos), -1, dtype=np.int64)
    arr = np.asarray(ring, dtype=np.int64)
    slots = arr[(pos // p) % r] * p + pos % p
    return np.where(pos >= keep_from, slots, -1)


def build_step_meta(steps: list[SeqStep], spec: KVCacheSpec | None, device: torch.device | str = "cpu"
                    ) -> StepMeta:
    """Host-side metadata of one step, vectorised with numpy (O(pages) per step, in C), uploaded in
    two copies (Upload)."""
    up = Upload(device)
    q_lens = [s.q_len for s in steps]
    positions = np.concatenate([np.arange(s.start, s.start + s.q_len) for s in steps])
    cu = np.zeros(len(steps) + 1, dtype=np.int32)
    cu[1:] = np.cumsum(q_lens)
    logits_idx = (cu[1:] - 1).astype(np.int64)
    views = {"positions": up.add(positions, np.int64), "cu": up.add(cu), "logits": up.add(logits_idx, np.int64)}
    groups: list = [None, None]
    if spec is not None:
        p = spec.page_size
        if spec.full_layers:
            rows, slots = [], []
            for s in steps:
                assert s.pages is not None
                arr = s.pages.full_array()
                rows.append(arr[: -(-(s.start + s.q_len) // p)])
                if s.q_len == 1:  # decode: scalar arithmetic beats a numpy call per sequence
                    slots.append(np.array([int(arr[s.start // p]) * p + s.start % p], dtype=np.int64))
                else:
                    slots.append(_full_slots(arr, s.start, s.start + s.q_len, p))
            starts = [s.start for s in steps]
            ends = [s.start + s.q_len for s in steps]
            flat = _flat(rows)
            groups[PageGroup.FULL] = (up.add(_table(rows)), up.add(starts), up.add(ends),
                                      up.add(np.concatenate(slots), np.int64), True, starts, ends, flat, up.add(flat))
        if spec.sliding_layers:
            groups[PageGroup.SLIDING] = _sliding_meta(steps, spec, up)
    up.run()
    metas = tuple(None if g is None else GroupMeta(g[0](), g[1](), g[2](), g[3](), g[4], g[5], g[6], g[7], g[8]())
                  for g in groups)
    return StepMeta(views["positions"](), views["cu"](), q_lens, views["logits"](), metas)


def ring_keep_from(start: int, end: int, page_size: int, window: int) -> int:
    """First position a chunk [start, end) stores in the ring when it cannot store all of it: every
    page that holds one of its last W positions, whole (span <= R pages). A later step needs only
    keys > end - W; whole pages keep every block of [end - W, end) valid for a prefix-cache hit
    (model/prefix_cache.py). A step that stores everything stores at least this."""
    return max(start, max(0, end - window) // page_size * page_size)


def _sliding_meta(steps: list[SeqStep], spec: KVCacheSpec, up: Upload) -> tuple:
    p, w, r = spec.page_size, spec.sliding_window, spec.ring_pages
    # Write-then-read is valid only if, for every sequence, the oldest key the first new token needs
    # and the newest new token fit the ring together.
    hold_all = all(-(-(s.start + s.q_len) // p) - max(0, s.start - (w - 1)) // p <= r for s in steps)
    rows, prefix, kv, slots = [], [], [], []
    for s in steps:
        assert s.pages is not None
        end = s.start + s.q_len
        first = max(0, s.start - (w - 1))
        pages, vstart = ring_view(s.pages.ring, first, end if hold_all else s.start, p, r)
        rows.append(pages)
        prefix.append(s.start - vstart)
        kv.append(end - vstart)
        keep_from = s.start if hold_all else ring_keep_from(s.start, end, p, w)
        if s.q_len == 1 and s.pages.ring:
            slot = s.pages.ring[(s.start // p) % r] * p + s.start % p if s.start >= keep_from else -1
            slots.append(np.array([slot], dtype=np.int64))
        else:
            slots.append(_ring_slots(s.pages.ring, s.start, end, keep_from, p, r))
    flat = _flat(rows)
    return (up.add(_table(rows)), up.add(prefix), up.add(kv), up.add(np.concatenate(slots), np.int64), hold_all,
            prefix, kv, flat, up.add(flat))

"""Page ids of one KV page group with reference counts (model/kv_cache.py's KVManager holds one per group;
the prefix cache's shared pages are the ones referenced more than once)."""

from __future__ import annotations

import numpy as np


class OutOfPages(Exception):
    """Internal signal to the scheduler: not enough free pages (it preempts or waits)."""


class PageAllocator:
    """Pages of one group with reference counts. Page ids are 0..num_pages-1.

    Allocation prefers contiguous runs: a request's pages then coalesce into few KV-transfer
    descriptors (NIXL moved 144 GB/s with contiguous decode pages and 2.6 GB/s with scattered ones,
    benchmarks/results/2026-11-30/x2_kv_transfer.json). n pages come from the first free run of at
    least n pages; failing that, the longest runs are taken first. Single pages (decode growth) come
    from a next-fit cursor so the common case stays O(1) amortised.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._is_free = np.ones(num_pages, dtype=bool)
        self._ref = np.zeros(num_pages, dtype=np.int32)
        self._num_free = num_pages
        self._cursor = 0

    @property
    def num_free(self) -> int:
        return self._num_free

    def allocate(self, n: int) -> list[int]:
        if n > self._num_free:
            raise OutOfPages(f"need {n} pages, {self._num_free} free")
        if n == 0:
            return []
        pages = self._next_fit() if n == 1 else self._runs(n)
        self._is_free[pages] = False
        self._ref[pages] = 1
        self._num_free -= n
        return pages.tolist()

    def _next_fit(self) -> np.ndarray:
        for lo, hi in ((self._cursor, self.num_pages), (0, self._cursor)):
            step = 4096
            for s in range(lo, hi, step):
                hits = np.flatnonzero(self._is_free[s:min(s + step, hi)])
                if hits.size:
                    page = s + int(hits[0])
                    self._cursor = page + 1
                    return np.array([page])
        raise AssertionError("free count says a page is free but none is")

    def _runs(self, n: int) -> np.ndarray:
        edges = np.diff(np.concatenate(([0], self._is_free.view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        lens = ends - starts
        fit = np.flatnonzero(lens >= n)
        if fit.size:
            s = int(starts[fit[0]])
            return np.arange(s, s + n)
        out, need = [], n
        for i in np.argsort(-lens, kind="stable"):  # longest runs first: fewest pieces
            take = min(need, int(lens[i]))
            out.append(np.arange(starts[i], starts[i] + take))
            need -= take
            if need == 0:
                break
        return np.concatenate(out)

    def ref(self, page: int) -> int:
        return int(self._ref[page])

    def free_unreferenced(self, page: int) -> None:
        """Evict: only the cache's reference may be left on a page that is freed this way."""
        assert self._ref[page] == 1, f"evicting page {page} that {self._ref[page] - 1} sequences still reference"
        self.free([page])

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            assert self._ref[p] > 0, f"incref of free page {p}"
            self._ref[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert self._ref[p] > 0, f"double free of page {p}"
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._is_free[p] = True
                self._num_free += 1

    def assert_all_free(self) -> None:
        leaked = np.flatnonzero(self._ref)
        assert leaked.size == 0 and self._num_free == self.num_pages, f"leaked pages: {leaked[:16].tolist()}..."

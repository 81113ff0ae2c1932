"""A check shared by the CPU and GPU tests of KVPool.copy_pages (a prefix hit's sliding pages into the new
sequence's ring)."""

import torch

from model.kv_cache import KVCacheSpec, KVPool, PageGroup


def check_copy_pages(spec: KVCacheSpec, device: str) -> None:
    """Random bytes in every page (every e4m3 code, NaN codes included), pages [1, 4, 7] copied onto [9, 2, 5] in both
    groups: the destinations hold the sources' bytes, K and V, and every other page is untouched."""
    pool = KVPool(spec, device)
    g = torch.Generator().manual_seed(0)
    for t in pool.pools:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8).to(device))
    before = [t.view(torch.uint8).clone() for t in pool.pools]
    src, dst = [1, 4, 7], [9, 2, 5]
    for group in PageGroup:
        pool.copy_pages(group, src, dst)
    for t, b in zip(pool.pools, before):
        want = b.clone()
        want[:, :, dst] = b[:, :, src]
        assert torch.equal(t.view(torch.uint8), want)

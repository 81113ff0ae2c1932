"""kv_transfer.plan: head mapping across TP degrees, page selection (full / sliding tail), byte
ranges checked against plain tensor indexing, and coalescing."""

import itertools
import math
import random

import numpy as np
import pytest
import torch

from common.errors import ProtocolError
from kv_transfer.messages import TransferRequest
from kv_transfer.plan import (GroupGeometry, check_source_pages, coalesce, head_runs, layer_copies, logical_pages,
                              page_pairs, ring_size, src_ranks_for)
from model.kv_cache import KVCacheSpec, PageGroup, SeqPages, ring_slot

TPS = (1, 2, 4, 8)


@pytest.mark.parametrize("p,d", list(itertools.product(TPS, TPS)))
def test_head_runs_cover_every_decode_head_once(p, d):
    total = 8
    seen = {}
    for r in range(p):
        for run in head_runs(total, r, p, d):
            for k in range(run.num_heads):
                g_src = r * total // p + run.src_head + k
                g_dst = run.dst_rank * total // d + run.dst_head + k
                assert g_src == g_dst, "a head must land on the same global head"
                assert (run.dst_rank, run.dst_head + k) not in seen
                seen[(run.dst_rank, run.dst_head + k)] = r
            assert 0 <= run.src_head and run.src_head + run.num_heads <= total // p
            assert 0 <= run.dst_head and run.dst_head + run.num_heads <= total // d
    assert len(seen) == total
    for s in range(d):
        assert src_ranks_for(total, s, d, p) == sorted({r for (dr, _), r in seen.items() if dr == s})


def test_head_runs_examples():
    # p < d: one prefill rank feeds both decode ranks, half of its heads each.
    runs = head_runs(8, 0, 1, 2)
    assert [(h.dst_rank, h.src_head, h.dst_head, h.num_heads) for h in runs] == [(0, 0, 0, 4), (1, 4, 0, 4)]
    # p > d: prefill rank 1 of 2 writes the upper half of decode rank 0's heads.
    assert [(h.dst_rank, h.src_head, h.dst_head, h.num_heads) for h in head_runs(8, 1, 2, 1)] == [(0, 0, 4, 4)]
    assert src_ranks_for(8, 0, 1, 2) == [0, 1]


@pytest.mark.parametrize("total,tp", [(8, 3), (8, 16), (8, 0)])
def test_bad_tp_split_is_refused(total, tp):
    with pytest.raises(ProtocolError):
        head_runs(total, 0, tp, 1)


@pytest.mark.parametrize("page_size,window", [(16, 128), (8, 32), (4, 4), (16, 7), (1, 3)])
def test_logical_pages_match_brute_force(page_size, window):
    for n in range(1, 5 * window + 3 * page_size):
        full = logical_pages(PageGroup.FULL, n, page_size, window)
        assert list(full) == sorted({t // page_size for t in range(n)})
        # The next decode query sits at position n and sees keys k with n - k < W.
        needed = {t // page_size for t in range(max(0, n - window + 1), n)}
        tail = logical_pages(PageGroup.SLIDING, n, page_size, window)
        assert set(tail) >= needed and len(tail) == len(needed), (n, list(tail), sorted(needed))
        assert len(tail) <= ring_size(page_size, window)


def test_page_pairs_full_and_ring():
    src = SeqPages(full=[10, 11, 12, 13], ring=[20, 21, 22, 23, 24])
    dst = SeqPages(full=[3, 1, 4, 1 + 4], ring=[7, 6, 5, 9, 8])
    sp, dp = page_pairs(PageGroup.FULL, src, dst, 50, 16, 128, 100, 100)
    assert sp.tolist() == [10, 11, 12, 13] and dp.tolist() == [3, 1, 4, 5]
    # W=32, P=8, R=5, n=100: tail = logical pages [(100-31)//8, 13) = 8..12 -> ring slots 3,4,0,1,2.
    src = SeqPages(ring=[20, 21, 22, 23, 24])
    sp, dp = page_pairs(PageGroup.SLIDING, src, dst, 100, 8, 32, 100, 100)
    assert sp.tolist() == [23, 24, 20, 21, 22] and dp.tolist() == [9, 8, 7, 6, 5]
    # n=96: logical 8..11 only, ring slot 2 (logical 7) is not sent.
    sp, _ = page_pairs(PageGroup.SLIDING, src, dst, 96, 8, 32, 100, 100)
    assert sp.tolist() == [23, 24, 20, 21]


def test_page_pairs_refuse_short_or_foreign_pages():
    with pytest.raises(ProtocolError, match="destination has 2 pages"):
        page_pairs(PageGroup.FULL, SeqPages(full=[0, 1, 2]), SeqPages(full=[0, 1]), 40, 16, 128, 10, 10)
    with pytest.raises(ProtocolError, match="outside its pool"):
        page_pairs(PageGroup.FULL, SeqPages(full=[0, 1]), SeqPages(full=[0, 10]), 20, 16, 128, 10, 10)
    with pytest.raises(ProtocolError, match="source has 3 pages"):  # ring too short for a full wrap
        page_pairs(PageGroup.SLIDING, SeqPages(ring=[0, 1, 2]), SeqPages(ring=[0, 1, 2, 3, 4]), 100, 8, 32, 10, 10)
    spec = KVCacheSpec(8, 2, 4, torch.float32, 32, (1,), (0,), (4, 5))
    req = TransferRequest("r", "e", ("x",), (1,), (0, 1, 2), (0, 1, 2, 3, 4), 20, 0.0)
    check_source_pages(spec, req, SeqPages(full=[0, 1, 2], ring=[0, 1, 2]))
    with pytest.raises(ProtocolError, match="outside its pool"):
        check_source_pages(spec, req, SeqPages(full=[0, 1, 7], ring=[0, 1, 2]))


def _geo(spec: KVCacheSpec, g: PageGroup) -> GroupGeometry:
    return GroupGeometry(len(spec.layers(g)), spec.num_pages[g], spec.num_kv_heads, spec.page_size, spec.head_dim,
                         torch.empty((), dtype=spec.dtype).element_size())


def _pool(spec, g, seed):
    shape = (len(spec.layers(g)), 2, spec.num_pages[g], spec.num_kv_heads, spec.page_size, spec.head_dim)
    if seed is None:
        return torch.zeros(shape, dtype=spec.dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(spec.dtype)


@pytest.mark.parametrize("seed", range(12))
def test_byte_ranges_equal_tensor_indexing(seed):
    """Apply the plan's byte ranges to flat byte views; compare with head/page indexing, and check
    every byte outside the planned pages/heads is untouched."""
    rnd = random.Random(seed)
    total = rnd.choice([2, 4, 8])
    p, d = rnd.choice([t for t in TPS if total % t == 0]), rnd.choice([t for t in TPS if total % t == 0])
    page, window = rnd.choice([(4, 8), (8, 32), (16, 16)])
    dtype = rnd.choice([torch.float32, torch.bfloat16])
    n = rnd.randint(1, 12 * page)
    need_full = math.ceil(n / page)
    group = rnd.choice(list(PageGroup))
    src_rank = rnd.randrange(p)
    src_spec = KVCacheSpec(page, total // p, 4, dtype, window, (1, 3), (0, 2), (need_full + 5, 12))
    dst_spec = KVCacheSpec(page, total // d, 4, dtype, window, (1, 3), (0, 2), (need_full + 9, 14))
    r = ring_size(page, window)
    n_ring = min(r, need_full)
    src_pages = SeqPages(rnd.sample(range(src_spec.num_pages[0]), need_full), rnd.sample(range(12), n_ring))
    dst_pages = SeqPages(rnd.sample(range(dst_spec.num_pages[0]), need_full), rnd.sample(range(14), n_ring))
    src, sg, dg = _pool(src_spec, group, seed), _geo(src_spec, group), _geo(dst_spec, group)
    pairs = page_pairs(group, src_pages, dst_pages, n, page, window, sg.num_pages, dg.num_pages)
    for run in head_runs(total, src_rank, p, d):
        dst = _pool(dst_spec, group, None)
        for li in range(2):
            cp = layer_copies(sg, dg, li, pairs, run)
            sb, db = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
            for s, t, k in zip(cp.src.tolist(), cp.dst.tolist(), cp.nbytes.tolist()):
                db[t:t + k] = sb[s:s + k]
        expect = _pool(dst_spec, group, None)
        sp, dp = (torch.from_numpy(a) for a in pairs)
        hs, hd, nh = run.src_head, run.dst_head, run.num_heads
        expect[:, :, dp, hd:hd + nh] = src[:, :, sp, hs:hs + nh]
        assert torch.equal(dst.view(torch.uint8) if dtype == torch.float32 else dst.view(torch.int16),
                           expect.view(torch.uint8) if dtype == torch.float32 else expect.view(torch.int16))


def test_sliding_tail_readable_through_ring_slots():
    """Independent check with model.kv_cache.ring_slot: every key the next decode step can see is
    at its slot on the destination after the copy."""
    P, W, D = 4, 10, 2
    R = ring_size(P, W)
    spec = KVCacheSpec(P, 1, D, torch.float32, W, (), (0,), (0, 2 * R))
    geo = _geo(spec, PageGroup.SLIDING)
    for n in range(1, 40):
        k = min(R, math.ceil(n / P))
        src_p, dst_p = SeqPages(ring=list(range(k))), SeqPages(ring=list(range(2 * R - 1, 2 * R - 1 - k, -1)))
        src = torch.arange(2 * R * P * D * 2, dtype=torch.float32).view(1, 2, 2 * R, 1, P, D)
        dst = torch.full_like(src, -1.0)
        cp = layer_copies(geo, geo, 0, page_pairs(PageGroup.SLIDING, src_p, dst_p, n, P, W, 2 * R, 2 * R),
                          head_runs(1, 0, 1, 1)[0])
        for s, t, b in zip(cp.src.tolist(), cp.dst.tolist(), cp.nbytes.tolist()):
            dst.view(-1)[t // 4:(t + b) // 4] = src.view(-1)[s // 4:(s + b) // 4]
        for pos in range(max(0, n - W + 1), n):
            ss, ds = ring_slot(src_p.ring, pos, P, R), ring_slot(dst_p.ring, pos, P, R)
            for kv in (0, 1):
                assert torch.equal(dst[0, kv].reshape(-1, D)[ds], src[0, kv].reshape(-1, D)[ss]), (n, pos)


def test_coalesce_merges_runs_contiguous_on_both_sides():
    geo = GroupGeometry(2, 8, 4, 16, 8, 2)  # page = 4 heads x 256 B
    run = head_runs(4, 0, 1, 1)[0]
    pairs = (np.arange(2, 6), np.arange(3, 7))
    cp = layer_copies(geo, geo, 1, pairs, run)
    assert len(cp) == 2 and cp.nbytes.tolist() == [4 * geo.page_bytes] * 2  # K run, V run
    whole = (np.arange(8), np.arange(8))
    assert len(layer_copies(geo, geo, 0, whole, run)) == 1  # K's last page abuts V's first
    # A break on one side only splits the run.
    cp = layer_copies(geo, geo, 0, (np.array([0, 1, 2]), np.array([0, 1, 5])), run)
    assert cp.nbytes.tolist() == [2 * geo.page_bytes, geo.page_bytes] * 2
    # Half the heads (TP 1 -> 2) are never contiguous across pages.
    half = head_runs(4, 0, 1, 2)[1]
    dst = GroupGeometry(2, 8, 2, 16, 8, 2)
    assert len(layer_copies(geo, dst, 0, pairs, half)) == 8
    c = coalesce(np.array([0, 10, 20, 40]), np.array([5, 15, 25, 50]), np.array([10, 10, 10, 10]))
    assert c.src.tolist() == [0, 40] and c.dst.tolist() == [5, 50] and c.nbytes.tolist() == [30, 10]
    assert len(coalesce(np.array([], dtype=np.int64), np.array([], dtype=np.int64), np.array([], dtype=np.int64))) == 0


@pytest.mark.parametrize("seed", range(4))
def test_group_plan_shift_equals_per_layer_plan(seed):
    """The sender plans a group's first layer once and shifts it per layer: the same descriptors
    as planning every layer from scratch (coalescing included)."""
    from kv_transfer.nixl_backend import descriptors
    from kv_transfer.plan import WritePlan

    rng = random.Random(seed)
    src_geo, dst_geo = GroupGeometry(5, 64, 4, 16, 8, 2), GroupGeometry(5, 80, 2, 16, 8, 2)
    run = head_runs(4, 0, 1, 2)[1]  # source heads 2..3 -> destination rank 1
    n = rng.randint(1, 40)
    sp = np.array(sorted(rng.sample(range(64), n)), dtype=np.int64)
    dp = np.array(rng.sample(range(80), n), dtype=np.int64)
    cp0 = layer_copies(src_geo, dst_geo, 0, (sp, dp), run)
    plan = WritePlan(descriptors(1 << 30, cp0.src, cp0.nbytes, 0), descriptors(1 << 31, cp0.dst, cp0.nbytes, 1),
                      2 * 64 * src_geo.page_bytes, 2 * 80 * dst_geo.page_bytes, cp0.total_bytes)
    for li in range(5):
        cp = layer_copies(src_geo, dst_geo, li, (sp, dp), run)
        src, dst = plan.layer(li)
        assert np.array_equal(src, descriptors(1 << 30, cp.src, cp.nbytes, 0))
        assert np.array_equal(dst, descriptors(1 << 31, cp.dst, cp.nbytes, 1))
        assert cp.total_bytes == plan.layer_bytes

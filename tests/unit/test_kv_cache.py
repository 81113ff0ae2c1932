import pytest
import torch

from common.errors import ConfigError
from model.config import preset
from model.context import SeqStep, build_step_meta
from model.kv_cache import KVManager, PageGroup, SeqPages, plan_kv_cache
from model.page_allocator import OutOfPages, PageAllocator


def test_allocator_refcounts_and_leak_check():
    a = PageAllocator(4)
    p = a.allocate(3)
    a.incref(p[:1])
    a.free(p)
    assert a.num_free == 3
    with pytest.raises(AssertionError, match="leaked"):
        a.assert_all_free()
    a.free(p[:1])
    a.assert_all_free()
    with pytest.raises(OutOfPages):
        a.allocate(5)
    with pytest.raises(AssertionError, match="double free"):
        a.free([0])


def test_plan_splits_budget_and_refuses_tiny_budgets():
    cfg = preset("gpt-oss-120b")
    spec = plan_kv_cache(cfg, 40 << 30, page_size=16, max_num_seqs=128)
    assert spec.ring_pages == 9 and spec.num_pages[PageGroup.SLIDING] == 128 * 9
    assert spec.total_bytes() <= 40 << 30
    # 18 full layers x 8 heads x 64 x 2 (K,V) x 2 bytes = 36 KiB per token for the full group
    assert spec.page_bytes(PageGroup.FULL) == 18 * 2 * 8 * 16 * 64 * 2
    with pytest.raises(ConfigError):
        plan_kv_cache(cfg, 1 << 20, page_size=16)
    with pytest.raises(ConfigError, match="KV heads"):
        plan_kv_cache(cfg, 40 << 30, tp_size=3)


def test_ring_slots_never_collide_within_the_window():
    cfg = preset("tiny")  # window 128
    spec = plan_kv_cache(cfg, 8 << 20, page_size=16, max_num_seqs=2, dtype=torch.float32)
    kv, pages = KVManager(spec), SeqPages()
    pos = 0
    for q in [100, 1, 37, 1, 1, 200, 1, 1, 5, 1]:
        kv.grow(pages, pos + q)
        assert len(pages.ring) <= spec.ring_pages
        meta = build_step_meta([SeqStep(pages, pos, q)], spec)
        g = meta.groups[PageGroup.SLIDING]
        stored = [s for s in g.slot_mapping.tolist() if s >= 0]
        assert len(stored) == len(set(stored))
        if g.pages_hold_all:  # every new token stored; view covers window of the first new token
            assert len(stored) == q and g.prefix_lens_host[0] <= 127 + 15
        else:  # only the pages of the last W new tokens are kept (whole, for the prefix cache)
            end = pos + q
            assert len(stored) == end - max(pos, (end - 128) // 16 * 16) and 127 <= len(stored) <= 128 + 15
        pos += q
    kv.release(pages)
    kv.assert_all_free()


def test_page_array_cache_follows_release_and_regrow():
    """Preemption releases pages and regrows to the same length with other ids: the cached int32
    view must not go stale (it once did, and preempted sequences read the wrong pages)."""
    cfg = preset("tiny-a")
    spec = plan_kv_cache(cfg, 1 << 20, page_size=4, max_num_seqs=2, dtype=torch.float32)
    kv, a, b = KVManager(spec), SeqPages(), SeqPages()
    kv.grow(a, 12)
    kv.grow(b, 12)
    assert a.full_array().tolist() == a.full
    kv.release(a)
    kv.release(b)
    kv.grow(b, 12)  # b takes a's old pages first or not: either way a differs now
    kv.grow(a, 12)
    assert a.full_array().tolist() == a.full and b.full_array().tolist() == b.full
    a.full[0], a.full[-1] = a.full[-1], a.full[0]  # any in-place change is seen too
    assert a.full_array().tolist() == a.full
    kv.release(a)
    kv.release(b)
    kv.assert_all_free()


def test_allocator_prefers_contiguous_runs_after_churn():
    a = PageAllocator(64)
    seqs = [a.allocate(4) for _ in range(16)]
    assert all(s == list(range(s[0], s[0] + 4)) for s in seqs)  # fresh pool: contiguous
    for s in seqs[::2]:
        a.free(s)  # 8 holes of 4 pages
    a.free(seqs[5])
    a.free(seqs[7])  # pages 20..23 and 28..31 join holes 16..19 and 24..27: one run 16..31
    got = a.allocate(12)
    assert got == list(range(16, 28))  # first run long enough, not the first free pages
    pieces = a.allocate(6)  # no run of 6 left: longest runs first
    assert len(set(pieces)) == 6 and all(a._ref[p] == 1 for p in pieces)
    one = a.allocate(1)
    assert a._ref[one[0]] == 1
    for p in (got, pieces, one, *[s for i, s in enumerate(seqs) if i % 2 and i not in (5, 7)]):
        a.free(p)
    a.assert_all_free()


def test_allocator_never_hands_out_a_page_twice():
    import random

    rng = random.Random(0)
    a = PageAllocator(97)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and (rng.random() < 0.45 or a.num_free == 0):
            a.free(held.pop(rng.randrange(len(held))))
        else:
            n = min(a.num_free, rng.choice([1, 1, 1, 2, 5, 9]))
            if n:
                held.append(a.allocate(n))
        flat = [p for h in held for p in h]
        assert len(flat) == len(set(flat)) and a.num_free == 97 - len(flat)
    for h in held:
        a.free(h)
    a.assert_all_free()


def test_flat_page_ids_are_each_rows_view_pages():
    """GroupMeta.page_ids_host (what FlashInfer's plan copies in one piece) is, row after row, the
    ceil(kv_len / P) pages each row's view attends over, for full and sliding groups."""
    import random

    cfg = preset("tiny-a")
    spec = plan_kv_cache(cfg, 4 << 20, page_size=4, max_num_seqs=6, dtype=torch.float32)
    kv, rng = KVManager(spec), random.Random(0)
    seqs = [SeqPages() for _ in range(5)]
    starts = [rng.randint(0, 60) for _ in seqs]
    for _ in range(3):
        steps = []
        for i, p in enumerate(seqs):
            q = rng.choice([1, 1, 3, 9])
            kv.grow(p, starts[i] + q)
            steps.append(SeqStep(p, starts[i], q))
        meta = build_step_meta(steps, spec)
        for g in meta.groups:
            if g is None or not g.pages_hold_all:
                continue
            want = [pid for b, n in enumerate(g.kv_lens_host)
                    for pid in g.page_table[b, : -(-n // spec.page_size)].tolist()]
            assert g.page_ids_host.tolist() == want
        starts = [s.start + s.q_len for s in steps]
    for p in seqs:
        kv.release(p)
    kv.assert_all_free()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32])
def test_prefix_copy_pages_moves_every_byte(dtype):
    """KVPool.copy_pages copies bytes: every e4m3 code, NaN codes included, both groups, K and V; other pages
    untouched (it works on a uint8 view: CUDA has no index_copy_ for float8, tests/kernels/test_fp8_kv_gpu.py::
    test_fp8_kv_prefix_copy_pages_on_gpu)."""
    from model.kv_cache import KVCacheSpec
    from tests.support.kv_pages import check_copy_pages

    check_copy_pages(KVCacheSpec(16, 2, 8, dtype, 128, (1, 3), (0, 2), (12, 10)), "cpu")

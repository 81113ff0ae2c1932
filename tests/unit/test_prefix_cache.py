"""Prefix cache pieces without a model: the hash chain, the two-group hit rule, reference counts,
LRU eviction order, the event log, and which pages a transfer ships after a decode-side hit."""

import dataclasses

import pytest
import torch

from common.prefix_hash import (block_hashes, extend_hashes, hit_blocks, identity_root, max_hit_blocks,
                                sliding_first_block)
from model.config import preset
from model.kv_cache import KVManager, PageGroup, SeqPages, plan_kv_cache
from model.prefix_cache import EVICTED_FULL, STORED_FULL, STORED_SLIDING


def test_prefix_hash_chain_names_the_whole_prefix():
    root = identity_root("m/page16/bfloat16")
    a = block_hashes(list(range(40)), 16, root)
    assert len(a) == 2  # the partial last block has no hash
    b = block_hashes([0] + list(range(1, 40)), 16, root)
    assert a == b
    c = block_hashes([1] + list(range(1, 40)), 16, root)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later hash
    assert block_hashes(list(range(40)), 16, identity_root("m/page16/float8")) != a  # layout identity
    grown = extend_hashes(list(a), list(range(64)), 16, root)
    assert grown[:2] == a and len(grown) == 4
    assert all(0 <= h < 2**64 for h in grown)


def test_prefix_hit_rule_needs_both_groups():
    p, w = 16, 128
    assert [sliding_first_block(k, p, w) for k in (1, 8, 9, 20)] == [0, 0, 1, 12]
    assert max_hit_blocks(33, 16) == 2 and max_hit_blocks(32, 16) == 1  # >= 1 token left to compute
    hs = list(range(100, 130))  # 30 blocks
    full = set(hs[:25])
    sliding = set(hs[12:20]) | set(hs[21:25])  # block 20 missing in the sliding group
    k = hit_blocks(hs, 30, full.__contains__, sliding.__contains__, p, w)
    assert k == 20  # 25 fails (needs 17..24, 20 missing), 20 needs 12..19: all there
    assert hit_blocks(hs, 30, full.__contains__, None, p, w) == 25
    assert hit_blocks(hs, 30, None, sliding.__contains__, p, w) == 20
    assert hit_blocks(hs, 30, set().__contains__, sliding.__contains__, p, w) == 0
    assert hit_blocks(hs, 18, full.__contains__, sliding.__contains__, p, w) == 0  # 18 needs 10..17


def _kv(full=40, sliding=30):
    spec = plan_kv_cache(preset("tiny"), 1 << 30, page_size=16, max_num_seqs=2, dtype=torch.float32)
    return KVManager(dataclasses.replace(spec, num_pages=(full, sliding)), "test")


def test_prefix_refcounts_lru_order_and_eviction_before_failure():
    kv = _kv(full=10, sliding=16)
    c = kv.cache
    hashes = block_hashes(list(range(200)), 16, c.root)[:6]
    pages = SeqPages()
    kv.grow(pages, 100)  # 7 full pages, 7 ring pages
    kv.release(pages, (hashes, 100, 0))  # 6 complete blocks cached in both groups
    assert kv.num_cached() == (6, 6) and kv.num_free() == (10, 16)  # evictable counts as free
    assert list(c.full.lru) == [c.full.page_of[h] for h in reversed(hashes)]  # tail first
    hit = c.match(hashes + [12345], 7 * 16 + 1)
    assert hit.num_tokens == 96 and hit.evictable == (6, 6)
    seq = SeqPages()
    kv.map_hit(seq, hit, 100)
    assert seq.full[:6] == hit.full and len(seq.ring) == 7 and len(seq.copy_src) == 6
    assert seq.copy_dst == [seq.ring[j % 9] for j in hit.sliding]
    # the referenced cached pages are off the LRU: filling the pool evicts nothing they hold
    other = SeqPages()
    kv.grow(other, 3 * 16)
    assert kv.num_free() == (0, 0)
    assert all(p in c.full.hash_of for p in hit.full)
    with pytest.raises(AssertionError, match="still reference"):
        kv.alloc[PageGroup.FULL].free_unreferenced(hit.full[0])
    kv.release(other)
    kv.release(seq)
    # now allocation takes evictable pages, tail blocks first
    big = SeqPages()
    kv.grow(big, 16 * 8)
    assert c.full.num_evicted == 4 and hashes[0] in c.full and hashes[5] not in c.full
    kv.release(big)
    kv.assert_all_free()
    kv.clear_cache()
    for a in kv.alloc:
        a.assert_all_free()


def test_prefix_ring_registers_only_valid_unoverwritten_blocks():
    kv = _kv()
    c = kv.cache
    hashes = block_hashes(list(range(400)), 16, c.root)
    pages = SeqPages()
    kv.grow(pages, 300)  # ring of 9 holds blocks 10..18 (block 18 partial: 300 = 18*16 + 12)
    kv.release(pages, (hashes[:18], 300, 0))
    assert len(c.full) == 18
    assert len(c.sliding) == 8
    assert all(hashes[j] in c.sliding for j in range(10, 18))
    # a ring whose chunk stored only its tail holds nothing valid below ring_valid_from
    kv2 = _kv()
    p2 = SeqPages()
    kv2.grow(p2, 300)
    kv2.release(p2, (block_hashes(list(range(300)), 16, kv2.cache.root), 300, 15 * 16 + 1))
    assert len(kv2.cache.sliding) == 2  # blocks 16, 17


def test_prefix_event_log_and_snapshot_reset():
    kv = _kv()
    c = kv.cache
    hashes = block_hashes(list(range(100)), 16, c.root)
    pages = SeqPages()
    kv.grow(pages, 100)
    kv.release(pages, (hashes, 100, 0))
    reset, cur, flat = c.events_since(0)
    assert not reset and cur == c.events.next_seq
    events = list(zip(flat[::2], flat[1::2]))
    assert [h for k, h in events if k == STORED_FULL] == hashes
    assert {h for k, h in events if k == STORED_SLIDING} == set(hashes)
    kv.clear_cache()
    reset, cur2, flat = c.events_since(cur)
    assert not reset and {h for k, h in zip(flat[::2], flat[1::2]) if k == EVICTED_FULL} == set(hashes)
    reset, cur3, flat = c.events_since(cur2 + 5)  # a cursor the log never issued: snapshot
    assert reset and flat == [] and cur3 == cur2


def test_prefix_transfer_ships_only_pages_after_the_decode_hit():
    from kv_transfer.plan import logical_pages
    from common.errors import ProtocolError

    f, s = PageGroup.FULL, PageGroup.SLIDING
    assert logical_pages(f, 300, 16, 128, 0) == range(0, 19)
    assert logical_pages(f, 300, 16, 128, 256) == range(16, 19)
    assert logical_pages(s, 300, 16, 128, 0) == range(10, 19)
    assert logical_pages(s, 300, 16, 128, 256) == range(16, 19)  # 10..15 decode copies from its cache
    assert logical_pages(s, 300, 16, 128, 64) == range(10, 19)
    with pytest.raises(ProtocolError):
        logical_pages(f, 300, 16, 128, 250)  # not a page boundary

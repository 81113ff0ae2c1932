"""The reference attention in blocks of query rows (kernels/reference.py DENSE_SCORES): a long
prompt's sequence is attended block by block against only the keys each block can see. It must give
what one dense pass gives (same formula per row; only the fp32 summation order may differ)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref


def _case(seed: int, tq: int, tk: int, hq: int, hkv: int, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, hq, d, generator=g)
    k = torch.randn(tk, hkv, d, generator=g)
    v = torch.randn(tk, hkv, d, generator=g)
    sinks = torch.randn(hq, generator=g)
    return q, k, v, sinks


@pytest.mark.parametrize("window", [None, 8, 37])
@pytest.mark.parametrize("tq,tk", [(300, 300), (97, 411), (1, 500), (256, 256)])
def test_blocks_equal_one_dense_pass(monkeypatch, window, tq, tk):
    q, k, v, sinks = _case(tq * 7 + tk, tq, tk, hq=4, hkv=2)
    q_pos = torch.arange(tk - tq, tk)
    k_pos = torch.arange(tk)
    dense = ref._attend_dense(q, k, v, q_pos, k_pos, sinks, 0.25, window)
    monkeypatch.setattr(ref, "DENSE_SCORES", 4 * 16 * 40)  # blocks of a few rows
    blocks = ref._attend_one(q, k, v, q_pos, k_pos, sinks, 0.25, window)
    torch.testing.assert_close(blocks, dense, rtol=1e-5, atol=1e-6)


def test_blocks_through_varlen_and_paged(monkeypatch):
    """Both callers (several sequences, a cached prefix in pages) give the dense results in blocks."""
    torch.manual_seed(0)
    hq, hkv, d, page = 4, 2, 16, 8
    lens_q, lens_k = [50, 1, 120], [90, 64, 120]
    q = torch.randn(sum(lens_q), hq, d)
    k = torch.randn(sum(lens_k), hkv, d)
    v = torch.randn(sum(lens_k), hkv, d)
    sinks = torch.randn(hq)
    cq = torch.tensor([0, 50, 51, 171], dtype=torch.int32)
    ck = torch.tensor([0, 90, 154, 274], dtype=torch.int32)
    for window in (None, 16):
        want = ref.varlen_attention(q, k, v, cq, ck, sinks, 0.3, window)
        pages = -(-max(lens_k) // page)
        k_cache = torch.zeros(3 * pages, hkv, page, d)
        v_cache = torch.zeros_like(k_cache)
        table = torch.arange(3 * pages, dtype=torch.int32).view(3, pages).flip(1).contiguous()  # not in order
        slots = torch.cat([table[b].repeat_interleave(page)[:n].long() * page + torch.arange(n) % page
                           for b, n in enumerate(lens_k)])
        ref.store_kv(k, v, k_cache, v_cache, slots)
        want_paged = ref.paged_attention(q, k_cache, v_cache, table, cq, torch.tensor(lens_k), sinks, 0.3, window)
        with monkeypatch.context() as mp:
            mp.setattr(ref, "DENSE_SCORES", 4 * 16 * 30)
            got = ref.varlen_attention(q, k, v, cq, ck, sinks, 0.3, window)
            got_paged = ref.paged_attention(q, k_cache, v_cache, table, cq, torch.tensor(lens_k), sinks, 0.3, window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_paged, want_paged, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(want_paged, want, rtol=1e-5, atol=1e-6)


def test_block_rows_bound_the_scores():
    for hq, tq, tk, window in ((4, 30000, 30000, None), (4, 30000, 30000, 128), (64, 8192, 8192, 128),
                               (64, 100000, 100000, None)):
        rows = ref._block_rows(hq, tq, tk, window)
        keys = tk if window is None else min(tk, rows + window)
        assert rows >= 16
        assert hq * rows * keys <= max(ref.DENSE_SCORES, hq * 16 * keys)  # the 16-row floor may pass it

"""Triton attention and store-KV kernels vs kernels/reference.py, in the Triton CPU interpreter.

Tiny shapes, fp32 (and fp16 where the interpreter is exact: its bf16 arithmetic is not), random
scattered pages, windows smaller and larger than the sequences, GQA groups 1/2/8, sinks large and
small, q_len 1 and > 1, prefix-in-pages + new-tokens-dense, split-KV with several splits.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import reference as ref  # noqa: E402
from kernels.triton_attention import AttnBatch, KernelConfig, pick_num_splits, sink_attention  # noqa: E402
from kernels.triton_store_kv import apply_rope, rope_store_kv, store_kv  # noqa: E402

ATOL = {torch.float32: 2e-5, torch.float16: 3e-3}


class Case:
    """A random batch: new tokens q/k/v [T, H, D], prefixes (or everything) in scattered pages."""

    def __init__(self, q_lens, prefix_lens, hq, hkv, d=16, page=4, dtype=torch.float32, sink_scale=2.0, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.q_lens, self.prefix_lens = list(q_lens), list(prefix_lens)
        self.kv_lens = [a + b for a, b in zip(q_lens, prefix_lens)]
        t = sum(q_lens)
        self.q = torch.randn(t, hq, d, generator=g).to(dtype)
        self.k = torch.randn(t, hkv, d, generator=g).to(dtype)
        self.v = torch.randn(t, hkv, d, generator=g).to(dtype)
        self.sinks = torch.randn(hq, generator=g) * sink_scale
        need = [-(-n // page) for n in self.kv_lens]
        num_pages = sum(need) + 3
        self.k_cache = torch.randn(num_pages, hkv, page, d, generator=g).to(dtype)
        self.v_cache = torch.randn(num_pages, hkv, page, d, generator=g).to(dtype)
        perm = torch.randperm(num_pages, generator=g)
        self.page_table = torch.zeros(len(q_lens), max(need + [1]), dtype=torch.int32)
        used = 0
        for b, n in enumerate(need):
            self.page_table[b, :n] = perm[used:used + n]
            used += n
        self.cu = torch.tensor([0] + torch.tensor(self.q_lens).cumsum(0).tolist(), dtype=torch.int32)

    def ref_all_paged(self, sm_scale, window):
        return ref.paged_attention(self.q.float(), self.k_cache.float(), self.v_cache.float(), self.page_table,
                                   self.cu, torch.tensor(self.kv_lens), self.sinks, sm_scale, window)

    def ref_prefix_dense(self, sm_scale, window):
        ks, vs, cuk = [], [], [0]
        for b, pre in enumerate(self.prefix_lens):
            lo, hi = self.cu[b].item(), self.cu[b + 1].item()
            ks += [ref.gather_pages(self.k_cache, self.page_table[b], pre), self.k[lo:hi]]
            vs += [ref.gather_pages(self.v_cache, self.page_table[b], pre), self.v[lo:hi]]
            cuk.append(cuk[-1] + self.kv_lens[b])
        return ref.varlen_attention(self.q.float(), torch.cat(ks).float(), torch.cat(vs).float(), self.cu,
                                    torch.tensor(cuk, dtype=torch.int32), self.sinks, sm_scale, window)

    def run(self, mode, sm_scale, window, **kw):
        if mode == "dense":
            batch = AttnBatch.build(self.q_lens, [0] * len(self.q_lens), self.q_lens, None, "cpu")
            return sink_attention(self.q, self.k, self.v, None, batch, self.sinks, sm_scale, window, **kw)
        paged = self.kv_lens if mode == "all" else self.prefix_lens
        batch = AttnBatch.build(self.q_lens, paged, self.kv_lens, self.page_table, "cpu")
        return sink_attention(self.q, self.k, self.v, (self.k_cache, self.v_cache), batch, self.sinks, sm_scale,
                              window, **kw)


def check(out, expected, dtype):
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=1e-3)


@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("window", [None, 3, 1000])
def test_dense_varlen(group, window):
    c = Case([1, 7, 19], [0, 0, 0], hq=2 * group, hkv=2, seed=group)
    cu = c.cu
    expected = ref.varlen_attention(c.q, c.k, c.v, cu, cu, c.sinks, 0.3, window)
    check(c.run("dense", 0.3, window), expected, torch.float32)


@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("window", [None, 3, 1000])
def test_paged_mixed_batch(group, window):
    """Everything in pages (decode and full layers): q_len 1 and > 1 in one batch."""
    c = Case([1, 6, 1, 13], [20, 0, 5, 9], hq=2 * group, hkv=2, seed=10 + group)
    check(c.run("all", 0.25, window), c.ref_all_paged(0.25, window), torch.float32)


@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("window", [None, 5])
def test_prefix_from_pages_plus_dense_new(group, window):
    """Sliding-layer chunks: the cached prefix from pages, the chunk's own K/V dense."""
    c = Case([9, 1, 14], [6, 11, 0], hq=2 * group, hkv=2, seed=20 + group)
    check(c.run("prefix", 0.25, window), c.ref_prefix_dense(0.25, window), torch.float32)


@pytest.mark.parametrize("sink_scale", [0.01, 30.0])
def test_sinks_small_and_large(sink_scale):
    """A sink of +-30 either takes all the mass (output ~0) or none of it."""
    c = Case([3, 1, 8], [10, 30, 2], hq=8, hkv=2, sink_scale=sink_scale, seed=3)
    check(c.run("all", 0.25, 6), c.ref_all_paged(0.25, 6), torch.float32)
    check(c.run("all", 0.25, None), c.ref_all_paged(0.25, None), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 9])
@pytest.mark.parametrize("window", [None, 7])
def test_split_kv_decode(num_splits, window):
    """Batched decode with the KV range split across programs and merged; 9 splits leave some of
    them empty for the short sequences (only split 0 carries the sink)."""
    c = Case([1] * 5, [0, 16, 39, 62, 1], hq=16, hkv=2, seed=num_splits)
    check(c.run("all", 0.125, window, num_splits=num_splits), c.ref_all_paged(0.125, window), torch.float32)


@pytest.mark.parametrize("num_splits", [3])
def test_split_kv_prefill_with_prefix(num_splits):
    c = Case([5, 12], [30, 4], hq=8, hkv=2, seed=7)
    check(c.run("prefix", 0.25, None, num_splits=num_splits), c.ref_prefix_dense(0.25, None), torch.float32)
    check(c.run("all", 0.25, 9, num_splits=num_splits), c.ref_all_paged(0.25, 9), torch.float32)


@pytest.mark.parametrize("cfg", [KernelConfig(16, 16, 1), KernelConfig(32, 16, 2), KernelConfig(64, 32, 8),
                                 KernelConfig(16, 32, 8)])
def test_launch_configs(cfg):
    """Tile shapes move the masked / unmasked block boundaries; all must agree."""
    c = Case([1, 17, 4], [23, 0, 12], hq=16, hkv=2, seed=5)
    for window in (None, 6):
        check(c.run("all", 0.2, window, config=cfg), c.ref_all_paged(0.2, window), torch.float32)
        check(c.run("prefix", 0.2, window, config=cfg), c.ref_prefix_dense(0.2, window), torch.float32)


def test_window_of_one_attends_to_self_only():
    c = Case([4, 1], [3, 6], hq=4, hkv=2, seed=11)
    check(c.run("all", 0.5, 1), c.ref_all_paged(0.5, 1), torch.float32)


def test_fp16_paged_and_dense():
    c = Case([1, 9, 3], [12, 5, 0], hq=16, hkv=2, d=32, page=8, dtype=torch.float16, seed=2)
    check(c.run("all", 0.18, None), c.ref_all_paged(0.18, None), torch.float16)
    check(c.run("prefix", 0.18, 4), c.ref_prefix_dense(0.18, 4), torch.float16)


def test_non_contiguous_qkv_views():
    """The model slices q/k/v out of one fused projection: row strides differ from H * D."""
    c = Case([6, 1], [0, 9], hq=8, hkv=2, seed=4)
    t, d = c.q.shape[0], c.q.shape[2]
    fused = torch.cat([c.q.reshape(t, -1), c.k.reshape(t, -1), c.v.reshape(t, -1)], dim=1)
    q = fused[:, :8 * d].view(t, 8, d)
    k = fused[:, 8 * d:10 * d].view(t, 2, d)
    v = fused[:, 10 * d:].view(t, 2, d)
    batch = AttnBatch.build(c.q_lens, c.prefix_lens, c.kv_lens, c.page_table, "cpu")
    out = sink_attention(q, k, v, (c.k_cache, c.v_cache), batch, c.sinks, 0.3, 4)
    check(out, c.ref_prefix_dense(0.3, 4), torch.float32)


def test_pick_num_splits():
    batch = AttnBatch.build([1] * 2, [8192, 100], [8192, 100], None, "cpu")
    cfg = KernelConfig(16, 64, 8)
    assert pick_num_splits(batch, 1000, None, cfg, target_programs=264) == 1
    assert pick_num_splits(batch, 16, None, cfg, target_programs=264) == 17
    assert pick_num_splits(batch, 16, 128, cfg, target_programs=264) == 1  # a 128-key band: 2 blocks


# ---- store-KV ---------------------------------------------------------------------------------------
def _store_case(dtype, t=13, h=3, d=16, page=4, num_pages=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, h, d, generator=g).to(dtype)
    v = torch.randn(t, h, d, generator=g).to(dtype)
    slots = torch.randperm(num_pages * page, generator=g)[:t].long()
    slots[[2, 7]] = -1
    kc = torch.randn(num_pages, h, page, d, generator=g).to(dtype)
    vc = torch.randn(num_pages, h, page, d, generator=g).to(dtype)
    ang = torch.randn(t, d // 2, generator=g) * 3
    return k, v, slots, kc, vc, ang.cos() * 1.35, ang.sin() * 1.35


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_exact(dtype):
    k, v, slots, kc, vc, _, _ = _store_case(dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    store_kv(k, v, kc, vc, slots)
    ref.store_kv(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_store_kv_exact(dtype):
    k, v, slots, kc, vc, cos, sin = _store_case(dtype, seed=1)
    kc2, vc2 = kc.clone(), vc.clone()
    k_rot = rope_store_kv(k, v, kc, vc, slots, cos, sin)
    expected = ref.apply_rope(k, cos, sin)
    ref.store_kv(expected, v, kc2, vc2, slots)
    assert torch.equal(k_rot, expected) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_on_q_exact_and_in_place(dtype):
    _, _, _, _, _, cos, sin = _store_case(dtype, seed=2)
    q = torch.randn(13, 8, 16).to(dtype)
    expected = ref.apply_rope(q, cos, sin)
    assert torch.equal(apply_rope(q, cos, sin), expected)
    fused = torch.randn(13, 8 * 16 + 40).to(dtype)  # a strided view, rotated in place
    view = fused[:, :128].view(13, 8, 16)
    view.copy_(q)
    apply_rope(view, cos, sin, out=view)
    assert torch.equal(view, expected)


def test_store_kv_into_strided_pool_view():
    """Caches are views of one pool [L, 2, NP, Hkv, P, D]; other layers must stay untouched."""
    pool = torch.randn(2, 2, 6, 2, 4, 16)
    before = pool.clone()
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([3, 9, -1, 22, 0])
    store_kv(k, v, pool[1, 0], pool[1, 1], slots)
    ref.store_kv(k, v, before[1, 0], before[1, 1], slots)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("splits", [2, 5, 64, 70])
def test_merge_splits_matches_torch(splits):
    """merge_splits against the log-sum-exp combination in torch: more splits than one block (70),
    empty splits (m = -inf, as a split past a sequence's keys leaves them) after split 0."""
    from kernels.attention_splits import merge_splits  # noqa: PLC0415

    g = torch.Generator().manual_seed(splits)
    t, hq, d = 3, 8, 16
    acc = torch.randn(splits, t, hq, d, generator=g)
    m = torch.randn(splits, t, hq, generator=g) * 4
    den = torch.rand(splits, t, hq, generator=g) + 0.5
    if splits > 2:
        m[splits // 2:, 1] = float("-inf")  # token 1: the later splits are empty
        den[splits // 2:, 1] = 0.0
        acc[splits // 2:, 1] = 0.0
    out = torch.empty(t, hq, d)
    merge_splits(acc, m, den, out)
    m_tot = m.max(0).values
    w = torch.exp2(m - m_tot)  # [S, T, Hq]
    want = (w[..., None] * acc).sum(0) / (w * den).sum(0)[..., None]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)

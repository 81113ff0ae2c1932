"""The Triton decode kernel (kernels/triton_decode.py) against kernels/reference.py, in the Triton CPU
interpreter (tiny shapes): e4m3 pages under per-head scales (and 16-bit / fp32 pages), sinks,
sliding windows, split-KV with empty splits, ragged context lengths (1 key, page boundaries),
scattered page tables, GQA groups that are not powers of two, blocks of several pages and blocks
inside one page; the f16 MMA path of 16-bit queries (bf16 q past f16's range scaled first); and
which steps `TritonAttention` sends to it.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.selftest import SelfTestShape, self_test_attention  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.triton_attention import AttnBatch  # noqa: E402
from kernels.triton_attention_backend import DecodeKernel, TritonAttention  # noqa: E402
from kernels.triton_decode import (  # noqa: E402
    ONE_SEQ_BF16_DECODE, DecodeConfig, decode_splits, layer_config, paged_decode)
from model.kv_cache import PageGroup  # noqa: E402
from tests.kernels.test_fp8_kv import Fp8Case  # noqa: E402
from tests.kernels.test_triton_attention import Case  # noqa: E402

FP8 = torch.float8_e4m3fn
# Context lengths (prefix + the token itself): 1 key, a page boundary each side, several blocks.
PREFIX = [0, 3, 4, 16, 37, 60]


def _decode(c, sm_scale, window, *, block_n=16, num_splits=None, kv=None, kv_scale=None):
    batch = AttnBatch.build(c.q_lens, c.kv_lens, c.kv_lens, c.page_table, "cpu")
    return paged_decode(c.q, kv or (c.k_cache, c.v_cache), batch, c.sinks, sm_scale, window, kv_scale=kv_scale,
                        config=DecodeConfig(block_n=block_n), num_splits=num_splits)


def _close(out, want, atol=2e-5, rtol=1e-3):
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_kv_decode_matches_reference(group, window, num_splits):
    c = Fp8Case([1] * len(PREFIX), PREFIX, hq=2 * group, hkv=2, seed=group + 10 * num_splits)
    _close(_decode(c, 0.3, window, num_splits=num_splits, kv_scale=c.kv_scale), c.ref_all_paged(0.3, window))


@pytest.mark.parametrize("page,block_n", [(4, 4), (4, 32), (16, 8), (8, 16)])
def test_fp8_kv_decode_block_shapes(page, block_n):
    """Blocks of one page, of 8 pages, and blocks inside a page (two per page of 16); windows that
    start mid-page and a split count leaving later splits empty for the short sequences."""
    c = Fp8Case([1] * len(PREFIX), PREFIX, hq=8, hkv=2, page=page, seed=page + block_n)
    for window, splits in ((None, 1), (7, 1), (None, 4), (9, 5)):
        _close(_decode(c, 0.25, window, block_n=block_n, num_splits=splits, kv_scale=c.kv_scale),
               c.ref_all_paged(0.25, window))


def test_fp8_kv_decode_scales_sinks_and_unit_scales():
    """Per-head K/V scales (swapping them changes the output), large sinks (all the mass or none),
    and e4m3 pages without scales (1.0)."""
    c = Fp8Case([1] * 4, [9, 30, 2, 17], hq=8, hkv=2, sink_scale=30.0, seed=3)
    out = _decode(c, 0.25, None, kv_scale=c.kv_scale)
    _close(out, c.ref_all_paged(0.25, None))
    swapped = (c.k_scale.flip(0).contiguous(), c.v_scale.flip(0).contiguous())
    assert (_decode(c, 0.25, None, kv_scale=swapped) - out).abs().max() > 1e-3
    want = ref.paged_attention(c.q.float(), c.k_cache, c.v_cache, c.page_table, c.cu, torch.tensor(c.kv_lens),
                               c.sinks, 0.25, 4, None)
    _close(_decode(c, 0.25, 4), want)


def test_fp8_kv_decode_f16_mma_path():
    """16-bit queries over e4m3 pages: f16 MMAs on the exact codes (the interpreter's f16 is exact)."""
    c = Fp8Case([1] * 5, [12, 5, 0, 33, 8], hq=16, hkv=2, d=32, page=8, dtype=torch.float16, seed=2)
    for window, splits in ((None, 1), (6, 2)):
        _close(_decode(c, 0.18, window, num_splits=splits, kv_scale=c.kv_scale), c.ref_all_paged(0.18, window),
               atol=3e-3)


def test_fp8_kv_decode_bf16_queries_past_f16_range():
    """bf16 q into f16: a row with |q| ~ 2^17 would be inf in f16; the kernel scales the row by a
    power of two and the logits back, so it matches the fp32 reference (bf16 output tolerance)."""
    c = Fp8Case([1] * 3, [20, 7, 41], hq=8, hkv=2, dtype=torch.bfloat16, seed=5)
    c.q = (c.q.float() * 2.0 ** 17).to(torch.bfloat16)
    c.q[1] = c.q[1] * 2.0 ** -17  # only some programs need the scaling
    sm = 0.25 * 2.0 ** -17
    _close(_decode(c, sm, None, kv_scale=c.kv_scale), c.ref_all_paged(sm, None), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("pages", ["fp32", "bf16", "f16"])
def test_fp8_kv_decode_reads_wider_pages_too(pages):
    """The same kernel on 16-bit and fp32 pages (DecodeKernel.ALL): halves are dims [0, D/2) and
    [D/2, D); bf16 pages under fp32 queries are widened exactly."""
    dtype = torch.float16 if pages == "f16" else torch.float32
    c = Case([1] * len(PREFIX), PREFIX, hq=8, hkv=2, dtype=dtype, seed=7)
    kv = (c.k_cache, c.v_cache) if pages != "bf16" else (c.k_cache.to(torch.bfloat16), c.v_cache.to(torch.bfloat16))
    want = ref.paged_attention(c.q.float(), kv[0].float(), kv[1].float(), c.page_table, c.cu,
                               torch.tensor(c.kv_lens), c.sinks, 0.3, 6)
    _close(_decode(c, 0.3, 6, num_splits=2, kv=kv), want, atol=3e-3 if dtype == torch.float16 else 2e-5)


def test_fp8_kv_decode_splits_follow_the_grid():
    """Splits only when the grid leaves SMs short of programs, >= 2 blocks each, and from the host
    kv_lens (the capacity under CUDA graphs, so a graph's grid never changes)."""
    cfg = DecodeConfig(block_n=64, programs_per_sm=6)
    big = AttnBatch([], None, [1] * 128, [8192] * 128)
    small = AttnBatch([], None, [1] * 8, [8192] * 8)
    assert decode_splits(big, 8, None, cfg, 132) == 1  # 1024 programs >= 792
    assert decode_splits(small, 8, None, cfg, 132) == 13  # 64 programs -> 13 splits
    assert decode_splits(small, 8, 128, cfg, 132) == 1  # a window of 2 blocks: one split
    assert decode_splits(AttnBatch([], None, [1] * 8, [300] * 8), 8, None, cfg, 132) == 2
    # One sequence on bf16 pages: 32-key blocks split a full layer 64 ways; a sliding layer keeps its 64-key
    # blocks (window_block_n), so its 128-key window is one split and no merge launch (b1-probes-1: 4.13 us)
    one = AttnBatch([], None, [1], [8192])
    assert decode_splits(one, 8, None, layer_config(ONE_SEQ_BF16_DECODE, None), 132) == 64
    win = layer_config(ONE_SEQ_BF16_DECODE, 128)
    assert win.block_n == 64 and win.num_stages == 3 and decode_splits(one, 8, 128, win, 132) == 1
    assert layer_config(cfg, 128) is cfg  # no window_block_n: every layer alike


def test_fp8_kv_decode_kernel_policy(monkeypatch):
    """TritonAttention: pure-decode steps over e4m3 pages go to the decode kernel (FP8, the default),
    every pure-decode step with ALL, none with OFF; prefill and mixed steps never. Under CUDA-graph
    tables the results still match the reference (the engine's self-test)."""
    import kernels.triton_attention_backend as tab
    calls = []
    real = tab.paged_decode
    monkeypatch.setattr(tab, "paged_decode", lambda q, kv, batch, *a, **kw: calls.append(
        (kv[0].dtype, batch.max_q_len)) or real(q, kv, batch, *a, **kw))
    small = SelfTestShape(num_q_heads=8, num_kv_heads=2, head_dim=16, window=8, page_size=4)
    for mode, kv_dtype, expect in ((DecodeKernel.FP8, FP8, True), (DecodeKernel.FP8, None, False),
                                   (DecodeKernel.ALL, None, True), (DecodeKernel.OFF, FP8, False)):
        calls.clear()
        impl = TritonAttention(decode=mode)
        impl.enable_cuda_graphs([3], max_pages_per_seq=32)
        self_test_attention(impl, "cpu", torch.float32, shape=small, kv_dtype=kv_dtype)
        assert bool(calls) == expect, (mode, kv_dtype)
        assert all(n == 1 for _, n in calls)  # only pure-decode steps
        if expect:
            assert sorted(impl._graph) == [(3, PageGroup.FULL, 32), (3, PageGroup.SLIDING, 32)]

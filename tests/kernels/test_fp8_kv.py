"""FP8 (e4m3) KV pages with per-head scales: the store kernel's bits and the Triton attention's
output against kernels/reference.py, in the Triton CPU interpreter (tiny shapes).

The reference is the ground truth for FP8 KV: `quantize_kv` on store, `dequantize_kv` (fp32) on
read. The Triton store must write the same bytes; the attention, which widens e4m3 tiles in
registers and folds the scales into QK and PV, must match the reference read of the same pages.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.selftest import SelfTestShape, self_test_attention  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.torch_backend import TorchAttention  # noqa: E402
from kernels.triton_attention import AttnBatch, sink_attention  # noqa: E402
from kernels.triton_attention_backend import TritonAttention  # noqa: E402
from kernels.triton_store_kv import rope_store_kv, store_kv  # noqa: E402
from tests.kernels.test_triton_attention import Case, _store_case  # noqa: E402

FP8 = torch.float8_e4m3fn
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _scales(h: int, seed: int, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if pow2:
        return (torch.exp2(torch.randint(-3, 4, (h,), generator=g).float()),
                torch.exp2(torch.randint(-6, 1, (h,), generator=g).float()))
    return torch.rand(h, generator=g) * 2 + 0.05, torch.rand(h, generator=g) * 0.1 + 0.003


class Fp8Case(Case):
    """Case with its caches quantised to e4m3 under per-head scales (values spread over the range)."""

    def __init__(self, *a, pow2=False, **kw):
        super().__init__(*a, **kw)
        hkv = self.k.shape[1]
        self.k_scale, self.v_scale = _scales(hkv, kw.get("seed", 0) + 100, pow2)
        self.k_cache = self._quant(self.k_cache.float() * 40, self.k_scale)
        self.v_cache = self._quant(self.v_cache.float() * 0.5, self.v_scale)
        self.k = (self.k.float() * 40).to(self.k.dtype)
        self.v = (self.v.float() * 0.5).to(self.v.dtype)

    @staticmethod
    def _quant(cache, scale):  # [NP, H, P, D] -> e4m3 per head
        return ref.quantize_kv(cache.permute(0, 2, 1, 3).reshape(-1, *cache.shape[1::2]), scale).reshape(
            cache.shape[0], cache.shape[2], cache.shape[1], cache.shape[3]).permute(0, 2, 1, 3).contiguous()

    @property
    def kv_scale(self):
        return self.k_scale, self.v_scale

    def ref_all_paged(self, sm_scale, window):
        return ref.paged_attention(self.q.float(), self.k_cache, self.v_cache, self.page_table, self.cu,
                                   torch.tensor(self.kv_lens), self.sinks, sm_scale, window, self.kv_scale)

    def ref_prefix_dense(self, sm_scale, window):
        ks, vs, cuk = [], [], [0]
        for b, pre in enumerate(self.prefix_lens):
            lo, hi = self.cu[b].item(), self.cu[b + 1].item()
            ks += [ref.gather_pages(self.k_cache, self.page_table[b], pre, self.k_scale), self.k[lo:hi].float()]
            vs += [ref.gather_pages(self.v_cache, self.page_table[b], pre, self.v_scale), self.v[lo:hi].float()]
            cuk.append(cuk[-1] + self.kv_lens[b])
        return ref.varlen_attention(self.q.float(), torch.cat(ks), torch.cat(vs), self.cu,
                                    torch.tensor(cuk, dtype=torch.int32), self.sinks, sm_scale, window)

    def run(self, mode, sm_scale, window, **kw):
        return super().run(mode, sm_scale, window, kv_scale=self.kv_scale, **kw)


def check(out, expected, dtype):
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=1e-3)


# ---- store ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_kv_store_writes_the_reference_bits(dtype, pow2):
    """Saturation (|x| / scale > 448), subnormals, ties: the bytes of ref.quantize_kv."""
    k, v, slots, _, _, _, _ = _store_case(dtype)
    k = (k.float() * 300).to(dtype)  # some beyond 448 * scale: saturate
    v = (v.float() * 0.002).to(dtype)  # some below 2^-6 * scale: subnormal codes
    ks, vs = _scales(k.shape[1], 1, pow2)
    kc = torch.zeros(10, 3, 4, 16, dtype=FP8)
    vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
    store_kv(k, v, kc, vc, slots, (ks, vs))
    ref.store_kv(k, v, kc2, vc2, slots, (ks, vs))
    assert torch.equal(_bits(kc), _bits(kc2)) and torch.equal(_bits(vc), _bits(vc2))
    assert (kc.float().abs() == 448).any() and ((vc.float().abs() < 2 ** -6) & (vc.float() != 0)).any()
    store_kv(k, v, kc, vc, slots)  # no scales = 1.0
    ref.store_kv(k, v, kc2, vc2, slots)
    assert torch.equal(_bits(kc), _bits(kc2)) and torch.equal(_bits(vc), _bits(vc2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_kv_rope_store_quantises_k_after_rope(dtype):
    k, v, slots, _, _, cos, sin = _store_case(dtype, seed=3)
    ks, vs = _scales(k.shape[1], 2, False)
    kc = torch.zeros(10, 3, 4, 16, dtype=FP8)
    vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
    k_rot = rope_store_kv(k, v, kc, vc, slots, cos, sin, (ks, vs))
    expected = ref.apply_rope(k, cos, sin)
    ref.store_kv(expected, v, kc2, vc2, slots, (ks, vs))
    assert torch.equal(k_rot, expected)
    assert torch.equal(_bits(kc), _bits(kc2)) and torch.equal(_bits(vc), _bits(vc2))


def test_fp8_kv_round_trip_error_is_e4m3s():
    """Within the normal range the round trip is off by at most half an e4m3 ulp (2^-4 relative)."""
    x = torch.randn(64, 4, 32) * 10
    s = torch.tensor([0.25, 1.0, 0.03125, 4.0])
    back = ref.dequantize_kv(ref.quantize_kv(x, s), s)
    normal = (x.abs() >= 2 ** -6 * s[None, :, None]) & (x.abs() <= 448 * s[None, :, None])
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2 ** -4 + 1e-7 and normal.float().mean() > 0.9


# ---- attention -------------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_kv_paged_attention(group, window, pow2):
    """Everything in e4m3 pages (decode and full layers), q_len 1 and > 1 in one batch."""
    c = Fp8Case([1, 6, 1, 13], [20, 0, 5, 9], hq=2 * group, hkv=2, seed=30 + group, pow2=pow2)
    check(c.run("all", 0.25, window), c.ref_all_paged(0.25, window), torch.float32)


@pytest.mark.parametrize("window", [None, 5])
def test_fp8_kv_prefix_from_pages_plus_dense_new(window):
    """Sliding chunks: the prefix from e4m3 pages, the chunk's own K/V dense and unquantised."""
    c = Fp8Case([9, 1, 14], [6, 11, 0], hq=8, hkv=2, seed=40)
    check(c.run("prefix", 0.25, window), c.ref_prefix_dense(0.25, window), torch.float32)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_fp8_kv_split_kv_decode(num_splits):
    c = Fp8Case([1] * 5, [0, 16, 39, 62, 1], hq=16, hkv=2, seed=num_splits)
    check(c.run("all", 0.125, None, num_splits=num_splits), c.ref_all_paged(0.125, None), torch.float32)
    check(c.run("all", 0.125, 7, num_splits=num_splits), c.ref_all_paged(0.125, 7), torch.float32)


def test_fp8_kv_fp16_queries():
    """e4m3 tiles widened to fp16 for an fp16 dot (the interpreter's fp16 is exact; bf16 is not)."""
    c = Fp8Case([1, 9, 3], [12, 5, 0], hq=16, hkv=2, d=32, page=8, dtype=torch.float16, seed=2)
    check(c.run("all", 0.18, None), c.ref_all_paged(0.18, None), torch.float16)
    check(c.run("prefix", 0.18, 4), c.ref_prefix_dense(0.18, 4), torch.float16)


def test_fp8_kv_scales_are_per_head():
    """Swapping the two heads' scales must change the output (a kernel using head 0's scale for
    every head would pass the uniform-scale tests)."""
    c = Fp8Case([1, 4], [10, 3], hq=4, hkv=2, seed=8)
    batch = AttnBatch.build(c.q_lens, c.kv_lens, c.kv_lens, c.page_table, "cpu")
    out = sink_attention(c.q, c.k, c.v, (c.k_cache, c.v_cache), batch, c.sinks, 0.25, None, kv_scale=c.kv_scale)
    swapped = (c.k_scale.flip(0).contiguous(), c.v_scale.flip(0).contiguous())
    out2 = sink_attention(c.q, c.k, c.v, (c.k_cache, c.v_cache), batch, c.sinks, 0.25, None, kv_scale=swapped)
    check(out, c.ref_all_paged(0.25, None), torch.float32)
    assert (out - out2).abs().max() > 1e-3


def test_fp8_kv_bf16_pages_under_fp32_queries():
    """--kv-cache-dtype bf16 on an fp32 model: pages widened, no scales."""
    c = Case([1, 5], [9, 2], hq=4, hkv=2, seed=12)
    kc, vc = c.k_cache.to(torch.bfloat16), c.v_cache.to(torch.bfloat16)
    batch = AttnBatch.build(c.q_lens, c.kv_lens, c.kv_lens, c.page_table, "cpu")
    out = sink_attention(c.q, c.k, c.v, (kc, vc), batch, c.sinks, 0.3, None)
    want = ref.paged_attention(c.q, kc, vc, c.page_table, c.cu, torch.tensor(c.kv_lens), c.sinks, 0.3, None)
    check(out, want, torch.float32)


# ---- the backends on real StepMetas (store, then read; prefix + dense; ring wrap) ------------------------
SMALL = SelfTestShape(num_q_heads=8, num_kv_heads=2, head_dim=16, window=8, page_size=4)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_fp8_kv_backend_self_test(impl):
    """The start-up self-test with e4m3 pages: the backend's caches bit-equal to the reference's
    stores and its outputs within tolerance of the fp32 reference reading the same pages."""
    backend = TritonAttention() if impl == "triton" else TorchAttention()
    self_test_attention(backend, "cpu", torch.float32, shape=SMALL, kv_dtype=FP8)
    self_test_attention(backend, "cpu", torch.float16, shape=SelfTestShape(16, 2, 32, 16, 8), kv_dtype=FP8, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_kv_gather_dequantises_like_the_reference(dtype):
    """gather_kv (FlashInfer's dense paths read FP8 pages through it): reference bits."""
    from kernels.triton_store_kv import gather_kv

    c = Fp8Case([1, 4], [10, 3], hq=4, hkv=2, seed=9)
    slots = torch.tensor([0, 5, 17, 3, 3, 30], dtype=torch.int64)
    k, v = gather_kv(c.k_cache, c.v_cache, slots, c.kv_scale, dtype)
    p = c.k_cache.shape[2]
    want_k = ref.dequantize_kv(c.k_cache[slots // p, :, slots % p], c.k_scale).to(dtype)
    want_v = ref.dequantize_kv(c.v_cache[slots // p, :, slots % p], c.v_scale).to(dtype)
    assert k.dtype == dtype
    if dtype == torch.bfloat16:  # the interpreter's fp32 -> bf16 cast is not round-to-nearest: 1 ulp
        torch.testing.assert_close(k, want_k, atol=0, rtol=2 ** -7)
        torch.testing.assert_close(v, want_v, atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(k, want_k) and torch.equal(v, want_v)


@pytest.mark.parametrize("fp8", [True, False])
def test_prefix_chunk_gather_builds_prefix_and_new_rows_in_one_launch(fp8):
    """gather_kv with `new`: FlashInfer's chunk plans build a sliding layer's [cached prefix ; new] keys
    in one launch: a slot >= 0 reads the pages (e4m3 dequantised), a slot s < 0 copies new row -s - 1
    (here a strided view, as K is a slice of the QKV projection) unchanged."""
    from kernels.triton_store_kv import gather_kv

    c = Fp8Case([1, 4], [10, 3], hq=4, hkv=2, seed=11)
    kc, vc = (c.k_cache, c.v_cache) if fp8 else (c.k_cache.float(), c.v_cache.float())
    scale = c.kv_scale if fp8 else None
    d = kc.shape[3]
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(3, 8, 2 * d, generator=g)  # [T, Hkv, 2D]: k and v as strided views
    k, v = qkv[..., :d], qkv[..., d:]
    slots = torch.tensor([7, -1, 0, 30, -3, -2, 12], dtype=torch.int64)
    out_k, out_v = gather_kv(kc, vc, slots, scale, torch.float32, new=(k[:, :2], v[:, :2]))
    p = kc.shape[2]
    cached = slots >= 0
    want_k = torch.empty_like(out_k)
    want_v = torch.empty_like(out_v)
    s = slots[cached]
    rk, rv = kc[s // p, :, s % p], vc[s // p, :, s % p]
    want_k[cached] = ref.dequantize_kv(rk, c.k_scale) if fp8 else rk
    want_v[cached] = ref.dequantize_kv(rv, c.v_scale) if fp8 else rv
    want_k[~cached] = k[-1 - slots[~cached], :2]
    want_v[~cached] = v[-1 - slots[~cached], :2]
    assert torch.equal(out_k, want_k) and torch.equal(out_v, want_v)


def test_prefix_chunk_row_sources_lay_out_each_sequence_as_prefix_then_new():
    """FlashInfer's chunk plan (pure parts, CPU): the dense keys of sequence b are its cached prefix read
    through its page-table row, in order, then its new tokens; gathered in one launch."""
    from kernels.flashinfer_host import chunk_gather_indices, chunk_row_sources
    from kernels.triton_store_kv import gather_kv

    p, hkv, d, max_pages = 4, 2, 8, 5
    g = torch.Generator().manual_seed(3)
    prefix, q = [6, 0, 13], [2, 3, 1]
    table = torch.randperm(20, generator=g)[:3 * max_pages].view(3, max_pages).to(torch.int32)
    kc = torch.randn(20, hkv, p, d, generator=g)
    vc = torch.randn(20, hkv, p, d, generator=g)
    k, v = torch.randn(sum(q), hkv, d, generator=g), torch.randn(sum(q), hkv, d, generator=g)
    flat, offs, dst_pre, dst_new, cu_k = chunk_gather_indices(prefix, q, max_pages, p)
    rows = chunk_row_sources(flat, offs, dst_pre, dst_new, table, p, torch.from_numpy)
    keys, vals = gather_kv(kc, vc, rows, None, torch.float32, new=(k, v))
    start = 0
    for b, (n_pre, n_new) in enumerate(zip(prefix, q)):
        pos = torch.arange(n_pre)
        want_k = torch.cat([kc[table[b, pos // p].long(), :, pos % p], k[start:start + n_new]])
        want_v = torch.cat([vc[table[b, pos // p].long(), :, pos % p], v[start:start + n_new]])
        assert torch.equal(keys[cu_k[b]:cu_k[b + 1]], want_k) and torch.equal(vals[cu_k[b]:cu_k[b + 1]], want_v)
        start += n_new

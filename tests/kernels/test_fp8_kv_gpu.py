"""FP8 (e4m3) KV on the GPU at gpt-oss dims (d 64, GQA 8, window 128, page 16): the hardware
conversions write the reference's bytes (store, RoPE + store, gather); Triton (the decode kernel of
kernels/triton_decode.py for pure-decode steps, and the generic kernel alone) and FlashInfer (its own
fa2 decode variant with per-head scales, or the default: e4m3 decode on the Triton decode kernel; fa3
prefill over dequantised keys) pass the start-up self-test with e4m3 pages and match the reference
read of the same pages at real sizes (decode 16 x 8k with forced split-KV, a mixed prefill/decode
batch); the decode kernel's launch configs at real dims (e4m3 and bf16 pages, windows, splits, bf16
q past f16's range) and its e4m3 -> f16 conversion exact on every code; a captured FP8 decode replays
later steps; engine tokens Triton == torch with FP8 pages. Deselected by default (marker gpu).

  FLASHINFER_WORKSPACE_BASE=/tmp/tandem-flashinfer python -m pytest -m gpu tests/kernels/test_fp8_kv_gpu.py
"""

import pytest
import torch

from engine.selftest import SelfTestShape, self_test_attention
from kernels import reference as ref
from tests.kernels.test_attention_gpu import D, DEV, HKV, HQ, P, W, _bf16, _rel, _step
from tests.support.cuda_graph import capture

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

FP8 = torch.float8_e4m3fn
REAL = SelfTestShape(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, window=W, page_size=P)


def _scales(seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.rand(HKV, generator=g, device=DEV) * 0.2 + 0.01,
            torch.rand(HKV, generator=g, device=DEV) * 0.01 + 0.002)


def _impl(name, **kw):
    """triton (decode kernel for e4m3 decode), triton-generic (never), flashinfer (the workers'
    default: fa3 prefill, e4m3 decode on the Triton decode kernel), flashinfer-fa3/-fa2 (FlashInfer's
    own e4m3 decode variant)."""
    if name.startswith("triton"):
        from kernels.triton_attention_backend import TritonAttention
        return TritonAttention(decode="off" if name == "triton-generic" else "fp8", **kw)
    pytest.importorskip("flashinfer")
    from kernels.flashinfer_backend import FlashInferAttention
    if name == "flashinfer":
        return FlashInferAttention()
    backend = name.removeprefix("flashinfer-")
    return FlashInferAttention(prefill_backend=backend, decode_backend=backend, fp8_decode="flashinfer")


def _bits(t):
    return t.view(torch.uint8)


def test_fp8_kv_store_rope_and_gather_write_the_reference_bytes():
    from kernels.triton_store_kv import gather_kv, rope_store_kv, store_kv
    t = 300
    k, v = _bf16(t, HKV, D) * 8, _bf16(t, HKV, D) * 0.05
    slots = torch.randperm(64 * P, device=DEV)[:t]
    slots[::7] = -1
    sc = _scales()
    kc = torch.zeros(64, HKV, P, D, device=DEV, dtype=FP8)
    vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
    store_kv(k, v, kc, vc, slots, sc)
    ref.store_kv(k, v, kc2, vc2, slots, sc)
    assert torch.equal(_bits(kc), _bits(kc2)) and torch.equal(_bits(vc), _bits(vc2))
    ang = torch.randn(t, D // 2, device=DEV) * 10
    cos, sin = ang.cos() * 1.3466, ang.sin() * 1.3466
    k_rot = rope_store_kv(k, v, kc, vc, slots, cos, sin, sc)
    ref.store_kv(ref.apply_rope(k, cos, sin), v, kc2, vc2, slots, sc)
    assert torch.equal(k_rot, ref.apply_rope(k, cos, sin)) and torch.equal(_bits(kc), _bits(kc2))
    keep = slots[slots >= 0]
    gk, gv = gather_kv(kc, vc, keep, sc, torch.bfloat16)
    assert torch.equal(gk, ref.dequantize_kv(kc[keep // P, :, keep % P], sc[0]).to(torch.bfloat16))
    assert torch.equal(gv, ref.dequantize_kv(vc[keep // P, :, keep % P], sc[1]).to(torch.bfloat16))


@pytest.mark.parametrize("name", ["triton", "flashinfer", "flashinfer-fa3", "flashinfer-fa2"])
def test_fp8_kv_self_test(name):
    impl = _impl(name)
    self_test_attention(impl, DEV, torch.bfloat16, kv_dtype=FP8)
    self_test_attention(impl, DEV, torch.bfloat16, shape=REAL, kv_dtype=FP8)
    if name.startswith("flashinfer-"):  # FlashInfer 0.6.6 builds our FP8 variant: no fallback to Triton
        assert impl._fp8_fallback is None and impl._triton_decode is None
    if name == "flashinfer":
        assert impl._triton_decode is not None


def _run_case(impl, q_lens, prefix, window, seed=0):
    """e4m3 pages under per-head scales; the backend stores the new tokens, then reads everything."""
    step, num_pages = _step(q_lens, prefix, window, seed=seed)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    sc = _scales(seed)
    kc = ref.quantize_kv(torch.randn(num_pages * P, HKV, D, generator=g, device=DEV) * 4, sc[0])
    vc = ref.quantize_kv(torch.randn(num_pages * P, HKV, D, generator=g, device=DEV) * 0.05, sc[1])
    kc = kc.view(num_pages, P, HKV, D).transpose(1, 2).contiguous()  # [NP, Hkv, P, D]
    vc = vc.view(num_pages, P, HKV, D).transpose(1, 2).contiguous()
    t = sum(q_lens)
    q = torch.randn(t, HQ, D, generator=g, device=DEV, dtype=torch.bfloat16)
    k, v = _bf16(t, HKV, D) * 4, _bf16(t, HKV, D) * 0.05
    sinks = torch.randn(HQ, device=DEV) * 2
    impl.plan(step)
    out = impl.forward(0 if window is None else 1, q, k, v, (kc, vc), sinks, D ** -0.5, window, kv_scale=sc)
    grp = step.groups[0] if window is None else step.groups[1]
    want = ref.paged_attention(q.float(), kc, vc, grp.page_table, step.cu_seqlens_q, grp.kv_lens, sinks, D ** -0.5,
                               window, sc)
    return out, want


@pytest.mark.parametrize("name", ["triton", "triton-generic", "flashinfer", "flashinfer-fa2", "flashinfer-fa3"])
@pytest.mark.parametrize("window", [None, W])
def test_fp8_kv_real_dims(name, window):
    impl = _impl(name)
    assert _rel(*_run_case(impl, [1, 700, 1, 33], [3000, 0, 150, 900], window)) <= 1e-2
    assert _rel(*_run_case(impl, [1] * 16, [8191] * 16, window, seed=3)) <= 1e-2
    if name.startswith("triton"):
        for splits in (1, 6):
            assert _rel(*_run_case(_impl(name, num_splits=splits), [1] * 16, [8191] * 16, window, seed=4)) <= 1e-2


def _decode_case(b, kv_lens, kv_dtype, seed=0):
    """Pure decode over scattered pages already holding every key (e4m3 under per-head scales, or
    bf16): q [B, Hq, D] bf16, the caches, the batch table and the reference's inputs."""
    from kernels.triton_attention import AttnBatch
    g = torch.Generator(device=DEV).manual_seed(seed)
    need = [-(-n // P) for n in kv_lens]
    width = max(need)
    num_pages = b * width + 1
    table = torch.randperm(num_pages, generator=g, device=DEV)[:b * width].view(b, width).to(torch.int32)
    sc = _scales(seed) if kv_dtype == FP8 else None
    kc = torch.randn(num_pages, HKV, P, D, generator=g, device=DEV) * 4
    vc = torch.randn(num_pages, HKV, P, D, generator=g, device=DEV) * 0.05
    if kv_dtype == FP8:
        kc = ref.quantize_kv(kc.transpose(1, 2).reshape(-1, HKV, D), sc[0]).view(num_pages, P, HKV, D).transpose(1, 2)
        vc = ref.quantize_kv(vc.transpose(1, 2).reshape(-1, HKV, D), sc[1]).view(num_pages, P, HKV, D).transpose(1, 2)
    kc, vc = kc.to(kv_dtype).contiguous(), vc.to(kv_dtype).contiguous()
    q = torch.randn(b, HQ, D, generator=g, device=DEV, dtype=torch.bfloat16)
    sinks = torch.randn(HQ, generator=g, device=DEV) * 2
    batch = AttnBatch.build([1] * b, kv_lens, kv_lens, table, DEV)
    cu = torch.arange(b + 1, dtype=torch.int32, device=DEV)
    return q, (kc, vc), sc, sinks, batch, cu


@pytest.mark.parametrize("kv_dtype", [FP8, torch.bfloat16])
@pytest.mark.parametrize("cfg", [(64, 1, 3), (128, 1, 4), (64, 4, 2)])
def test_fp8_kv_decode_kernel_configs(kv_dtype, cfg):
    """The decode kernel at real dims under the launch configs the benchmark sweeps (BLOCK_N, warps,
    stages): ragged lengths (1 key, page boundaries, 8k), windows, splits."""
    from kernels.triton_decode import DecodeConfig, paged_decode
    kv_lens = [1, 16, 17, 129, 1000, 4095, 8192, 333]
    q, kv, sc, sinks, batch, cu = _decode_case(len(kv_lens), kv_lens, kv_dtype, seed=cfg[0] + cfg[1])
    config = DecodeConfig(block_n=cfg[0], num_warps=cfg[1], num_stages=cfg[2])
    for window, splits in ((None, 1), (W, 1), (None, 5), (W, 3)):
        out = paged_decode(q, kv, batch, sinks, D ** -0.5, window, kv_scale=sc, config=config, num_splits=splits)
        want = ref.paged_attention(q.float(), kv[0], kv[1], batch.page_table, cu, torch.tensor(kv_lens, device=DEV),
                                   sinks, D ** -0.5, window, sc)
        assert _rel(out, want) <= 1e-2, (window, splits)


def test_fp8_kv_decode_kernel_scales_queries_past_f16_range():
    """bf16 q rows at ~2^17 would be inf in f16: the kernel scales them by a power of two first."""
    from kernels.triton_decode import paged_decode
    kv_lens = [700, 8192, 64]
    q, kv, sc, sinks, batch, cu = _decode_case(3, kv_lens, FP8, seed=9)
    q[1] *= 2.0 ** 17
    sm = D ** -0.5 * 2.0 ** -17  # row 1's logits as usual, the others near 0
    out = paged_decode(q, kv, batch, sinks, sm, None, kv_scale=sc)
    want = ref.paged_attention(q.float(), kv[0], kv[1], batch.page_table, cu, torch.tensor(kv_lens, device=DEV),
                               sinks, sm, None, sc)
    assert _rel(out, want) <= 1e-2 and _rel(out[1:2], want[1:2]) <= 1e-2


def test_fp8_kv_decode_kernel_converts_every_code_exactly():
    """One key per sequence and a sink of -inf: the output is V's row itself (p = 1), so every finite
    e4m3 code must come back exactly through the kernel's prmt + cvt conversion and dim split."""
    from kernels.triton_attention import AttnBatch
    from kernels.triton_decode import paged_decode
    codes = torch.arange(256, dtype=torch.uint8, device=DEV)
    codes = codes[(codes & 0x7F) != 0x7F].view(FP8)  # the 254 finite codes (0x7F / 0xFF are NaN)
    b = 1
    row = torch.zeros(HKV * D, dtype=torch.uint8, device=DEV)
    row[:codes.numel()] = codes.view(torch.uint8)
    vc = torch.zeros(2, HKV, P, D, device=DEV, dtype=FP8)
    vc.view(torch.uint8)[0, :, 0] = row.view(HKV, D)
    kc = torch.zeros_like(vc)
    q = torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16)
    batch = AttnBatch.build([1], [1], [1], torch.zeros(1, 1, dtype=torch.int32, device=DEV), DEV)
    ones = torch.ones(HKV, device=DEV)
    out = paged_decode(q, (kc, vc), batch, torch.full((HQ,), float("-inf"), device=DEV), 0.125, None,
                       kv_scale=(ones, ones))  # [1, Hq, D]
    want = vc[0, :, 0].float().repeat_interleave(HQ // HKV, dim=0)  # [Hq, D]
    assert torch.equal(out[0].float(), want)


@pytest.mark.parametrize("name", ["flashinfer-fa2", "flashinfer", "triton", "triton-generic"])
def test_fp8_kv_decode_cuda_graph_replays_a_later_step(name):
    impl = _impl(name)
    b, max_pages = 4, 64
    impl.enable_cuda_graphs([b], max_pages_per_seq=max_pages)
    num_pages = b * max_pages + 1
    sc = _scales(2)
    kc = ref.quantize_kv(torch.randn(num_pages * P, HKV, D, device=DEV) * 4, sc[0]).view(
        num_pages, P, HKV, D).transpose(1, 2).contiguous()
    vc = ref.quantize_kv(torch.randn(num_pages * P, HKV, D, device=DEV) * 0.05, sc[1]).view(
        num_pages, P, HKV, D).transpose(1, 2).contiguous()
    q = torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16)
    k, v = _bf16(b, HKV, D), _bf16(b, HKV, D) * 0.05
    sinks = torch.randn(HQ, device=DEV) * 2
    steps = [_step([1] * b, pre, None, pages_per_seq=max_pages, seed=s)[0]
             for s, pre in enumerate(([100, 5, 700, 1000], [37, 999, 2, 400]))]
    outs = {}
    impl.plan(steps[0])
    impl.forward(0, q, k, v, (kc, vc), sinks, D ** -0.5, None, kv_scale=sc)  # eager warm-up (and JIT builds)
    graph, outs["o"] = capture(lambda: impl.forward(0, q, k, v, (kc, vc), sinks, D ** -0.5, None, kv_scale=sc))
    for step in steps[::-1]:
        impl.plan(step)
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        graph.replay()
        torch.cuda.synchronize()
        g = step.groups[0]
        slots = g.slot_mapping
        assert torch.equal(_bits(kc[slots // P, :, slots % P]), _bits(ref.quantize_kv(k, sc[0])))
        want = ref.paged_attention(q.float(), kc, vc, g.page_table, step.cu_seqlens_q, g.kv_lens, sinks, D ** -0.5,
                                   None, sc)
        assert _rel(outs["o"], want) <= 1e-2


def test_fp8_kv_engine_tokens_triton_equal_torch_on_gpu(ckpt_factory):
    from engine.build import EngineConfig
    from engine.llm import LLM
    from engine.sampling import SamplingParams
    from engine.scheduler import SchedulerConfig

    path = ckpt_factory("tiny-a")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (19, 1, 6, 27, 64)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(EngineConfig(checkpoint=path, device=DEV, dtype="float32", attention_backend=backend, page_size=4,
                               kv_cache_bytes=1 << 22, kv_cache_dtype="fp8", kv_scale_calibration=1,
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256)))
        outs[backend] = [c.output_ids for c in llm.generate(prompts, params)]
        llm.kv.assert_all_free()
    assert outs["triton"] == outs["torch"]


@pytest.mark.parametrize("window", [None, W])
def test_triton_decode_backend_on_bf16_pages(window):
    """--attention-backend flashinfer-triton-decode: pure-decode steps over bf16 pages on the Triton
    decode kernel (BF16_DECODE), against the reference, eager and replayed from a CUDA graph; the
    start-up self-test at real dims; prefill and mixed steps stay FlashInfer's."""
    pytest.importorskip("flashinfer")
    from kernels.flashinfer_backend import FlashInferAttention
    impl = FlashInferAttention(decode_kernel="triton")
    self_test_attention(impl, DEV, torch.bfloat16, shape=REAL)
    assert impl._triton_decode is not None
    b = 16
    step, num_pages = _step([1] * b, [8191] * b, window, seed=5)
    g = torch.Generator(device=DEV).manual_seed(6)
    kc = (torch.randn(num_pages, HKV, P, D, generator=g, device=DEV) * 4).to(torch.bfloat16)
    vc = (torch.randn(num_pages, HKV, P, D, generator=g, device=DEV) * 0.05).to(torch.bfloat16)
    q, k, v = _bf16(b, HQ, D), _bf16(b, HKV, D) * 4, _bf16(b, HKV, D) * 0.05
    sinks = torch.randn(HQ, device=DEV) * 2
    grp = step.groups[0] if window is None else step.groups[1]
    group = 0 if window is None else 1

    def run():
        return impl.forward(group, q, k, v, (kc, vc), sinks, D ** -0.5, window)

    impl.plan(step)
    eager = run()
    want = ref.paged_attention(q.float(), kc, vc, grp.page_table, step.cu_seqlens_q, grp.kv_lens, sinks, D ** -0.5,
                               window, None)
    assert _rel(eager, want) <= 1e-2
    graph, out = capture(run)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("dtype", [FP8, torch.bfloat16])
def test_fp8_kv_prefix_copy_pages_on_gpu(dtype):
    """A prefix hit copies cached sliding pages into the new sequence's ring (KVPool.copy_pages). CUDA has no
    index_copy_ for float8 types: a served decode worker with e4m3 pages failed in its warm-up's first hit
    (b1-profile-fp8kv-served-1). The copy moves every byte, both groups, K and V, other pages untouched."""
    from model.kv_cache import KVCacheSpec
    from tests.support.kv_pages import check_copy_pages

    check_copy_pages(KVCacheSpec(P, HKV, D, dtype, W, (1, 3), (0, 2), (12, 10)), DEV)

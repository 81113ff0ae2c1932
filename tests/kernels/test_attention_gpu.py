"""Attention backends on the GPU at gpt-oss dims (d 64, GQA 8, window 128, page 16): the start-up
self-test for Triton and FlashInfer (fa3, fa2), bf16 parity at real sizes with forced split-KV,
exact store-KV/RoPE in bf16, FlashInfer decode captured in a CUDA graph and replayed on a later
step, and engine tokens Triton == torch. Deselected by default (marker gpu).

  FLASHINFER_WORKSPACE_BASE=/tmp/tandem-flashinfer python -m pytest -m gpu tests/kernels/test_attention_gpu.py
(the same folder as benchmarks/attention.py, so its JIT builds are reused).
"""

import pytest
import torch

from kernels import reference as ref
from kernels.interface import GroupMeta, StepMeta
from engine.selftest import SelfTestShape, self_test_attention
from tests.support.cuda_graph import capture

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

DEV = "cuda"
HQ, HKV, D, P, W = 64, 8, 64, 16, 128


def _bf16(*shape):
    return torch.randn(shape, device=DEV, dtype=torch.bfloat16)


def _flashinfer(backend):
    pytest.importorskip("flashinfer")
    from kernels.flashinfer_backend import FlashInferAttention
    return FlashInferAttention(prefill_backend=backend, decode_backend=backend)


def _step(q_lens, prefix, window, pages_per_seq=None, seed=0):
    """A StepMeta with everything in scattered pages (new tokens stored by the backend)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    kv = [a + b for a, b in zip(q_lens, prefix)]
    need = [-(-n // P) for n in kv]
    width = pages_per_seq or max(need)
    num_pages = len(kv) * width + 1
    perm = torch.randperm(num_pages, generator=g, device=DEV).to(torch.int32)
    table = perm[:len(kv) * width].view(len(kv), width).contiguous()
    pos = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, q_lens)]).to(DEV)
    seq = torch.repeat_interleave(torch.arange(len(kv), device=DEV), torch.tensor(q_lens, device=DEV))
    slots = table[seq, pos // P].long() * P + pos % P
    i32 = dict(dtype=torch.int32, device=DEV)
    gm = GroupMeta(table, torch.tensor(prefix, **i32), torch.tensor(kv, **i32), slots, True, list(prefix), kv)
    cu = torch.tensor([0] + q_lens).cumsum(0)
    groups = (gm, None) if window is None else (None, gm)
    return StepMeta(pos, cu.to(**i32), list(q_lens), (cu[1:] - 1).to(DEV), groups), num_pages


def _reference(step, q, k_cache, v_cache, sinks, window):
    g = step.groups[0] if window is None else step.groups[1]
    return ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), g.page_table, step.cu_seqlens_q,
                               g.kv_lens, sinks, D ** -0.5, window)


def _run_case(impl, q_lens, prefix, window, seed=0):
    step, num_pages = _step(q_lens, prefix, window, seed=seed)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    kc = torch.randn(num_pages, HKV, P, D, generator=g, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    t = sum(q_lens)
    q = torch.randn(t, HQ, D, generator=g, device=DEV, dtype=torch.bfloat16)
    k, v = _bf16(t, HKV, D), _bf16(t, HKV, D)
    sinks = torch.randn(HQ, device=DEV) * 2
    impl.plan(step)
    out = impl.forward(0 if window is None else 1, q, k, v, (kc, vc), sinks, D ** -0.5, window)
    expected = _reference(step, q, kc, vc, sinks, window)  # the backend stored k/v: read them back
    return out, expected


def _rel(out, expected):
    assert torch.isfinite(out).all()
    return ((out.float() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_self_test(dtype):
    from kernels.triton_attention_backend import TritonAttention
    self_test_attention(TritonAttention(), DEV, dtype)


@pytest.mark.parametrize("window", [None, W])
@pytest.mark.parametrize("num_splits", [None, 1, 6])
def test_triton_real_dims(window, num_splits):
    from kernels.triton_attention_backend import TritonAttention
    impl = TritonAttention(num_splits=num_splits)
    assert _rel(*_run_case(impl, [1, 700, 1, 33], [3000, 0, 150, 900], window)) <= 1e-2
    assert _rel(*_run_case(impl, [1] * 16, [8191] * 16, window, seed=3)) <= 1e-2


def test_store_kv_and_rope_exact_bf16():
    from kernels.triton_store_kv import apply_rope, rope_store_kv, store_kv
    t = 300
    k, v = _bf16(t, HKV, D), _bf16(t, HKV, D)
    slots = torch.randperm(64 * P, device=DEV)[:t]
    slots[::7] = -1
    kc = torch.randn(64, HKV, P, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    store_kv(k, v, kc, vc, slots)
    ref.store_kv(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    ang = torch.randn(t, D // 2, device=DEV) * 10
    cos, sin = ang.cos() * 1.3466, ang.sin() * 1.3466
    k_rot = rope_store_kv(k, v, kc, vc, slots, cos, sin)
    expected = ref.apply_rope(k, cos, sin)
    ref.store_kv(expected, v, kc2, vc2, slots)
    assert torch.equal(k_rot, expected) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    q = torch.randn(t, HQ, D, device=DEV, dtype=torch.bfloat16)
    assert torch.equal(apply_rope(q, cos, sin), ref.apply_rope(q, cos, sin))


@pytest.mark.parametrize("backend", ["fa3", "fa2"])
def test_flashinfer_self_test(backend):
    self_test_attention(_flashinfer(backend), DEV, torch.bfloat16)
    self_test_attention(_flashinfer(backend), DEV, torch.bfloat16,
                        shape=SelfTestShape(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, window=W, page_size=P))


@pytest.mark.parametrize("backend", ["fa3", "fa2"])
@pytest.mark.parametrize("window", [None, W])
def test_flashinfer_real_dims(backend, window):
    impl = _flashinfer(backend)
    assert _rel(*_run_case(impl, [1, 700, 1, 33], [3000, 0, 150, 900], window)) <= 1e-2
    assert _rel(*_run_case(impl, [1] * 16, [8191] * 16, window, seed=3)) <= 1e-2


@pytest.mark.parametrize("window", [None, W])
@pytest.mark.parametrize("sliding", [None, "fa2"])
def test_flashinfer_fresh_prefill_read_ragged(window, sliding):
    """A prefill step with no cached prefix read from its own k/v (set_prefill_reads("ragged")): the
    reference's output, and it stores the pages the paged read stores, bit for bit."""
    q_lens = [700, 33, 2048]
    got = {}
    for fresh in ("paged", "ragged"):  # the same seeds: the same q, k, v and pages before the store
        impl = _flashinfer("fa3")
        impl.set_prefill_reads(fresh, sliding)
        step, num_pages = _step(q_lens, [0] * len(q_lens), window, seed=5)
        g = torch.Generator(device=DEV).manual_seed(6)
        kc, vc = (torch.randn(num_pages, HKV, P, D, generator=g, device=DEV, dtype=torch.bfloat16) for _ in "kv")
        t = sum(q_lens)
        q, k, v = (torch.randn(t, h, D, generator=g, device=DEV, dtype=torch.bfloat16) for h in (HQ, HKV, HKV))
        sinks = torch.randn(HQ, generator=g, device=DEV) * 2
        impl.plan(step)
        out = impl.forward(0 if window is None else 1, q, k, v, (kc, vc), sinks, D ** -0.5, window)
        assert _rel(out, _reference(step, q, kc, vc, sinks, window)) <= 1e-2
        got[fresh] = (out, kc, vc)
    assert torch.equal(got["paged"][1], got["ragged"][1]) and torch.equal(got["paged"][2], got["ragged"][2])
    assert _rel(got["ragged"][0], got["paged"][0].float()) <= 1e-2


@pytest.mark.parametrize("backend", ["flashinfer-fa2", "triton"])
def test_decode_cuda_graph_replays_a_later_step(backend):
    """Capture one decode forward for batch 4; then plan a different step (other lengths, other
    pages) outside the graph and replay: the store and the output must follow the new step."""
    if backend == "triton":
        from kernels.triton_attention_backend import TritonAttention
        impl = TritonAttention()
    else:
        impl = _flashinfer("fa2")
    b, max_pages = 4, 64
    impl.enable_cuda_graphs([b], max_pages_per_seq=max_pages)
    num_pages = b * max_pages + 1
    kc = torch.randn(num_pages, HKV, P, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16)
    k, v = _bf16(b, HKV, D), _bf16(b, HKV, D)
    sinks = torch.randn(HQ, device=DEV) * 2
    steps = [_step([1] * b, pre, None, pages_per_seq=max_pages, seed=s)[0]
             for s, pre in enumerate(([100, 5, 700, 1000], [37, 999, 2, 400]))]
    outs = {}
    impl.plan(steps[0])
    impl.forward(0, q, k, v, (kc, vc), sinks, D ** -0.5, None)  # eager warm-up
    graph, outs["o"] = capture(lambda: impl.forward(0, q, k, v, (kc, vc), sinks, D ** -0.5, None))
    for step in steps[::-1]:
        impl.plan(step)
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        graph.replay()
        torch.cuda.synchronize()
        slots = step.groups[0].slot_mapping  # the replayed store wrote this step's slots
        assert torch.equal(kc[slots // P, :, slots % P], k)
        assert _rel(outs["o"], _reference(step, q, kc, vc, sinks, None)) <= 1e-2


def test_engine_tokens_triton_equal_torch_on_gpu(ckpt_factory):
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
                               kv_cache_bytes=1 << 22,
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256)))
        outs[backend] = [c.output_ids for c in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


def test_graphed_attention_splits_long_context_under_graph_replay():
    """kernels/triton_graph_attention.py's split-KV on full layers at long context, captured once and replayed
    for two steps: a decode row at 32k among 15 at 1k (it splits, the short ones do not), then a 200-token chunk at
    16k beside 15 decode rows at 2k, both against the fp32 reference; the replay reads only the refilled tables."""
    from kernels.triton_graph_attention import GroupTables, graph_configs, graph_splits, graphed_attention
    steps = [_step([1] * 16, [32767] + [1023] * 15, None, pages_per_seq=2049, seed=1),
             _step([200] + [1] * 15, [16384] + [2047] * 15, None, pages_per_seq=2049, seed=2)]
    bucket, num_pages = 256, steps[0][1]
    g = torch.Generator(device=DEV).manual_seed(7)
    kc = torch.randn(num_pages, HKV, P, D, generator=g, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    sinks = torch.randn(HQ, device=DEV) * 2
    cfgs = graph_configs(HQ // HKV, torch.device(DEV))
    tables = GroupTables((bucket,), 64, 2049, 0, torch.device(DEV), cfgs,
                         **graph_splits(HQ // HKV, HKV, cfgs, torch.device(DEV)))
    q, k, v = _bf16(bucket, HQ, D), _bf16(bucket, HKV, D), _bf16(bucket, HKV, D)
    tables.fill(steps[0][0], bucket)
    graph, out = capture(lambda: graphed_attention(q, k, v, (kc, vc), tables, bucket, sinks, D ** -0.5, None))
    for i, (step, _) in enumerate(steps):
        tables.fill(step, bucket)
        counts = tables.seq_info[5, :len(step.q_lens_host)].tolist()
        assert counts[0] > 1, counts  # the long sequence splits
        if i == 0:
            assert set(counts[1:]) == {1}, counts
        q.normal_()
        graph.replay()
        t = sum(step.q_lens_host)
        # the reference reads every key from the pages (the step's tables say pages hold all)
        assert _rel(out[:t], _reference(step, q[:t], kc, vc, sinks, None)) <= 1e-2
        assert torch.equal(out[t:], torch.zeros_like(out[t:]))

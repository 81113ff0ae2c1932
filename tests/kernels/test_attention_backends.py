"""Attention backends vs TorchAttention on StepMetas built by model/context.py (Triton interpreter).

TritonAttention must behave exactly like the reference backend in every case (no cache, store
then paged read, prefix + dense then store) and give the same tokens end to end. The FlashInfer
backend needs a GPU; its planning runs against a torch stand-in in test_flashinfer_planning.py.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from common.errors import ConfigError  # noqa: E402
from kernels.registry import make_attention  # noqa: E402
from engine.selftest import AttentionSelfTestFailed, SelfTestShape, self_test_attention  # noqa: E402
from kernels.torch_backend import TorchAttention  # noqa: E402
from kernels.triton_attention_backend import TritonAttention  # noqa: E402
from model.context import SeqStep, build_step_meta  # noqa: E402
from model.kv_cache import KVCacheSpec, KVManager, KVPool, PageGroup, SeqPages  # noqa: E402

SMALL = SelfTestShape(num_q_heads=8, num_kv_heads=2, head_dim=16, window=8, page_size=4)


@pytest.mark.parametrize("shape", [SMALL, SelfTestShape(4, 4, 16, 5, 4), SelfTestShape(16, 2, 32, 16, 8),
                                   SelfTestShape(4, 2, 16, 3, 2)], ids=["g4", "g1", "g8", "g2-page2"])
def test_triton_backend_passes_self_test(shape):
    self_test_attention(TritonAttention(), "cpu", torch.float32, shape=shape)


def test_triton_backend_self_test_fp16():
    self_test_attention(make_attention("triton"), "cpu", torch.float16, shape=SMALL)


class _Broken(TorchAttention):
    def __init__(self, flaw):
        super().__init__()
        self.flaw = flaw

    def forward(self, group, q, k, v, kv, sinks, sm_scale, window, kv_scale=None):
        if self.flaw == "window+1" and window is not None:
            window += 1
        if self.flaw == "no-sink":
            sinks = torch.full_like(sinks, -1e4)
        if self.flaw == "scaled-sink":
            sinks = sinks * sm_scale
        out = super().forward(group, q, k, v, kv, sinks, sm_scale, window, kv_scale)
        if self.flaw == "no-store" and kv is not None:
            kv[0].zero_()
        return out


@pytest.mark.parametrize("flaw", ["window+1", "no-sink", "scaled-sink", "no-store"])
def test_self_test_catches_broken_backends(flaw):
    with pytest.raises(AttentionSelfTestFailed, match="self-test"):
        self_test_attention(_Broken(flaw), "cpu", torch.float32, shape=SMALL)


@pytest.mark.parametrize("num_splits", [None, 3])
def test_triton_graph_mode_static_buffers(num_splits):
    """enable_cuda_graphs: decode steps of batch 3 plan into the same static tables (what a captured
    graph reads), later steps with other lengths and pages included; results follow each step."""
    impl = TritonAttention(num_splits=num_splits)
    impl.enable_cuda_graphs([3], max_pages_per_seq=32)
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL)  # its last step: decode of 3 seqs
    static = {key: (buf.batch.seq_info, buf.batch.page_table, buf.slots) for key, buf in impl._graph.items()}
    assert sorted(static) == [(3, PageGroup.FULL, 32), (3, PageGroup.SLIDING, 32)]  # (batch, group, page capacity)
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL, seed=5)
    for key, tensors in static.items():
        buf = impl._graph[key]
        assert all(a is b for a, b in zip(tensors, (buf.batch.seq_info, buf.batch.page_table, buf.slots)))


def test_replanning_the_same_step_is_a_no_op(fake_flashinfer):
    """GptOss.forward calls plan(step) itself, also inside a CUDA-graph capture: planning the step
    already planned must do no host work and keep every table."""
    spec = KVCacheSpec(4, 2, 16, torch.float32, 8, full_layers=(1,), sliding_layers=(0,), num_pages=(16, 16))
    mgr = KVManager(spec)
    seqs = [SeqPages(), SeqPages()]
    for s in seqs:
        mgr.grow(s, 10)
    meta = build_step_meta([SeqStep(seqs[0], 9, 1), SeqStep(seqs[1], 5, 1)], spec)
    pool = KVPool(spec)
    q, k, v = torch.randn(2, 8, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    impls = [TritonAttention(), fake_flashinfer.FlashInferAttention(), TritonAttention(),
             fake_flashinfer.FlashInferAttention()]
    for i, impl in enumerate(impls):
        if i >= 2:
            impl.enable_cuda_graphs([2], max_pages_per_seq=8)
        impl.plan(meta)
        out = impl.forward(PageGroup.FULL, q, k, v, pool.layer_kv(1), torch.zeros(8), 0.25, None)
        tables = (impl._groups + impl._slots) if impl.name == "triton" else list(impl._plans.values())
        impl.plan(meta)
        again = (impl._groups + impl._slots) if impl.name == "triton" else list(impl._plans.values())
        assert len(tables) == len(again) and all(a is b for a, b in zip(tables, again))
        torch.testing.assert_close(impl.forward(PageGroup.FULL, q, k, v, pool.layer_kv(1), torch.zeros(8), 0.25, None), out)


def test_triton_random_schedule_matches_torch():
    """Sequences arrive, prefill in random chunks (some longer than the sliding ring, so
    pages_hold_all flips), decode and finish; both backends see the same StepMetas and inputs."""
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, p, w = 8, 2, 16, 4, 6
    spec = KVCacheSpec(p, hkv, d, torch.float32, w, full_layers=(1,), sliding_layers=(0,), num_pages=(80, 40))
    mgr = KVManager(spec)
    pools = [KVPool(spec), KVPool(spec)]
    impls = [TritonAttention(), TorchAttention()]
    sinks = torch.randn(hq, generator=g) * 3
    prompt = {0: 23, 1: 9, 2: 30, 3: 5}
    done = {s: 0 for s in prompt}
    pages = {s: SeqPages() for s in prompt}
    saw_chunk_mode = False
    for step_i in range(9):
        steps = []
        for s, n in prompt.items():
            if step_i < s:  # staggered arrivals
                continue
            left = n - done[s]
            q_len = 1 if left <= 0 else min(left, int(torch.randint(1, 13, (1,), generator=g)))
            mgr.grow(pages[s], done[s] + q_len)
            steps.append(SeqStep(pages[s], done[s], q_len))
            done[s] += q_len
        meta = build_step_meta(steps, spec)
        saw_chunk_mode |= not meta.groups[PageGroup.SLIDING].pages_hold_all
        t = sum(meta.q_lens_host)
        for impl in impls:
            impl.plan(meta)
        for grp, window in ((PageGroup.SLIDING, w), (PageGroup.FULL, None)):
            q = torch.randn(t, hq, d, generator=g)
            k, v = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
            layer = spec.layers(grp)[0]
            outs = [impl.forward(grp, q, k, v, pool.layer_kv(layer), sinks, 0.25, window)
                    for impl, pool in zip(impls, pools)]
            torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-4)
            assert torch.equal(pools[0].pools[grp], pools[1].pools[grp])
    assert saw_chunk_mode


@pytest.mark.parametrize("preset", ["tiny-a", "tiny-b"])
def test_engine_tokens_triton_equal_torch(ckpt_factory, one_torch_thread, preset):
    """End to end through the engine (tiny-a: window 4, G 4; tiny-b: window 7, one KV head):
    chunked prefill (a small token budget mixes prefill chunks with decodes), sliding rings of page
    size 4, greedy decoding; the tokens must be identical."""
    from engine.build import EngineConfig
    from engine.llm import LLM
    from engine.sampling import SamplingParams
    from engine.scheduler import SchedulerConfig

    path = ckpt_factory(preset)
    vocab = 512 if preset == "tiny-a" else 384
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab - 8, (n,), generator=gen).tolist() for n in (19, 1, 6, 27)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(EngineConfig(checkpoint=path, attention_backend=backend, page_size=4, kv_cache_bytes=1 << 20,
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                                         max_model_len=256)))
        outs[backend] = [c.output_ids for c in llm.generate(prompts, params)]
        llm.kv.assert_all_free()
    assert outs["triton"] == outs["torch"]


def test_flashinfer_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="CUDA"):
        make_attention("flashinfer")

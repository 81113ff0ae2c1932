"""Attention backends vs TorchAttention on StepMetas built by model/context.py (Triton interpreter).

TritonAttention must behave exactly like the reference backend in every case (no cache, store
then paged read, prefix + dense then store) and give the same tokens end to end. The FlashInfer
backend needs a GPU; here its planning (page indices, last-page lengths, window_left, chunk
gathers, CUDA-graph static buffers) runs against a torch stand-in with FlashInfer's documented
semantics, and the real thing is covered by tests/kernels/test_attention_gpu.py.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import sys  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from common.errors import ConfigError  # noqa: E402
from kernels import reference as ref  # noqa: E402
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


# ---- FlashInfer planning against a torch stand-in ---------------------------------------------------
class _FakeWrapper:
    """FlashInfer's BatchPrefillWith{Paged,Ragged}KVCacheWrapper semantics in torch: causal with
    queries aligned to the end of each sequence's keys; keys kept when kv_idx >= q_pos - window_left;
    paged KV = indices[indptr[b]:indptr[b+1]] with the last page holding last_page_len tokens; the
    jit variant's extra args are (sink fp32 [Hq], sm_scale)."""

    log: list = []

    def __init__(self, ragged, workspace, layout, use_cuda_graph=False, qo_indptr_buf=None, paged_kv_indptr_buf=None,
                 paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None, backend="auto", jit_args=None,
                 jit_kwargs=None):
        self.fp8 = jit_args[2] == torch.float8_e4m3fn
        if self.fp8:  # our FP8-KV variant: paged, fa2, K/V scales as extra tensors, derived declaration
            assert not ragged and backend == "fa2" and jit_args[11] == "AttentionSinkKVScale"
            assert jit_args[7] == ["sink", "k_scale", "v_scale"] and "params.k_scale[kv_head_idx]" in jit_args[12]
        else:
            assert jit_args[11] == "AttentionSink" and jit_args[7] == ["sink"] and jit_args[2] == jit_args[1]
        assert jit_args[9] == ["sm_scale"]
        assert layout == ("NHD" if ragged else "HND") and backend in ("fa2", "fa3")
        self.kv_dtype = jit_args[2]
        self.ragged, self.sliding, self.graph = ragged, jit_kwargs["use_sliding_window"], use_cuda_graph
        self.bufs = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf)
        _FakeWrapper.log.append((backend, "ragged" if ragged else "paged", self.sliding, use_cuda_graph))

    def plan(self, qo_indptr, kv_indptr, *args, causal, window_left, q_data_type, kv_data_type, seq_lens=None):
        assert causal and (window_left >= 0) == self.sliding and qo_indptr.device.type == "cpu"
        assert kv_data_type == self.kv_dtype, (kv_data_type, self.kv_dtype)
        self.window_left = window_left
        if self.ragged:
            assert seq_lens is None
            self.qo, self.kv = qo_indptr, kv_indptr
            return
        indices, last, *_ = args
        # our paged plans pass the lengths (host, int32), which FlashInfer would otherwise derive as
        # get_seq_lens does: they must be exactly those
        page = args[5]
        derived = (kv_indptr[1:] - kv_indptr[:-1] - 1).clamp(min=0) * page + last
        assert seq_lens is not None and seq_lens.dtype == torch.int32 and seq_lens.device.type == "cpu"
        assert torch.equal(seq_lens, derived.to(torch.int32)), (seq_lens, derived)
        if self.graph:  # FlashInfer copies into the static buffers; run() must read from them
            for buf, x in zip(self.bufs, (qo_indptr, kv_indptr, indices, last)):
                buf[:len(x)].copy_(x)
            self.n_idx = len(indices)
        else:
            self.bufs = (qo_indptr, kv_indptr, indices, last)
            self.n_idx = len(indices)

    def run(self, q, *kv_and_extra, out):
        window = None if self.window_left < 0 else self.window_left + 1
        if self.ragged:
            k, v, sink, sm_scale = kv_and_extra
            return out.copy_(ref.varlen_attention(q, k, v, self.qo, self.kv, sink, sm_scale, window))
        if self.fp8:
            (k_cache, v_cache), sink, k_scale, v_scale, sm_scale = kv_and_extra
            assert k_scale.dtype == v_scale.dtype == torch.float32 and k_cache.dtype == torch.float8_e4m3fn
        else:
            (k_cache, v_cache), sink, sm_scale = kv_and_extra
            k_scale = v_scale = None
        qo, kvp, idx, last = self.bufs
        p = k_cache.shape[2]
        for b in range(len(qo) - 1):
            pages = idx[kvp[b]:kvp[b + 1]]
            n = (len(pages) - 1) * p + int(last[b])
            ks, vs = ref.gather_pages(k_cache, pages, n, k_scale), ref.gather_pages(v_cache, pages, n, v_scale)
            cq = torch.tensor([0, int(qo[b + 1] - qo[b])], dtype=torch.int32)
            ck = torch.tensor([0, n], dtype=torch.int32)
            out[qo[b]:qo[b + 1]] = ref.varlen_attention(q[qo[b]:qo[b + 1]], ks, vs, cq, ck, sink, sm_scale, window)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    fi = types.ModuleType("flashinfer")
    fi.BatchPrefillWithPagedKVCacheWrapper = lambda *a, **kw: _FakeWrapper(False, *a, **kw)
    fi.BatchPrefillWithRaggedKVCacheWrapper = lambda *a, **kw: _FakeWrapper(True, *a, **kw)
    variants = types.ModuleType("flashinfer.jit.attention.variants")
    # the places our FP8-KV variant edits, as in FlashInfer 0.6.6's fa2 declaration
    variants.attention_sink_decl = {"fa2": "struct AttentionSink : Base {\n  AttentionSink(const Params& params) {}\n"
                                           "  REGISTER_LOGITS_MASK(p, {})\n"
                                           "  OUT({ return output * scale * d_rcp; })\n};", "fa3": "decl-fa3"}
    utils = types.ModuleType("flashinfer.utils")
    utils.is_sm90a_supported = lambda device: True
    prefill = types.ModuleType("flashinfer.prefill")
    prefill.built = []

    def get_module(backend, *jit_args, use_sliding_window):  # the JIT build: record, or fail on demand
        if prefill.fail:
            raise RuntimeError("ninja: build stopped: subcommand failed")
        prefill.built.append((backend, jit_args[0], use_sliding_window))

    prefill.fail = False
    prefill.get_customize_batch_prefill_module = get_module
    fi.prefill = prefill
    for name, mod in (("flashinfer", fi), ("flashinfer.jit", types.ModuleType("flashinfer.jit")),
                      ("flashinfer.jit.attention", types.ModuleType("flashinfer.jit.attention")),
                      ("flashinfer.jit.attention.variants", variants), ("flashinfer.utils", utils),
                      ("flashinfer.prefill", prefill)):
        monkeypatch.setitem(sys.modules, name, mod)
    import kernels.flashinfer_backend as fb
    monkeypatch.setattr(fb, "import_flashinfer", lambda cache_dir=None: fi)
    _FakeWrapper.log = []
    return fb


def test_flashinfer_planning_matches_torch(fake_flashinfer):
    impl = fake_flashinfer.FlashInferAttention()
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL)
    kinds = set(_FakeWrapper.log)
    # prefill on fa3 (sm90a): a fresh prompt's full layers read ragged; prefill's sliding reads on fa2 (set_prefill_reads);
    # decode (and mixed steps) on fa2, paged, both window kinds
    assert {("fa3", "ragged", False, False), ("fa2", "ragged", True, False),
            ("fa2", "paged", True, False), ("fa2", "paged", False, False)} <= kinds
    assert ("fa3", "ragged", True, False) not in kinds
    # the reads before 2026-12-06: full layers stored then read paged on fa3, sliding reads on fa3
    _FakeWrapper.log = []
    impl.set_prefill_reads("paged", "fa3")
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL)
    assert {("fa3", "paged", False, False), ("fa3", "ragged", True, False)} <= set(_FakeWrapper.log)
    with pytest.raises(ConfigError, match="unknown prefill reads"):
        impl.set_prefill_reads("dense")


def test_flashinfer_decode_graph_buffers(fake_flashinfer):
    """With CUDA graphs enabled for batch 3, the decode step plans into static buffers (sized for
    max_pages_per_seq) and still matches the reference."""
    impl = fake_flashinfer.FlashInferAttention()
    impl.enable_cuda_graphs([3], max_pages_per_seq=64)
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL)
    assert ("fa2", "paged", True, True) in _FakeWrapper.log and ("fa2", "paged", False, True) in _FakeWrapper.log


def test_flashinfer_self_test_then_other_shapes(fake_flashinfer):
    """Workers self-test the very instance the model then uses, on other head counts / windows."""
    impl = fake_flashinfer.FlashInferAttention()
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL)
    self_test_attention(impl, "cpu", torch.float32, shape=SelfTestShape(16, 2, 32, 16, 8))
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL, seed=3)


def test_flashinfer_prepare_builds_every_variant_up_front(fake_flashinfer):
    impl = fake_flashinfer.FlashInferAttention(prefill_backend="fa2")
    dims = fake_flashinfer.AttentionDims(8, 2, 16, 4, torch.float32, torch.device("cpu"))
    impl.prepare(dims, {PageGroup.FULL: None, PageGroup.SLIDING: 8})
    assert set(_FakeWrapper.log) == {("fa2", "paged", True, False), ("fa2", "paged", False, False),
                                     ("fa2", "ragged", True, False), ("fa2", "ragged", False, False)}
    with pytest.raises(ConfigError, match="unknown FlashInfer backend"):
        fake_flashinfer.FlashInferAttention(decode_backend="fa4")
    with pytest.raises(ConfigError, match="unknown e4m3 decode kernel"):
        fake_flashinfer.FlashInferAttention(fp8_decode="fa2")


def test_flashinfer_fp8_kv_planning_matches_torch(fake_flashinfer):
    """e4m3 pages, fp8_decode="flashinfer": decode through the FP8 variant (fa2, per-head K/V scales),
    prefill stores and reads its keys back dequantised into the ragged kernel (fa3), chunks dequantise
    their prefix; caches bit-equal to the reference's and outputs within the self-test's tolerance."""
    fp8 = torch.float8_e4m3fn
    impl = fake_flashinfer.FlashInferAttention(fp8_decode="flashinfer")
    impl.enable_cuda_graphs([3], max_pages_per_seq=64)
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL, kv_dtype=fp8)
    assert impl._fp8_fallback is None and impl._triton_decode is None
    kinds = set(_FakeWrapper.log)
    assert {("fa2", "paged", True, True), ("fa2", "paged", False, True),  # decode of 3: graph wrappers
            ("fa2", "ragged", True, False), ("fa3", "ragged", False, False)} <= kinds  # prefill: sliding reads on fa2
    assert not any(b == "fa3" and kind == "paged" for b, kind, _, _ in kinds)  # fa3 cannot read e4m3 pages
    built = sys.modules["flashinfer.prefill"].built
    assert {(b, sliding) for b, uri, sliding in built if "e4m3" in uri} == {("fa2", False), ("fa2", True)}
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL)  # back to fp32 pages: new wrappers


def test_flashinfer_fp8_kv_decode_runs_on_the_triton_decode_kernel(fake_flashinfer, monkeypatch):
    """The default (fp8_decode="triton"): pure-decode steps over e4m3 pages go to the Triton decode
    kernel through a TritonAttention graphed like the backend (its static tables for batch 3), prefill keeps the
    ragged fa3 path, and the step mixing a one-token row with chunks reads the e4m3 pages in place on fa2's e4m3
    variant (fp8_mixed_paged; off: read back dequantised, and no e4m3 variant built)."""
    import kernels.triton_attention_backend as tab
    calls = []
    real = tab.paged_decode
    monkeypatch.setattr(tab, "paged_decode", lambda q, kv, *a, **kw: calls.append(kv[0].dtype) or real(q, kv, *a, **kw))
    impl = fake_flashinfer.FlashInferAttention()
    impl.enable_cuda_graphs([3], max_pages_per_seq=64)
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL, kv_dtype=torch.float8_e4m3fn)
    assert calls and set(calls) == {torch.float8_e4m3fn}
    assert sorted(impl._triton_decode._graph) == [(3, PageGroup.FULL, 64), (3, PageGroup.SLIDING, 64)]
    kinds = set(_FakeWrapper.log)
    assert ("fa3", "ragged", False, False) in kinds  # the first step: prompts only, read back into fa3
    assert {(b, kind, graph) for b, kind, _, graph in kinds if kind == "paged"} == {("fa2", "paged", False)}  # mixed
    assert {(b, sl) for b, uri, sl in sys.modules["flashinfer.prefill"].built if "e4m3" in uri} == {("fa2", False),
                                                                                                   ("fa2", True)}
    off = fake_flashinfer.FlashInferAttention()
    off.fp8_mixed_paged = False
    _FakeWrapper.log = []
    sys.modules["flashinfer.prefill"].built.clear()
    self_test_attention(off, "cpu", torch.float32, shape=SMALL, kv_dtype=torch.float8_e4m3fn)
    assert not any(kind == "paged" for _, kind, _, _ in _FakeWrapper.log)
    assert not any("e4m3" in uri for _, uri, _ in sys.modules["flashinfer.prefill"].built)
    calls.clear()
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL)  # fp32 pages: FlashInfer decodes again
    assert not calls and ("fa2", "paged", True, True) in set(_FakeWrapper.log)
    _FakeWrapper.log = []
    fresh = fake_flashinfer.FlashInferAttention()  # start-up builds no wrapper the e4m3 decode would not use
    fresh.prepare(fake_flashinfer.AttentionDims(8, 2, 16, 4, torch.float32, torch.device("cpu"), torch.float8_e4m3fn),
                  {PageGroup.FULL: None, PageGroup.SLIDING: 8})
    assert set(_FakeWrapper.log) == {("fa2", "ragged", True, False), ("fa3", "ragged", False, False)}


def test_flashinfer_triton_decode_takes_16bit_pages_too(fake_flashinfer, monkeypatch):
    """decode_kernel="triton" (--attention-backend flashinfer-triton-decode): pure-decode steps over
    16-bit (here fp32) pages run the Triton decode kernel in BF16_DECODE's config, graphed like the
    backend; prefill stays on FlashInfer; no FlashInfer decode wrapper is built at start-up."""
    import kernels.triton_attention_backend as tab
    from kernels.registry import make_attention
    from kernels.triton_decode import BF16_DECODE
    calls = []
    real = tab.paged_decode
    monkeypatch.setattr(tab, "paged_decode", lambda q, kv, *a, **kw: calls.append(kw.get("config")) or real(q, kv, *a, **kw))
    impl = fake_flashinfer.FlashInferAttention(decode_kernel="triton")
    assert impl.name == "flashinfer-triton-decode"
    impl.enable_cuda_graphs([3], max_pages_per_seq=64)
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL)
    assert calls and set(calls) == {BF16_DECODE}
    assert sorted(impl._triton_decode._graph) == [(3, PageGroup.FULL, 64), (3, PageGroup.SLIDING, 64)]
    _FakeWrapper.log = []
    fresh = fake_flashinfer.FlashInferAttention(decode_kernel="triton")
    fresh.prepare(fake_flashinfer.AttentionDims(8, 2, 16, 4, torch.float32, torch.device("cpu"), torch.float32),
                  {PageGroup.FULL: None, PageGroup.SLIDING: 8})
    assert not any(b == "fa2" and kind == "paged" for b, kind, _, _ in _FakeWrapper.log)  # fa2: the decode wrappers
    with pytest.raises(ConfigError, match="16-bit decode kernel"):
        fake_flashinfer.FlashInferAttention(decode_kernel="fa2")
    assert make_attention("flashinfer-triton-decode").name == "flashinfer-triton-decode"


def test_flashinfer_batch1_decode_on_the_triton_decode_kernel(fake_flashinfer, monkeypatch):
    """The default backend reads pure-decode steps of one sequence over 16-bit pages on the Triton decode kernel
    (ONE_SEQ_BF16_DECODE: b1-probes-1; TRITON_DECODE_MAX_SEQS, b1-ab-1), larger decode batches and prefills on
    FlashInfer; both match the reference. triton_decode_max_seqs = 0 keeps every decode step on fa2."""
    import dataclasses

    import kernels.triton_attention_backend as tab
    from kernels.triton_decode import ONE_SEQ_BF16_DECODE

    @dataclasses.dataclass(frozen=True)
    class OneSeq(SelfTestShape):
        def schedule(self):
            return [[(0, 2 * self.window + self.page_size + 5)], [(0, 1)], [(0, 1)]]

    calls = []
    real = tab.paged_decode
    monkeypatch.setattr(tab, "paged_decode", lambda q, kv, *a, **kw: calls.append((q.shape[0], kw.get("config")))
                        or real(q, kv, *a, **kw))
    one = OneSeq(**{f.name: getattr(SMALL, f.name) for f in dataclasses.fields(SelfTestShape)})
    impl = fake_flashinfer.FlashInferAttention()
    self_test_attention(impl, "cpu", torch.float32, shape=one)
    assert calls and set(calls) == {(1, ONE_SEQ_BF16_DECODE)}  # both decode steps, both layers
    _FakeWrapper.log, calls[:] = [], []
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL)  # its decode steps hold 3 sequences
    assert not calls and ("fa2", "paged", False, False) in _FakeWrapper.log
    off = fake_flashinfer.FlashInferAttention()
    off.triton_decode_max_seqs = 0
    _FakeWrapper.log = []
    self_test_attention(off, "cpu", torch.float32, shape=one)
    assert not calls and ("fa2", "paged", False, False) in _FakeWrapper.log


def test_flashinfer_fp8_kv_falls_back_to_triton_when_the_variant_does_not_build(fake_flashinfer, caplog):
    sys.modules["flashinfer.prefill"].fail = True
    impl = fake_flashinfer.FlashInferAttention(fp8_decode="flashinfer")
    with caplog.at_level("WARNING"):
        self_test_attention(impl, "cpu", torch.float32, shape=SMALL, kv_dtype=torch.float8_e4m3fn)
    assert impl._fp8_fallback is not None and impl._fp8_fallback.name == "triton"
    assert "FP8-KV attention runs on Triton" in caplog.text and "ninja" in caplog.text


def test_fp8_kv_variant_refuses_an_unknown_declaration():
    from kernels.flashinfer_fp8kv import fp8_variant_decl
    with pytest.raises(ConfigError, match="declaration changed"):
        fp8_variant_decl("struct Something {};")

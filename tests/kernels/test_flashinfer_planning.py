"""kernels/flashinfer_backend.py's planning on CPU, against a torch stand-in with FlashInfer's documented semantics
(tests/support/fake_flashinfer.py): which wrappers and backends each step kind takes, the CUDA-graph buffers, the
FP8-KV variant and its fallback, the decode steps it hands to the Triton decode kernel. The real FlashInfer is
covered by tests/kernels/test_attention_gpu.py."""

import sys

import pytest
import torch

from common.errors import ConfigError
from engine.selftest import SelfTestShape, self_test_attention
from model.kv_cache import PageGroup
from tests.support.fake_flashinfer import FakeWrapper

SMALL = SelfTestShape(num_q_heads=8, num_kv_heads=2, head_dim=16, window=8, page_size=4)  # test_attention_backends'


def test_flashinfer_planning_matches_torch(fake_flashinfer):
    impl = fake_flashinfer.FlashInferAttention()
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL)
    kinds = set(FakeWrapper.log)
    # prefill on fa3 (sm90a): a fresh prompt's full layers read ragged; prefill's sliding reads on fa2 (set_prefill_reads);
    # decode (and mixed steps) on fa2, paged, both window kinds
    assert {("fa3", "ragged", False, False), ("fa2", "ragged", True, False),
            ("fa2", "paged", True, False), ("fa2", "paged", False, False)} <= kinds
    assert ("fa3", "ragged", True, False) not in kinds
    # the reads before 2026-12-06: full layers stored then read paged on fa3, sliding reads on fa3
    FakeWrapper.log = []
    impl.set_prefill_reads("paged", "fa3")
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL)
    assert {("fa3", "paged", False, False), ("fa3", "ragged", True, False)} <= set(FakeWrapper.log)
    with pytest.raises(ConfigError, match="unknown prefill reads"):
        impl.set_prefill_reads("dense")


def test_flashinfer_decode_graph_buffers(fake_flashinfer):
    """With CUDA graphs enabled for batch 3, the decode step plans into static buffers (sized for
    max_pages_per_seq) and still matches the reference."""
    impl = fake_flashinfer.FlashInferAttention()
    impl.enable_cuda_graphs([3], max_pages_per_seq=64)
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL)
    assert ("fa2", "paged", True, True) in FakeWrapper.log and ("fa2", "paged", False, True) in FakeWrapper.log


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
    assert set(FakeWrapper.log) == {("fa2", "paged", True, False), ("fa2", "paged", False, False),
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
    kinds = set(FakeWrapper.log)
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
    kinds = set(FakeWrapper.log)
    assert ("fa3", "ragged", False, False) in kinds  # the first step: prompts only, read back into fa3
    assert {(b, kind, graph) for b, kind, _, graph in kinds if kind == "paged"} == {("fa2", "paged", False)}  # mixed
    assert {(b, sl) for b, uri, sl in sys.modules["flashinfer.prefill"].built if "e4m3" in uri} == {("fa2", False),
                                                                                                   ("fa2", True)}
    off = fake_flashinfer.FlashInferAttention()
    off.fp8_mixed_paged = False
    FakeWrapper.log = []
    sys.modules["flashinfer.prefill"].built.clear()
    self_test_attention(off, "cpu", torch.float32, shape=SMALL, kv_dtype=torch.float8_e4m3fn)
    assert not any(kind == "paged" for _, kind, _, _ in FakeWrapper.log)
    assert not any("e4m3" in uri for _, uri, _ in sys.modules["flashinfer.prefill"].built)
    calls.clear()
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL)  # fp32 pages: FlashInfer decodes again
    assert not calls and ("fa2", "paged", True, True) in set(FakeWrapper.log)
    FakeWrapper.log = []
    fresh = fake_flashinfer.FlashInferAttention()  # start-up builds no wrapper the e4m3 decode would not use
    fresh.prepare(fake_flashinfer.AttentionDims(8, 2, 16, 4, torch.float32, torch.device("cpu"), torch.float8_e4m3fn),
                  {PageGroup.FULL: None, PageGroup.SLIDING: 8})
    assert set(FakeWrapper.log) == {("fa2", "ragged", True, False), ("fa3", "ragged", False, False)}


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
    FakeWrapper.log = []
    fresh = fake_flashinfer.FlashInferAttention(decode_kernel="triton")
    fresh.prepare(fake_flashinfer.AttentionDims(8, 2, 16, 4, torch.float32, torch.device("cpu"), torch.float32),
                  {PageGroup.FULL: None, PageGroup.SLIDING: 8})
    assert not any(b == "fa2" and kind == "paged" for b, kind, _, _ in FakeWrapper.log)  # fa2: the decode wrappers
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
    FakeWrapper.log, calls[:] = [], []
    self_test_attention(impl, "cpu", torch.float32, shape=SMALL)  # its decode steps hold 3 sequences
    assert not calls and ("fa2", "paged", False, False) in FakeWrapper.log
    off = fake_flashinfer.FlashInferAttention()
    off.triton_decode_max_seqs = 0
    FakeWrapper.log = []
    self_test_attention(off, "cpu", torch.float32, shape=one)
    assert not calls and ("fa2", "paged", False, False) in FakeWrapper.log


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


def test_flashinfer_plan_max_of_a_tensor_does_not_iterate(monkeypatch):
    """FlashInfer 0.6.6's paged plan takes Python's max() of 1-D host tensors (max_q_len, max_kv_len), which walks
    the tensor element by element: import_flashinfer shadows the module's max with tensor_max (unless
    TANDEM_FI_TENSOR_MAX=0). A module with the
    plan's own lines gives the same values patched, without iterating a tensor; other uses of max are unchanged."""
    import types

    from kernels.flashinfer_host import patch_tensor_max, tensor_max

    plan = types.ModuleType("prefill_like")
    exec("def plan(qo_indptr, kv_lens):\n"
         "    max_q = max(qo_indptr[1:] - qo_indptr[:-1]).item()\n"
         "    return max_q, max(kv_lens).item(), max([3, 9, 4]), max(2, 7), max([], default=-1)\n", plan.__dict__)
    qo = torch.tensor([0, 1, 2, 302, 303], dtype=torch.int32)
    lens = torch.tensor([4000, 17, 8191, 5], dtype=torch.int32)
    want = plan.plan(qo, lens)
    assert want == (300, 8191, 9, 7, -1)

    def no_iter(self):
        raise AssertionError("a tensor was iterated")

    patch_tensor_max(plan)
    patch_tensor_max(plan)  # idempotent
    assert plan.max is tensor_max
    monkeypatch.setattr(torch.Tensor, "__iter__", no_iter)
    assert plan.plan(qo, lens) == want

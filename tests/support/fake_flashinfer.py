"""A torch stand-in for FlashInfer, for the CPU tests of kernels/flashinfer_backend.py's planning (page indices,
last-page lengths, window_left, chunk gathers, CUDA-graph static buffers, the FP8-KV variant's declaration and
JIT build): the fixture `fake_flashinfer` (tests/kernels/conftest.py) installs it. The real FlashInfer is covered
by tests/kernels/test_attention_gpu.py."""

from __future__ import annotations

import sys
import types

import torch

from kernels import reference as ref


class FakeWrapper:
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
        FakeWrapper.log.append((backend, "ragged" if ragged else "paged", self.sliding, use_cuda_graph))

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


def install(monkeypatch):
    """A stand-in `flashinfer` package in sys.modules (wrappers, the JIT build, the variant declarations) and
    kernels.flashinfer_backend importing it; returns that backend module."""
    fi = types.ModuleType("flashinfer")
    fi.BatchPrefillWithPagedKVCacheWrapper = lambda *a, **kw: FakeWrapper(False, *a, **kw)
    fi.BatchPrefillWithRaggedKVCacheWrapper = lambda *a, **kw: FakeWrapper(True, *a, **kw)
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
    FakeWrapper.log = []
    return fb



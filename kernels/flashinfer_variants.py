"""The FlashInfer 0.6.6 AttentionSink JIT variants this project builds: bf16 (or the model dtype)
pages for fa2 / fa3, and our e4m3-KV fa2 variant with per-KV-head scales (kernels/flashinfer_fp8kv.py).

`jit_args` is what the wrappers are constructed with (FlashInfer caches a built module by these
arguments); `build_variant` compiles or loads one ahead of the first step; `variant_spec` generates
its sources only (benchmarks/flashinfer_cache.py --prebuild on a machine without a GPU).
"""

from __future__ import annotations

import hashlib

import torch

from kernels.flashinfer_fp8kv import FP8_KV, FP8_VARIANT, fp8_variant_decl


def jit_args(backend: str, dtype: torch.dtype, head_dim: int, sliding: bool, kv_dtype: torch.dtype | None = None
             ) -> list:
    from flashinfer.jit.attention.variants import attention_sink_decl
    name = str(dtype).removeprefix("torch.")
    if kv_dtype == FP8_KV:  # paged reads of e4m3 pages: fa2 only (kernels/flashinfer_fp8kv.py)
        assert backend == "fa2", "FlashInfer reads bf16 queries against e4m3 pages with fa2 only"
        tensors, decl = ["sink", "k_scale", "v_scale"], fp8_variant_decl(attention_sink_decl["fa2"])
        # FlashInfer loads a carried module by its uri alone (benchmarks/flashinfer_cache.py restores
        # .so files as AOT modules, sources unchecked): the uri names our edit of the declaration, so a
        # module built from an older edit is never loaded for this one.
        tag = hashlib.sha256("\n".join([decl, *tensors]).encode()).hexdigest()[:8]
        uri = f"tandem_attention_sink_{name}_kv_e4m3_d{head_dim}_swa{int(sliding)}_{backend}_{tag}"
        return [uri, dtype, FP8_KV, dtype, torch.int32, head_dim, head_dim, tensors,
                ["float", "float", "float"], ["sm_scale"], ["double"], FP8_VARIANT, decl]
    uri = f"tandem_attention_sink_{name}_d{head_dim}_swa{int(sliding)}_{backend}"
    return [uri, dtype, dtype, dtype, torch.int32, head_dim, head_dim, ["sink"], ["float"], ["sm_scale"],
            ["double"], "AttentionSink", attention_sink_decl[backend]]


def variant_spec(backend: str, dtype: torch.dtype, head_dim: int, sliding: bool,
                 kv_dtype: torch.dtype | None = None):
    """FlashInfer's JitSpec of one variant (sources generated, nothing compiled or loaded): what a
    machine without a GPU builds ahead (benchmarks/flashinfer_cache.py --prebuild)."""
    from flashinfer.jit.attention.modules import gen_customize_batch_prefill_module
    return gen_customize_batch_prefill_module(backend, *jit_args(backend, dtype, head_dim, sliding, kv_dtype),
                                              use_sliding_window=sliding)


def build_variant(backend: str, dtype: torch.dtype, head_dim: int, sliding: bool,
                  kv_dtype: torch.dtype | None = None) -> None:
    """Compile (or load from the JIT cache) one AttentionSink variant exactly as the wrappers will
    ask for it (FlashInfer caches the module by these arguments), so start-up can build several
    variants in parallel threads: each build is a ninja/nvcc subprocess."""
    from flashinfer.prefill import get_customize_batch_prefill_module
    get_customize_batch_prefill_module(backend, *jit_args(backend, dtype, head_dim, sliding, kv_dtype),
                                       use_sliding_window=sliding)

"""Model construction and the arithmetic of the benchmarks: FLOPs of a prefill, bytes a decode
step must read (the HBM floor), KV state with random contents."""

from __future__ import annotations

import torch

from engine.build import EngineConfig, load_model
from model.config import GptOssConfig
from model.gpt_oss import GptOss
from model.kv_cache import KVManager, KVPool, PageGroup, plan_kv_cache
from model.parallel import ParallelConfig


def build(preset: str, attention: str, linear: str, moe: str, parallel: ParallelConfig | None = None,
          device: str = "cuda", fp8_attention: bool = True, mxfp4_experts: bool = False) -> GptOss:
    """mxfp4_experts: keep the MXFP4 experts too (a run whose settings use Fusion.MXFP4_MOE)."""
    cfg = EngineConfig(random_preset=preset, device=device, dtype="bfloat16", fp8=True, fp8_attention=fp8_attention,
                       attention_backend=attention,
                       linear_backend=linear, moe_backend=moe, parallel=parallel or ParallelConfig(),
                       mxfp4_experts=mxfp4_experts)
    return load_model(cfg)


def decode_state(model: GptOss, tokens_per_seq: int, num_seqs: int, kv_dtype: torch.dtype | None = None) -> tuple:
    """A KV pool just large enough for num_seqs sequences of tokens_per_seq tokens, in kv_dtype (None:
    the model dtype; e4m3 pools get the default scales, 1.0)."""
    cfg = model.cfg
    kv_dtype = kv_dtype or model.dtype
    probe = plan_kv_cache(cfg, 1 << 40, page_size=16, max_num_seqs=num_seqs + 1, tp_size=model.par.tp_size,
                          dtype=kv_dtype)
    full_pages = num_seqs * (-(-tokens_per_seq // 16)) + 2
    budget = (full_pages * probe.page_bytes(PageGroup.FULL)
              + (num_seqs + 1) * probe.ring_pages * probe.page_bytes(PageGroup.SLIDING))
    spec = plan_kv_cache(cfg, budget + probe.page_bytes(PageGroup.FULL), page_size=16, max_num_seqs=num_seqs + 1,
                         tp_size=model.par.tp_size, dtype=kv_dtype)
    return spec, KVPool(spec, model.device, kv_heads=model.par.kv_heads(cfg)), KVManager(spec)


def fill_random(pool: KVPool) -> None:
    """Random K/V (never time on zeros), in chunks to bound temporaries (e4m3 pools: N(0, 1) values
    rounded to e4m3, as a store with scale 1.0 would write them)."""
    for p in pool.pools:
        flat = p.view(-1)
        for i in range(0, flat.numel(), 1 << 28):
            chunk = flat[i:i + (1 << 28)]
            if chunk.dtype == torch.float8_e4m3fn:
                chunk.copy_(torch.randn(chunk.shape, device=chunk.device, dtype=torch.bfloat16))
            else:
                chunk.normal_()


def active_linear_params(cfg: GptOssConfig) -> int:
    """Weights one token multiplies through (excluding the unembedding): attention projections,
    router, and top-k experts."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    attn = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
    experts = cfg.num_experts_per_tok * (2 * i * h + i * h)
    return cfg.num_hidden_layers * (attn + h * cfg.num_local_experts + experts)


def prefill_flops(cfg: GptOssConfig, n: int) -> float:
    """Matmul FLOPs of a batch-1 prefill of n tokens (causal; window-aware on sliding layers),
    plus the unembedding of the last token."""
    lin = 2.0 * n * active_linear_params(cfg) + 2.0 * cfg.vocab_size * cfg.hidden_size
    w = cfg.sliding_window
    pairs_full = n * (n + 1) / 2
    pairs_win = sum(min(t + 1, w) for t in range(min(n, w))) + max(0, n - w) * w
    per_pair = 4.0 * cfg.num_attention_heads * cfg.head_dim  # QK^T and PV
    attn = per_pair * (len(cfg.full_layers) * pairs_full + len(cfg.sliding_layers) * pairs_win)
    return lin + attn


def floor_bytes_decode(cfg: GptOssConfig, batch: int, context: int, kv_bytes: int = 2) -> float:
    """Bytes one decode step must read at least: FP8 attention weights, bf16 router and
    unembedding, the experts the batch touches (expected count under uniform routing), and every
    sequence's K/V (sliding layers: only the window)."""
    h, i, e, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok
    attn = cfg.num_hidden_layers * (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h)
    router = cfg.num_hidden_layers * e * h * 2
    touched = e * (1 - (1 - k / e) ** batch)
    experts = cfg.num_hidden_layers * touched * 3 * i * h
    unembed = cfg.vocab_size * h * 2
    kv_tok = 2 * cfg.kv_size * kv_bytes
    kv = batch * kv_tok * (len(cfg.full_layers) * context + len(cfg.sliding_layers) * min(context, cfg.sliding_window))
    return attn + router + experts + unembed + kv


"""gpt-oss in torch, mirroring openai/gpt-oss `gpt_oss/torch/model.py` and HF `modeling_gpt_oss.py`.

Tokens are packed: a step feeds T tokens of B sequences as one [T, H] batch (positions and page
tables in `StepMeta`). Attention, linear and MoE call the backends chosen once at start-up; the
weights are filled in by `model.loader`. Shape legend: T tokens, H hidden, D head dim, Hq / Hkv
this rank's query / KV heads, E experts.

Model quirks, stated where they happen:
  * attention sinks: one learned logit per head in the softmax denominator, no value vector;
  * sliding window of 128 keys (incl. the current token) on even layers, full attention on odd;
  * QKV and O projections have biases; O's is added once across TP ranks;
  * MoE router has a bias; softmax over the top-k logits only (after top-k);
  * clamped SwiGLU with an (up + 1) term on interleaved gate/up columns; experts have biases;
  * the unembedding is untied.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels import reference as ref
from kernels.interface import ExpertWeights, StepMeta
from kernels.registry import Backends
from model.config import GptOssConfig
from model.kv_cache import KVPool, PageGroup
from model.labels import label
from model.parallel import MoEMode, ParallelConfig
from model.rope import Rotary


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: GptOssConfig, layer: int, par: ParallelConfig, dtype: torch.dtype, fp8: bool,
                 device: torch.device | str) -> None:
        super().__init__()
        self.layer = layer
        self.par = par
        self.num_heads = cfg.num_attention_heads // par.tp_size
        self.num_kv_heads = cfg.num_key_value_heads // par.tp_size
        self.head_dim = cfg.head_dim
        self.sm_scale = cfg.head_dim ** -0.5
        self.group = PageGroup.SLIDING if cfg.is_sliding(layer) else PageGroup.FULL
        # Only even layers slide; the window counts the current token (keys with q - k < W).
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None
        d, h = cfg.head_dim, cfg.hidden_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        wdt = torch.float8_e4m3fn if fp8 else dtype
        self.qkv_w = _empty((q + 2 * kv, h), wdt, device)
        self.qkv_s = _empty((-(-(q + 2 * kv) // 128), -(-h // 128)), torch.float32, device) if fp8 else None
        self.qkv_b = _empty((q + 2 * kv,), dtype, device)
        self.o_w = _empty((h, q), wdt, device)
        self.o_s = _empty((-(-h // 128), -(-q // 128)), torch.float32, device) if fp8 else None
        # Row-parallel output: the bias is added by one rank only.
        self.o_b = _empty((h,), dtype, device) if par.adds_replicated_bias else None
        self.sinks = _empty((self.num_heads,), torch.float32, device)  # raw logits, never scaled

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, be: Backends,
                kv: tuple[torch.Tensor, torch.Tensor] | None,
                kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return self.project(self.attend(self.qkv(x, be), cos, sin, be, kv, kv_scale), be)

    # The three parts of forward, apart for the piecewise CUDA graphs (engine/piecewise.py): qkv and
    # project are row-wise and captured; attend reads the KV cache and runs eagerly between graphs.
    def qkv(self, x: torch.Tensor, be: Backends) -> torch.Tensor:
        return be.attn_linear(x, self.qkv_w, self.qkv_s, self.qkv_b)  # [T, (Hq + 2 Hkv) D]

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, be: Backends,
               kv: tuple[torch.Tensor, torch.Tensor] | None,
               kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) D] -> attention output [T, Hq D]; stores this step's K/V."""
        t = qkv.shape[0]
        q_sz = self.num_heads * self.head_dim
        q, k, v = self.split_qkv(qkv)
        if be.fused_rope_store and kv is not None:  # the backend rotates q and k in its store's launch
            o = be.attention.forward(self.group, q, k, v, kv, self.sinks, self.sm_scale, self.window,
                                     kv_scale=kv_scale, rope=(cos, sin))
        else:
            if qkv.is_cuda:  # one Triton launch each instead of ~9 elementwise kernels; the same bits
                from kernels.triton_store_kv import rope_qk

                q, k = rope_qk(q, k, cos, sin)
            else:
                q, k = ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)
            o = be.attention.forward(self.group, q, k, v, kv, self.sinks, self.sm_scale, self.window,
                                     kv_scale=kv_scale)
        return o.reshape(t, q_sz)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k, v [T, Hkv, D], views. v stays a strided view of qkv
        (no copy kernel): the store kernels and the Triton attention take row/head strides, FlashInfer's
        dense paths make their own contiguous copies."""
        t, d = qkv.shape[0], self.head_dim
        q_sz, kv_sz = self.num_heads * d, self.num_kv_heads * d
        return (qkv[:, :q_sz].view(t, self.num_heads, d), qkv[:, q_sz:q_sz + kv_sz].view(t, self.num_kv_heads, d),
                qkv[:, q_sz + kv_sz:].reshape(t, self.num_kv_heads, d))

    def project(self, o: torch.Tensor, be: Backends) -> torch.Tensor:
        """o [T, Hq D] -> [T, H], summed over TP ranks."""
        return self.par.all_reduce(be.attn_linear(o, self.o_w, self.o_s, self.o_b))


class MoE(nn.Module):
    def __init__(self, cfg: GptOssConfig, par: ParallelConfig, dtype: torch.dtype, fp8: bool,
                 device: torch.device | str) -> None:
        super().__init__()
        self.cfg, self.par = cfg, par
        e_range, i_range = par.experts(cfg), par.intermediate(cfg)
        el, il, h = len(e_range), len(i_range), cfg.hidden_size
        wdt = torch.float8_e4m3fn if fp8 else dtype
        self.router_w = _empty((cfg.num_local_experts, h), dtype, device)  # replicated, stays native
        self.router_b = _empty((cfg.num_local_experts,), dtype, device)
        self.w1 = _empty((el, 2 * il, h), wdt, device)
        self.w1_s = _empty((el, -(-2 * il // 128), -(-h // 128)), torch.float32, device) if fp8 else None
        self.b1 = _empty((el, 2 * il), dtype, device)
        self.w2 = _empty((el, h, il), wdt, device)
        self.w2_s = _empty((el, -(-h // 128), -(-il // 128)), torch.float32, device) if fp8 else None
        # EP: each expert lives on one rank, so its b2 is added exactly once. TP: rank 0 adds it.
        has_b2 = par.moe_mode == MoEMode.EP or par.adds_replicated_bias
        self.b2 = _empty((el, h), dtype, device) if has_b2 else None
        self.expert_start = e_range.start
        # The checkpoint's MXFP4 experts, kept beside the compute copy when EngineConfig.mxfp4_experts asks
        # (model.loader, keep_mxfp4): one-token steps with Fusion.MXFP4_MOE read them (kernels/moe_mxfp4.py)
        self.mx = None
        self._mx_moe = None  # the kernel, where Triton runs for mx (a GPU, or the interpreter)

    def experts(self) -> ExpertWeights:
        return ExpertWeights(self.w1, self.w1_s, self.b1, self.w2, self.w2_s, self.b2, self.expert_start,
                             self.cfg.num_local_experts, self.cfg.swiglu_alpha, self.cfg.swiglu_limit)

    def keep_mxfp4(self, mx) -> None:
        """The loader's MXFP4 experts (kernels.moe_mxfp4.Mxfp4Experts) for Fusion.MXFP4_MOE."""
        from kernels import moe_mxfp4  # Triton imported only where the MXFP4 experts are kept

        self.mx = mx
        self._mx_moe = moe_mxfp4.SmallBatchMxfp4MoE() if mx.w1.is_cuda or moe_mxfp4.INTERPRETED else None

    def use_mxfp4_config(self, config) -> None:
        """Another kernels.moe_mxfp4.Mxfp4Config for the kept experts' kernel (benchmarks A/B its forms)."""
        if self._mx_moe is not None:
            self._mx_moe.config = config

    def takes_fp8_input(self, num_tokens: int, be: Backends) -> bool:
        if self._mxfp4_step(num_tokens, be):
            return False  # W4A16: x stays in its dtype
        return be.moe.takes_fp8_input(num_tokens, self.cfg.num_experts_per_tok, self.experts())

    def _mxfp4_step(self, num_tokens: int, be: Backends) -> bool:
        return self._mx_moe is not None and be.mxfp4_moe(num_tokens)

    def forward(self, x: torch.Tensor, be: Backends, logits: torch.Tensor | None = None,
                x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """logits / x_fp8: the router's output and x quantised 1x128, when the norm before made them."""
        if logits is None:
            # The router runs in the activation dtype (bf16 in bf16 mode): this mattered for accuracy.
            logits = torch.nn.functional.linear(x, self.router_w, self.router_b)  # [T, E]
        if self._mxfp4_step(x.shape[0], be):
            out = self._mx_moe(x, logits, self.cfg.num_experts_per_tok, self.mx)  # [T, H] partial
        else:
            out = be.moe(x, logits, self.cfg.num_experts_per_tok, self.experts(), x_fp8)  # [T, H] partial
        return self.par.all_reduce(out)


class Block(nn.Module):
    def __init__(self, cfg: GptOssConfig, layer: int, par: ParallelConfig, dtype: torch.dtype, fp8: bool,
                 device: torch.device | str, fp8_attention: bool) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.attn_norm = _empty((cfg.hidden_size,), torch.float32, device)  # norms stay fp32
        self.attn = Attention(cfg, layer, par, dtype, fp8_attention, device)
        self.mlp_norm = _empty((cfg.hidden_size,), torch.float32, device)
        self.mlp = MoE(cfg, par, dtype, fp8, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, be: Backends,
                kv: tuple[torch.Tensor, torch.Tensor] | None, pending: torch.Tensor | None = None,
                kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (residual stream, pending). With fused norms the MoE output is returned as `pending`
        and added by the next layer's (or the final) residual-add + RMSNorm kernel: one pass fewer
        per layer, the same bits as adding it here. The MoE's norm may also compute the router
        logits (Fusion.NORM_ROUTER, few tokens) and the FP8 copy of its output the MoE would make
        first (Fusion.NORM_QUANT); QKV takes bf16 by default, so the attention norm is add + norm."""
        x, h = self.attn_input(x, pending, be)
        return self.mlp_residual(x, self.attn(h, cos, sin, be, kv, kv_scale), be)

    def attn_input(self, x: torch.Tensor, pending: torch.Tensor | None, be: Backends
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (residual stream with `pending` added, its attention norm) [T, H] each."""
        if not be.fused_norm:
            assert pending is None
            return x, ref.rms_norm(x, self.attn_norm, self.eps)
        from kernels.norm import add_rms_norm, rms_norm

        if pending is None:
            return x, rms_norm(x, self.attn_norm, self.eps)
        return add_rms_norm(x, pending, self.attn_norm, self.eps)

    def mlp_residual(self, x: torch.Tensor, a: torch.Tensor, be: Backends) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x + the attention output a, then the MoE half -> (residual stream, pending) [T, H]."""
        if not be.fused_norm:
            x = x + a
            return x + self.mlp(ref.rms_norm(x, self.mlp_norm, self.eps), be), None
        from kernels.norm import fused_norm

        t = x.shape[0]
        router = (self.mlp.router_w, self.mlp.router_b) if be.norm_router(t, self.mlp.router_w.shape[0]) else None
        # residual add and the next norm in one pass (+ the router, + the MoE's FP8 input)
        n = fused_norm(x, a, self.mlp_norm, self.eps, quant=be.norm_quant(t) and self.mlp.takes_fp8_input(t, be),
                       router=router)
        return n.x, self.mlp(n.y, be, n.logits, (n.yq, n.ys) if n.yq is not None else None)


class GptOss(nn.Module):
    def __init__(self, cfg: GptOssConfig, backends: Backends, *, dtype: torch.dtype = torch.bfloat16,
                 fp8: bool = False, parallel: ParallelConfig | None = None,
                 device: torch.device | str = "cpu", fp8_attention: bool | None = None) -> None:
        """fp8: experts in FP8 128x128. fp8_attention (default: = fp8): the QKV and O projections too.
        Measured on the H200 (benchmarks/results/2026-11-30): at decode sizes (M <= 128) cuBLASLt's
        block-scaled FP8 GEMM streams weights at ~0.9 TB/s against ~2.9 TB/s for a bf16 GEMV, so the
        workers keep these projections (10 % of the weights) in bf16 by default. Prefill and decode
        workers must use the same choice, or their KV differs from single-process KV."""
        super().__init__()
        self.cfg, self.dtype, self.fp8, self.backends = cfg, dtype, fp8, backends
        self.fp8_attention = fp8 if fp8_attention is None else fp8_attention
        self.par = parallel or ParallelConfig()
        self.par.validate(cfg)
        self.device = torch.device(device)
        self.embed = _empty((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.layers = nn.ModuleList(Block(cfg, i, self.par, dtype, fp8, device, self.fp8_attention)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = _empty((cfg.hidden_size,), torch.float32, device)
        # untied; [V / tp, H] when vocab-parallel (ParallelConfig.vocab_parallel)
        self.lm_head = _empty((len(self.par.vocab_rows(cfg)), cfg.hidden_size), dtype, device)
        self.rotary = Rotary(cfg, device)
        self.checkpoint_kv_scales = None  # model.kv_scales.KVScales when the checkpoint has FP8 KV scales

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, step: StepMeta, kv: KVPool | None,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids [T] -> final-normed hidden states [T, H]. `on_layer_done(i)` runs after layer i
        has stored its K/V (the prefill worker starts that layer's KV transfer there)."""
        x = self.embed[input_ids]  # [T, H]
        cos, sin = self.rotary.cos_sin(step.positions)  # [T, D/2] each
        self.backends.attention.plan(step)
        pending = None  # the last MoE output, not yet added to x (fused norms only)
        for i, block in enumerate(self.layers):
            with label(f"layer{i}"):
                x, pending = block(x, cos, sin, self.backends, kv.layer_kv(i) if kv is not None else None, pending,
                                   kv.layer_scales(i) if kv is not None else None)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.final_norm(x, pending)

    def final_norm(self, x: torch.Tensor, pending: torch.Tensor | None) -> torch.Tensor:
        """(residual stream, pending MoE output) [T, H] -> final-normed hidden states [T, H]."""
        if self.backends.fused_norm:
            from kernels.norm import add_rms_norm, rms_norm

            if pending is None:
                return rms_norm(x, self.norm, self.cfg.rms_norm_eps)
            return add_rms_norm(x, pending, self.norm, self.cfg.rms_norm_eps)[1]
        return ref.rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in fp32 (every rank gets all of them)."""
        logits = torch.nn.functional.linear(hidden, self.lm_head)  # [N, V / tp] when vocab-parallel
        if self.par.vocab_parallel:
            logits = self.par.all_gather_last(logits)  # gathered in the model dtype: half the bytes of fp32
        return logits.float()

"""The torch reference backend: the ground truth, on any device and dtype (fp32, bf16, FP8 weights
dequantised, FP8 KV pages quantised on store and dequantised on read). Slow by design; every fast
backend is tested against it."""

from __future__ import annotations

import torch

from kernels import reference as ref
from kernels.interface import ExpertWeights, StepMeta


class TorchAttention:
    name = "torch"

    def __init__(self) -> None:
        self._step: StepMeta | None = None

    def plan(self, step: StepMeta) -> None:
        self._step = step

    def forward(self, group: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None, sinks: torch.Tensor, sm_scale: float,
                window: int | None, kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        step = self._step
        assert step is not None, "plan() must run before forward()"
        if rope is not None:
            q, k = ref.apply_rope(q, *rope), ref.apply_rope(k, *rope)
        g = step.groups[group]
        cu = step.cu_seqlens_q
        if kv is None or g is None:
            return ref.varlen_attention(q, k, v, cu, cu, sinks, sm_scale, window)
        k_cache, v_cache = kv
        if g.pages_hold_all:
            ref.store_kv(k, v, k_cache, v_cache, g.slot_mapping, kv_scale)
            return ref.paged_attention(q, k_cache, v_cache, g.page_table, cu, g.kv_lens, sinks, sm_scale, window,
                                       kv_scale)
        # Prefix from pages, new tokens as given; store only after attending (the ring is smaller
        # than the chunk, so storing first would overwrite keys the chunk still needs). With FP8
        # pages the prefix is read dequantised and the chunk's own K/V at full precision.
        page = k_cache.shape[2]
        k_s, v_s = kv_scale if kv_scale is not None else (None, None)
        ks, vs, cuk = [], [], [0]
        cq = cu.tolist()
        for b, pre in enumerate(g.prefix_lens_host):
            pages = g.page_table[b, : -(-pre // page)]
            ks += [ref.gather_pages(k_cache, pages, pre, k_s).float(), k[cq[b]:cq[b + 1]].float()]
            vs += [ref.gather_pages(v_cache, pages, pre, v_s).float(), v[cq[b]:cq[b + 1]].float()]
            cuk.append(cuk[-1] + pre + cq[b + 1] - cq[b])
        cu_k = torch.tensor(cuk, dtype=torch.int32, device=q.device)
        out = ref.varlen_attention(q, torch.cat(ks), torch.cat(vs), cu, cu_k, sinks, sm_scale, window)
        ref.store_kv(k, v, k_cache, v_cache, g.slot_mapping, kv_scale)
        return out


def _dequant(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return w if scale is None else ref.dequantize_fp8_blockwise(w, scale, dtype=dtype)


class TorchLinear:
    name = "torch"

    def __call__(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None,
                 bias: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, _dequant(w, w_scale, x.dtype), bias)


class TorchMoE:
    name = "torch"

    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int, w: ExpertWeights,
                 x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        vals, ids = torch.topk(router_logits, top_k, dim=-1)
        weights = torch.softmax(vals, dim=-1, dtype=vals.dtype)
        w1 = _dequant(w.w1, w.w1_scale, x.dtype)
        w2 = _dequant(w.w2, w.w2_scale, x.dtype)
        return ref.moe(x, weights, ids, w1, w.b1, w2, w.b2, w.alpha, w.limit, w.expert_start)

    def takes_fp8_input(self, num_tokens: int, top_k: int, w: ExpertWeights) -> bool:
        return False  # experts dequantised, x never quantised

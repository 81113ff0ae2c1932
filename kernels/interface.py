"""The contract between the model and its kernel backends.

StepMeta / GroupMeta are built once per step by `model.context.build_step_meta` (semantics in that
module's docstring). An attention backend is planned once per step and then called per layer; a
linear or MoE backend is a plain function table chosen once at start-up (`kernels.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(slots=True)
class GroupMeta:
    page_table: torch.Tensor  # [B, maxp] int32, logical order from view_start
    prefix_lens: torch.Tensor  # [B] int32
    kv_lens: torch.Tensor  # [B] int32
    slot_mapping: torch.Tensor  # [T] int64, -1 = not stored
    pages_hold_all: bool
    prefix_lens_host: list[int]
    kv_lens_host: list[int]
    # The page table's rows back to back on the host ([sum of row lengths] int32; row b holds the
    # ceil(kv_lens[b] / P) pages of its view): backends that want flat page lists (FlashInfer) take
    # them from here in one copy instead of gathering per page. None: not built (tests, benchmarks).
    page_ids_host: np.ndarray | None = None
    page_ids: torch.Tensor | None = None  # the same on the device (uploaded with the step's metadata)


@dataclass(slots=True)
class StepMeta:
    positions: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    q_lens_host: list[int]
    logits_indices: torch.Tensor  # [B] int64: each sequence's last new token
    groups: tuple[GroupMeta | None, GroupMeta | None]  # by PageGroup; None = no cache (dense only)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens_host)

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens_host)


class AttentionImpl(Protocol):
    name: str

    def plan(self, step: StepMeta) -> None:
        """Once per step, before the first layer (FlashInfer plans its wrappers here)."""

    def forward(self, group: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None, sinks: torch.Tensor, sm_scale: float,
                window: int | None, kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [T,Hq,D], k/v [T,Hkv,D] (RoPE applied); kv = (k_cache, v_cache) [NP,Hkv,P,D] of this
        layer or None (no cache: attend over the step's own tokens). Stores the new K/V per the
        group's slot_mapping. Returns [T,Hq,D]. FP8 (e4m3) caches: kv_scale = (k_scale, v_scale)
        [Hkv] fp32 of this layer (None = 1.0); stores quantise, reads dequantise (model/kv_scales.py).
        rope = (cos, sin) [T, D/2]: q and k come unrotated and the backend rotates them, in the
        store's launch where it stores before reading (Fusion.ROPE_STORE; the model passes it only
        with a cache, and only then)."""


@dataclass(slots=True)
class ExpertWeights:
    """One rank's experts. FP8 weights carry fp32 128x128 block scales; native ones carry None.

    Experts [expert_start, expert_start + El) are local (EP); with TP sharding each expert holds
    an I_l slice (gate/up pairs kept together) and b2 is None on all but one rank.
    """

    w1: torch.Tensor  # [El, 2*I_l, H], gate/up INTERLEAVED along rows
    w1_scale: torch.Tensor | None  # [El, ceil(2*I_l/128), ceil(H/128)]
    b1: torch.Tensor  # [El, 2*I_l]
    w2: torch.Tensor  # [El, H, I_l]
    w2_scale: torch.Tensor | None  # [El, ceil(H/128), ceil(I_l/128)]
    b2: torch.Tensor | None  # [El, H]
    expert_start: int
    num_experts: int  # global E
    alpha: float
    limit: float

    @property
    def num_local(self) -> int:
        return self.w1.shape[0]


class LinearImpl(Protocol):
    name: str

    def __call__(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None,
                 bias: torch.Tensor | None) -> torch.Tensor:
        """x [M,K] -> x W^T + b [M,N]; W [N,K] native or e4m3 with [ceil(N/128),ceil(K/128)] scales."""


class MoEImpl(Protocol):
    name: str

    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int, w: ExpertWeights,
                 x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [T,H], router_logits [T,E] -> this rank's share of the MoE output [T,H]: top-k, softmax
        over the k (logits dtype), local experts only, each weighted by its routing weight.
        x_fp8: x already quantised, `fp8_quant.quantize_act_1x128(x)`'s bits and layout (the fused
        norm makes it); only passed where `takes_fp8_input` said so."""

    def takes_fp8_input(self, num_tokens: int, top_k: int, w: ExpertWeights) -> bool:
        """Whether a call with this many tokens would start by quantising x 1x128 itself (and so
        can take x_fp8 instead)."""

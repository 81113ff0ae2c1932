"""Tensor / expert parallelism inside the layers (MODEL_SPEC.md §6).

One process group of size `tp_size` serves both attention (heads split by rank: q heads
[Hq/tp * r, ...), KV heads [Hkv/tp * r, ...), sinks sliced, O bias added once) and the MoE, which
is either
  * "tp": every rank holds every expert, sliced along I (gate/up pairs kept together; b2 added by
    rank 0 only), or
  * "ep": whole experts per rank (contiguous blocks of E/tp), inputs replicated, each rank keeps
    the (token, expert) pairs of its local experts -- the TP-only dispatch/combine: dispatch is a
    local selection and combine is the same single all-reduce TP needs. No all-to-all at DP1.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from common.errors import ConfigError
from model.config import GptOssConfig


class MoEMode(str, Enum):
    TP = "tp"
    EP = "ep"


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tp_size: int = 1
    tp_rank: int = 0
    moe_mode: MoEMode = MoEMode.TP
    group: Any = None  # torch.distributed ProcessGroup; None when tp_size == 1
    # Decode-sized all-reduces (<= this many bytes, CUDA only) through torch symmetric memory's
    # one-shot kernel: every rank reads its peers' buffers over NVLink and sums, one launch, no
    # NCCL protocol; NCCL above the limit. 0 = NCCL only. Multicast is never used.
    fast_allreduce_max_bytes: int = 0
    # Which one-shot kernel: "torch" (symm_mem.one_shot_all_reduce_copy) or "tandem"
    # (kernels/allreduce.py: one program per SM, rank-ordered fp32 sum; bf16 only).
    fast_allreduce_impl: str = "torch"
    # Unembedding split by vocabulary rows (each rank computes logits for V/tp tokens, one all-gather
    # assembles them) instead of replicated: a decode step reads 1/tp of the 1.16 GB bf16 lm_head.
    # The embedding stays replicated: a lookup reads T rows, and splitting it would add an all-reduce.
    vocab_parallel: bool = False

    def validate(self, cfg: GptOssConfig) -> None:
        tp = self.tp_size
        if self.fast_allreduce_impl not in ("torch", "tandem"):
            raise ConfigError(f"unknown fast all-reduce {self.fast_allreduce_impl!r}: torch or tandem")
        if cfg.num_key_value_heads % tp:
            raise ConfigError(f"TP {tp} does not divide {cfg.num_key_value_heads} KV heads (TP <= "
                              f"{cfg.num_key_value_heads} without KV replication)")
        if cfg.num_attention_heads % tp:
            raise ConfigError(f"TP {tp} does not divide {cfg.num_attention_heads} attention heads")
        if self.moe_mode == MoEMode.EP and cfg.num_local_experts % tp:
            raise ConfigError(f"expert parallelism over {tp} ranks needs the expert count "
                              f"({cfg.num_local_experts}) to be divisible by {tp}")
        if self.vocab_parallel and cfg.vocab_size % tp:
            raise ConfigError(f"vocab-parallel unembedding needs the vocabulary ({cfg.vocab_size}) divisible by TP {tp}")
        if self.moe_mode == MoEMode.TP and cfg.intermediate_size % tp:
            raise ConfigError(f"TP {tp} does not divide intermediate_size {cfg.intermediate_size}")

    # ---- shard ranges (global index ranges owned by this rank) --------------------------------
    def q_heads(self, cfg: GptOssConfig) -> range:
        n = cfg.num_attention_heads // self.tp_size
        return range(n * self.tp_rank, n * (self.tp_rank + 1))

    def kv_heads(self, cfg: GptOssConfig) -> range:
        n = cfg.num_key_value_heads // self.tp_size
        return range(n * self.tp_rank, n * (self.tp_rank + 1))

    def experts(self, cfg: GptOssConfig) -> range:
        if self.moe_mode == MoEMode.TP:
            return range(cfg.num_local_experts)
        n = cfg.num_local_experts // self.tp_size
        return range(n * self.tp_rank, n * (self.tp_rank + 1))

    def intermediate(self, cfg: GptOssConfig) -> range:
        if self.moe_mode == MoEMode.EP:
            return range(cfg.intermediate_size)
        n = cfg.intermediate_size // self.tp_size
        return range(n * self.tp_rank, n * (self.tp_rank + 1))

    def vocab_rows(self, cfg: GptOssConfig) -> range:
        """Rows of lm_head (token ids) this rank computes logits for."""
        if not self.vocab_parallel:
            return range(cfg.vocab_size)
        n = cfg.vocab_size // self.tp_size
        return range(n * self.tp_rank, n * (self.tp_rank + 1))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., tp * n], rank-major along the last dim."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    @property
    def adds_replicated_bias(self) -> bool:
        """Row-parallel outputs are summed over ranks: only rank 0 adds a replicated bias."""
        return self.tp_rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        if x.is_cuda and 0 < x.numel() * x.element_size() <= self.fast_allreduce_max_bytes:
            if self.fast_allreduce_impl == "tandem" and x.dtype == torch.bfloat16:
                return _tandem_one_shot(self.group, self.fast_allreduce_max_bytes // 2, x.device)(x)
            return _one_shot_all_reduce(x, self.group)
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x


_SYMM: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}
_TANDEM: dict[tuple[str, int], Any] = {}


def _tandem_one_shot(group: Any, max_numel: int, device: torch.device) -> Any:
    """Our one-shot kernel's state per (group, size): created on first use by every rank together,
    like the torch path's buffers (eager warm-up precedes any CUDA-graph capture)."""
    import torch.distributed as dist

    from kernels.allreduce import OneShotAllReduce

    key = ((group or dist.group.WORLD).group_name, max_numel)
    if key not in _TANDEM:
        _TANDEM[key] = OneShotAllReduce.symmetric(group, max_numel, device)
    return _TANDEM[key]


def _one_shot_all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over the group with symmetric memory's one-shot kernel. One symmetric buffer per
    (group, shape, dtype), created on first use by every rank together (a collective); a CUDA-graph
    capture is always preceded by eager warm-up steps of the same shapes, so capture never creates
    one. `one_shot_all_reduce_copy` (torch >= 2.8) stages x into the buffer inside the same kernel."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    name = (group or dist.group.WORLD).group_name
    key = (name, tuple(x.shape), x.dtype)
    buf = _SYMM.get(key)
    if buf is None:
        buf = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buf, name)
        _SYMM[key] = buf
    if hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        return torch.ops.symm_mem.one_shot_all_reduce_copy(buf, x.contiguous(), "sum", name)
    buf.copy_(x)
    return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)

"""TritonAttention: the AttentionImpl on our own Triton kernels (kernels/triton_attention.py,
kernels/triton_store_kv.py), with exactly the semantics of `TorchAttention`.

Lifecycle: `plan(step)` once per step builds the per-group sequence tables on the device (one
small host->device copy each); `forward` is then called per layer:
  * no cache (kv None or the group has no pages): causal attention over the step's own tokens;
  * pages_hold_all: store the new K/V first, then read every key through the page table;
  * otherwise (a sliding layer fed a prefill chunk larger than its ring): attend over the prefix
    from pages plus the new K/V given densely, and only then store (storing first would overwrite
    ring slots the chunk still needs).
With rope= (Fusion.ROPE_STORE) q and k arrive unrotated; the pages_hold_all path rotates them in its
store's launch (`rope_qk_store_kv`), the others rotate them first.
FP8 (e4m3) pages: the store quantises with the layer's per-head scales, the kernel dequantises the
paged range in registers (kernels/triton_attention.py); plan() does not depend on the KV dtype.

Which kernel reads the pages of a pure-decode step (`DecodeKernel`, default FP8): the decode kernel
(kernels/triton_decode.py) for e4m3 pages, which the generic kernel reads at ~0.42 of copy bandwidth
(in bf16's time: instruction-bound, see that module); the generic `_attn_fwd` for every other step,
and for 16-bit pages until the attention benchmark's triton-decode rows show the decode kernel ahead
there too (then ALL).

Decode CUDA graphs: after `enable_cuda_graphs(batch_sizes, max_pages_per_seq)`, a pure-decode
step of one of those batch sizes plans into static buffers (sequence table, page table, slots)
owned per (batch size, group); the split count is fixed from the capacity, so the launch grid
never changes. plan() runs outside the graph, forward() inside it; planning the same StepMeta
again is a no-op (the model's forward plans too, also while being captured).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from kernels.interface import GroupMeta, StepMeta
from kernels.triton_attention import AttnBatch, KernelConfig, sink_attention
from kernels.triton_decode import FP8, DecodeConfig, decode_supported, paged_decode
from kernels.triton_store_kv import rope_qk, rope_qk_store_kv, store_kv


class DecodeKernel(str, Enum):
    """Which pages a pure-decode step reads with the decode kernel (the rest: the generic one)."""

    OFF = "off"
    FP8 = "fp8"  # e4m3 pages only
    ALL = "all"


def _num_sms(device: torch.device) -> int:
    """SMs the split heuristics fill; 0 on the CPU interpreter (there splits only cost time; the
    kernel tests force them explicitly)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 0


@dataclass(slots=True)
class _GraphBuffers:
    batch: AttnBatch  # seq_info / page_table are static; host kv_lens = capacity (fixed splits)
    slots: torch.Tensor  # [B] int64


class TritonAttention:
    name = "triton"

    def __init__(self, *, config: KernelConfig | None = None, num_splits: int | None = None,
                 decode: DecodeKernel | str = DecodeKernel.FP8, decode_config: DecodeConfig | None = None) -> None:
        """config (generic kernel) / decode_config (decode kernel) / num_splits (both) override the
        per-step heuristics (tests, benchmarks, tuning)."""
        self._config = config
        self._num_splits = num_splits
        self._decode = DecodeKernel(decode)
        self._decode_config = decode_config
        self._step: StepMeta | None = None
        self._dense: AttnBatch | None = None
        self._groups: list[AttnBatch | None] = []
        self._slots: list[torch.Tensor | None] = []
        self._num_sms: int | None = None
        self._graph_sizes: set[int] = set()
        self._graph_max_pages = 0
        self._graph: dict[tuple[int, int, int], _GraphBuffers] = {}

    def enable_cuda_graphs(self, batch_sizes: Sequence[int], max_pages_per_seq: int) -> None:
        self._graph_sizes = set(batch_sizes)
        self._graph_max_pages = max_pages_per_seq

    def plan(self, step: StepMeta) -> None:
        if step is self._step:
            return  # already planned: GptOss.forward re-plans inside a CUDA-graph capture, where host work is illegal
        self._step = step
        device = step.cu_seqlens_q.device
        if self._num_sms is None:
            self._num_sms = _num_sms(device)
        q_lens = step.q_lens_host
        graphed = step.is_decode and step.num_seqs in self._graph_sizes
        self._dense = None
        self._groups, self._slots = [], []
        for gi, g in enumerate(step.groups):
            if g is None:
                self._groups.append(None)
                self._slots.append(None)
            elif graphed and g.pages_hold_all:
                buf = self._static(gi, g, step, device)
                self._groups.append(buf.batch)
                self._slots.append(buf.slots)
            else:
                paged = g.kv_lens_host if g.pages_hold_all else g.prefix_lens_host
                self._groups.append(AttnBatch.build(q_lens, paged, g.kv_lens_host, g.page_table, device))
                self._slots.append(g.slot_mapping)

    def _static(self, gi: int, g: GroupMeta, step: StepMeta, device: torch.device) -> _GraphBuffers:
        b, maxp = step.num_seqs, self._graph_max_pages
        buf = self._graph.get((b, gi, maxp))  # buffers are sized by the page capacity
        if buf is None:
            # kv_lens stays empty until forward sees the page size: then the capacity, so the
            # split count (and the launch grid) is the same for every step
            batch = AttnBatch(torch.zeros(5, b, dtype=torch.int32, device=device),
                              torch.zeros(b, maxp, dtype=torch.int32, device=device), [1] * b, [])
            buf = self._graph[(b, gi, maxp)] = _GraphBuffers(batch, torch.empty(b, dtype=torch.int64, device=device))
        width = g.page_table.shape[1]
        assert width <= maxp, f"page table of {width} pages exceeds the graph capacity {maxp}"
        fresh = AttnBatch.build(step.q_lens_host, g.kv_lens_host, g.kv_lens_host, None, "cpu")
        buf.batch.seq_info.copy_(fresh.seq_info, non_blocking=True)
        buf.batch.page_table[:, :width].copy_(g.page_table)
        buf.slots.copy_(g.slot_mapping)
        return buf

    def _dense_batch(self, device: torch.device) -> AttnBatch:
        if self._dense is None:
            assert self._step is not None
            q_lens = self._step.q_lens_host
            self._dense = AttnBatch.build(q_lens, [0] * len(q_lens), q_lens, None, device)
        return self._dense

    def forward(self, group: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None, sinks: torch.Tensor, sm_scale: float,
                window: int | None, kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        step = self._step
        assert step is not None, "plan() must run before forward()"
        g = step.groups[group]
        cfg, splits = self._config, self._num_splits
        target = max(1, 2 * (self._num_sms or 0))  # the generic kernel: about two programs per SM
        if rope is not None and not (kv is not None and g is not None and g.pages_hold_all):
            q, k = rope_qk(q, k, *rope)  # no store ahead of the read to fuse with
            rope = None
        if kv is None or g is None:
            return sink_attention(q, k, v, None, self._dense_batch(q.device), sinks, sm_scale, window,
                                  config=cfg, num_splits=splits, target_programs=target)
        batch, slots = self._groups[group], self._slots[group]
        assert batch is not None and slots is not None
        k_cache, v_cache = kv
        if not batch.kv_lens:  # a graph table
            batch.kv_lens = [self._graph_max_pages * k_cache.shape[2]] * batch.num_seqs
        if g.pages_hold_all:
            if rope is not None:  # rotated k also comes back dense (cheap), though the paged read covers every key
                q, k = rope_qk_store_kv(q, k, v, k_cache, v_cache, slots, *rope, kv_scale, write_k=True)
            else:
                store_kv(k, v, k_cache, v_cache, slots, kv_scale)
            if self._decodes(batch, q, kv):
                return paged_decode(q, kv, batch, sinks, sm_scale, window, kv_scale=kv_scale,
                                    config=self._decode_config, num_splits=splits, num_sms=self._num_sms or 0)
            return sink_attention(q, k, v, kv, batch, sinks, sm_scale, window, config=cfg, num_splits=splits,
                                  target_programs=target, kv_scale=kv_scale)
        out = sink_attention(q, k, v, kv, batch, sinks, sm_scale, window, config=cfg, num_splits=splits,
                             target_programs=target, kv_scale=kv_scale)
        store_kv(k, v, k_cache, v_cache, slots, kv_scale)
        return out

    def _decodes(self, batch: AttnBatch, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether this paged read goes to the decode kernel (every key in the pages, q_len 1)."""
        if self._decode == DecodeKernel.OFF or batch.max_q_len != 1:
            return False
        if self._decode == DecodeKernel.FP8 and kv[0].dtype != FP8:
            return False
        return decode_supported(q, kv)

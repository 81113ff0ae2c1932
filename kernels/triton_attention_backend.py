"""TritonAttention: the AttentionImpl on our own Triton kernels (kernels/triton_attention.py,
kernels/triton_store_kv.py), with exactly the semantics of `TorchAttention`.

Lifecycle: `plan(step)` once per step builds the per-group sequence tables on the device (one
small host->device copy each); `forward` is then called per layer:
  * no cache (kv None or the group has no pages): causal attention over the step's own tokens;
  * pages_hold_all: store the new K/V first, then read every key through the page table;
  * otherwise (a sliding layer fed a prefill chunk larger than its ring): attend over the prefix
    from pages plus the new K/V given densely, and only then store (storing first would overwrite
    ring slots the chunk still needs).
"""

from __future__ import annotations

import torch

from kernels.interface import StepMeta
from kernels.triton_attention import AttnBatch, KernelConfig, sink_attention
from kernels.triton_store_kv import store_kv


def _target_programs(device: torch.device) -> int:
    """Split the KV range until about two programs per SM run; never on the CPU interpreter
    (there splits only cost time; the kernel tests force them explicitly)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1


class TritonAttention:
    name = "triton"

    def __init__(self, *, config: KernelConfig | None = None, num_splits: int | None = None) -> None:
        """config / num_splits override the per-step heuristics (tests, benchmarks, tuning)."""
        self._config = config
        self._num_splits = num_splits
        self._step: StepMeta | None = None
        self._dense: AttnBatch | None = None
        self._groups: list[AttnBatch | None] = []
        self._target_programs: int | None = None

    def plan(self, step: StepMeta) -> None:
        self._step = step
        device = step.cu_seqlens_q.device
        if self._target_programs is None:
            self._target_programs = _target_programs(device)
        q_lens = step.q_lens_host
        self._dense = None
        self._groups = []
        for g in step.groups:
            if g is None:
                self._groups.append(None)
            elif g.pages_hold_all:
                self._groups.append(AttnBatch.build(q_lens, g.kv_lens_host, g.kv_lens_host, g.page_table, device))
            else:
                self._groups.append(AttnBatch.build(q_lens, g.prefix_lens_host, g.kv_lens_host, g.page_table, device))

    def _dense_batch(self, device: torch.device) -> AttnBatch:
        if self._dense is None:
            assert self._step is not None
            q_lens = self._step.q_lens_host
            self._dense = AttnBatch.build(q_lens, [0] * len(q_lens), q_lens, None, device)
        return self._dense

    def forward(self, group: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None, sinks: torch.Tensor, sm_scale: float,
                window: int | None) -> torch.Tensor:
        step = self._step
        assert step is not None, "plan() must run before forward()"
        g = step.groups[group]
        opts = dict(config=self._config, num_splits=self._num_splits, target_programs=self._target_programs or 1)
        if kv is None or g is None:
            return sink_attention(q, k, v, None, self._dense_batch(q.device), sinks, sm_scale, window, **opts)
        batch = self._groups[group]
        assert batch is not None
        k_cache, v_cache = kv
        if g.pages_hold_all:
            store_kv(k, v, k_cache, v_cache, g.slot_mapping)
            return sink_attention(q, k, v, kv, batch, sinks, sm_scale, window, **opts)
        out = sink_attention(q, k, v, kv, batch, sinks, sm_scale, window, **opts)
        store_kv(k, v, k_cache, v_cache, g.slot_mapping)
        return out

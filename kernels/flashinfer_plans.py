"""The planning half of FlashInferAttention (kernels/flashinfer_backend.py): FlashInfer's wrappers, built once per
(role, kind, window, backend, graph batch), and each page group's plan for a step (paged, ragged over a gathered
[prefix ; new], the FP8 prefill's read-back, dense). A mixin: it reads the backend's state and helpers (_fi, _dims,
_workspace, _backend, _wrappers, _graph_*, _fp8_paged(), fresh_prefill, sliding_prefill, mixed_role,
fp8_mixed_paged), which FlashInferAttention sets up. GPU only, like the backend."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels.flashinfer_fp8kv import read_slots
from kernels.flashinfer_host import chunk_gather_indices, chunk_row_sources, host_cu, pinned
from kernels.flashinfer_variants import jit_args
from kernels.interface import GroupMeta, StepMeta

log = logging.getLogger("kernels.flashinfer_backend")


@dataclass(slots=True)
class GroupPlan:
    """What one page group needs at forward time in the current step."""

    kind: str  # "paged" | "ragged"
    wrapper: object
    slots: torch.Tensor | None = None  # [T] int64 slot_mapping to store with (static when graphed)
    gather: torch.Tensor | None = None  # [Tk] int64 dense row sources (gather_kv): slot, or -(new row + 1)
    read_slots: torch.Tensor | None = None  # FP8 prefill: store first, then every key read back from pages


class FlashInferPlans:
    """Wrappers and per-group plans (see the module docstring)."""

    def _wrapper(self, role: str, kind: str, window_left: int, graph_batch: int = 0):
        d = self._dims
        assert d is not None and self._workspace is not None
        backend = "fa2" if kind == "paged" and d.fp8_kv else self._backend[role]
        if kind == "ragged" and window_left >= 0 and role == "prefill" and self.sliding_prefill:
            backend = self.sliding_prefill
        # Graph wrappers own index buffers sized by the page capacity: a new capacity needs new ones.
        key = (role, kind, window_left, backend, graph_batch, self._graph_max_pages if graph_batch else 0)
        w = self._wrappers.get(key)
        if w is not None:
            return w
        try:
            w = self._make_wrapper(backend, kind, window_left, graph_batch)
        except Exception as e:  # a failed fa3 JIT build: fall back to fa2 for good
            if backend != "fa3":
                raise
            log.warning("FlashInfer fa3 build failed (%s); falling back to fa2 for %s", e, role)
            self._backend[role] = "fa2"
            w = self._make_wrapper("fa2", kind, window_left, graph_batch)
        self._wrappers[key] = w
        return w

    def _make_wrapper(self, backend: str, kind: str, window_left: int, graph_batch: int):
        fi, d = self._fi, self._dims
        args = jit_args(backend, d.dtype, d.head_dim, window_left >= 0, d.kv_dtype if kind == "paged" else None)
        jit_kwargs = {"use_sliding_window": window_left >= 0}
        if kind == "ragged":
            return fi.BatchPrefillWithRaggedKVCacheWrapper(self._workspace, "NHD", backend=backend,
                                                           jit_args=args, jit_kwargs=jit_kwargs)
        if graph_batch:
            dev, n = d.device, graph_batch
            return fi.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "HND", use_cuda_graph=True,
                qo_indptr_buf=torch.zeros(n + 1, dtype=torch.int32, device=dev),
                paged_kv_indptr_buf=torch.zeros(n + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buf=torch.zeros(n * self._graph_max_pages, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buf=torch.zeros(n, dtype=torch.int32, device=dev),
                backend=backend, jit_args=args, jit_kwargs=jit_kwargs)
        return fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "HND", backend=backend,
                                                      jit_args=args, jit_kwargs=jit_kwargs)

    def _plan_group(self, step: StepMeta, g: GroupMeta, window_left: int) -> GroupPlan:
        d = self._dims
        assert d is not None
        cu_q = host_cu(step)
        fresh = not step.is_decode and not any(g.prefix_lens_host)
        if not g.pages_hold_all or (fresh and self.fresh_prefill == "ragged" and not d.fp8_kv):
            return self._plan_chunk(step, g, window_left, cu_q)  # no prefix: no gather, the step's own k/v
        # e4m3 pages: a prefill step stores, then reads every key back dequantised into the bf16 ragged kernel (fa3's
        # speed on long prompts). A step that also holds one-token rows reads the pages in place (fa2's e4m3 variant):
        # read back, each decode row would dequantise its whole context every layer (served multi-turn with e4m3
        # pages, b1-defaults-ab-1: mixed steps of ~310 tokens beside ~60 decodes spanned 35.9 ms on the GPU against
        # 20.5 on bf16 pages, while decode steps were faster: 9.0 vs 10.0 ms).
        if d.fp8_kv and not step.is_decode and not (
                self.fp8_mixed_paged and 1 in step.q_lens_host and self._fp8_paged(d)):
            return self._plan_fp8_prefill(g, window_left, cu_q)
        p, maxp = d.page_size, g.page_table.shape[1]
        num_pages = [-(-n // p) for n in g.kv_lens_host]
        if g.page_ids is not None and g.page_ids_host is not None and len(g.page_ids_host) == sum(num_pages):
            indices = g.page_ids  # uploaded with the step's metadata (model.context.Upload)
        elif g.page_ids_host is not None and len(g.page_ids_host) == sum(num_pages):
            # one host -> device copy of the rows back to back (a per-page gather cost ~10 ms per
            # step at batch 128 x 8k on the H200's host)
            indices = pinned(torch.from_numpy(g.page_ids_host)).to(d.device, non_blocking=True)
        else:
            flat = [b * maxp + j for b, n in enumerate(num_pages) for j in range(n)]
            indices = g.page_table.flatten()[pinned(torch.tensor(flat, dtype=torch.long)).to(d.device, non_blocking=True)]
        indptr = pinned(torch.tensor([0] + num_pages, dtype=torch.int32).cumsum(0, dtype=torch.int32))
        last = pinned(torch.tensor([n - (k - 1) * p for n, k in zip(g.kv_lens_host, num_pages)], dtype=torch.int32))
        decode = step.is_decode
        graph = step.num_seqs if decode and step.num_seqs in self._graph_sizes else 0
        w = self._wrapper(self._role(step), "paged", window_left, graph)
        # seq_lens: without it FlashInfer's paged plan (0.6.6, prefill.py) derives the lengths into a pageable
        # tensor and copies that to the device, and to stage pageable memory the driver may synchronise with
        # the stream, i.e. wait for the step in flight (the overlapped loop plans step N+1 while N runs).
        # Pinned lengths (the same values) keep the copy asynchronous.
        lens = pinned(torch.tensor(g.kv_lens_host, dtype=torch.int32))
        w.plan(cu_q, indptr, indices, last, d.num_q_heads, d.num_kv_heads, d.head_dim, p, causal=True,
               window_left=window_left, q_data_type=d.dtype, kv_data_type=d.kv_dtype or d.dtype, seq_lens=lens)
        slots = g.slot_mapping
        if graph:  # the captured store must read this step's slots: copy them into a static buffer
            slots = self._graph_slots.get((graph, window_left))
            if slots is None:
                slots = self._graph_slots[(graph, window_left)] = torch.empty(graph, dtype=torch.int64, device=d.device)
            slots.copy_(g.slot_mapping)
        return GroupPlan("paged", w, slots)

    def _role(self, step: StepMeta) -> str:
        """Whose kernel reads this step: decode steps the decode role's, steps mixing one-token rows
        with chunks `mixed_role`'s (see __init__), prefill steps the prefill role's."""
        return "decode" if step.is_decode else self.mixed_role if 1 in step.q_lens_host else "prefill"

    def _plan_chunk(self, step: StepMeta, g: GroupMeta, window_left: int, cu_q: torch.Tensor) -> GroupPlan:
        """Prefix from pages + new tokens, made dense by one gather per layer (sliding prefixes are
        at most W + P tokens per sequence). The gather's indices are built with numpy and uploaded
        in one pinned, non-blocking copy: this plan runs for every step with a prefill chunk wider
        than the ring (each later turn's suffix), and a synchronous `.to(device)` there waited for
        the step in flight, so the overlapped loop lost its overlap on exactly those steps."""
        d = self._dims
        p, maxp = d.page_size, g.page_table.shape[1]
        flat, offs, dst_pre, dst_new, cu_k = chunk_gather_indices(g.prefix_lens_host, step.q_lens_host, maxp, p)
        dev = d.device
        gather = None
        if flat.size:
            gather = chunk_row_sources(flat, offs, dst_pre, dst_new, g.page_table, p,
                                       lambda a: pinned(torch.from_numpy(a)).to(dev, non_blocking=True))
        w = self._wrapper(self._role(step), "ragged", window_left)
        w.plan(cu_q, pinned(torch.from_numpy(cu_k)), d.num_q_heads, d.num_kv_heads, d.head_dim, causal=True,
               window_left=window_left, q_data_type=d.dtype, kv_data_type=d.dtype)
        return GroupPlan("ragged", w, gather=gather)

    def _plan_fp8_prefill(self, g: GroupMeta, window_left: int, cu_q: torch.Tensor) -> GroupPlan:
        """A prefill step over e4m3 pages: forward stores, then reads every key of each view back
        dequantised (`gather_kv`) and runs the bf16 ragged kernel (fa3 on sm90a): the keys are
        exactly what the paged read would see, at ragged-kernel speed."""
        d = self._dims
        slots = pinned(torch.from_numpy(read_slots(g, d.page_size))).to(d.device, non_blocking=True)
        cu_k = pinned(torch.tensor([0] + list(g.kv_lens_host), dtype=torch.int32).cumsum(0, dtype=torch.int32))
        w = self._wrapper("prefill", "ragged", window_left)
        w.plan(cu_q, cu_k, d.num_q_heads, d.num_kv_heads, d.head_dim, causal=True, window_left=window_left,
               q_data_type=d.dtype, kv_data_type=d.dtype)
        return GroupPlan("ragged", w, g.slot_mapping, read_slots=slots)

    def _plan_dense(self, step: StepMeta, window_left: int) -> GroupPlan:
        d = self._dims
        cu = host_cu(step)
        w = self._wrapper("prefill", "ragged", window_left)
        w.plan(cu, cu, d.num_q_heads, d.num_kv_heads, d.head_dim, causal=True, window_left=window_left,
               q_data_type=d.dtype, kv_data_type=d.dtype)
        return GroupPlan("ragged", w)

    # ---- per layer ---------------------------------------------------------------------------------

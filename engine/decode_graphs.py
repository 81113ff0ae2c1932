"""Decode CUDA graphs: one graph per batch-size bucket, all sharing one memory pool.

A pure-decode step of B sequences (q_len 1 each) is padded to the smallest bucket >= B with dummy
sequences that read and write one reserved page per group (their outputs are dropped), the step's
token ids and positions are copied into static buffers, the attention backend is planned outside
the graph (it copies page tables into its own static buffers), and the captured forward + logits
are replayed. Prefill and mixed steps stay eager here (engine/piecewise.py graphs their pieces). A decode worker
captures these at start-up on a GPU (--cuda-graphs), the offline engine with EngineConfig.cuda_graphs.
"""

from __future__ import annotations

import logging

import torch

from kernels.interface import StepMeta
from model.context import SeqStep, build_step_meta
from model.gpt_oss import GptOss
from model.kv_cache import KVManager, KVPool, PageGroup, SeqPages

log = logging.getLogger("tandem.decode.graphs")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class CudaGraphDecoder:
    def __init__(self, model: GptOss, pool: KVPool, kv: KVManager, max_batch: int, max_model_len: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        self.model, self.pool = model, pool
        self.buckets = tuple(b for b in buckets if b <= max_batch) or (max_batch,)
        spec = pool.spec
        self.max_pages = -(-max_model_len // spec.page_size)
        # One reserved page per group for padding sequences (never freed while the runner lives).
        self.dummy = SeqPages(kv.alloc[PageGroup.FULL].allocate(1) if spec.full_layers else [],
                              kv.alloc[PageGroup.SLIDING].allocate(1) if spec.sliding_layers else [])
        dev = model.device
        n = self.buckets[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)  # [B] static inputs
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mempool = None
        model.backends.attention.enable_cuda_graphs(self.buckets, self.max_pages)

    def bucket(self, b: int) -> int | None:
        return next((x for x in self.buckets if x >= b), None)

    def _padded_meta(self, steps: list[SeqStep], b: int) -> StepMeta:
        pad = [SeqStep(self.dummy, 0, 1)] * (b - len(steps))
        meta = build_step_meta(steps + pad, self.pool.spec, self.model.device)
        self.positions[:b].copy_(meta.positions)
        meta.positions = self.positions[:b]
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, so smaller graphs reuse the pool's memory."""
        for b in sorted(self.buckets, reverse=True):
            meta = self._padded_meta([], b)
            self.model.backends.attention.plan(meta)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton autotune / FlashInfer JIT outside capture
                    self.model.compute_logits(self.model(self.ids[:b], meta, self.pool))
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.mempool):
                logits = self.model.compute_logits(self.model(self.ids[:b], meta, self.pool))  # [b, V]
            self.mempool = self.mempool or g.pool()
            self.graphs[b] = (g, logits)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", sorted(self.graphs))

    @torch.inference_mode()
    def prepare(self, input_ids: torch.Tensor, steps: list[SeqStep]) -> int | None:
        """Host work of a step: static inputs and the backend's plan. Returns the bucket, or None
        when the step is not a graphable decode step."""
        n = len(steps)
        b = self.bucket(n)
        if b is None or b not in self.graphs or any(s.q_len != 1 for s in steps):
            return None
        meta = self._padded_meta(steps, b)
        self.ids[:n].copy_(input_ids)
        self.model.backends.attention.plan(meta)  # host work + copies into the backend's static buffers
        return b

    def replay(self, b: int, n: int) -> torch.Tensor:
        g, logits = self.graphs[b]
        g.replay()
        return logits[:n]

    def run(self, input_ids: torch.Tensor, steps: list[SeqStep]) -> torch.Tensor | None:
        """Replay the step as a graph; None when it is not a graphable decode step."""
        b = self.prepare(input_ids, steps)
        return None if b is None else self.replay(b, len(steps))

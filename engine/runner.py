"""ModelRunner: turns a scheduled batch into model inputs, runs one forward, samples.

Inputs are packed: every scheduled sequence contributes its q_len new tokens; logits are computed
only for sequences whose chunk reaches their last token (the others are mid-prompt chunks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.sampling import Sampler
from engine.scheduler import ScheduledSeq
from engine.sequence import TokenLogprob
from model.context import SeqStep, build_step_meta
from model.gpt_oss import GptOss
from model.kv_cache import KVPool


class ModelRunner:
    # A forward may be left between layers (an exception from on_layer_done): nothing else waits on
    # it. A TP group's runner is not: its followers are inside the same forward's all-reduces.
    interruptible = True

    def __init__(self, model: GptOss, pool: KVPool, sampler: Sampler) -> None:
        self.model, self.pool, self.sampler = model, pool, sampler
        self.device = model.device
        self.graphs = None  # decode_worker.runner.CudaGraphDecoder, set by the decode worker on GPU

    @torch.inference_mode()
    def run(self, items: list[ScheduledSeq], on_layer_done: Callable[[int], None] | None = None
            ) -> tuple[list[int | None], list[TokenLogprob | None]]:
        ids = [t for it in items for t in it.seq.all_ids[it.start:it.start + it.q_len]]
        steps = [SeqStep(it.seq.pages, it.start, it.q_len) for it in items]
        rows = [i for i, it in enumerate(items) if it.sample]
        tokens: list[int | None] = [None] * len(items)
        lps: list[TokenLogprob | None] = [None] * len(items)
        logits = self.forward(ids, steps, rows, on_layer_done)
        if logits is None:
            return tokens, lps
        with torch.profiler.record_function("sample"):
            out = self.sampler(logits, [(items[i].seq.request_id, items[i].seq.params) for i in rows])
        sampled = out.token_ids.tolist()  # the step's one host sync
        want_lp = out.logprobs is not None
        if want_lp:
            lp, top_ids, top_lp = out.logprobs.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
        for j, i in enumerate(rows):
            tokens[i] = sampled[j]
            n = items[i].seq.params.logprobs
            if want_lp and n is not None:
                lps[i] = TokenLogprob(sampled[j], lp[j], list(zip(top_ids[j][:n], top_lp[j][:n])))
        return tokens, lps

    @torch.inference_mode()
    def forward(self, ids: list[int], steps: list[SeqStep], rows: list[int],
                on_layer_done: Callable[[int], None] | None = None, want_logits: bool = True) -> torch.Tensor | None:
        """The step's forward; logits [len(rows), V] of the sampled rows (None when none or not
        wanted). Every TP rank runs this with the same arguments (followers without logits), so the
        graph-or-eager choice and the all-reduces match on all ranks."""
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T]
        if self.graphs is not None and on_layer_done is None and len(rows) == len(steps):
            with torch.profiler.record_function("decode_graph"):
                logits = self.graphs.run(input_ids, steps)  # [B, V] or None when not graphable
            if logits is not None:
                return logits
        meta = build_step_meta(steps, self.pool.spec, self.device)
        with torch.profiler.record_function("forward"):
            hidden = self.model(input_ids, meta, self.pool, on_layer_done)  # [T, H]
        if not rows or not want_logits:
            return None
        return self.model.compute_logits(hidden[meta.logits_indices[rows]])  # [B', V]

"""ModelRunner: turns a scheduled batch into model inputs, runs one forward, samples on the device.

Inputs are packed: every scheduled sequence contributes its q_len new tokens; logits are computed
only for sequences whose chunk reaches their last token (the others are mid-prompt chunks).

Two halves, so the host can prepare step N+1 while the GPU runs step N (engine.core):
  launch(items, prev) -> StepHandle   inputs, metadata, forward (CUDA graph or eager), sampling and
                                      a non-blocking copy of the sampled ids into pinned memory; a
                                      token sampled by `prev` that the host has not seen yet is
                                      gathered on the device from prev's output (no round trip)
  collect(handle) -> tokens, logprobs waits for that step's copy (an event), reads pinned memory
`run(items)` is both at once (the prefill worker, tests).

Structured outputs: a grammar-constrained row needs its bitmask before sampling, and the mask for
step N+1 depends on step N's token, which the host learns only at collect(N). So a step with such
rows and a step in flight is launched with its sampling *deferred*: launch queues the forward
(the part that does not need the mask), the core collects step N (the matchers advance with its
tokens), and `finish_sample(handle)` computes the masks on the host and queues the sampler. The
GPU runs step N+1's forward meanwhile, so the loop stays overlapped for every row; the host's mask
work must fit inside one forward for the GPU not to wait (measured by the grammar bench suite).

Host buffers the GPU reads (pinned staging, FlashInfer's plan buffers) are reused step after step:
a launch first waits for the previous launch's input copies to have executed (`_inputs_done`), so
it never overwrites a buffer a queued copy still reads. That wait is normally already over: it
trails the GPU by one whole step.
"""

from __future__ import annotations

import time

from collections.abc import Callable
from dataclasses import dataclass

import torch

import numpy as np

from common.grammar import VOCAB_SIZE as GRAMMAR_VOCAB
from common.grammar import fill_masks
from engine import prompt_logprobs
from engine.prompt_logprobs import PromptRows
from engine.sampling import GrammarMasks, Sampler, SampleRow, _dev
from engine.scheduler import ScheduledSeq
from engine.sequence import TokenLogprob
from model.context import SeqStep, build_step_meta
from model.gpt_oss import GptOss
from model.kv_cache import KVPool, PageGroup
from model.labels import label


@dataclass(slots=True)
class StepHandle:
    """A launched step: what it ran, where its sampled ids are (device and pinned host copies)."""

    no: int
    items: list[ScheduledSeq]
    rows: list[int]  # indices of the items that sample, in row order
    row_of: dict[int, int]  # id(seq) -> its row in `token_ids` (for the next step's input gather)
    token_ids: torch.Tensor | None  # [R] int64 on the device
    host: tuple[torch.Tensor, ...] | None  # pinned (ids, logprob, top ids, top logprobs) views
    event: torch.cuda.Event | None  # recorded after the device -> host copies
    deferred: tuple[torch.Tensor, list[SampleRow]] | None = None  # logits [R, V] + rows awaiting finish_sample
    started: torch.cuda.Event | None = None  # timing event at the launch's start (time_gpu)
    gpu_ms: float | None = None  # set by collect when timed: the GPU's span of the step (started -> event)
    prompt_rows: list[PromptRows] | None = None  # prompt logprobs queued by this step (engine/prompt_logprobs.py)


class ModelRunner:
    # A forward may be left between layers (an exception from on_layer_done): nothing else waits on
    # it. A TP group's runner is not: its followers are inside the same forward's all-reduces.
    interruptible = True

    def __init__(self, model: GptOss, pool: KVPool, sampler: Sampler) -> None:
        self.model, self.pool, self.sampler = model, pool, sampler
        self.device = model.device
        self.cuda = self.device.type == "cuda"
        self.graphs = None  # engine.decode_graphs.CudaGraphDecoder, set by the decode worker on GPU
        self.piecewise = None  # engine.piecewise.PiecewiseGraphs (EngineConfig.piecewise_graphs): eager steps
        self.supports_overlap = True
        self.supports_page_copies = True  # model/prefix_share.py (a TP group's runner has no such copy)
        self.share_inputs: Callable[[torch.Tensor], None] | None = None  # TP rank 0: ids to the followers
        self._inputs_done: torch.cuda.Event | None = None
        self._pinned: list[tuple[torch.Tensor, ...]] = []  # two sets, alternating by step parity
        # --step-trace: each step's GPU span, from an event queued at its launch's start (the GPU reaches
        # it once the step before is done) to its tokens' copy. Span ~ host launch: the host fed it late.
        self.time_gpu = False
        # --step-trace: the last launch's host time by part (ms): meta (step metadata, attention plans, piecewise
        # tables), forward (the forward's launches or a graph replay), sample; None = not recorded
        self.launch_parts: dict[str, float] | None = None

    # ---- the two halves ----------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, items: list[ScheduledSeq], prev: StepHandle | None = None, no: int = 0,
               on_layer_done: Callable[[int], None] | None = None) -> StepHandle:
        if self._inputs_done is not None and not self._inputs_done.query():
            self._inputs_done.synchronize()  # the previous step's input copies have run (see module doc)
        started = None
        if self.time_gpu and self.cuda:
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        input_ids = self._input_ids(items, prev)
        if self.share_inputs is not None:
            self.share_inputs(input_ids)
        steps = [SeqStep(it.seq.pages, it.start, it.q_len) for it in items]
        rows = [i for i, it in enumerate(items) if it.sample]
        prompt_rows = prompt_logprobs.plan(items)
        logits = self.forward(input_ids, steps, rows, on_layer_done, prompt_rows=prompt_rows)
        handle = StepHandle(no, items, rows, {}, None, None, None, started=started, prompt_rows=prompt_rows or None)
        if logits is None:
            if prompt_rows and self.cuda:  # a mid-prompt chunk: its prompt logprobs are what collect waits for
                handle.event = torch.cuda.Event()
                handle.event.record()
            return handle
        sample_rows: list[SampleRow] = []
        for i in rows:
            seq = items[i].seq
            if seq.noise_seed is None:
                seq.noise_seed = seq.params.seed if seq.params.seed is not None else self.sampler.draw_seed()
            sample_rows.append(SampleRow(seq.request_id, seq.params, seq.noise_seed, items[i].start + items[i].q_len,
                                         len(seq.output_ids) + seq.num_pending,
                                         seq.output_ids if seq.params.penalized else None))
        handle.deferred = (logits, sample_rows)
        if prev is None or not any(items[i].seq.grammar is not None for i in rows):
            t0 = time.perf_counter()
            self.finish_sample(handle)  # every token a mask depends on is known: sample now
            if self.launch_parts is not None:
                self.launch_parts["sample"] = (time.perf_counter() - t0) * 1e3
        return handle

    @torch.inference_mode()  # also when the loop defers it (grammar rows): the pinned buffers are inference tensors
    def finish_sample(self, handle: StepHandle) -> None:
        """Queue the sampling of a launched step (masks from the sequences' grammars as they are now)."""
        assert handle.deferred is not None
        logits, sample_rows = handle.deferred
        handle.deferred = None
        items, rows, no = handle.items, handle.rows, handle.no
        with label("sample"):
            out = self.sampler.sample(logits, sample_rows, self._grammar_masks(items, rows, logits.shape[1]))
        handle.token_ids = out.token_ids
        handle.row_of = {id(items[i].seq): r for r, i in enumerate(rows)}
        parts = [out.token_ids] + ([] if out.logprobs is None else [out.logprobs, out.top_ids, out.top_logprobs])
        if self.cuda:
            handle.host = self._to_pinned(no, parts)
            handle.event = torch.cuda.Event(enable_timing=handle.started is not None)
            handle.event.record()
        else:
            handle.host = tuple(parts)

    def _grammar_masks(self, items: list[ScheduledSeq], rows: list[int], vocab: int) -> GrammarMasks | None:
        """Bitmasks of the rows whose next token a grammar constrains (None: no such row)."""
        active = [(r, items[i].seq.grammar) for r, i in enumerate(rows)
                  if items[i].seq.grammar is not None and items[i].seq.grammar.active]
        if not active:
            return None
        with label("grammar_mask"):
            bits = np.empty((len(active), (max(vocab, GRAMMAR_VOCAB) + 31) // 32), dtype=np.int32)  # [Rc, W]
            fill_masks([g for _, g in active], bits)
            return GrammarMasks(_dev(torch.tensor([r for r, _ in active], dtype=torch.int64), self.device),
                                _dev(torch.from_numpy(bits), self.device))

    def ready(self, h: StepHandle) -> bool:
        """The step's tokens are on the host already (its event passed). A CPU step has no event: it
        reads as still running, so CPU runs keep the overlapped order the tests cover."""
        return h.event is not None and h.event.query()

    def wait_ready(self, h: StepHandle, timeout_s: float) -> bool:
        """ready(h), waiting for it up to timeout_s (polling: CUDA has no timed event wait; the sleeps
        release the GIL for the network thread). A CPU step never gets ready."""
        if h.event is None:
            return False
        t_end = time.perf_counter() + timeout_s
        while not h.event.query():
            if time.perf_counter() >= t_end:
                return False
            time.sleep(0.0001)
        return True

    def collect(self, h: StepHandle) -> tuple[list[int | None], list[TokenLogprob | None]]:
        tokens: list[int | None] = [None] * len(h.items)
        lps: list[TokenLogprob | None] = [None] * len(h.items)
        if h.event is not None:
            with label("wait_tokens"):
                h.event.synchronize()
            if h.started is not None and h.host is not None:
                h.gpu_ms = h.started.elapsed_time(h.event)
        if h.prompt_rows:
            prompt_logprobs.collect(h.items, h.prompt_rows)
        if h.host is None:
            return tokens, lps
        sampled = h.host[0].tolist()
        want_lp = len(h.host) > 1
        if want_lp:
            lp, top_ids, top_lp = (t.tolist() for t in h.host[1:])
        for j, i in enumerate(h.rows):
            tokens[i] = sampled[j]
            n = h.items[i].seq.params.logprobs
            if want_lp and n is not None:
                lps[i] = TokenLogprob(sampled[j], lp[j], list(zip(top_ids[j][:n], top_lp[j][:n])))
        return tokens, lps

    def run(self, items: list[ScheduledSeq], on_layer_done: Callable[[int], None] | None = None
            ) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """One synchronous step (every input token known on the host)."""
        return self.collect(self.launch(items, None, 0, on_layer_done))

    # ---- pieces ------------------------------------------------------------------------------------
    def _input_ids(self, items: list[ScheduledSeq], prev: StepHandle | None) -> torch.Tensor:
        """[T] token ids; a decode token the previous step sampled comes from its device output."""
        ids: list[int] = []
        at, rows = [], []  # positions in `ids` to fill from prev.token_ids[rows]
        for it in items:
            seq = it.seq
            end, known = it.start + it.q_len, seq.num_tokens
            if end <= known:
                ids += seq.token_slice(it.start, end)
                continue
            # The overlapped loop's case: the token at `start` was sampled by the step in flight.
            assert prev is not None and it.q_len == 1 and end == known + 1, "input token not sampled yet"
            at.append(len(ids))
            rows.append(prev.row_of[id(seq)])
            ids.append(0)
        if not at:
            return _dev(torch.tensor(ids, dtype=torch.long), self.device)  # [T]
        assert prev is not None and prev.token_ids is not None
        if len(at) == len(ids):  # a pure decode step: every input is a token the last step sampled
            if rows == list(range(prev.token_ids.shape[0])):
                return prev.token_ids  # the same sequences in the same order: no copy at all
            return prev.token_ids[_dev(torch.tensor(rows, dtype=torch.long), self.device)]
        input_ids = _dev(torch.tensor(ids, dtype=torch.long), self.device)
        src = _dev(torch.tensor(rows, dtype=torch.long), self.device)
        input_ids[_dev(torch.tensor(at, dtype=torch.long), self.device)] = prev.token_ids[src]
        return input_ids

    def _to_pinned(self, no: int, parts: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Non-blocking device -> host copies into this step parity's pinned buffers (a step's
        buffers are read by collect() before the step two launches later copies into them)."""
        rows = parts[0].shape[0]
        width = parts[2].shape[1] if len(parts) > 1 else 1
        if not self._pinned or self._pinned[0][0].shape[0] < rows or self._pinned[0][2].shape[1] < width:
            cap, w = max(256, 2 * rows), max(width, 21)
            self._pinned = [(torch.empty(cap, dtype=torch.int64, pin_memory=True),
                             torch.empty(cap, dtype=torch.float32, pin_memory=True),
                             torch.empty(cap, w, dtype=torch.int64, pin_memory=True),
                             torch.empty(cap, w, dtype=torch.float32, pin_memory=True)) for _ in range(2)]
        buf = self._pinned[no % 2]
        out = []
        for dst, src in zip(buf, parts):
            view = dst[:rows] if src.dim() == 1 else dst[:rows, :src.shape[1]]
            view.copy_(src, non_blocking=True)
            out.append(view)
        return tuple(out)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor | list[int], steps: list[SeqStep], rows: list[int],
                on_layer_done: Callable[[int], None] | None = None, want_logits: bool = True,
                prompt_rows: list[PromptRows] | None = None) -> torch.Tensor | None:
        """The step's forward; logits [len(rows), V] of the sampled rows (None when none or not
        wanted); `prompt_rows` get their prompt logprobs queued. Every TP rank runs this with the same
        arguments (followers without logits, and with prompt rows only to join a vocab-parallel lm_head's
        all-gathers), so the graph-or-eager choice and the collectives match on all ranks.
        A step with prompt rows is never a decode graph's: a sampled one-token row lies past its prompt's
        positions that have a next prompt token."""
        if not isinstance(input_ids, torch.Tensor):
            input_ids = _dev(torch.tensor(input_ids, dtype=torch.long), self.device)  # [T]
        parts, t0 = self.launch_parts, time.perf_counter()
        self._copy_ring_hits(steps)
        if self.graphs is not None and on_layer_done is None and len(rows) == len(steps):
            with label("decode_graph"):
                b = self.graphs.prepare(input_ids, steps)
                self._mark_inputs()
                if b is not None:
                    t1 = time.perf_counter()
                    logits = self.graphs.replay(b, len(steps))  # [B, V]
                    if parts is not None:  # prepare: metadata, plans, static inputs; then the replay
                        parts["meta"], parts["forward"] = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
                    return logits
        meta = build_step_meta(steps, self.pool.spec, self.device)
        piecewise = self.piecewise is not None and self.piecewise.bucket(input_ids.shape[0]) is not None
        if piecewise:  # the attention groups its islands read, and its own per-step tables
            self.piecewise.plan(meta)
        else:
            self.model.backends.attention.plan(meta)  # the forward's own plan() is then a no-op
        self._mark_inputs()
        t1 = time.perf_counter()
        if piecewise:
            with label("forward_piecewise"):
                hidden = self.piecewise.run(input_ids, meta, self.pool, on_layer_done)  # [T, H]
        else:
            with label("forward"):
                hidden = self.model(input_ids, meta, self.pool, on_layer_done)  # [T, H]
        if parts is not None:
            parts["meta"], parts["forward"] = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
        if prompt_rows:
            with label("prompt_logprobs"):
                prompt_logprobs.compute(prompt_rows, hidden, self.model.compute_logits)
        if not rows:
            return None
        last = meta.logits_indices  # [B] each sequence's last new token
        if len(rows) != len(steps):  # mid-prompt chunks sample nothing (a device index: no pageable copy)
            last = last[_dev(torch.tensor(rows, dtype=torch.long), self.device)]
        if not want_logits:
            if self.model.par.vocab_parallel and self.model.par.tp_size > 1:
                self.model.compute_logits(hidden[last])  # a follower's share of rank 0's lm_head all-gather
            return None
        return self.model.compute_logits(hidden[last])  # [B', V]

    def copy_sliding_pages(self, src: list[int], dst: list[int]) -> None:
        """Queue sliding-group page copies (a shared prompt's ring blocks into the cache's pages)."""
        self.pool.copy_pages(PageGroup.SLIDING, src, dst)

    def sync_copies(self) -> None:
        """Wait for the page copies queued so far (the loop goes idle with pages fenced behind them)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def _copy_ring_hits(self, steps: list[SeqStep]) -> None:
        """Prefix hits: cached sliding blocks into their ring slots, before this step reads them
        (model/kv_cache.py). The owner drops the source references once the step completed."""
        src, dst = [], []
        for s in steps:
            if s.pages is not None and s.pages.copy_src:
                src += s.pages.copy_src
                dst += s.pages.copy_dst
        if src:
            self.pool.copy_pages(PageGroup.SLIDING, src, dst)

    def _mark_inputs(self) -> None:
        """Every input copy of this step is queued: the next launch may reuse host buffers once
        this event passed (the attention backend plans, and so copies, inside graphs.prepare or
        the model's forward before its first layer)."""
        if self.cuda:
            self._inputs_done = torch.cuda.Event()
            self._inputs_done.record()

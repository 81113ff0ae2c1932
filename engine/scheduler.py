"""Continuous-batching scheduler: policy on host state only, no tensors.

Each step spends a token budget (max_num_batched_tokens):
  1. RUNNING sequences, oldest first: one token each when decoding, or the next chunk of a prompt
     (chunked prefill). If a sequence cannot get the pages it needs, the NEWEST running sequence is
     preempted by recompute (pages freed, back to the front of WAITING) until it fits.
  2. WAITING sequences are admitted in arrival order while budget, max_num_seqs and free pages allow,
     keeping one page of headroom per running sequence so admissions do not immediately force
     preemptions.
`postprocess` applies the sampled tokens: appends, checks stop conditions, frees finished pages.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from common.errors import InvalidRequest
from engine.sequence import FinishReason, Sequence, SeqStatus, TokenLogprob
from model.kv_cache import KVManager, PageGroup


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131072


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens cached before this step
    q_len: int  # new tokens this step
    sample: bool  # the chunk reaches the last known token, so a new token is sampled


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVManager, eos_ids: tuple[int, ...]) -> None:
        self.cfg, self.kv, self.eos_ids = cfg, kv, frozenset(eos_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- admission ------------------------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse what could never run: longer than the context or than the whole KV cache."""
        total = prompt_len + max_tokens
        if prompt_len == 0:
            raise InvalidRequest("the prompt is empty", param="messages")
        if total > self.cfg.max_model_len:
            raise InvalidRequest(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                                 f"maximum context length {self.cfg.max_model_len}", param="max_tokens")
        spec = self.kv.spec
        if spec.full_layers and math.ceil(total / spec.page_size) > spec.num_pages[PageGroup.FULL]:
            raise InvalidRequest(f"prompt + max_tokens ({total} tokens) exceeds the KV cache capacity "
                                 f"({spec.num_pages[PageGroup.FULL] * spec.page_size} tokens)", param="max_tokens")

    def add(self, seq: Sequence) -> None:
        self.check_fits(len(seq.prompt_ids), seq.params.max_tokens)
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose pages are already reserved and filled (KV from a prefill worker)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        budget = self.cfg.max_num_batched_tokens
        items: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            q = min(seq.num_uncached, budget)
            if not self._make_room(seq, seq.num_cached + q):
                break  # seq itself was preempted (it was the newest)
            items.append(ScheduledSeq(seq, seq.num_cached, q, q == seq.num_uncached))
            budget -= q
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            q = min(seq.num_uncached, budget)
            if not self._fits_with_headroom(seq, seq.num_cached + q):
                break
            self.waiting.popleft()
            self.kv.grow(seq.pages, seq.num_cached + q)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            items.append(ScheduledSeq(seq, seq.num_cached, q, q == seq.num_uncached))
            budget -= q
        return items

    def _fits_with_headroom(self, seq: Sequence, total: int) -> bool:
        full, sliding = self.kv.pages_needed(seq.pages, total)
        free_full, free_sliding = self.kv.num_free()
        return full + len(self.running) <= free_full and sliding <= free_sliding

    def _make_room(self, seq: Sequence, total: int) -> bool:
        while not self.kv.can_grow(seq.pages, total):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.kv.grow(seq.pages, total)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq.pages)
        seq.num_cached = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- results --------------------------------------------------------------------------------
    def postprocess(self, items: list[ScheduledSeq], tokens: list[int | None],
                    logprobs: list[TokenLogprob | None]) -> list[Sequence]:
        """Apply one step's sampled tokens (None for chunks that sample nothing). Returns the
        sequences that produced a token this step (finished ones included)."""
        out = []
        for it, tok, lp in zip(items, tokens, logprobs, strict=True):
            seq = it.seq
            seq.num_cached = it.start + it.q_len
            if not it.sample:
                continue
            assert tok is not None
            seq.output_ids.append(tok)
            if lp is not None:
                seq.logprobs.append(lp)
            reason = self.stop_reason(seq, tok)
            if reason is not None:
                self.finish(seq, reason)
            out.append(seq)
        return out

    def stop_reason(self, seq: Sequence, tok: int) -> FinishReason | None:
        p = seq.params
        n = len(seq.output_ids)
        if n >= p.min_tokens and (tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids)):
            return FinishReason.STOP
        if n >= p.max_tokens or seq.num_tokens >= self.cfg.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status == SeqStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.release(seq.pages)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

"""Continuous-batching scheduler: policy on host state only, no tensors.

Each step spends a token budget (max_num_batched_tokens):
  1. RUNNING sequences, oldest first: one token each when decoding, or the next chunk of a prompt
     (chunked prefill). If a sequence cannot get the pages it needs, the NEWEST running sequence is
     preempted by recompute (pages freed, back to the front of WAITING) until it fits.
  2. WAITING sequences are admitted in arrival order while budget, max_num_seqs and free pages allow,
     keeping one page of headroom per running sequence so admissions do not immediately force
     preemptions.
  With prefill_steps="separate" a step with prompt work (1's chunks, 2's admissions) runs it without the
  decode rows, and the decode rows run alone in the step after it (SchedulerConfig).
`postprocess` applies the sampled tokens: appends, checks stop conditions, frees finished pages.

Overlapped steps (engine.core): step N+1 is scheduled and launched before step N's tokens reach the
host. `on_launch` books a launched step (KV cached, a token pending); a sequence whose pending token
is its last by length (max_tokens, context) is not scheduled again; a stop token is seen one step
late and the token sampled meanwhile is dropped. Pages released while a step is in flight may
still be written by it, so they return to the free lists only once that step completed
(`release_completed`): a KV transfer must never land in a page a running step still writes. Pages
that page copies queued behind the last launch read (`_copy_behind`) wait for the step after it, or,
when none follows, for engine/core.py to settle them (`release_fenced`).
Preemption frees pages at once, so `schedule(preempt_ok=False)` returns None instead of preempting
while a step is in flight; the caller completes that step first.

Prefix cache (when the KVManager has one; the lookup, hit mapping and indexing are engine/scheduler_prefix.py):
a WAITING sequence is looked up as it is admitted; a hit
maps the cached blocks (model/kv_cache.py: full pages shared, sliding blocks copied into a fresh
ring by its first step) and only the rest is computed. Released sequences (finished, aborted,
preempted) register their complete blocks at once, even while the step that writes their last KV is
in flight: every reader of a cached page is a later step (or a copy queued before it) on the same
stream, so it runs after those writes, and the next turn of a conversation, which arrives right
after the last token, must find them. The sequence's references are still released under the
fence, so none of those pages is evictable (or reusable by a KV transfer) before that step completed.
A prompt that extends a recently seen prefix past its usable hit keeps the sliding KV at that branch
point (engine/prefix_branch.py): its chunk may end there, and the launch that writes it snapshots it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from common.errors import InvalidRequest
from engine.prefix_branch import BranchPoints
from engine.scheduler_prefix import PrefixScheduling
from engine.sequence import FinishReason, Sequence, SeqStatus, TokenLogprob
from model.context import ring_keep_from
from model.kv_cache import KVManager, PageGroup, SeqPages
from model.prefix_cache import Hit


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131072
    # "mixed": prompt chunks share a step with the decode rows (one step, the MoE's weights read once for both);
    # "separate": a step with prompt work runs it alone and the step after it decodes (SGLang's default order):
    # a prompt's first token waits for its own tokens' step only, the decode rows for one more step. Never two
    # prompt-only steps in a row while sequences decode, so a flood of prompts cannot stall decoding.
    prefill_steps: str = "mixed"


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens cached before this step
    q_len: int  # new tokens this step
    sample: bool  # the chunk reaches the last known token, so a new token is sampled

    @property
    def chunk(self) -> bool:
        """A prompt chunk (more than one token, or tokens of the prompt), not a one-token decode row."""
        return self.q_len > 1 or self.start < len(self.seq.prompt_ids)


class Scheduler(PrefixScheduling):
    def __init__(self, cfg: SchedulerConfig, kv: KVManager, eos_ids: tuple[int, ...]) -> None:
        self.cfg, self.kv, self.eos_ids = cfg, kv, frozenset(eos_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.waiting_tokens = 0  # uncached tokens of WAITING sequences, kept as they move (status is O(1))
        self.launched = 0  # number of the latest launched step
        self.completed = 0  # number of the latest step whose tokens reached the host
        self._fenced: deque[tuple[int, SeqPages]] = deque()  # (step that may still use them, pages)
        self.share_prompts = True  # the runner can copy pages (engine/core.py); a TP group's cannot
        self.pending_copies: list[tuple[list[int], list[int]]] = []  # sliding (src, dst), queued after on_launch
        self._copies_behind = -1  # the launch whose on_launch queued page copies last
        self.prompt_only_steps = 0  # prefill_steps="separate": steps scheduled with prompt work alone
        spec = kv.spec
        self.branches = (BranchPoints(spec.page_size, spec.sliding_window, spec.ring_pages)
                         if kv.cache is not None and spec.sliding_layers else None)
        self._last_prompt_only = False

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
        self.waiting_tokens += seq.num_uncached

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose pages are already reserved and filled (KV from a prefill worker)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self, preempt_ok: bool = True, admit: bool = True) -> list[ScheduledSeq] | None:
        """The next step's batch; None when it needs a preemption and `preempt_ok` is False. `admit`:
        waiting sequences may start (False: the running ones only, engine/launch_hold.py)."""
        decode_only = False
        if self.cfg.prefill_steps == "separate":
            if not self._last_prompt_only and (items := self._prompts_only(admit)):
                self._last_prompt_only = True
                self.prompt_only_steps += 1
                return items
            # otherwise the decode rows run alone (after a prompt-only step, or when the prompt work cannot run
            # now: its pages), unless none decodes
            decode_only = any(_decoding(s) for s in self.running)
        budget = self.cfg.max_num_batched_tokens
        items: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            i += 1
            if seq.num_pending and self._last_by_length(seq):
                continue  # its pending token is its last: nothing more to compute
            if decode_only and not _decoding(seq):
                continue
            q = self.chunk_len(seq, seq.num_cached, min(seq.num_uncached, budget))
            if self.kv.pages_needed(seq.pages, seq.num_cached + q) != (0, 0):  # most decode rows fit their pages
                if not self.kv.can_grow(seq.pages, seq.num_cached + q) and not preempt_ok:
                    return None  # pages grown so far stay with their sequences: they need them next time anyway
                if not self._make_room(seq, seq.num_cached + q):
                    break  # seq itself was preempted (it was the newest)
            items.append(ScheduledSeq(seq, seq.num_cached, q, q == seq.num_uncached))
            budget -= q
        if admit and not decode_only:
            self._admit(items, budget)
        self._last_prompt_only = False
        return items

    def _admit(self, items: list[ScheduledSeq], budget: int) -> None:
        """WAITING sequences into the step, in arrival order, while budget, seats and pages allow."""
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            hit = self.lookup(seq)
            at = self.branch_of(seq, hit)
            q = min(seq.total_len - hit.num_tokens, budget)
            if at:
                q = self.branches.chunk(at, hit.num_tokens, q)  # type: ignore[union-attr]
            if not self._fits_with_headroom(seq, hit.num_tokens + q, hit):
                break
            self.waiting.popleft()
            self.waiting_tokens -= seq.num_uncached
            self.admit_pages(seq, hit, hit.num_tokens + q, at)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            items.append(ScheduledSeq(seq, seq.num_cached, q, q == seq.num_uncached))
            budget -= q

    def _prompts_only(self, admit: bool) -> list[ScheduledSeq]:
        """prefill_steps="separate": the prompt chunks of running sequences and the admissions, without the decode
        rows; [] when there is no prompt work or nothing decodes. Chunks that need a preemption to grow wait for
        pages (the decode-only steps between them may preempt, newest first, as usual)."""
        prompts = [s for s in self.running if not _decoding(s)]
        if len(prompts) == len(self.running) or not (prompts or (admit and self.waiting)):
            return []
        budget = self.cfg.max_num_batched_tokens
        items: list[ScheduledSeq] = []
        for seq in prompts:
            q = self.chunk_len(seq, seq.num_cached, min(seq.num_uncached, budget))
            if budget <= 0 or not self.kv.can_grow(seq.pages, seq.num_cached + q):
                continue
            self.kv.grow(seq.pages, seq.num_cached + q)
            items.append(ScheduledSeq(seq, seq.num_cached, q, q == seq.num_uncached))
            budget -= q
        if admit:
            self._admit(items, budget)
        return items

    def _last_by_length(self, seq: Sequence) -> bool:
        return (len(seq.output_ids) + seq.num_pending >= seq.params.max_tokens
                or seq.total_len >= self.cfg.max_model_len)

    def on_launch(self, items: list[ScheduledSeq], step: int) -> None:
        """A step was launched: its KV will be cached and its sampled rows hold a pending token."""
        self.launched = step
        spec = self.kv.spec
        for it in items:
            seq = it.seq
            end = it.start + it.q_len
            seq.num_cached = end
            note_ring_write(seq, it.start, end, spec.page_size, spec.sliding_window)
            if seq.pages.copy_src:  # the step copied its hit's sliding blocks: drop the sources after it
                self._fenced.append((step, self.kv.release_copy_sources(seq.pages)))
            if self.branch_due(seq, it.start, end):
                self._copy_behind(*self.snapshot_branch(seq, end))
            if it.sample:
                if seq.params.share_prompt and not seq.output_ids and not seq.num_pending:
                    self.share_prompt(seq)  # its prompt's KV exists once this step ran
                seq.num_pending += 1

    def release_fenced(self) -> None:
        """Nothing is in flight and the copies queued before it ran: every fenced page is free (or evictable).
        Pages fenced behind copies wait for the step after them; the loop calls this when none follows."""
        while self._fenced:
            self.kv.release(self._fenced.popleft()[1])

    @property
    def has_fenced(self) -> bool:
        return bool(self._fenced)

    def release_completed(self, step: int) -> None:
        """Step `step` completed: pages released while it (or an earlier step) was in flight are free
        (or evictable, when cached)."""
        self.completed = step
        while self._fenced and self._fenced[0][0] <= step:
            self.kv.release(self._fenced.popleft()[1])

    def _release(self, seq: Sequence) -> None:
        self.forget_branch(seq)
        self.kv.register(seq.pages, self.registration(seq))  # cached now, evictable once released (module doc)
        copies = self._copies_behind == self.launched  # page copies queued behind the last launch may read them
        if self.launched == self.completed and not copies:
            self.kv.release(seq.pages)
        else:  # a launched step may still write these pages (or the copies behind it read them): hand them back
            # when it (or the step after the copies) completed; engine/core.py settles them when none follows
            self._fenced.append((self.launched + copies, seq.pages))
            seq.pages = SeqPages()

    def _fits_with_headroom(self, seq: Sequence, total: int, hit: Hit | None = None) -> bool:
        if hit is not None and hit.num_tokens:
            full, sliding = self.kv.room_for_hit(hit, total)
        else:
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
        assert seq.num_pending == 0, "preemption with a token in flight (schedule(preempt_ok=False) prevents it)"
        self.running.remove(seq)
        self._release(seq)  # its blocks stay cached: re-admission will likely hit them
        seq.num_cached = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.waiting_tokens += seq.num_uncached

    # ---- results --------------------------------------------------------------------------------
    def postprocess(self, items: list[ScheduledSeq], tokens: list[int | None],
                    logprobs: list[TokenLogprob | None]) -> list[Sequence]:
        """Apply one launched step's sampled tokens (None for chunks that sample nothing). Returns
        the sequences that produced a token this step (finished ones included). A sequence that
        finished (stop token, abort) after this step was launched drops its token here."""
        out = []
        for it, tok, lp in zip(items, tokens, logprobs, strict=True):
            seq = it.seq
            if not it.sample:
                continue
            assert tok is not None
            if seq.status == SeqStatus.FINISHED:
                continue  # the surplus token of the overlapped loop
            seq.num_pending -= 1
            seq.output_ids.append(tok)
            if seq.grammar is not None:
                seq.grammar.advance(tok)
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
        if seq.grammar is not None and seq.grammar.completed and not p.ignore_eos:  # the constrained answer ended
            return FinishReason.STOP
        if n >= p.max_tokens or seq.num_tokens >= self.cfg.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status == SeqStatus.FINISHED:
            return
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
            self.waiting_tokens -= seq.num_uncached
        self._release(seq)
        seq.num_pending = 0
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason


def _decoding(seq: Sequence) -> bool:
    """Its next row is one decode token (not a prompt chunk, nor a preempted sequence's recompute)."""
    return seq.num_cached >= len(seq.prompt_ids) and seq.num_uncached <= 1


def note_ring_write(seq: Sequence, start: int, end: int, page_size: int, window: int) -> None:
    """A launched step writes positions [start, end): the ring holds valid sliding KV from
    seq.ring_valid_from on, restarting where a chunk larger than the ring stored only its tail
    (model.context.ring_keep_from, the least a step stores)."""
    kf = ring_keep_from(start, end, page_size, window)
    if kf > start:
        seq.ring_valid_from = kf

"""The STEP command's page protocol: rank 0 describes a scheduled batch, followers rebuild it.

Rank 0 allocates every page; followers only index their own pool (same page ids, their own KV
heads) with the ids they are given. A decode step must not ship every sequence's whole page list
(256 sequences x 2k pages at 32k context), so full-attention pages travel as a delta against the
follower's mirror of the previous step:
  - the mirror holds exactly the sequences of the previous step;
  - rank 0 remembers, per sequence of the previous step, the page LIST OBJECT it sent from and its
    length. KVManager.grow only extends that list in place and release replaces it, so "same
    object, not shorter" proves the sent prefix is unchanged; anything else (first sight, a
    preempted sequence regrown, a sequence absent from the last step) is sent whole (full_from 0);
  - the sliding ring (at most R pages) is always sent whole, with the prefix hit's sliding copies
    of the sequence's first step (model/kv_cache.py; the forward applies them on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import prompt_logprobs
from engine.scheduler import ScheduledSeq
from engine.tp import messages as m
from model.context import SeqStep
from model.kv_cache import SeqPages


@dataclass(slots=True)
class _Sent:
    full: list[int]  # the very list object of the sequence's SeqPages
    n: int


class StepEncoder:
    """Rank 0: scheduled items -> Step."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, items: list[ScheduledSeq], layer_done: bool) -> m.Step:
        seqs, sent, on_device = [], {}, False
        for it in items:
            seq, full = it.seq, it.seq.pages.full
            rec = self._sent.get(seq.request_id)
            keep = rec.n if rec is not None and rec.full is full and len(full) >= rec.n else 0
            end = it.start + it.q_len
            if end > seq.num_tokens:  # its input token is still on the device (overlapped loop)
                ids, on_device = [0] * it.q_len, True
            else:
                ids = seq.token_slice(it.start, end)
            seqs.append(m.StepSeq(seq.request_id, ids, it.start, it.sample, keep, full[keep:], list(seq.pages.ring),
                                  list(seq.pages.copy_src), list(seq.pages.copy_dst)))
            sent[seq.request_id] = _Sent(full, len(full))
        self._sent = sent
        shares = [x for p in prompt_logprobs.plan(items) for x in (p.row0, len(p.targets), p.top_n)]
        return m.Step(seqs, layer_done, on_device, shares)


class StepMirror:
    """Follower: Step -> the runner's inputs (token ids, per-sequence SeqStep, rows to sample)."""

    def __init__(self) -> None:
        self._pages: dict[str, SeqPages] = {}

    def apply(self, step: m.Step) -> tuple[list[int], list[SeqStep], list[int]]:
        ids: list[int] = []
        steps, rows, pages_now = [], [], {}
        for i, s in enumerate(step.seqs):
            pages = SeqPages() if s.full_from == 0 else self._pages.get(s.request_id)
            # Internal invariant of the delta protocol (rank 0 and this mirror saw the same steps).
            assert pages is not None and len(pages.full) == s.full_from, f"page mirror out of sync for {s.request_id}"
            pages.full += s.new_full
            pages.ring = list(s.ring)
            pages.copy_src, pages.copy_dst = list(s.copy_src), list(s.copy_dst)  # the forward applies them
            pages_now[s.request_id] = pages
            ids += s.token_ids
            steps.append(SeqStep(pages, s.start, len(s.token_ids)))
            if s.sample:
                rows.append(i)
        self._pages = pages_now
        return ids, steps, rows

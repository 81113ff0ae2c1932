"""Prompt log probabilities: what /v1/completions returns for echo + logprobs (lm-eval's loglikelihood requests,
vLLM's prompt_logprobs). For the prompt chunk a step computes, each position's logits give the log probability of
the prompt's next token under the raw model distribution (no temperature, penalties, bias or grammar: the model's
own score of the text) and the top-n tokens there.

Position j of a P-token prompt predicts token j + 1, so a sequence gets P - 1 entries, token 0 none. A chunk
[s, e) contributes positions [max(s, done), min(e, P - 1)), `done` being the entries the sequence already holds:
a preempted sequence recomputes its prompt and keeps its entries once. The rows are those of the forward's packed
hidden states [T, H]; their logits are computed in slices, since a 4,096-token chunk's fp32 logits over gpt-oss's
201,088-token vocabulary would be 3.3 GB at once. The tensors stay on the device until the step is collected.

A sequence asking for them skips the prefix cache (engine/scheduler_prefix.py: a cached token has no logits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass

import torch

from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence, TokenLogprob
from wire.protocol import PromptLogprobs, TopLogprob

# Rows per lm_head call: 256 x 201,088 x 4 B = 206 MB of fp32 logits at a time (plus logsumexp's temporary); each
# call streams lm_head's 1.16 GB once, so an 8k-token prompt reads it 32 times (~9 ms at 4 TB/s)
ROWS_PER_SLICE = 256


@dataclass(slots=True)
class PromptRows:
    """One item's prompt positions in a step: rows [row0, row0 + len(targets)) of the packed tokens."""

    item: int  # index in the step's items
    row0: int
    first: int  # first prompt position (it predicts token first + 1)
    targets: list[int]  # prompt_ids[first + 1 : first + 1 + count]
    top_n: int
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # logprob [count], top ids / logprobs [count, n]


def plan(items: Seq[ScheduledSeq]) -> list[PromptRows]:
    """The prompt positions this step computes for sequences that ask (usually none: an empty list)."""
    out: list[PromptRows] = []
    row = 0
    for i, it in enumerate(items):
        seq = it.seq
        n = seq.params.prompt_logprobs
        if n is not None:
            lo = max(it.start, len(seq.prompt_logprobs))
            hi = min(it.start + it.q_len, len(seq.prompt_ids) - 1)
            if hi > lo:
                out.append(PromptRows(i, row + lo - it.start, lo, seq.prompt_ids[lo + 1:hi + 1], n))
        row += it.q_len
    return out


def shares(flat: list[int], par) -> list[PromptRows]:
    """A tensor-parallel follower's copy of rank 0's plans (engine/tp/messages.Step.prompt_rows): with a vocab-parallel
    lm_head each slice's logits are an all-gather every rank must join; a replicated lm_head needs nothing (empty).
    The targets are placeholders: a follower's results are dropped."""
    if not (par.vocab_parallel and par.tp_size > 1):
        return []
    return [PromptRows(-1, flat[i], -1, [0] * flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]


def compute(plans: list[PromptRows], hidden: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Queue each plan's logprobs from the final-normed hidden states [T, H]; `logits_of`: [N, H] -> [N, V] fp32."""
    for p in plans:
        count = len(p.targets)
        targets = torch.tensor(p.targets, dtype=torch.long).to(hidden.device, non_blocking=True)  # [count]
        lps, top_ids, top_lps = [], [], []
        for a in range(0, count, ROWS_PER_SLICE):
            b = min(a + ROWS_PER_SLICE, count)
            logits = logits_of(hidden[p.row0 + a:p.row0 + b])  # [r, V] fp32
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [r, 1]: log-softmax = logits - lse, no [r, V] copy
            lps.append(logits.gather(1, targets[a:b, None])[:, 0] - lse[:, 0])  # [r]
            top = logits.topk(p.top_n, dim=-1)  # [r, n] each (n = 0: empty)
            top_lps.append(top.values - lse)
            top_ids.append(top.indices)
        p.out = torch.cat(lps), torch.cat(top_ids), torch.cat(top_lps)


def collect(items: Seq[ScheduledSeq], plans: list[PromptRows]) -> None:
    """Append the computed entries to their sequences (after the step's tokens are on the host)."""
    for p in plans:
        assert p.out is not None
        seq = items[p.item].seq
        assert len(seq.prompt_logprobs) == p.first, "prompt logprobs collected out of order"
        lp, ids, vals = (t.tolist() for t in p.out)
        for k, tok in enumerate(p.targets):
            seq.prompt_logprobs.append(TokenLogprob(tok, lp[k], list(zip(ids[k], vals[k]))))


def to_wire(seq: Sequence) -> PromptLogprobs | None:
    """The sequence's prompt logprobs as a worker sends them (None: not asked)."""
    if seq.params.prompt_logprobs is None:
        return None
    return PromptLogprobs([e.logprob for e in seq.prompt_logprobs],
                          [[TopLogprob(t, v) for t, v in e.top] for e in seq.prompt_logprobs])

"""A sequence: one request's tokens, pages and progress through the engine.

Lifecycle: WAITING (no KV) -> RUNNING (prefill chunks, then one token per step) -> FINISHED.
With the overlapped step loop a token is sampled on the device one step before the host sees it:
`num_pending` counts those (0-2); `total_len` is what the scheduler plans with, `num_tokens` what
the host holds.
A decode worker also admits sequences whose KV arrives from a prefill worker: TRANSFERRING (pages
reserved, KV being written by the peer) -> RUNNING. Preemption frees the pages and sends a RUNNING
sequence back to WAITING with num_cached = 0: its prompt and generated tokens are recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from common.grammar import GrammarState, default_compiler
from engine.sampling import SamplingParams
from model.kv_cache import SeqPages


class SeqStatus(Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, Enum):
    STOP = "stop"  # a stop token
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled or failed


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. (params.prompt_logprobs)
    pages: SeqPages = field(default_factory=SeqPages)
    num_cached: int = 0  # tokens whose K/V is in this engine's cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_pending: int = 0  # tokens sampled on the device, not yet appended here (engine.core)
    noise_seed: int | None = None  # the sampler's per-sequence seed (params.seed, else drawn once)
    # Prefix cache (model/prefix_cache.py): hashes of complete blocks of all_ids, extended lazily;
    # the first position whose sliding KV the ring holds valid from there to num_cached; and the
    # prompt tokens the last admission took from the cache.
    block_hashes: list[int] = field(default_factory=list)
    ring_valid_from: int = 0
    num_cached_prefix: int = 0
    snapshot_at: int = 0  # a branch point: keep the prefix cache's KV of [0, snapshot_at) (engine/prefix_branch.py)
    grammar: GrammarState | None = None  # structured outputs: attach_grammar(), advanced by every output token
    first_launch: float | None = None  # monotonic time its first step was scheduled and launched (TTFT breakdown)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_uncached(self) -> int:
        return self.total_len - self.num_cached

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (a decode step reads one token of a long
        prompt + output: concatenating both per sequence per step cost milliseconds at batch 128)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED


def attach_grammar(seq: Sequence) -> None:
    """Give a sequence whose parameters carry grammars its GrammarState, caught up with its prompt
    tail and any output it already has (a first token from the prefill worker). Called where a
    request arrives, not in the step: a schema that does not compile raises InvalidRequest here
    (the compiled grammar is cached per schema, so this is a lookup plus a ~0.3 ms matcher)."""
    if not seq.params.grammars or seq.grammar is not None:
        return
    compiler = default_compiler()
    for g in seq.params.grammars:
        compiler.matcher(g)  # compile (cached) and check now
    seq.grammar = GrammarState(compiler, seq.params.grammars, seq.prompt_ids)
    for t in seq.output_ids:
        seq.grammar.advance(t)

"""Sampling parameters and the batched sampler.

The sampler makes no host syncs of its own: greedy is an argmax; stochastic sampling draws
exponential noise and takes argmax(p / q) (the Gumbel/exponential race, as gpt-fast and nano-vllm
do) after temperature, top-k and top-p filtering, all as per-row tensors. The engine reads the
sampled ids (and logprobs) back once per step, which is the one sync a step needs anyway.
Requests with a seed get their own generator, so their samples do not depend on batch composition.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.errors import InvalidRequest
from wire.protocol import SamplingSpec

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; n >= 0: sampled token's logprob plus top-n
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequest(f"temperature must be in [0, 2], got {self.temperature}", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if not 0 <= self.top_k < 1 << 31:  # any k past the vocabulary means off; a tensor holds it
            raise InvalidRequest(f"top_k must be in [0, 2^31), got {self.top_k}", param="top_k")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest("min_tokens must be in [0, max_tokens]", param="min_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def to_params(s: SamplingSpec) -> SamplingParams:
    """The wire's sampling spec as the engine's (validated) parameters."""
    return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          seed=s.seed, stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
                          logprobs=s.logprobs, min_tokens=s.min_tokens)


def check_prompt(ids: list[int], vocab_size: int) -> None:
    """A prompt from the wire is token ids the model can embed (the router checks too; a worker
    does not trust its peers with an index into the embedding)."""
    if not ids:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", param="prompt")


@dataclass(slots=True)
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] fp32 logprob of the sampled token
    top_ids: torch.Tensor | None  # [B, n]
    top_logprobs: torch.Tensor | None  # [B, n]


@dataclass(slots=True)
class Sampler:
    device: torch.device
    seed: int = 0
    _gen: torch.Generator = field(init=False)
    _seq_gens: dict[str, torch.Generator] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(self.seed)

    def forget(self, request_id: str) -> None:
        self._seq_gens.pop(request_id, None)

    def _noise(self, shape: tuple[int, int], rows: list[tuple[str, SamplingParams]]) -> torch.Tensor:
        q = torch.empty(shape, device=self.device).exponential_(1, generator=self._gen)
        for i, (rid, p) in enumerate(rows):
            if p.seed is not None:
                g = self._seq_gens.get(rid)
                if g is None:
                    g = self._seq_gens[rid] = torch.Generator(device=self.device)
                    g.manual_seed(p.seed)
                q[i].exponential_(1, generator=g)
        return q

    def __call__(self, logits: torch.Tensor, rows: list[tuple[str, SamplingParams]]) -> SampleOutput:
        """logits [B, V] fp32 -> sampled ids (+ logprobs when any row asks)."""
        b, v = logits.shape
        dev = logits.device
        greedy = torch.tensor([p.greedy for _, p in rows], device=dev)
        temp = torch.tensor([max(p.temperature, 1e-5) for _, p in rows], device=dev)
        top_p = torch.tensor([p.top_p for _, p in rows], device=dev)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else v for _, p in rows], device=dev)
        ids = logits.argmax(-1)
        if not all(p.greedy for _, p in rows):  # known on the host: no device sync
            probs = torch.softmax(logits / temp[:, None], dim=-1)
            probs = _filter_top_k_top_p(probs, top_k, top_p)
            sampled = (probs / self._noise((b, v), rows)).argmax(-1)
            ids = torch.where(greedy, ids, sampled)
        n = max((p.logprobs for _, p in rows if p.logprobs is not None), default=None)
        if n is None:
            return SampleOutput(ids, None, None, None)
        lp = torch.log_softmax(logits, dim=-1)
        top_lp, top_ids = lp.topk(max(n, 1), dim=-1)
        return SampleOutput(ids, lp.gather(1, ids[:, None])[:, 0], top_ids, top_lp)


def _filter_top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero out tokens outside each row's top-k and nucleus (top-p), without host syncs."""
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(probs.shape[1], device=probs.device)[None, :]
    cum = sorted_p.cumsum(-1)
    # Keep a token if fewer than top_p of the mass comes before it (the first always survives).
    keep = (ranks < top_k[:, None]) & ((cum - sorted_p) < top_p[:, None])
    sorted_p = sorted_p * keep
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)

"""Sampling parameters and the batched sampler, on the device with no host sync and no
per-sequence Python on the hot path.

One step samples R rows (the sequences whose chunk reaches their last token):
  logits [R, V] fp32
    -> penalties (presence / frequency over each sequence's generated tokens, counted on the device)
    -> logit bias and min_tokens masking (sparse, only for the rows that ask)
    -> grammar bitmasks (structured outputs, only the constrained rows: [Rc, ceil(V/32)] int32
       words computed on the host by common.grammar, unpacked to [Rc, V] on the device)
    -> greedy rows: argmax
    -> stochastic rows: the exponential race argmax(p / q), p = softmax(logits / T), q ~ Exp(1)
       (gpt-fast, nano-vllm). On CUDA one fused kernel (kernels/sampling.py: argmax(l / T - log q),
       one read of the logits, greedy rows in the same launch); rows with top-k / top-p go through
       the torch race (_race: softmax, sort-based filter, noise, argmax), which is also the CPU path
       and the kernel's reference (the two agree but for near ties of p / q, ~1e-6 relative)
    -> logprobs of the raw distribution when any row asks (sampled token + top-n)
The noise is counter-based: q for (seed, position, token) is a hash, not a generator's stream, so
a sequence's samples depend only on its seed and positions, never on which other sequences share
the batch or on how many steps ran before (seeded requests reproduce across runs and batch
compositions; disaggregated prefill and decode draw the same noise for the same position).
Unseeded sequences get a seed drawn once from the sampler's own generator.

Per-row parameter tensors are cached by batch composition: a decode batch that did not change
since the last step reuses them and only uploads the new positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from common.errors import InvalidRequest
from common.grammar import JsonGrammar
from wire.protocol import SamplingSpec

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
_MASK32 = 0xFFFFFFFF


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
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added logit)
    grammars: tuple[JsonGrammar, ...] = ()  # structured outputs (common/grammar.py)
    share_prompt: bool = False  # the prompt's KV enters the prefix cache once computed (model/prefix_share.py)
    prompt_logprobs: int | None = None  # None = off; n >= 0: prompt tokens' logprobs plus top-n (engine/prompt_logprobs.py)

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
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest("min_tokens must be in [0, max_tokens]", param="min_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}", param=name)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries", param="logit_bias")
        for tok, bias in self.logit_bias:
            if tok < 0 or not -100.0 <= bias <= 100.0:
                raise InvalidRequest(f"logit_bias entry {tok}: {bias} is out of range (bias in [-100, 100])",
                                     param="logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def to_params(s: SamplingSpec) -> SamplingParams:
    """The wire's sampling spec as the engine's (validated) parameters."""
    return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          seed=s.seed, stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
                          logprobs=s.logprobs, min_tokens=s.min_tokens, presence_penalty=s.presence_penalty,
                          frequency_penalty=s.frequency_penalty,
                          logit_bias=tuple((b.token_id, b.bias) for b in s.logit_bias),
                          grammars=tuple(JsonGrammar(g.target, g.schema) for g in s.grammars),
                          share_prompt=s.share_prompt, prompt_logprobs=s.prompt_logprobs)


@dataclass(slots=True)
class SampleRow:
    """One row to sample: who, with what, at which position (the index the new token will have)."""

    request_id: str
    params: SamplingParams
    seed: int
    position: int
    num_generated: int  # tokens this sequence generated before this one (min_tokens masking)
    output_ids: list[int] | None = None  # read once, when a penalised sequence first gets a slot


def check_request(ids: list[int], params: SamplingParams, vocab_size: int) -> None:
    """Token ids from the wire are ids the model can embed and the sampler can index (the router
    checks too; a worker does not trust its peers with an index into a [V] tensor)."""
    if not ids:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise InvalidRequest(f"stop token ids must be in [0, {vocab_size})", param="stop")


@dataclass(slots=True)
class SampleOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor | None  # [R] fp32 logprob of the sampled token
    top_ids: torch.Tensor | None  # [R, n]
    top_logprobs: torch.Tensor | None  # [R, n]


@dataclass(slots=True)
class _RowTensors:
    """Device tensors of one batch composition."""

    key: tuple
    greedy: torch.Tensor  # [R] bool
    temp: torch.Tensor  # [R] fp32
    top_p: torch.Tensor
    top_k: torch.Tensor  # [R] int64 (V when off)
    seeds: torch.Tensor  # [R] int64
    all_greedy: bool
    noise: torch.Tensor  # [R] bool: stochastic rows without top-k/top-p (the fused kernel's noisy rows)
    filtered: tuple[torch.Tensor, ...] | None  # ([Rf] rows, their temp, top_k, top_p, seeds): top-k/top-p rows
    max_logprobs: int | None
    penal_rows: torch.Tensor | None  # [Rp] rows with penalties
    penal_slots: torch.Tensor | None  # [Rp] their count rows
    presence: torch.Tensor | None  # [Rp]
    frequency: torch.Tensor | None


def noise_hash(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The noise's bits: [R, V] int64 in [0, 2^32). A 64-bit mix of seed and position per row, then
    murmur3's 32-bit finaliser over the token index (int64 arithmetic masked to 32 bits, so the shifts
    are logical on every backend; kernels/sampling.py draws the same bits in uint32)."""
    dev = seeds.device
    key = seeds * -7046029254386353131 + positions * -4658895280553007687  # wrapping int64 products
    key = (key ^ (key >> 31)) & _MASK32  # [R]
    # In place on the [R, V] int64 tensor: ~4x faster on a CPU (no 100 MB temporary per operation at
    # R = 64 over 201,088 tokens), the same bits.
    h = torch.arange(vocab, device=dev, dtype=torch.int64).mul_(0x9E3779B9)[None, :] + key[:, None]
    h.bitwise_and_(_MASK32)
    h.bitwise_xor_(h >> 16)
    h.mul_(0x85EBCA6B).bitwise_and_(_MASK32)
    h.bitwise_xor_(h >> 13)
    h.mul_(0xC2B2AE35).bitwise_and_(_MASK32)
    return h.bitwise_xor_(h >> 16)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """q ~ Exp(1) of shape [R, V] from (seed, position, token) alone (the bits of noise_hash)."""
    h = noise_hash(seeds, positions, vocab)
    v = h.bitwise_right_shift_(8).to(torch.float32).add_(0.5).mul_(1.0 / (1 << 24))  # [2^-25, 1 - 2^-25], 24 bits
    # q = -log(1 - v), not -log(v): the top v rounds to 1.0 in fp32, and -log(1.0) would be q = 0, a
    # token that wins whatever its p (2^-24 of all draws: with 201,088 tokens, 1.2 % of sampled
    # tokens were any token of the vocabulary, p ~ 0 included). Here it gives q = inf (p / q = 0,
    # that token loses) and the smallest q is 2^-25 > 0, drawn as often as Exp(1) says; p = 0 rows
    # (grammar masks, top-k/top-p) score 0, never NaN.
    return v.neg_().log1p_().neg_()


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, eos_ids: tuple[int, ...] = (),
                 fused: bool | None = None) -> None:
        """fused: stochastic rows through kernels/sampling.py (default: on CUDA; tests run it on the CPU
        through the Triton interpreter); otherwise the torch race (_race), its reference."""
        self.device = device
        self.fused = device.type == "cuda" if fused is None else fused
        if self.fused:  # Triton only where the kernel runs (GPU-import-guarded)
            from kernels.sampling import fused_sample
            self._fused_sample = fused_sample
        self.eos_ids = tuple(eos_ids)
        self._rng = np.random.default_rng(seed)
        self._rows: _RowTensors | None = None
        self._counts: torch.Tensor | None = None  # [S, V] int32 generated-token counts (penalties)
        self._slot_of: dict[str, int] = {}
        self._free_slots: list[int] = []

    def warm_up(self, vocab: int) -> None:
        """Compiles the fused kernels for [R, vocab] fp32 logits at start-up (Triton JITs on first use:
        ~seconds that the first sampled request would otherwise wait)."""
        if self.fused:
            r = 2
            logits = torch.zeros(r, vocab, device=self.device)  # [2, V]: one greedy row, one sampled
            zeros = torch.zeros(r, dtype=torch.int64, device=self.device)
            self._fused_sample(logits, torch.ones(r, device=self.device), zeros, zeros,
                               torch.tensor([True, False], device=self.device))

    def draw_seed(self) -> int:
        """A seed for an unseeded sequence (drawn once per sequence, kept on it)."""
        return int(self._rng.integers(0, 2**62))

    def forget(self, request_id: str) -> None:
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    # ---- per-composition state ---------------------------------------------------------------------
    def _row_tensors(self, rows: list[SampleRow], vocab: int) -> _RowTensors:
        key = tuple(r.request_id for r in rows)
        cached = self._rows
        if cached is not None and cached.key == key:
            return cached
        dev = self.device
        ps = [r.params for r in rows]
        penal = [i for i, p in enumerate(ps) if p.penalized]
        filt = [(p.top_p < 1.0 or p.top_k > 0) and not p.greedy for p in ps]
        slots = [self._slot(rows[i], vocab) for i in penal]
        t = _RowTensors(
            key, _dev(torch.tensor([p.greedy for p in ps]), dev),
            _dev(torch.tensor([max(p.temperature, 1e-5) for p in ps], dtype=torch.float32), dev),
            _dev(torch.tensor([p.top_p for p in ps], dtype=torch.float32), dev),
            _dev(torch.tensor([p.top_k if p.top_k > 0 else vocab for p in ps], dtype=torch.int64), dev),
            _dev(torch.tensor([r.seed for r in rows], dtype=torch.int64), dev),
            all(p.greedy for p in ps),
            _dev(torch.tensor([not p.greedy and not f for p, f in zip(ps, filt)]), dev), None,
            max((p.logprobs for p in ps if p.logprobs is not None), default=None),
            None, None, None, None)
        if any(filt):
            fr = _dev(torch.tensor([i for i, f in enumerate(filt) if f], dtype=torch.int64), dev)
            t.filtered = (fr, t.temp[fr], t.top_k[fr], t.top_p[fr], t.seeds[fr])
        if penal:
            t.penal_rows = _dev(torch.tensor(penal, dtype=torch.int64), dev)
            t.penal_slots = _dev(torch.tensor(slots, dtype=torch.int64), dev)
            t.presence = _dev(torch.tensor([ps[i].presence_penalty for i in penal], dtype=torch.float32), dev)
            t.frequency = _dev(torch.tensor([ps[i].frequency_penalty for i in penal], dtype=torch.float32), dev)
        self._rows = t
        return t

    def _slot(self, row: SampleRow, vocab: int) -> int:
        """The counts row of a penalised sequence, assigned on first sight and filled with the
        tokens it already generated (a first token from a prefill worker, output before a preemption)."""
        slot = self._slot_of.get(row.request_id)
        if slot is not None:
            return slot
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = len(self._slot_of)
            if self._counts is None or slot >= self._counts.shape[0]:
                grown = torch.zeros(max(16, 2 * slot), vocab, dtype=torch.int32, device=self.device)
                if self._counts is not None:
                    grown[:self._counts.shape[0]] = self._counts
                self._counts = grown
        self._slot_of[row.request_id] = slot
        assert self._counts is not None
        self._counts[slot].zero_()
        if row.output_ids:
            ids = torch.tensor(row.output_ids, dtype=torch.int64)
            self._counts[slot].index_add_(0, _dev(ids, self.device), torch.ones_like(ids, dtype=torch.int32,
                                                                                   device=self.device))
        return slot

    # ---- the step ------------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, rows: list[SampleRow], masks: GrammarMasks | None = None) -> SampleOutput:
        """logits [R, V] fp32 -> sampled ids (+ logprobs when any row asks). No host sync.
        `masks`: the allowed tokens of the grammar-constrained rows (the others are free)."""
        r, v = logits.shape
        assert r == len(rows)
        t = self._row_tensors(rows, v)
        raw = logits
        logits = self._adjust(logits, rows, t)
        if masks is not None:
            logits = apply_bitmask(logits if logits is not raw else logits.clone(), masks)
        if t.all_greedy:
            ids = logits.argmax(-1)  # [R]
        else:
            positions = _dev(torch.tensor([x.position for x in rows], dtype=torch.int64), self.device)  # [R]
            ids = self._sample_stochastic(logits, positions, t)
        if t.penal_rows is not None:  # count the new tokens (dropped surplus tokens too: harmless)
            assert self._counts is not None
            self._counts.index_put_((t.penal_slots, ids[t.penal_rows]),
                                    torch.ones_like(t.penal_slots, dtype=torch.int32), accumulate=True)
        if t.max_logprobs is None:
            return SampleOutput(ids, None, None, None)
        lp = torch.log_softmax(raw.float(), dim=-1)
        top_lp, top_ids = lp.topk(max(t.max_logprobs, 1), dim=-1)
        return SampleOutput(ids, lp.gather(1, ids[:, None])[:, 0], top_ids, top_lp)

    def _sample_stochastic(self, logits: torch.Tensor, positions: torch.Tensor, t: _RowTensors) -> torch.Tensor:
        """logits [R, V] (adjusted, masked), a row at least not greedy -> ids [R] int64. Fused: one kernel
        for the greedy and unfiltered rows, the sort-based torch path for the top-k/top-p rows only."""
        if not self.fused:
            sampled = _race(logits, t.temp, t.seeds, positions, (t.top_k, t.top_p) if t.filtered is not None else None)
            return torch.where(t.greedy, logits.argmax(-1), sampled)
        if logits.stride(1) != 1:  # the kernel reads rows with unit stride
            logits = logits.contiguous()
        ids = self._fused_sample(logits, t.temp, t.seeds, positions, t.noise)  # [R]
        if t.filtered is not None:  # rows are independent: the same ids as the whole batch through _race
            fr, temp, top_k, top_p, seeds = t.filtered
            ids.index_copy_(0, fr, _race(logits[fr], temp, seeds, positions[fr], (top_k, top_p)))
        return ids

    def _adjust(self, logits: torch.Tensor, rows: list[SampleRow], t: _RowTensors) -> torch.Tensor:
        """Penalties, logit bias and min_tokens masking; the input is left as is (logprobs read it)."""
        sparse = [(i, x) for i, x in enumerate(rows) if x.params.logit_bias
                  or x.num_generated < x.params.min_tokens]
        if t.penal_rows is None and not sparse:
            return logits
        logits = logits.clone()
        if t.penal_rows is not None:
            assert self._counts is not None
            c = self._counts[t.penal_slots].to(logits.dtype)  # [Rp, V]
            logits[t.penal_rows] -= t.presence[:, None] * (c > 0) + t.frequency[:, None] * c
        if sparse:
            ri, ti, vals = [], [], []
            for i, x in sparse:
                for tok, bias in x.params.logit_bias:
                    if tok < logits.shape[1]:
                        ri.append(i), ti.append(tok), vals.append(bias)
                if x.num_generated < x.params.min_tokens:  # no stop before min_tokens (vLLM semantics)
                    stops = set(x.params.stop_token_ids) | (set() if x.params.ignore_eos else set(self.eos_ids))
                    for tok in stops:
                        ri.append(i), ti.append(tok), vals.append(float("-inf"))
            if ri:
                idx = (_dev(torch.tensor(ri, dtype=torch.int64), self.device),
                       _dev(torch.tensor(ti, dtype=torch.int64), self.device))
                logits.index_put_(idx, _dev(torch.tensor(vals, dtype=logits.dtype), self.device), accumulate=True)
        return logits


@dataclass(slots=True)
class GrammarMasks:
    """The constrained rows of one step and their allowed-token bitmasks, on the device."""

    rows: torch.Tensor  # [Rc] int64 rows of the logits
    bits: torch.Tensor  # [Rc, W] int32, W = ceil(V'/32): bit t % 32 of word t // 32 set = token t allowed


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, m: GrammarMasks) -> torch.Tensor:
    """logits [R, V] (modified in place and returned): disallowed tokens of the masked rows -> -inf."""
    v = logits.shape[1]
    dev = logits.device
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS.setdefault(dev, torch.arange(32, dtype=torch.int32, device=dev))
    rc, w = m.bits.shape
    allowed = ((m.bits[:, :, None] >> shifts) & 1).view(rc, w * 32)  # [Rc, 32 W]
    if allowed.shape[1] < v:  # ids past the grammar's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, v - allowed.shape[1]))
    sub = logits[m.rows].masked_fill(allowed[:, :v] == 0, float("-inf"))  # [Rc, V]
    logits[m.rows] = sub
    return logits


def _dev(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without a stream sync: through pinned memory on CUDA (a pageable source can
    make the copy wait for the stream, which would undo the overlapped step loop)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _race(logits: torch.Tensor, temp: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
          filt: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The torch exponential race: argmax(softmax(logits / T) / q) over [R, V] (top-k/top-p filtered
    when `filt` = (top_k [R], top_p [R])) -> ids [R] int64; the reference of kernels/sampling.py."""
    probs = torch.softmax(logits / temp[:, None], dim=-1)  # [R, V]
    if filt is not None:
        probs = _filter_top_k_top_p(probs, *filt)
    return (probs / exponential_noise(seeds, positions, logits.shape[1])).argmax(-1)


def _filter_top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero out tokens outside each row's top-k and nucleus (top-p), without host syncs."""
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(probs.shape[1], device=probs.device)[None, :]
    cum = sorted_p.cumsum(-1)
    # Keep a token if fewer than top_p of the mass comes before it (the first always survives).
    keep = (ranks < top_k[:, None]) & ((cum - sorted_p) < top_p[:, None])
    sorted_p = sorted_p * keep
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)

"""Wire protocol between router and workers: typed messages, msgpack over ZMQ, versioned, bounded.
Part of no role: the router and both workers import it, and it imports nothing of theirs.

Every frame is msgpack `[PROTOCOL_VERSION, tag, [field values...]]`. Decoding checks the version,
the tag, the field count and every field's type against the class annotations, so a malformed or
foreign frame raises ProtocolError instead of reaching worker logic. No dict[str, Any] crosses.

Request lifecycle (disaggregated):
  router -> decode  AdmitRequest        decode looks the prompt up in its prefix cache and reserves
                                        pages for the rest (or Rejected)
  decode -> router  Admitted            with an opaque KV target (kv_transfer's TransferRequest bytes)
                                        and the cached prefix length: only the pages after it are shipped
  router -> prefill PrefillRequest      prefill computes the prompt (from its own cached prefix) and
                                        writes KV into those pages
  prefill -> router PrefillResult       first token once the transfer is DONE (or an error)
  router -> decode  StartDecode         decode waits for the KV-landed notification and this message
  decode -> router  TokenBatch ...      each step: a TokenChunk per sequence of that router, until finished
  router -> any     Abort               client gone / failure; frees or quarantines pages
Colocated (or a short uncached suffix on the decode worker holding the prefix): router -> decode
GenerateRequest, then TokenChunks. Status polls (StatusRequest with the router's cursor) carry each
worker's prefix-cache events (WorkerStatus.cache_*).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from common.errors import ProtocolError
from wire.codec import brief, build, pack, to_wire, unpack

PROTOCOL_VERSION = 9  # 2: sampling penalties and logit bias; TokenBatch (one frame per step); 3: prefix cache;
# 4: structured outputs (SamplingSpec.grammars), n > 1 (SamplingSpec.share_prompt)
# 5: TokenChunk carries a local prefill's queue and compute time (the TTFT breakdown of colocated requests)
# 6: PrefillResult.split: where the prefill worker's compute time went (host before launch, launch, GPU)
# 7: GrammarSpec target "call": a required tool call constrains the whole turn (tool_choice required / named)
# 8: WorkerStatus.max_model_len: the router's default max_tokens is the room a worker's context and KV leave
# 9: prompt log probabilities (SamplingSpec.prompt_logprobs; PromptLogprobs on PrefillResult, the first TokenChunk)
MAX_RESERVATION_S = 3600.0  # longest AdmitRequest.deadline_s a decode worker accepts
MAX_FRAME_BYTES = 64 << 20  # a 128k-token prompt is ~1 MB; anything near this is an error


@dataclass(frozen=True, slots=True)
class LogitBias:
    token_id: int
    bias: float


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A JSON grammar for one Harmony message target (common/grammar.py): target "final" (the
    answer: response_format) or "functions.NAME" (a strict tool's arguments); schema is the JSON
    schema text, "" for any JSON object (response_format json_object). Target "call" (tool_choice
    required or named): the turn must end in a call; schema is a JSON object {tool name: its
    arguments' schema text, "" = any object}."""

    target: str
    schema: str = ""


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: list[LogitBias] = field(default_factory=list)
    grammars: list[GrammarSpec] = field(default_factory=list)  # structured outputs; empty = unconstrained
    share_prompt: bool = False  # n > 1: index the prompt's KV in the prefix cache once computed (model/prefix_share.py)
    # echo + logprobs (/v1/completions): every prompt token's log probability given the tokens before it, plus the
    # top-n there (None = off). The worker computing the prompt then skips its prefix cache: a cached token has no logits.
    prompt_logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Log probabilities of prompt tokens 1..P-1 (token 0 has no context), each under the raw model distribution
    (no temperature, penalties or bias) given the tokens before it; `top`: the n most likely tokens there."""

    logprobs: list[float]  # [P - 1]
    top: list[list[TopLogprob]]  # [P - 1][n]


@dataclass(frozen=True, slots=True)
class StatusRequest:
    # The router's position in this worker's prefix-cache event log (WorkerStatus.cache_*); -1: no
    # events wanted (health checks, tools).
    cache_cursor: int = -1


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    role: str  # "prefill" | "decode"
    worker_id: str
    epoch: int
    ready: bool
    draining: bool
    queue_depth: int  # requests waiting (prefill: queued prompts; decode: waiting + transferring)
    queued_tokens: int  # prompt tokens waiting (prefill placement)
    running: int
    kv_free_pages: int  # full-attention group (grows with context)
    kv_total_pages: int
    kv_free_sliding_pages: int  # sliding-window rings
    kv_total_sliding_pages: int
    page_size: int
    max_num_seqs: int
    busy_seconds: float
    # Prefix cache (model/prefix_cache.py); identity "" = caching off. The router hashes prompts with
    # common.prefix_hash seeded by cache_identity and mirrors each worker's index from its events:
    # cache_events is flat [kind, hash, ...] (kinds in model.prefix_cache: stored/evicted x full/sliding)
    # after the requester's cursor, cache_cursor the cursor to ask from next time; cache_reset: the
    # events are a snapshot of the whole index (the cursor was unknown): start from empty.
    cache_identity: str = ""
    sliding_window: int = 0
    cache_cursor: int = 0
    cache_reset: bool = False
    cache_events: list[int] = field(default_factory=list)
    cached_pages: int = 0  # full-attention pages held by the cache alone (evictable)
    kv_bytes_per_token: int = 0  # one token's KV over all layers (this rank's heads): what shipping it costs
    max_model_len: int = 0  # the worker's context limit (prompt + output tokens); 0: not said


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    request_id: str
    prompt_len: int
    max_tokens: int
    prefill_tp: int  # the prefill worker's TP degree (heads per rank for the transfer plan)
    deadline_s: float  # seconds the reservation may wait for its KV (0, MAX_RESERVATION_S]
    prompt_ids: list[int] = field(default_factory=list)  # for the prefix-cache lookup (empty: none)


@dataclass(frozen=True, slots=True)
class Admitted:
    request_id: str
    epoch: int
    kv_target: bytes  # kv_transfer TransferRequest, opaque to the router
    cached_tokens: int = 0  # decode holds [0, cached_tokens) already: only the rest is shipped


@dataclass(frozen=True, slots=True)
class Rejected:
    request_id: str
    reason: str
    retryable: bool


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    kv_target: bytes
    deadline_s: float


@dataclass(frozen=True, slots=True)
class ComputeSplit:
    """Where a prefill worker's compute time (PrefillResult.prefill_seconds) went, in seconds. What
    admit and launch leave of it is the host waiting for the GPU (and between-chunk bookkeeping)."""

    admit_seconds: float  # host, before the first launch: KV target, prefix lookup, page mapping, transfer start
    launch_seconds: float  # host, inside the forward launches: metadata, attention plan, queuing every kernel, hooks
    hook_seconds: float  # of launch: per-layer hooks (KV transfer posts, the sender's run-ahead waits, cancel checks)
    gpu_seconds: float  # device: CUDA-event span from the first launch to the first token's copy (0 off CUDA)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    request_id: str
    ok: bool
    first_token: int
    first_logprob: float | None
    first_top: list[TopLogprob]
    error: str
    prefill_seconds: float  # compute, first chunk to sampled token
    transfer_bytes: int
    transfer_seconds: float
    queue_seconds: float = 0.0  # waiting in the prefill worker's queue
    tail_seconds: float = 0.0  # compute done -> the KV transfer terminal (what the transfer added to TTFT)
    cached_tokens: int = 0  # prompt tokens the prefill worker took from its own prefix cache
    split: ComputeSplit | None = None  # prefill_seconds by part (None: a failed request)
    prompt: PromptLogprobs | None = None  # SamplingSpec.prompt_logprobs asked


@dataclass(frozen=True, slots=True)
class StartDecode:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    first_token: int
    first_logprob: float | None
    first_top: list[TopLogprob]


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingSpec


@dataclass(frozen=True, slots=True)
class TokenChunk:
    request_id: str
    token_ids: list[int]
    logprobs: list[float]  # one per token when requested, else empty
    top_logprobs: list[list[TopLogprob]]  # per token, when requested
    finished: bool
    finish_reason: str  # "" | "stop" | "length" | "abort"
    error: str
    cached_tokens: int = 0  # first chunk of a GenerateRequest: prompt tokens taken from the prefix cache
    queue_seconds: float = 0.0  # first chunk of a GenerateRequest: the worker received it -> its first step scheduled
    prefill_seconds: float = 0.0  # ... that step's launch -> its first token on the worker's host
    prompt: PromptLogprobs | None = None  # first chunk, when SamplingSpec.prompt_logprobs asked


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """One decode step's new tokens for every sequence of one router connection: one frame per step
    per peer instead of one per sequence (batch 128 sent 128 frames a step)."""

    chunks: list[TokenChunk]


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Ack:
    request_id: str


MESSAGES: tuple[type, ...] = (SamplingSpec, TopLogprob, StatusRequest, WorkerStatus, AdmitRequest, Admitted, Rejected,
                              PrefillRequest, PrefillResult, StartDecode, GenerateRequest, TokenChunk, Abort, Ack,
                              LogitBias, TokenBatch, GrammarSpec, ComputeSplit, PromptLogprobs)
_TAGS = {cls: i for i, cls in enumerate(MESSAGES)}


def encode(msg: typing.Any) -> bytes:
    cls = type(msg)
    if cls not in _TAGS:
        raise TypeError(f"{cls.__name__} is not a protocol message")
    data = pack([PROTOCOL_VERSION, _TAGS[cls], to_wire(msg)])
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"{cls.__name__} frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    return data


def decode(data: bytes) -> typing.Any:
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    frame = unpack(data, "wire protocol")
    if not isinstance(frame, list) or len(frame) != 3:
        raise ProtocolError("frame is not [version, tag, fields]")
    version, tag, values = frame
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {brief(version)} != ours {PROTOCOL_VERSION}; upgrade the older side")
    if type(tag) is not int or not 0 <= tag < len(MESSAGES):
        raise ProtocolError(f"unknown message tag {brief(tag)}")
    return build(MESSAGES[tag], values, "frame")

"""Open-loop load generation against any OpenAI-compatible server.

A run, top to bottom:
  plan_requests   every request is drawn up front from one seeded generator: its arrival offset
                  (Poisson: exponential gaps at the target rate; gamma gaps when burstier), its
                  prompt (token ids for /v1/completions, words for /v1/chat/completions) and its
                  output length (max_tokens, with ignore_eos so the server generates exactly that)
  run_load        sleeps until each offset and fires the request without waiting for earlier ones
                  (open loop); --max-concurrency caps in-flight requests (a closed loop at that
                  concurrency when the rate is infinite)
  stream_one      POSTs with stream=true, stamps each SSE event with the monotonic clock as it
                  arrives, counts its tokens (token_ids when the server returns them, else one per
                  non-empty text piece) and ends in a RequestResult; a failure has a kind
                  (http_503, timeout, connect_error, stream_closed, server_error, bad_payload)

Every request runs under its own deadline, so a silent server can never hang the run.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field

import httpx
import numpy as np

from common.errors import ConfigError

# Common short English words: each is one o200k token with its leading space, so a chat prompt of
# N words is about N tokens (the server's usage.prompt_tokens gives the exact count).
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have "
         "an they you were her she there one all we their can has more will would if so no out up what about "
         "into than them only other new some could time these two may then do first any my now such like our "
         "over man me even most made after also did many before must through back years where much your way "
         "well down should because each just those people how too little state good very make world still own "
         "see men work long get here between both life being under never day same another know while last").split()


@dataclass(frozen=True, slots=True)
class LengthRange:
    """A fixed length (lo == hi) or a uniform draw from [lo, hi]."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """'128' or '64:256'."""
        try:
            parts = [int(x) for x in text.split(":")]
        except ValueError:
            raise ConfigError(f"length {text!r}: expected N or LO:HI") from None
        if len(parts) not in (1, 2):
            raise ConfigError(f"length {text!r}: expected N or LO:HI")
        lo, hi = parts[0], parts[-1]
        if lo < 1 or hi < lo:
            raise ConfigError(f"length {text!r}: expected N or LO:HI with 1 <= LO <= HI")
        return cls(lo, hi)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.lo, self.hi + 1, size=n)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    base_url: str  # http://host:port (no /v1)
    model: str
    api: str = "completions"  # or "chat"
    num_requests: int = 64
    request_rate: float = math.inf  # requests per second; inf: all arrive at t=0
    burstiness: float = 1.0  # gamma shape of the gaps: 1 = Poisson, < 1 burstier, > 1 smoother
    max_concurrency: int | None = None
    input_len: LengthRange = LengthRange(128, 128)
    output_len: LengthRange = LengthRange(64, 64)
    seed: int = 0
    extras: bool = True  # send ignore_eos + return_token_ids (vLLM-style extensions)
    token_id_range: tuple[int, int] = (1000, 100_000)  # ordinary text tokens, no specials
    json_schema: bool = False  # structured outputs: response_format json_schema (GRAMMAR_SCHEMA), see request_body
    temperature: float = 0.0  # 0: greedy; > 0 (the OpenAI default is 1) measures the sampler too
    request_timeout_s: float = 120.0  # whole request, first byte to [DONE]
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.api not in ("completions", "chat"):
            raise ConfigError(f"api must be completions or chat, got {self.api!r}")
        if self.num_requests < 1:
            raise ConfigError("num_requests must be >= 1")
        if not self.request_rate > 0:
            raise ConfigError("request_rate must be > 0 (inf for all at once)")
        if not self.burstiness > 0:
            raise ConfigError("burstiness must be > 0")
        if not 0 <= self.temperature <= 2:
            raise ConfigError("temperature must be in [0, 2]")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError("max_concurrency must be >= 1")
        if self.request_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ConfigError("timeouts must be > 0")


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    offset_s: float  # scheduled arrival, from the start of the run
    prompt_ids: tuple[int, ...]  # completions: the prompt; chat: the word indices used
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    index: int
    prompt_tokens: int  # what we sent (completions) or what usage reported (chat)
    expected_output_tokens: int
    scheduled_s: float
    dispatch_s: float = 0.0  # when it was actually sent, from the start of the run
    ok: bool = False
    error_kind: str | None = None
    error: str = ""
    output_tokens: int = 0
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    ttft_s: float | None = None  # dispatch -> first event carrying a token
    last_token_s: float | None = None  # dispatch -> last event carrying a token
    e2e_s: float | None = None  # dispatch -> end of the stream
    itl_s: list[float] = field(default_factory=list)  # one entry per token after the first
    token_ids: list[int] = field(default_factory=list)  # when the server returns them (return_token_ids)
    queue_wait_s: float | None = None  # the server's x-tandem-queue-wait-s header, when it sends one

    @property
    def tpot_s(self) -> float | None:
        """Mean inter-token latency of this request (time per output token after the first)."""
        if self.ttft_s is None or self.last_token_s is None or self.output_tokens < 2:
            return None
        return (self.last_token_s - self.ttft_s) / (self.output_tokens - 1)

    def fail(self, kind: str, message: str) -> RequestResult:
        self.ok, self.error_kind, self.error = False, kind, message[:300]
        return self


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times of n requests from t=0: gaps are gamma(k, 1/(rate k)), mean 1/rate, CV 1/sqrt(k);
    k = 1 is a Poisson process. The first request arrives at 0 so a run never starts idle."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def plan_requests(spec: LoadSpec) -> list[PlannedRequest]:
    rng = np.random.default_rng(spec.seed)
    offsets = arrival_offsets(spec.num_requests, spec.request_rate, spec.burstiness, rng)
    in_lens = spec.input_len.sample(rng, spec.num_requests)
    out_lens = spec.output_len.sample(rng, spec.num_requests)
    lo, hi = (0, len(WORDS)) if spec.api == "chat" else spec.token_id_range
    return [PlannedRequest(i, float(offsets[i]), tuple(int(t) for t in rng.integers(lo, hi, size=int(in_lens[i]))),
                           int(out_lens[i])) for i in range(spec.num_requests)]


# --json-schema: 16 required free-string fields. A JSON answer ends only after 16 closing quotes, and
# a token that closes a string is rare among the allowed ones, so the grammar stays active for
# hundreds of tokens: every measured output token pays the mask (host) and its application (device).
GRAMMAR_SCHEMA = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(16)},
                  "required": [f"f{i}" for i in range(16)], "additionalProperties": False}
# `<|start|>assistant<|channel|>final<|message|>` in o200k_harmony: the grammar acts inside the final
# channel only, and a random-weight model never opens it by itself.
FINAL_HEADER = (200006, 173781, 200005, 17196, 200008)
END_IDS = (200002, 200007)


def request_body(spec: LoadSpec, p: PlannedRequest) -> tuple[str, dict]:
    body: dict = {"model": spec.model, "max_tokens": p.max_tokens, "temperature": spec.temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if spec.extras:
        body.update(ignore_eos=True, return_token_ids=True)
    if spec.json_schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": GRAMMAR_SCHEMA,
                                                                          "strict": True}}
    if spec.api == "chat":
        text = " ".join(WORDS[i] for i in p.prompt_ids)
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    prompt = list(p.prompt_ids) + (list(FINAL_HEADER) if spec.json_schema else [])
    return "/v1/completions", {**body, "prompt": prompt}


def constrained_fraction(results: list[RequestResult]) -> float | None:
    """Share of the returned output tokens generated before the first end token (inside the grammar)."""
    total = sum(len(r.token_ids) for r in results if r.ok)
    if not total:
        return None
    inside = sum(next((i for i, t in enumerate(r.token_ids) if t in END_IDS), len(r.token_ids))
                 for r in results if r.ok)
    return inside / total


class SSEParser:
    """Server-sent events from lines (WHATWG rules we need: `data:` lines joined by newlines, an
    event ends at a blank line, `:` starts a comment, other fields are ignored)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """The data of the event this line completes, else None."""
        line = line.rstrip("\r\n")
        if not line:
            data, self._data = self._data, []
            return "\n".join(data) if data else None
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """An event left without its blank line when the stream ended."""
        return self.feed("")


async def sse_json(lines: AsyncIterable[bytes]) -> AsyncIterator[dict]:
    """The JSON of each SSE event of a streamed response read as byte lines (aiohttp's `resp.content`),
    up to [DONE]. Bad JSON or UTF-8 raises ValueError."""
    parser = SSEParser()
    async for raw in lines:
        data = parser.feed(raw.decode())
        if data is None:
            continue
        if data.strip() == "[DONE]":
            return
        yield json.loads(data)


class _Counter:
    """Tokens in one streamed chunk. token_ids, when the server sends them, are exact; otherwise each
    non-empty text piece counts as one token (OpenAI servers stream one token per chunk)."""

    def __init__(self, api: str) -> None:
        self.api, self.ids_seen = api, False

    def tokens(self, chunk: dict) -> int:
        n = 0
        for choice in chunk.get("choices") or []:
            if "token_ids" in choice and choice["token_ids"] is not None:
                self.ids_seen = True
                n += len(choice["token_ids"])
            elif not self.ids_seen:
                if self.api == "chat":
                    d = choice.get("delta") or {}
                    n += int(bool(d.get("content") or d.get("reasoning_content") or d.get("reasoning")
                                  or d.get("tool_calls")))
                else:
                    n += int(bool(choice.get("text")))
        return n


async def stream_one(client: httpx.AsyncClient, spec: LoadSpec, p: PlannedRequest, t_run0: float) -> RequestResult:
    path, body = request_body(spec, p)
    r = RequestResult(p.index, len(p.prompt_ids), p.max_tokens, p.offset_s)
    t0 = time.perf_counter()
    r.dispatch_s = t0 - t_run0
    try:
        async with asyncio.timeout(spec.request_timeout_s):
            return await _stream(client, spec, path, body, r, t0)
    except TimeoutError:
        return r.fail("timeout", f"no complete response within {spec.request_timeout_s:g} s")
    except httpx.TimeoutException as e:
        return r.fail("timeout", f"{type(e).__name__}: {e}")
    except httpx.ConnectError as e:
        return r.fail("connect_error", str(e))
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        return r.fail("stream_closed", f"{type(e).__name__}: {e}")
    except httpx.HTTPError as e:
        return r.fail("http_error", f"{type(e).__name__}: {e}")


async def _stream(client: httpx.AsyncClient, spec: LoadSpec, path: str, body: dict, r: RequestResult,
                  t0: float) -> RequestResult:
    async with client.stream("POST", path, json=body) as resp:
        wait = resp.headers.get("x-tandem-queue-wait-s")
        r.queue_wait_s = float(wait) if wait is not None else None
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            return r.fail(f"http_{resp.status_code}", text)
        parser, counter, done, prev = SSEParser(), _Counter(spec.api), False, None
        async for line in resp.aiter_lines():
            data = parser.feed(line)
            if data is None:
                continue
            now = time.perf_counter() - t0
            if data.strip() == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                return r.fail("bad_payload", f"not JSON: {data[:100]!r}")
            if "error" in chunk:
                err = chunk["error"]
                return r.fail("server_error", str(err.get("message", err) if isinstance(err, dict) else err))
            if chunk.get("usage"):
                r.usage_prompt_tokens = chunk["usage"].get("prompt_tokens")
                r.usage_completion_tokens = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or []:
                r.token_ids += choice.get("token_ids") or []
            k = counter.tokens(chunk)
            if k == 0:
                continue
            if prev is None:
                r.ttft_s = now  # tokens beyond the first in this event arrived with it: no gaps
            else:
                r.itl_s.extend([(now - prev) / k] * k)  # a k-token event spreads its gap over its tokens
            prev = r.last_token_s = now
            r.output_tokens += k
    r.e2e_s = time.perf_counter() - t0
    if spec.api == "chat" and r.usage_prompt_tokens is not None:
        r.prompt_tokens = r.usage_prompt_tokens
    if not done:
        return r.fail("stream_closed", "the stream ended without [DONE]")
    if r.ttft_s is None:
        return r.fail("no_tokens", "the stream finished without a token")
    r.ok = True
    return r


@dataclass(slots=True)
class RunOutcome:
    results: list[RequestResult]
    duration_s: float  # first dispatch to last completion


async def run_load(spec: LoadSpec, planned: list[PlannedRequest]) -> RunOutcome:
    # No connection cap: a pool limit would queue requests in the client and quietly close the loop.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(spec.request_timeout_s, connect=spec.connect_timeout_s)
    sem = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
    async with httpx.AsyncClient(base_url=spec.base_url, limits=limits, timeout=timeout) as client:

        async def one(p: PlannedRequest) -> RequestResult:
            try:
                return await stream_one(client, spec, p, t_run0)
            finally:
                if sem is not None:
                    sem.release()

        tasks: list[asyncio.Task] = []
        t_run0 = time.perf_counter()
        for p in planned:
            delay = t_run0 + p.offset_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                await sem.acquire()
            tasks.append(asyncio.create_task(one(p)))
        results = list(await asyncio.gather(*tasks))
        return RunOutcome(results, time.perf_counter() - t_run0)

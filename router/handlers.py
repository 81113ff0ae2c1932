"""Chat and text completions: request -> prompt ids -> orchestrator -> deltas / final response.

Both endpoints run one event generator (`_events`) and differ only in how they present it: SSE
chunks as they come, or one JSON body at the end. Stop strings are matched on the generated text
(content for chat): text that could still grow into a stop string is held back, and a hit ends the
request on its workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from common.errors import InvalidRequest, ProtocolError
from router.chat_types import Delta, DeltaKind, ParsedCompletion
from router.config import RouterConfig
from router.harmony import HarmonyFormat
from router.metrics import RouterMetrics
from router.openai_models import (ChatCompletionRequest, CompletionRequest, choice_seed, completion_grammars,
                                  prompt_grammars, sampling_spec, to_chat_prompt)
from router.orchestrator import Job, Orchestrator
from router.prefix_index import PromptHashes
from router.textguard import check_texts, guarded
from wire.protocol import PromptLogprobs, SamplingSpec, TokenChunk
from router.tokenizer import VOCAB_SIZE, Tokenizer


class StopStrings:
    """Finds the earliest stop string in streamed text, holding back a possible partial match."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held = stops, ""
        self.keep = max((len(s) for s in stops), default=1) - 1

    def feed(self, text: str) -> tuple[str, bool]:
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[:min(hits)], True
        cut = len(buf) - self.keep if self.keep else len(buf)
        self.held = buf[max(cut, 0):]
        return buf[:max(cut, 0)], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


@dataclass(slots=True)
class Event:
    deltas: list[Delta] = field(default_factory=list)
    text: str = ""  # completions: new text
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[dict] | None = None  # completions with echo + logprobs: one entry per prompt token


class Handlers:
    def __init__(self, cfg: RouterConfig, orch: Orchestrator, metrics: RouterMetrics, fmt: HarmonyFormat) -> None:
        self.cfg, self.orch, self.metrics, self.fmt = cfg, orch, metrics, fmt
        self.tok: Tokenizer = fmt.tokenizer

    # ---- shared -------------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        from common.errors import ModelNotFound

        if name not in self.cfg.model_names:
            raise ModelNotFound(f"model {name!r} does not exist; served: {', '.join(self.cfg.model_names)}",
                                param="model")

    def default_max_tokens(self, prompt_len: int) -> int:
        """max_tokens of a request that names none: --default-max-tokens if set, else (0, the default) the
        room the context leaves, as OpenAI and vLLM do: the router's --max-model-len and every ready decode
        worker's context and KV cache (Fleet.context_limit). A reasoning model's long answer is then not cut at
        an arbitrary length (Codex ends a turn cut by max_output_tokens with an error). At least 1: a prompt
        that leaves no room is refused by the length checks."""
        if self.cfg.default_max_tokens > 0:
            return max(min(self.cfg.default_max_tokens, self.cfg.max_model_len - prompt_len), 1)
        fleet = self.orch.fleet.context_limit()
        limit = min(self.cfg.max_model_len, fleet) if fleet is not None else self.cfg.max_model_len
        return max(limit - prompt_len, 1)

    def max_tokens(self, requested: int | None, prompt_len: int, prompt_param: str = "messages",
                   max_param: str = "max_tokens") -> int:
        """The request's output budget: `requested`, or the default for its prompt; a 400 naming the
        endpoint's own field (`prompt_param`, `max_param`) when the context cannot hold it."""
        room = self.cfg.max_model_len - prompt_len
        if room < 1:
            raise InvalidRequest(f"the {prompt_param} has {prompt_len} tokens; the maximum context length is "
                                 f"{self.cfg.max_model_len}", param=prompt_param)
        if requested is not None and requested > room:
            raise InvalidRequest(f"{prompt_param} ({prompt_len} tokens) + {max_param} ({requested}) exceeds the "
                                 f"maximum context length {self.cfg.max_model_len}", param=max_param)
        return requested if requested is not None else self.default_max_tokens(prompt_len)

    def _logprob_entry(self, token_id: int, logprob: float, top: list) -> dict:
        return {"token": self.tok.decode([token_id]), "logprob": logprob,
                "bytes": list(self.tok.token_bytes([token_id])),
                "top_logprobs": [{"token": self.tok.decode([t.token_id]), "logprob": t.logprob,
                                  "bytes": list(self.tok.token_bytes([t.token_id]))} for t in top]}

    def _prompt_entries(self, prompt_ids: list[int], pl: PromptLogprobs) -> list[dict]:
        """Echoed prompt tokens as logprob entries: the first has no context, so no logprob (OpenAI's null)."""
        if len(pl.logprobs) != len(prompt_ids) - 1 or len(pl.top) != len(pl.logprobs):
            raise ProtocolError(f"worker returned {len(pl.logprobs)} prompt logprobs for a {len(prompt_ids)}-token "
                                    "prompt")
        first = {"token": self.tok.decode(prompt_ids[:1]), "logprob": None,
                 "bytes": list(self.tok.token_bytes(prompt_ids[:1])), "top_logprobs": None}
        return [first] + [self._logprob_entry(t, lp, top) for t, lp, top in zip(prompt_ids[1:], pl.logprobs, pl.top)]

    async def _run(self, job: Job, stream_fn) -> AsyncIterator[Event]:
        """Drive the orchestrator; `stream_fn(chunk) -> (Event, stop_hit)` turns chunks into events."""
        t0 = time.monotonic()
        last = None
        gen = self.orch.generate(job)
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        status = "error"
        try:
            async for chunk in gen:
                now = time.monotonic()
                if last is None:
                    self.metrics.ttft.observe(now - t0)
                    if job.trace.placed_at is not None:
                        self.metrics.ttft_placed.observe(now - job.trace.placed_at)
                        own = max(0.0, now - t0 - job.trace.queue_wait_s - job.trace.worker_s)
                        job.trace.parts["router"] = own
                        self.metrics.ttft_part.labels("router").observe(own)
                elif chunk.token_ids:
                    for _ in chunk.token_ids:
                        self.metrics.itl.observe((now - last) / len(chunk.token_ids))
                last = now
                self.metrics.generation_tokens.inc(len(chunk.token_ids))
                ev, hit = stream_fn(chunk)
                if hit:
                    ev.finish_reason = "stop"
                    yield ev
                    status = "ok"
                    return
                if chunk.finished:
                    ev.finish_reason = chunk.finish_reason or "stop"
                yield ev
                if chunk.finished:
                    status = "ok"
                    return
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            await gen.aclose()  # a stop-string hit or a client disconnect aborts on the workers
            self.metrics.requests.labels(status).inc()
            self.metrics.e2e.observe(time.monotonic() - t0)

    # ---- chat -----------------------------------------------------------------------------------------
    def prepare_chat(self, req: ChatCompletionRequest) -> tuple[list[Job], list[str]]:
        """The request's n choices as jobs (one for n = 1) and its stop strings."""
        self.check_model(req.model)
        req.check_unsupported()
        check_texts(_chat_texts(req), self.cfg.max_model_len)  # before the tokenizer sees it
        prompt = to_chat_prompt(req, time.strftime("%Y-%m-%d"), self.cfg.knowledge_cutoff)
        ids = guarded(self.fmt.render, prompt, param="messages")
        max_tokens = self.max_tokens(req.max_completion_tokens or req.max_tokens, len(ids))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        spec = sampling_spec(req, max_tokens, self.fmt.stop_token_ids(), logprobs, prompt_grammars(prompt, req.min_tokens))
        return self.choices(f"chatcmpl-{uuid.uuid4().hex}", ids, spec, req.n, req.priority), req.stop_strings()

    def choices(self, rid: str, ids: list[int], spec: SamplingSpec, n: int, priority: int) -> list[Job]:
        """n jobs of one prompt: ids rid-c0.., seeds seed + i, the prompt's block hashes computed once."""
        if n == 1:
            return [Job(rid, ids, spec, priority)]
        hashes = PromptHashes(ids)  # choice 0 shares its prompt's KV as soon as it is computed (router/fanout.py)
        return [Job(f"{rid}-c{i}", ids, dataclasses.replace(spec, seed=choice_seed(spec.seed, i), share_prompt=i == 0),
                    priority, hashes=hashes) for i in range(n)]

    async def chat_events(self, job: Job, stops: list[str]) -> AsyncIterator[tuple[Event, ParsedCompletion | None]]:
        """Events as tokens arrive; the last one carries the ParsedCompletion and the finish reason."""
        parser = self.fmt.new_parser()
        stop = StopStrings(stops)
        stopped = False
        content_parts: list[str] = []

        def filter_deltas(deltas: list[Delta]) -> list[Delta]:
            nonlocal stopped
            out = []
            for d in deltas:
                if stopped:
                    break
                if d.kind == DeltaKind.CONTENT and stops:
                    text, stopped = stop.feed(d.text)
                    if text:
                        content_parts.append(text)
                        out.append(Delta(DeltaKind.CONTENT, text))
                else:
                    out.append(d)
            return out

        def on_chunk(chunk: TokenChunk) -> tuple[Event, bool]:
            ev = Event(token_ids=list(chunk.token_ids), deltas=filter_deltas(parser.feed(chunk.token_ids)))
            if job.sampling.logprobs is not None:
                tops = chunk.top_logprobs or [[]] * len(chunk.token_ids)
                ev.logprobs = [self._logprob_entry(t, lp, top) for t, lp, top in
                               zip(chunk.token_ids, chunk.logprobs, tops)]
            return ev, stopped

        finish = "stop"
        async for ev in self._run(job, on_chunk):
            finish = ev.finish_reason or finish
            ev.finish_reason = None  # reported once, with the parsed result below
            yield ev, None
        tail, parsed = parser.finish("length" if finish == "length" else "stop")
        tail = filter_deltas(tail)
        if stops and not stopped:
            held = stop.flush()
            if held:
                content_parts.append(held)
                tail.append(Delta(DeltaKind.CONTENT, held))
        if stops:
            parsed.content = "".join(content_parts) or None
        if stopped:
            parsed.finish_reason = "stop"
        yield Event(deltas=tail, finish_reason=parsed.finish_reason), parsed

    # ---- completions ------------------------------------------------------------------------------
    def prompts_of(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        texts = [p] if isinstance(p, str) else [x for x in p if isinstance(x, str)]
        check_texts((("prompt", t) for t in texts), self.cfg.max_model_len)
        if isinstance(p, str):
            prompts = [guarded(self.tok.encode, p, param="prompt")]
        elif p and isinstance(p[0], int):
            prompts = [list(p)]  # type: ignore[arg-type]
        elif p and isinstance(p[0], str):
            prompts = [guarded(self.tok.encode, s, param="prompt") for s in p]  # type: ignore[union-attr]
        else:
            prompts = [list(x) for x in p]  # type: ignore[union-attr]
        if not prompts or any(not x for x in prompts):
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if any(min(x) < 0 or max(x) >= VOCAB_SIZE for x in prompts):  # C loops: prompts are 1k-100k ids
            raise InvalidRequest(f"prompt token ids must be in [0, {VOCAB_SIZE})", param="prompt")
        return prompts

    def prepare_completion(self, req: CompletionRequest) -> tuple[str, list[Job], list[str]]:
        """(response id, jobs: prompt k's choice i at k * n + i, stop strings)."""
        self.check_model(req.model)
        req.check_unsupported()
        if req.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        prompts = self.prompts_of(req)
        if len(prompts) * req.n > 128:
            raise InvalidRequest("prompts x n must be at most 128", param="n")
        grammars = completion_grammars(req)
        rid, jobs = f"cmpl-{uuid.uuid4().hex}", []
        prompt_lp = req.logprobs if req.echo else None  # echo + logprobs: the prompt tokens' too
        for k, ids in enumerate(prompts):
            # max_tokens 0 (echo only): the worker samples one token, which completion_events drops
            max_tokens = self.max_tokens(req.max_tokens if req.max_tokens is not None else 16, len(ids), "prompt")
            spec = dataclasses.replace(sampling_spec(req, max(max_tokens, 1), [], req.logprobs, grammars),
                                       prompt_logprobs=prompt_lp)
            jobs += self.choices(rid if len(prompts) == 1 else f"{rid}-p{k}", ids, spec, req.n, req.priority)
        return rid, jobs, req.stop_strings()

    async def completion_events(self, job: Job, stops: list[str], skip_special: bool,
                                prompt_only: bool = False) -> AsyncIterator[Event]:
        """`prompt_only` (max_tokens 0): the sampled token is dropped; the events carry the prompt's logprobs."""
        detok = self.tok.new_detokenizer(skip_special=skip_special)
        stop = StopStrings(stops)
        stop_hit = [False]

        def on_chunk(chunk: TokenChunk) -> tuple[Event, bool]:
            ev, hit = (Event(), False) if prompt_only else on_tokens(chunk)
            if chunk.prompt is not None and job.sampling.prompt_logprobs is not None:
                ev.prompt_logprobs = self._prompt_entries(job.prompt_ids, chunk.prompt)
            return ev, hit

        def on_tokens(chunk: TokenChunk) -> tuple[Event, bool]:
            text, hit = stop.feed(detok.feed(chunk.token_ids))
            stop_hit[0] = stop_hit[0] or hit
            ev = Event(text=text, token_ids=list(chunk.token_ids))
            if job.sampling.logprobs is not None:
                tops = chunk.top_logprobs or [[]] * len(chunk.token_ids)
                ev.logprobs = [self._logprob_entry(t, lp, top) for t, lp, top in
                               zip(chunk.token_ids, chunk.logprobs, tops)]
            return ev, hit

        finish = "stop"
        async for ev in self._run(job, on_chunk):
            finish = ev.finish_reason or finish
            ev.finish_reason = None  # reported once, on the final event
            yield ev
        tail = "" if stop_hit[0] or prompt_only else stop.feed(detok.flush())[0] + stop.flush()
        yield Event(text=tail, finish_reason="length" if prompt_only else finish)


def _chat_texts(req: ChatCompletionRequest):
    """(param, text) of everything in a chat request that the tokenizer will see."""
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            yield f"{where}.content", m.content
        elif m.content:
            for part in m.content:
                yield f"{where}.content", part.text
        for text in (m.reasoning_content, m.reasoning, m.name, m.tool_call_id):
            if text:
                yield where, text
        for c in m.tool_calls or []:
            yield f"{where}.tool_calls", c.function.arguments
    for t in req.tools or []:
        yield "tools", t.function.description
        if t.function.parameters is not None:
            yield "tools", json.dumps(t.function.parameters)

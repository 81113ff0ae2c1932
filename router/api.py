"""HTTP endpoints (OpenAI-compatible) and the mapping of typed errors to OpenAI error bodies.

/v1/chat/completions, /v1/completions (stream and not), /v1/models, /health, /ready, /metrics, and
the OpenAPI schema at /openapi.json (what API fuzzers read). Every TandemError becomes
{"error": {"message", "type", "param", "code"}} with its HTTP status (and headers: Retry-After on
429); FastAPI's validation errors (bad JSON, wrong types, out-of-range values) become 400s.

Each generation request runs in a router.lifecycle scope (client disconnect, request timeout and
the drain deadline cancel it); while the router drains, new requests get 503 and /ready 503.
Responses carry `x-tandem-queue-wait-s` (how long the request waited in the admission queue),
`x-tandem-decode` / `x-tandem-prefill` (the workers it ran on; prefill empty: prefilled on decode)
and `x-tandem-ttft-breakdown` (`component=seconds;...`, the components of tandem_ttft_breakdown_seconds
for this request; streams send headers with the first token, so they are known by then).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.errors import InvalidRequest, TandemError
from router.chat_types import DeltaKind
from router.errors import ServiceDraining, error_code
from router.handlers import Event, Handlers
from router.lifecycle import ClientGone, InFlight
from router.openai_models import ChatCompletionRequest, CompletionRequest
from router.orchestrator import Job
from router.responses import register_responses


@dataclass(slots=True)
class Serving:
    """What the endpoints share beyond the handlers: health, metrics, the requests in flight, drain."""

    ready: Callable[[], tuple[bool, str]]
    render_metrics: Callable[[], bytes]
    inflight: InFlight
    draining: bool = False

    def admitting(self) -> None:
        if self.draining:
            raise ServiceDraining("the server is shutting down and takes no new requests; retry on another replica")


def error_body(status: int, message: str, etype: str, param: str | None = None, code: int | str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": etype, "param": param,
                                   "code": status if code is None else code}}, status_code=status, headers=headers)


def _error_event(e: TandemError) -> bytes:
    return _sse({"error": {"message": e.message, "type": e.error_type, "param": e.param, "code": error_code(e)}})


def _abort_tail(head: dict, choice: dict, e: TandemError) -> list[bytes]:
    """How a stream ends when the server ends it (timeout, drain): finish_reason abort, the reason, [DONE]."""
    return [_sse({**head, "choices": [{"index": 0, **choice, "finish_reason": "abort"}]}), _error_event(e),
            b"data: [DONE]\n\n"]


def _trace_headers(job: Job) -> dict[str, str]:
    """Where the request ran (the placement that produced its first token) and how long it queued."""
    return {"x-tandem-queue-wait-s": f"{job.trace.queue_wait_s:.3f}", "x-tandem-decode": job.trace.decode,
            "x-tandem-prefill": job.trace.prefill,
            "x-tandem-ttft-breakdown": ";".join(f"{k}={v:.4f}" for k, v in job.trace.parts.items())}


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def _delta_json(ev: Event) -> list[dict]:
    """OpenAI chat deltas of one event: reasoning, content and tool-call pieces, in order."""
    out = []
    for d in ev.deltas:
        if d.kind == DeltaKind.REASONING:
            out.append({"reasoning_content": d.text})
        elif d.kind == DeltaKind.CONTENT:
            out.append({"content": d.text})
        elif d.kind == DeltaKind.TOOL_CALL_START:
            out.append({"tool_calls": [{"index": d.tool_index, "id": d.tool_call_id, "type": "function",
                                        "function": {"name": d.tool_name, "arguments": ""}}]})
        elif d.kind == DeltaKind.TOOL_CALL_ARGS:
            out.append({"tool_calls": [{"index": d.tool_index, "function": {"arguments": d.text}}]})
    return out


def build_app(h: Handlers, serving: Serving) -> FastAPI:
    app = FastAPI(title="tandem", version="1", docs_url=None, redoc_url=None, openapi_url="/openapi.json")

    @app.exception_handler(TandemError)
    async def _typed(_: Request, e: TandemError) -> JSONResponse:
        return error_body(e.http_status, e.message, e.error_type, e.param, error_code(e), getattr(e, "headers", None))

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the client closed the connection

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error_body(400, "request body is not valid JSON", "invalid_request_error")
        if first.get("type") == "extra_forbidden":
            return error_body(400, f"unsupported parameter: {loc}", "invalid_request_error", loc)
        return error_body(400, f"{loc}: {msg}" if loc else msg, "invalid_request_error", loc or None)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready_() -> JSONResponse:
        ok, why = (False, "draining") if serving.draining else serving.ready()
        return JSONResponse({"ready": ok, "reason": why}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.render_metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "tandem",
                                            "max_model_len": h.cfg.max_model_len} for m in h.cfg.model_names]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        serving.admitting()
        job, stops = h.prepare_chat(req)
        base = {"id": job.request_id, "created": int(time.time()), "model": req.model}
        usage = {"prompt_tokens": len(job.prompt_ids)}
        events = h.chat_events(job, stops)
        scope = serving.inflight.open(job.request_id)
        if req.stream:
            # Wait for the first event before answering: a failure before the first token (no worker,
            # queue bound, failed transfer) is then a proper HTTP status instead of a 200 stream.
            try:
                first = await scope.run(request, _first(events))
            except BaseException:
                serving.inflight.close(scope)
                raise
            tail = partial(_abort_tail, {**base, "object": "chat.completion.chunk"}, {"delta": {}})
            return StreamingResponse(scope.stream(_chat_sse(_prepend(first, events), base, usage, req, job), tail),
                                     media_type="text/event-stream", headers=_trace_headers(job))
        try:
            body = await scope.run(request, _collect_chat(events, base, usage, req, job))
        finally:
            serving.inflight.close(scope)
        return JSONResponse(body, headers=_trace_headers(job))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        serving.admitting()
        jobs, stops = h.prepare_completion(req)
        created = int(time.time())
        if req.stream and len(jobs) != 1:
            raise InvalidRequest("streaming takes a single prompt", param="prompt")
        scope = serving.inflight.open(jobs[0].request_id)
        if req.stream:
            base = {"id": jobs[0].request_id, "created": created, "model": req.model, "object": "text_completion"}
            events = h.completion_events(jobs[0], stops, req.skip_special_tokens)
            try:
                first = await scope.run(request, _first(events))
            except BaseException:
                serving.inflight.close(scope)
                raise
            tail = partial(_abort_tail, base, {"text": "", "logprobs": None})
            return StreamingResponse(scope.stream(_completion_sse(h, jobs[0], _prepend(first, events), base, req), tail),
                                     media_type="text/event-stream", headers=_trace_headers(jobs[0]))
        try:
            body = await scope.run(request, _collect_completions(h, jobs, stops, req, created))
        finally:
            serving.inflight.close(scope)
        return JSONResponse(body, headers=_trace_headers(jobs[0]))

    register_responses(app, h, h.cfg.responses_store_size)
    return app


async def _collect_chat(events, base: dict, usage: dict, req: ChatCompletionRequest, job: Job) -> dict:
    ids: list[int] = []
    logprobs: list[dict] = []
    parsed = None
    async for ev, p in events:
        ids += ev.token_ids
        logprobs += ev.logprobs
        parsed = p or parsed
    assert parsed is not None
    msg: dict = {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning}
    if parsed.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in parsed.tool_calls]
    choice = {"index": 0, "message": msg, "finish_reason": parsed.finish_reason,
              "logprobs": {"content": logprobs} if req.logprobs else None}
    if req.return_token_ids:
        choice["token_ids"] = ids
    usage = dict(usage, completion_tokens=len(ids), total_tokens=len(job.prompt_ids) + len(ids), **prefix_usage([job]))
    return {**base, "object": "chat.completion", "choices": [choice], "usage": usage}


async def _collect_completions(h: Handlers, jobs: list[Job], stops: list[str], req: CompletionRequest,
                               created: int) -> dict:
    choices, n_out = [], 0
    for i, job in enumerate(jobs):
        text, ids, lps, finish = "", [], [], "stop"
        async for ev in h.completion_events(job, stops, req.skip_special_tokens):
            text += ev.text
            ids += ev.token_ids
            lps += ev.logprobs
            finish = ev.finish_reason or finish
        if req.echo:
            text = h.tok.decode(job.prompt_ids, skip_special=req.skip_special_tokens) + text
        choice = {"index": i, "text": text, "finish_reason": finish,
                  "logprobs": _completion_logprobs(lps) if req.logprobs is not None else None}
        if req.return_token_ids:
            choice["token_ids"] = ids
            choice["prompt_token_ids"] = job.prompt_ids
        choices.append(choice)
        n_out += len(ids)
    n_in = sum(len(j.prompt_ids) for j in jobs)
    return {"id": jobs[0].request_id, "object": "text_completion", "created": created, "model": req.model,
            "choices": choices, "usage": {"prompt_tokens": n_in, "completion_tokens": n_out,
                                          "total_tokens": n_in + n_out, **prefix_usage(jobs)}}


def _completion_logprobs(entries: list[dict]) -> dict:
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries]}


def prefix_usage(jobs: list) -> dict:
    """usage.prompt_tokens_details.cached_tokens as OpenAI and vLLM report it (prompt tokens not
    recomputed), and tandem's own breakdown: computed tokens, KV bytes shipped, where it prefilled."""
    st = [j.stats for j in jobs]
    return {"prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in st)},
            "tandem": {"computed_tokens": sum(s.computed_tokens for s in st),
                       "decode_cached_tokens": sum(s.decode_cached_tokens for s in st),
                       "kv_bytes_shipped": sum(s.kv_bytes for s in st), "prefill": st[0].prefill if st else ""}}


async def _chat_sse(events, base: dict, usage: dict, req: ChatCompletionRequest, job) -> AsyncIterator[bytes]:
    head = {**base, "object": "chat.completion.chunk"}
    n_out = 0
    try:
        yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
        async for ev, parsed in events:
            n_out += len(ev.token_ids)
            choices = [{"index": 0, "delta": piece, "finish_reason": None} for piece in _delta_json(ev)]
            if not choices and (ev.logprobs or (req.return_token_ids and ev.token_ids)):
                choices = [{"index": 0, "delta": {}, "finish_reason": None}]
            if choices:  # logprobs and token ids of the event ride on its first chunk
                if req.logprobs and ev.logprobs:
                    choices[0]["logprobs"] = {"content": ev.logprobs}
                if req.return_token_ids:
                    choices[0]["token_ids"] = ev.token_ids
            for c in choices:
                yield _sse({**head, "choices": [c]})
            if parsed is not None:
                yield _sse({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": parsed.finish_reason}]})
        if req.stream_options and req.stream_options.include_usage:
            u = dict(usage, completion_tokens=n_out, total_tokens=usage["prompt_tokens"] + n_out, **prefix_usage([job]))
            yield _sse({**head, "choices": [], "usage": u})
    except TandemError as e:
        yield _error_event(e)
    yield b"data: [DONE]\n\n"


async def _first(events):
    """The first item of an async iterator (raising its error here), or None when it is empty."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def _prepend(first, events):
    if first is not None:
        yield first
        async for ev in events:
            yield ev


async def _completion_sse(h: Handlers, job, events, base: dict, req: CompletionRequest) -> AsyncIterator[bytes]:
    n_out = 0
    try:
        if req.echo:
            yield _sse({**base, "choices": [{"index": 0, "text": h.tok.decode(job.prompt_ids), "finish_reason": None,
                                             "logprobs": None}]})
        async for ev in events:
            n_out += len(ev.token_ids)
            if ev.text or ev.token_ids or ev.finish_reason:
                choice = {"index": 0, "text": ev.text, "finish_reason": ev.finish_reason,
                          "logprobs": _completion_logprobs(ev.logprobs) if req.logprobs is not None else None}
                if req.return_token_ids:
                    choice["token_ids"] = ev.token_ids
                yield _sse({**base, "choices": [choice]})
        if req.stream_options and req.stream_options.include_usage:
            n_in = len(job.prompt_ids)
            yield _sse({**base, "choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": n_out,
                                                         "total_tokens": n_in + n_out, **prefix_usage([job])}})
    except TandemError as e:
        yield _error_event(e)
    yield b"data: [DONE]\n\n"

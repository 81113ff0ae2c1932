"""HTTP endpoints (OpenAI-compatible) and the mapping of typed errors to OpenAI error bodies.

/v1/chat/completions, /v1/completions (stream and not), /v1/models, /health, /ready, /metrics.
Every TandemError becomes {"error": {"message", "type", "param", "code"}} with its HTTP status;
FastAPI's validation errors (bad JSON, wrong types, out-of-range values) become 400s.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.errors import InvalidRequest, TandemError
from router.chat_types import DeltaKind
from router.handlers import Event, Handlers
from router.openai_models import ChatCompletionRequest, CompletionRequest
from router.responses import register_responses


def error_body(status: int, message: str, etype: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": etype, "param": param, "code": status}},
                        status_code=status)


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


def build_app(h: Handlers, ready, render_metrics) -> FastAPI:
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None)

    @app.exception_handler(TandemError)
    async def _typed(_: Request, e: TandemError) -> JSONResponse:
        return error_body(e.http_status, e.message, e.error_type, e.param)

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
        ok, why = ready()
        return JSONResponse({"ready": ok, "reason": why}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "tandem",
                                            "max_model_len": h.cfg.max_model_len} for m in h.cfg.model_names]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        job, stops = h.prepare_chat(req)
        created = int(time.time())
        base = {"id": job.request_id, "created": created, "model": req.model}
        usage = {"prompt_tokens": len(job.prompt_ids)}
        events = h.chat_events(job, stops)
        if req.stream:
            # Wait for the first event before answering: a failure before the first token (no worker,
            # no KV room, failed transfer) is then a proper HTTP status instead of a 200 stream.
            first = await _first(events)
            return StreamingResponse(_chat_sse(_prepend(first, events), base, usage, req),
                                     media_type="text/event-stream")
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
        usage.update(completion_tokens=len(ids), total_tokens=len(job.prompt_ids) + len(ids))
        return {**base, "object": "chat.completion", "choices": [choice], "usage": usage}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        jobs, stops = h.prepare_completion(req)
        created = int(time.time())
        if req.stream:
            if len(jobs) != 1:
                raise InvalidRequest("streaming takes a single prompt", param="prompt")
            base = {"id": jobs[0].request_id, "created": created, "model": req.model, "object": "text_completion"}
            events = h.completion_events(jobs[0], stops, req.skip_special_tokens)
            first = await _first(events)
            return StreamingResponse(_completion_sse(h, jobs[0], _prepend(first, events), base, req),
                                     media_type="text/event-stream")
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
                                              "total_tokens": n_in + n_out}}

    register_responses(app, h, h.cfg.responses_store_size)
    return app


def _completion_logprobs(entries: list[dict]) -> dict:
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries]}


async def _chat_sse(events, base: dict, usage: dict, req: ChatCompletionRequest) -> AsyncIterator[bytes]:
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
            u = dict(usage, completion_tokens=n_out, total_tokens=usage["prompt_tokens"] + n_out)
            yield _sse({**head, "choices": [], "usage": u})
    except TandemError as e:
        yield _sse({"error": {"message": e.message, "type": e.error_type, "param": e.param, "code": e.http_status}})
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
                                                         "total_tokens": n_in + n_out}})
    except TandemError as e:
        yield _sse({"error": {"message": e.message, "type": e.error_type, "param": e.param, "code": e.http_status}})
    yield b"data: [DONE]\n\n"

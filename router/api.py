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
for this request, then for a remote prefill `prefill_compute.<part>`, the parts of its prefill_compute in
tandem_prefill_compute_split_seconds; streams send headers with the first token, so they are known by then).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from common.errors import InvalidRequest, TandemError
from router.chat_output import abort_tail, chat_sse, collect_chat, collect_completions, completion_sse
from router.errors import ServiceDraining, error_code
from router.fanout import fan_out
from router.handlers import Handlers
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


ENDPOINTS = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET|DELETE /v1/responses/{id}, "
             "GET /v1/models, GET /health, GET /ready, GET /metrics")


def error_body(status: int, message: str, etype: str, param: str | None = None, code: int | str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": etype, "param": param,
                                   "code": status if code is None else code}}, status_code=status, headers=headers)


def _trace_headers(job: Job) -> dict[str, str]:
    """Where the request ran (the placement that produced its first token) and how long it queued."""
    return {"x-tandem-queue-wait-s": f"{job.trace.queue_wait_s:.3f}", "x-tandem-decode": job.trace.decode,
            "x-tandem-prefill": job.trace.prefill,
            "x-tandem-ttft-breakdown": ";".join(f"{k}={v:.4f}" for k, v in job.trace.parts.items())}


def _is_branch(x: object) -> bool:
    """A union branch's name in a pydantic error location ('str', 'list[ContentPart]'), not a field."""
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "dict", "list", "none") or "[" in x)


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
        # A value of a union type (message content: text or parts) fails every branch; the deepest error
        # says what is wrong (an image part: content.0.type, not "content.str: should be a string")
        first = errs[0] if errs else {}
        if any(_is_branch(x) for x in first.get("loc", ())):
            first = max(errs, key=lambda er: len(er.get("loc", ())))
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body" and not _is_branch(x))
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error_body(400, "request body is not valid JSON", "invalid_request_error")
        if first.get("type") == "extra_forbidden":
            return error_body(400, f"unsupported parameter: {loc}", "invalid_request_error", loc)
        return error_body(400, f"{loc}: {msg}" if loc else msg, "invalid_request_error", loc or None)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        # Routing errors in OpenAI's shape, not FastAPI's {"detail": ...}: an OpenAI client would otherwise
        # show a bare "Error code: 404" for an endpoint tandem does not serve (embeddings, audio, images).
        where = f"{request.method} {request.url.path}"
        if e.status_code == 404:
            msg = f"Invalid URL ({where}): tandem serves {ENDPOINTS}"
        elif e.status_code == 405:
            msg = f"Method not allowed ({where})"
        else:
            msg = str(e.detail)
        return error_body(e.status_code, msg, "invalid_request_error", headers=getattr(e, "headers", None))

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
        jobs, stops = h.prepare_chat(req)
        base = {"id": jobs[0].request_id.rsplit("-c", 1)[0], "created": int(time.time()), "model": req.model}
        events = fan_out([h.chat_events(job, stops) for job in jobs])
        scope = serving.inflight.open(base["id"])
        scope.track_first_out([j.trace for j in jobs], bool(req.stream))
        if req.stream:
            # Wait for the first event before answering: a failure before the first token (no worker,
            # queue bound, failed transfer) is then a proper HTTP status instead of a 200 stream.
            try:
                first = await scope.run(request, _first(events))
            except BaseException:
                serving.inflight.close(scope)
                raise
            tail = partial(abort_tail, {**base, "object": "chat.completion.chunk"}, {"delta": {}})
            return StreamingResponse(scope.stream(chat_sse(_prepend(first, events), base, req, jobs), tail),
                                     media_type="text/event-stream", headers=_trace_headers(jobs[0]))
        try:
            body = await scope.run(request, collect_chat(events, base, req, jobs))
        finally:
            serving.inflight.close(scope)
        return JSONResponse(body, headers=_trace_headers(jobs[0]))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        serving.admitting()
        rid, jobs, stops = h.prepare_completion(req)
        created = int(time.time())
        if req.stream and len(jobs) != req.n:
            raise InvalidRequest("streaming takes a single prompt", param="prompt")
        n = req.n
        prompt_only = req.max_tokens == 0  # echo's legacy scoring form: the sampled token is dropped
        groups = [fan_out([h.completion_events(j, stops, req.skip_special_tokens, prompt_only) for j in jobs[k:k + n]])
                  for k in range(0, len(jobs), n)]
        scope = serving.inflight.open(rid)
        scope.track_first_out([j.trace for j in jobs], bool(req.stream))
        if req.stream:
            base = {"id": rid, "created": created, "model": req.model, "object": "text_completion"}
            try:
                first = await scope.run(request, _first(groups[0]))
            except BaseException:
                serving.inflight.close(scope)
                raise
            tail = partial(abort_tail, base, {"text": "", "logprobs": None})
            return StreamingResponse(scope.stream(completion_sse(h, jobs, _prepend(first, groups[0]), base, req), tail),
                                     media_type="text/event-stream", headers=_trace_headers(jobs[0]))
        try:
            body = await scope.run(request, collect_completions(h, rid, groups, jobs, req, created))
        finally:
            serving.inflight.close(scope)
        return JSONResponse(body, headers=_trace_headers(jobs[0]))

    register_responses(app, h, h.cfg.responses_store_size, serving)
    return app


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

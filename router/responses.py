"""/v1/responses: OpenAI's Responses API over the same Harmony layer as chat completions.

    POST /v1/responses          create (JSON body, or SSE events with stream: true)
    GET /v1/responses/{id}      a stored response
    DELETE /v1/responses/{id}   forget it

Lifecycle of one request: ResponsesRequest -> ChatPrompt (router.responses_models; the history of
`previous_response_id` first) -> Harmony render -> the orchestrator, through Handlers.chat_events
-> parser deltas -> `OutputBuilder`, which turns them into output items (reasoning, message,
function_call) and the SSE events the openai client expects, in this order:
    response.created, response.in_progress,
    per item: output_item.added, [content_part.added], *.delta..., *.done, [content_part.done],
              output_item.done,
    response.completed (response.incomplete when max_output_tokens cut the answer).
The non-streaming body is the final `response` of the same builder, so both agree by
construction.

Serving machinery shared with chat (router/api.py): new requests are refused (503) while the router
drains; each request runs in a router.lifecycle scope, so a client disconnect, the request timeout
or the drain deadline cancels its generation on the workers (a stream the server ends gets an
`error` event and `response.failed`); `priority` orders the admission queue; responses carry the
queue-wait header. Stored responses (store: true, the default) live in a bounded in-memory LRU
(`--responses-store-size`); an unknown or evicted previous_response_id is a 404.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from common.errors import InvalidRequest, NotFound, TandemError
from router.chat_output import prefix_usage
from router.chat_types import ChatMessage, ChatPrompt, ParsedCompletion
from router.handlers import Handlers
from router.openai_models import prompt_grammars
from router.orchestrator import Job
from router.responses_models import ResponsesRequest, ToolSet
from router.responses_output import OutputBuilder, failed, new_id, sse
from wire.protocol import SamplingSpec

if TYPE_CHECKING:
    from router.api import Serving


@dataclass(slots=True)
class StoredResponse:
    conversation: list[ChatMessage]  # everything up to and including this response's output
    calls: dict[str, str]  # call_id -> function name, for function_call_output items
    body: dict


class ResponseStore:
    """Bounded LRU of stored responses; the least recently used one goes first."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        item = self._items.get(response_id)
        if item is None:
            raise NotFound(f"no stored response with id {response_id!r} (unknown, stored with store: false, "
                           f"or evicted: this server keeps the last {self.max_entries})", param=param)
        self._items.move_to_end(response_id)
        return item

    def put(self, response_id: str, item: StoredResponse) -> None:
        if self.max_entries <= 0:
            return
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


class Responses:
    def __init__(self, h: Handlers, store: ResponseStore) -> None:
        self.h, self.store = h, store

    def prepare(self, req: ResponsesRequest) -> tuple[Job, list[ChatMessage], dict[str, str], dict, ToolSet]:
        """-> (job, the conversation so far without instructions, its calls, the initial Response, its tools)."""
        h = self.h
        h.check_model(req.model)
        req.check_unsupported()
        prev = self.store.get(req.previous_response_id, "previous_response_id") if req.previous_response_id else None
        calls = dict(prev.calls) if prev else {}
        history = (list(prev.conversation) if prev else []) + req.input_messages(calls)
        if not history:
            raise InvalidRequest("input must not be empty", param="input")
        toolset = req.tool_set(h.cfg.builtin_tools)
        tools = toolset.defs
        effort = (req.reasoning.effort if req.reasoning else None) or "medium"
        instructions = [ChatMessage("developer", req.instructions)] if req.instructions else []
        fmt = req.response_format()
        prompt = ChatPrompt(instructions + history, tools=tools, tool_choice=req.tool_choice_mode(),
                            reasoning_effort=effort, knowledge_cutoff=h.cfg.knowledge_cutoff,
                            current_date=time.strftime("%Y-%m-%d"), response_format=fmt)
        ids = h.fmt.render(prompt)
        budget = h.max_tokens(req.max_output_tokens or None, len(ids), "input", "max_output_tokens")
        spec = SamplingSpec(max_tokens=budget,
                            temperature=1.0 if req.temperature is None else req.temperature,
                            top_p=1.0 if req.top_p is None else req.top_p, stop_token_ids=h.fmt.stop_token_ids(),
                            grammars=prompt_grammars(prompt, 0))
        response = {
            "id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": req.model, "output": [], "instructions": req.instructions, "error": None,
            "incomplete_details": None, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": effort, "summary": req.reasoning.summary if req.reasoning else None},
            "store": req.store, "temperature": spec.temperature, "top_p": spec.top_p,
            "text": {"format": _format_echo(fmt)}, "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": _tools_echo(toolset),
            "truncation": "disabled", "usage": None, "metadata": req.metadata or {}, "user": req.user,
            "background": False,
        }
        if req.prompt_cache_key is not None:
            response["prompt_cache_key"] = req.prompt_cache_key
        return Job(response["id"], ids, spec, req.priority), history, calls, response, toolset

    def events(self, req: ResponsesRequest, job: Job, history: list[ChatMessage], calls: dict[str, str],
               b: OutputBuilder, first, events) -> AsyncIterator[dict]:
        """The response's SSE events, from the first chat event (already awaited) on."""

        async def gen() -> AsyncIterator[dict]:
            n_out = 0
            for ev in b.start():
                yield ev
            pending = [first] if first is not None else []
            async for ev, parsed in _chain(pending, events):
                n_out += len(ev.token_ids)
                for out in b.feed(ev.deltas):
                    yield out
                if parsed is not None:
                    for out in b.finish(parsed, self._usage(job, n_out, parsed)):
                        yield out
                    self._remember(req, b.response, history, calls, parsed)

        return gen()

    def _usage(self, job: Job, n_out: int, parsed: ParsedCompletion) -> dict:
        reasoning = len(self.h.tok.encode(parsed.reasoning, allow_special=False)) if parsed.reasoning else 0
        n_in = len(job.prompt_ids)
        cached = prefix_usage([job])["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": min(reasoning, n_out)},
                "total_tokens": n_in + n_out}

    def _remember(self, req: ResponsesRequest, body: dict, history: list[ChatMessage], calls: dict[str, str],
                  parsed: ParsedCompletion) -> None:
        if not req.store:
            return
        turn = ChatMessage("assistant", parsed.content or "", reasoning=parsed.reasoning,
                           tool_calls=list(parsed.tool_calls))
        calls = dict(calls) | {c.id: c.name for c in parsed.tool_calls}
        self.store.put(body["id"], StoredResponse(history + [turn], calls, body))


async def _first(events):
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def _chain(pending: list, events):
    for x in pending:
        yield x
    if pending:
        async for x in events:
            yield x


async def _sse_stream(events: AsyncIterator[dict], b: OutputBuilder) -> AsyncIterator[bytes]:
    try:
        async for ev in events:
            yield sse(ev)
    except TandemError as e:
        for ev in failed(b, e):
            yield ev


def _tools_echo(ts: ToolSet) -> list[dict]:
    """The tools the model was offered, as the request grouped them (built-in ones left out)."""
    def one(t) -> dict:
        if t.name in ts.custom:
            return {"type": "custom", "name": t.name, "description": t.description, "format": {"type": "text"}}
        return {"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                "strict": t.strict_schema is not None}

    out: list[dict] = []
    groups: dict[str, dict] = {}
    for t in ts.defs:
        ns = ts.namespaces.get(t.name)
        if ns is None:
            out.append(one(t))
            continue
        if ns not in groups:
            groups[ns] = {"type": "namespace", "name": ns, "description": ts.namespace_descriptions.get(ns, ""),
                          "tools": []}
            out.append(groups[ns])
        groups[ns]["tools"].append(one(t))
    return out


def _format_echo(fmt) -> dict:
    if fmt is None:
        return {"type": "text"}
    if fmt.name == "json_object" and not fmt.schema:
        return {"type": "json_object"}
    return {"type": "json_schema", "name": fmt.name, "schema": json.loads(fmt.schema), "strict": True,
            "description": fmt.description or None}


def register_responses(app: FastAPI, h: Handlers, store_size: int, serving: Serving) -> Responses:
    api = Responses(h, ResponseStore(store_size))

    @app.post("/v1/responses")
    async def create(req: ResponsesRequest, request: Request):
        serving.admitting()
        job, history, calls, response, toolset = api.prepare(req)
        b = OutputBuilder(response, toolset.custom, req.seal_reasoning, toolset.namespaces)
        for t in toolset.ignored:  # built-in tools this server does not run (router/responses_tools.py)
            h.metrics.ignored_tools.labels(t).inc()

        def headers() -> dict[str, str]:
            out = {"x-tandem-queue-wait-s": f"{job.trace.queue_wait_s:.3f}"}
            if toolset.ignored:
                out["x-tandem-ignored-tools"] = ",".join(toolset.ignored)
            return out
        chat = h.chat_events(job, [])
        scope = serving.inflight.open(job.request_id)
        scope.track_first_out([job.trace], bool(req.stream))
        if req.stream:
            try:  # a failure before the first token is an HTTP error, not a 200 stream
                first = await scope.run(request, _first(chat))
            except BaseException:
                serving.inflight.close(scope)
                raise
            body = _sse_stream(api.events(req, job, history, calls, b, first, chat), b)
            return StreamingResponse(scope.stream(body, partial(failed, b)), media_type="text/event-stream",
                                     headers=headers())

        async def collect() -> dict:
            first = await _first(chat)
            async for _ in api.events(req, job, history, calls, b, first, chat):
                pass
            return b.response

        try:
            body = await scope.run(request, collect())
        finally:
            serving.inflight.close(scope)
        return JSONResponse(body, headers=headers())

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict:
        return api.store.get(response_id).body

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict:
        api.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return api

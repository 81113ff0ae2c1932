"""The Responses API's output side: parser deltas -> output items (reasoning, message, function_call,
custom_tool_call) and the SSE events that build them, in the order router/responses.py's docstring
lists; a stream that fails after it started ends with `error` and `response.failed`."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Set
from dataclasses import dataclass, field

from common.errors import TandemError
from router.chat_types import DeltaKind, ParsedCompletion
from router.responses_tools import custom_input, seal_reasoning


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass(slots=True)
class _Open:
    index: int
    item: dict
    text: list[str] = field(default_factory=list)


class OutputBuilder:
    """Parser deltas -> output items and the SSE events that build them, with sequence numbers.
    `custom`: the custom tools' names, whose calls become custom_tool_call items (their input decoded from
    the JSON arguments once the call is complete); `seal`: reasoning items carry encrypted_content."""

    def __init__(self, response: dict, custom: Set[str] = frozenset(), seal: bool = False,
                 namespaces: dict[str, str] | None = None) -> None:
        self.response = response  # the Response object being built; output grows as items close
        self.custom, self.seal, self.namespaces = custom, seal, namespaces or {}
        self.seq = 0
        self.open: _Open | None = None

    def event(self, etype: str, **fields) -> dict:
        ev = {"type": etype, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.snapshot()),
                self.event("response.in_progress", response=self.snapshot())]

    def snapshot(self) -> dict:
        return json.loads(json.dumps(self.response))

    def feed(self, deltas) -> list[dict]:
        out: list[dict] = []
        for d in deltas:
            if d.kind is DeltaKind.REASONING:
                out += self._ensure("reasoning")
                out.append(self._delta("response.reasoning_text.delta", d.text))
            elif d.kind is DeltaKind.CONTENT:
                out += self._ensure("message")
                out.append(self._delta("response.output_text.delta", d.text, logprobs=[]))
            elif d.kind is DeltaKind.TOOL_CALL_START:
                out += self._close("completed")
                out += self._open(self._call_item(d.tool_call_id, d.tool_name))
            elif d.kind is DeltaKind.TOOL_CALL_ARGS and self.open is not None:
                self.open.text.append(d.text)
                if self.open.item["type"] == "function_call":  # a custom call's input is known at its end
                    out.append(self.event("response.function_call_arguments.delta", item_id=self.open.item["id"],
                                          output_index=self.open.index, delta=d.text))
        return out

    def finish(self, parsed: ParsedCompletion, usage: dict) -> list[dict]:
        incomplete = parsed.finish_reason == "length"
        out = self._close("incomplete" if incomplete else "completed")
        r = self.response
        r["status"] = "incomplete" if incomplete else "completed"
        r["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        r["completed_at"] = None if incomplete else int(time.time())
        r["usage"] = usage
        out.append(self.event("response.incomplete" if incomplete else "response.completed",
                              response=self.snapshot()))
        return out

    # -- items ---------------------------------------------------------------------------------------

    def _call_item(self, call_id: str, name: str) -> dict:
        """A function_call, or a custom_tool_call for a custom tool; `namespace` when the tool is in one."""
        custom = name in self.custom
        item = {"id": new_id("ctc" if custom else "fc"), "type": "custom_tool_call" if custom else "function_call",
                "call_id": call_id, "name": name, "input" if custom else "arguments": "", "status": "in_progress"}
        ns = self.namespaces.get(name)
        return item if ns is None else {**item, "namespace": ns}

    def _ensure(self, kind: str) -> list[dict]:
        if self.open is not None and self.open.item["type"] == kind:
            return []
        out = self._close("completed")
        if kind == "reasoning":
            return out + self._open({"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                                     "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
        return out + self._open({"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                                 "content": []}, {"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def _open(self, item: dict, part: dict | None = None) -> list[dict]:
        self.open = _Open(len(self.response["output"]), item)
        out = [self.event("response.output_item.added", output_index=self.open.index, item=dict(item))]
        if part is not None:
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.open.index,
                                  content_index=0, part=part))
        return out

    def _delta(self, etype: str, text: str, **extra) -> dict:
        assert self.open is not None
        self.open.text.append(text)
        return self.event(etype, item_id=self.open.item["id"], output_index=self.open.index, content_index=0,
                          delta=text, **extra)

    def _close(self, status: str) -> list[dict]:
        o, self.open = self.open, None
        if o is None:
            return []
        item, text, ids = o.item, "".join(o.text), {"item_id": o.item["id"], "output_index": o.index}
        out = []
        if item["type"] == "function_call":
            item["arguments"] = text
            out.append(self.event("response.function_call_arguments.done", **ids, arguments=text))
        elif item["type"] == "custom_tool_call":
            item["input"] = custom_input(text)
            out.append(self.event("response.custom_tool_call_input.delta", **ids, delta=item["input"]))
            out.append(self.event("response.custom_tool_call_input.done", **ids, input=item["input"]))
        else:
            if item["type"] == "reasoning":
                part = {"type": "reasoning_text", "text": text}
                out.append(self.event("response.reasoning_text.done", **ids, content_index=0, text=text))
            else:
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                out.append(self.event("response.output_text.done", **ids, content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **ids, content_index=0, part=part))
            item["content"] = [part]
            if item["type"] == "reasoning" and self.seal:
                item["encrypted_content"] = seal_reasoning(text)
        item["status"] = status
        self.response["output"].append(item)
        out.append(self.event("response.output_item.done", output_index=o.index, item=item))
        return out


def sse(ev: dict) -> bytes:
    return f"event: {ev['type']}\ndata: {json.dumps(ev, separators=(',', ':'))}\n\n".encode()



def failed(b: OutputBuilder, e: TandemError) -> list[bytes]:
    """How a stream ends on an error after it started (a worker lost, the request timeout, the drain
    deadline): an `error` event, then `response.failed` with the reason."""
    b.response.update(status="failed", error={"code": e.error_type, "message": e.message})
    return [sse(b.event("error", code=e.error_type, message=e.message, param=e.param)),
            sse(b.event("response.failed", response=b.snapshot()))]

"""The Responses API request (pydantic, the HTTP edge only) and its conversion into a ChatPrompt.

Input items map onto the router's chat model (router.chat_types), so Responses and chat
completions render through the same Harmony layer:
  message (user / system / developer)      -> ChatMessage of that role (system and developer become
                                              the developer message's instructions)
  reasoning, assistant message, function_call -> one assistant ChatMessage (analysis, final or
                                              preamble text, tool calls), in input order
  function_call_output                     -> a tool ChatMessage answering its call_id
`instructions` become a developer message of this request only (not carried over by
previous_response_id, as in OpenAI's API). Everything else a client may send is either supported
or refused with a 400 that names the parameter: unknown fields, a tool_choice other than auto, none,
required or a function, image/file inputs, background mode. Custom (freeform) tools, built-in tools and
sealed reasoning (`include: ["reasoning.encrypted_content"]`) are router/responses_tools.py's. Structured outputs
(`text.format` json_object / json_schema) and strict function tools (`strict: true`; the Responses
API's default of true is taken as false here unless sent) are constrained (router/structured.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.errors import InvalidRequest
from router.chat_types import ChatMessage, NamedToolChoice, ResponseFormat, ToolCall, ToolChoice, ToolDef
from router.openai_models import INT32, FunctionDef, ToolIn, tool_def
from router.responses_tools import (BUILTIN_TOOLS, CUSTOM_PARAMETERS, custom_arguments, open_reasoning)
from router.structured import TextFormatIn, final_format


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    """Items echoed back from our own output carry fields we do not need (status, annotations)."""

    model_config = ConfigDict(extra="allow")


class TextPart(_Lenient):
    type: str
    text: str | None = None


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]
    summary: list[TextPart] = Field(default_factory=list)
    content: list[TextPart] | None = None
    encrypted_content: str | None = None


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | list[TextPart]


class CustomToolCallItem(_Lenient):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str


class OtherItem(_Lenient):
    type: str


Item = MessageItem | ReasoningItem | FunctionCallItem | CustomToolCallItem | FunctionCallOutputItem | OtherItem
INCLUDABLE = ("reasoning.encrypted_content",)


class FunctionToolIn(_Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    format: dict[str, Any] | None = None  # custom tools: {"type": "text"} or a grammar (not enforced)
    tools: list[dict[str, Any]] | None = None  # namespace tools: the function / custom tools they group


@dataclass(slots=True)
class ToolSet:
    """A request's tools as the model sees them: function tools and custom tools (as one-string-argument
    functions, router/responses_tools.py), the names of the custom ones, and the built-in types left out."""

    defs: list[ToolDef]
    custom: set[str] = field(default_factory=set)
    ignored: list[str] = field(default_factory=list)
    namespaces: dict[str, str] = field(default_factory=dict)  # tool name -> its namespace tool's name
    namespace_descriptions: dict[str, str] = field(default_factory=dict)

    def add(self, t: FunctionToolIn, where: str, namespace: str | None = None) -> None:
        """One function or custom tool (inside `namespace`: its tools keep their names, which must not clash
        with another tool's; a call comes back with the namespace, as OpenAI's does)."""
        if not t.name:
            raise InvalidRequest(f"{where}: a {t.type} tool needs a name", param=f"{where}.name")
        if any(d.name == t.name for d in self.defs):
            raise InvalidRequest(f"{where}: tool name {t.name!r} is used twice (namespaces included)",
                                 param=f"{where}.name")
        extra = sorted(k for k, v in (t.model_extra or {}).items() if v is not None)
        extra += ["tools"] if t.tools is not None else []
        desc = t.description or ""
        if namespace is not None:  # the model sees which group a flattened tool belongs to
            self.namespaces[t.name] = namespace
            ns = self.namespace_descriptions.get(namespace)
            desc = f"({namespace}: {ns}) {desc}".strip() if ns else desc
        if t.type == "custom":
            extra += [k for k in ("parameters", "strict") if getattr(t, k) is not None]
            fn = FunctionDef(name=t.name, description=desc, parameters=CUSTOM_PARAMETERS, strict=True)
            self.custom.add(t.name)
        else:
            extra += ["format"] if t.format is not None else []
            fn = FunctionDef(name=t.name, description=desc, parameters=t.parameters, strict=t.strict)
        if extra:
            raise InvalidRequest(f"{where}: unsupported {t.type} tool field {extra[0]!r}", param=f"{where}.{extra[0]}")
        self.defs.append(tool_def(ToolIn(type="function", function=fn), where))


class ReasoningIn(_Strict):
    effort: Literal["low", "medium", "high"] | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptionsIn(_Strict):
    include_obfuscation: bool | None = None  # OpenAI pads deltas against side channels; tandem never does


class TextIn(_Strict):
    format: TextFormatIn | None = None
    verbosity: str | None = None


class ResponsesRequest(_Strict):
    model: str
    input: str | list[Annotated[Item, Field(union_mode="left_to_right")]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    reasoning: ReasoningIn | None = None
    tools: list[FunctionToolIn] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    text: TextIn | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    service_tier: str | None = None
    priority: Annotated[int, Field(ge=-INT32, le=INT32)] = 0  # vLLM extension: lower is admitted sooner when queued
    # Accepted and not needed: tandem's prefix cache is keyed by content (and placement follows it), so a
    # cache key adds nothing; client_metadata is the client's own bookkeeping (newer Codex sends it).
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # cached pages live until evicted (LRU)
    client_metadata: dict[str, Any] | None = None
    stream_options: StreamOptionsIn | None = None

    def check_unsupported(self) -> None:
        """Refuse, naming the parameter, what we accept in the schema but cannot honour."""
        def no(cond: bool, param: str, why: str) -> None:
            if cond:
                raise InvalidRequest(why, param=param)

        no(bool(self.background), "background", "background mode is not supported")
        other = [x for x in self.include or [] if x not in INCLUDABLE]
        no(bool(other), "include", f"include {other} is not supported (only {list(INCLUDABLE)})")
        no(bool(self.top_logprobs), "top_logprobs", "top_logprobs is not supported by /v1/responses")
        no(self.truncation == "auto", "truncation", "truncation 'auto' is not supported; a prompt longer "
           "than the context is refused")
        no(self.max_tool_calls is not None, "max_tool_calls", "max_tool_calls applies to built-in tools, "
           "which are not supported")
        no(self.service_tier not in (None, "auto", "default"), "service_tier",
           f"service_tier {self.service_tier!r} is not supported")
        if self.reasoning is not None:
            # "auto" lets the server choose, and gpt-oss has no summariser: the answer's reasoning items carry
            # the reasoning text itself (reasoning_text content) and an empty summary. Codex sends "auto".
            asked = {self.reasoning.summary, self.reasoning.generate_summary} - {None, "auto"}
            no(bool(asked), "reasoning.summary", f"reasoning summaries ({', '.join(map(repr, sorted(asked)))}) are "
               "not supported; 'auto' is (the reasoning text itself is returned as reasoning_text content)")
        if self.text is not None:
            no(self.text.verbosity not in (None, "medium"), "text.verbosity", "text.verbosity is not supported")

    @property
    def seal_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or [])

    def tool_set(self, builtin: str) -> ToolSet:
        """Function and custom tools for the model, a namespace's flattened (Harmony's developer tools are one
        `functions` namespace); built-in ones left out (`builtin` "ignore") or refused."""
        ts = ToolSet([])
        for i, t in enumerate(self.tools or []):
            where = f"tools[{i}]"
            if t.type in BUILTIN_TOOLS and builtin == "ignore":
                ts.ignored.append(t.type)
            elif t.type == "namespace":
                if not t.name or not t.tools:
                    raise InvalidRequest(f"{where}: a namespace tool needs a name and tools", param=where)
                ts.namespace_descriptions[t.name] = t.description or ""
                for j, inner in enumerate(t.tools):
                    try:
                        it = FunctionToolIn.model_validate(inner)
                    except ValidationError:
                        it = None
                    if it is None or it.type not in ("function", "custom"):
                        raise InvalidRequest(f"{where}.tools[{j}]: a namespace holds function and custom tools",
                                             param=f"{where}.tools[{j}].type")
                    ts.add(it, f"{where}.tools[{j}]", t.name)
            elif t.type in ("function", "custom"):
                ts.add(t, where)
            else:
                why = "tandem runs no built-in tools" if t.type in BUILTIN_TOOLS else "unknown tool type"
                raise InvalidRequest(f"{where}: {why}: {t.type!r} (function, custom and namespace tools are "
                                     "supported)", param=f"{where}.type")
        return ts

    def response_format(self) -> ResponseFormat | None:
        return final_format(self.text.format if self.text is not None else None, "text.format")

    def tool_choice_mode(self) -> ToolChoice:
        """auto | none | required | {"type": "function" or "custom", "name": NAME} (the last two enforced by
        decoding)."""
        c = self.tool_choice
        if c is None or c in ("auto", "none", "required"):
            return c or "auto"  # type: ignore[return-value]
        if isinstance(c, dict) and c.get("type") in ("function", "custom") and isinstance(c.get("name"), str) \
                and len(c) == 2:
            return NamedToolChoice(c["name"])
        raise InvalidRequest(f"tool_choice {c!r} is not supported; use 'auto', 'none', 'required' or "
                             "{'type': 'function', 'name': NAME}", param="tool_choice")

    def input_messages(self, known_calls: dict[str, str]) -> list[ChatMessage]:
        """This request's input as chat messages. `known_calls` (call_id -> name) holds the calls of
        the stored conversation, so a function_call_output may answer one of them."""
        if isinstance(self.input, str):
            return [ChatMessage("user", self.input)]
        return items_to_messages(self.input, known_calls)


def _text(parts: str | list[TextPart], where: str, allowed: tuple[str, ...]) -> str:
    if isinstance(parts, str):
        return parts
    out = []
    for j, p in enumerate(parts):
        if p.type not in allowed or p.text is None:
            raise InvalidRequest(f"{where}.content[{j}]: content of type {p.type!r} is not supported "
                                 f"(text only)", param=f"{where}.content[{j}].type")
        out.append(p.text)
    return "".join(out)


def items_to_messages(items: list, known_calls: dict[str, str]) -> list[ChatMessage]:
    """Input items -> chat messages; consecutive assistant-side items form one assistant turn."""
    out: list[ChatMessage] = []
    turn: ChatMessage | None = None  # the assistant turn being assembled

    def assistant() -> ChatMessage:
        nonlocal turn
        if turn is None:
            turn = ChatMessage("assistant", "")
            out.append(turn)
        return turn

    for i, it in enumerate(items):
        where = f"input[{i}]"
        if isinstance(it, MessageItem) and it.role != "assistant":
            turn = None
            text = _text(it.content, where, ("input_text", "text"))
            out.append(ChatMessage(it.role, text))
        elif isinstance(it, MessageItem):
            text = _text(it.content, where, ("output_text", "input_text", "text"))
            if assistant().content or turn.tool_calls:
                turn = None
            assistant().content = text
        elif isinstance(it, ReasoningItem):
            parts = it.content if it.content else it.summary
            text = "".join(p.text or "" for p in parts)
            if not text and it.encrypted_content:  # a stateless client's reasoning, sealed by this server
                text = open_reasoning(it.encrypted_content, f"{where}.encrypted_content")
            if turn is not None and (turn.reasoning or turn.content or turn.tool_calls):
                turn = None  # a new reasoning item starts the next assistant message
            assistant().reasoning = text or None
        elif isinstance(it, FunctionCallItem):
            assistant().tool_calls.append(ToolCall(it.call_id, it.name, it.arguments))
            known_calls[it.call_id] = it.name
        elif isinstance(it, CustomToolCallItem):
            assistant().tool_calls.append(ToolCall(it.call_id, it.name, custom_arguments(it.input)))
            known_calls[it.call_id] = it.name
        elif isinstance(it, FunctionCallOutputItem):
            turn = None
            if it.call_id not in known_calls:
                raise InvalidRequest(f"{where}: no function_call with call_id {it.call_id!r} in this "
                                     "conversation", param=f"{where}.call_id")
            out.append(ChatMessage("tool", _text(it.output, where, ("input_text", "output_text", "text")),
                                   tool_call_id=it.call_id, name=known_calls[it.call_id]))
        elif it.type in ("message", "reasoning", "function_call", "function_call_output", "custom_tool_call",
                         "custom_tool_call_output"):
            raise InvalidRequest(f"{where} is not a valid {it.type} item (a required field is missing or has "
                                 "the wrong type)", param=where)
        else:
            raise InvalidRequest(f"{where}: input items of type {it.type!r} are not supported (message, "
                                 "reasoning, function_call, function_call_output, custom_tool_call, "
                                 "custom_tool_call_output are)", param=f"{where}.type")
    return out

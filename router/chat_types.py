"""The router's internal chat model: typed, torch-free, independent of any chat format.

Role: the HTTP layer (pydantic, OpenAI JSON) converts requests into a `ChatPrompt`; a `ChatFormat`
plug-in (router.harmony today) renders it into prompt token ids and parses generated ids back into
`Delta`s and one `ParsedCompletion`, which the HTTP layer turns into OpenAI JSON / SSE again.

Lifecycle of one chat request:
    prompt = ChatPrompt(...)                      # validated on construction (InvalidRequest)
    ids = fmt.render(prompt)                      # -> engine, stops on fmt.stop_token_ids()
    parser = fmt.new_parser()
    parser.feed(chunk) -> [Delta]                 # per streamed chunk of generated ids
    parser.finish(hint) -> ([Delta], ParsedCompletion)

Everything a client sends is checked here and raises InvalidRequest (HTTP 400); nothing the model
generates may raise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from collections.abc import Sequence
from typing import Literal, Protocol, get_args

from common.errors import InvalidRequest
from common.grammar import TOOL_NAME_PATTERN

Role = Literal["system", "developer", "user", "assistant", "tool"]
ReasoningEffort = Literal["low", "medium", "high"]
FinishReason = Literal["stop", "tool_calls", "length"]
# A JSON value as parsed by json.loads (tool parameter schemas are JSON objects).
JsonValue = None | bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"]
JsonObject = dict[str, JsonValue]



@dataclass(slots=True)
class ToolCall:
    """One function call made by the assistant; `arguments` is the JSON text as generated."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ToolDef:
    """A function the model may call; `parameters` is its JSON schema (None: no arguments)."""

    name: str
    description: str = ""
    parameters: JsonObject | None = None
    strict_schema: str | None = None  # strict: the arguments' JSON schema text (constrained decoding)

    def __post_init__(self) -> None:
        if not TOOL_NAME_PATTERN.fullmatch(self.name):
            raise InvalidRequest(
                f"invalid tool name {self.name!r}: must match [A-Za-z0-9_-]{{1,64}}",
                param="tools",
            )
        if self.parameters is not None and not isinstance(self.parameters, dict):
            raise InvalidRequest(f"tool {self.name!r}: parameters must be a JSON object",
                                 param="tools")


@dataclass(slots=True)
class NamedToolChoice:
    """tool_choice = {"type": "function", "function": {"name": NAME}}."""

    name: str


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


@dataclass(slots=True)
class ChatMessage:
    """One OpenAI chat message.

    system / developer / user: `content`.
    assistant: `content` (the answer), optional `reasoning` (chain of thought from an earlier turn)
    and `tool_calls`.
    tool: `content` is the function's result, `tool_call_id` names the call it answers; `name` is
    the function name if the client sent it (otherwise found from the matching tool call).
    """

    role: Role
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.role not in get_args(Role):
            raise InvalidRequest(f"unknown message role {self.role!r}", param="messages")
        if self.role != "assistant" and (self.reasoning is not None or self.tool_calls):
            raise InvalidRequest(f"a {self.role} message cannot carry reasoning or tool_calls",
                                 param="messages")
        if self.role == "tool" and not (self.tool_call_id or self.name):
            raise InvalidRequest("a tool message needs tool_call_id", param="messages")


@dataclass(slots=True)
class ResponseFormat:
    """The answer's structured format: `schema` is JSON schema text, "" for any JSON object."""

    name: str
    schema: str
    description: str = ""


@dataclass(slots=True)
class ChatPrompt:
    """Everything that goes into one prompt.

    `model_identity` None keeps the format's default identity; `current_date` (YYYY-MM-DD) None
    leaves the date out of the prompt (the HTTP layer normally fills it in).
    """

    messages: list[ChatMessage]
    tools: list[ToolDef] = field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    reasoning_effort: ReasoningEffort = "medium"
    model_identity: str | None = None
    knowledge_cutoff: str = "2024-06"
    current_date: str | None = None
    response_format: ResponseFormat | None = None

    def __post_init__(self) -> None:
        if not self.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        if self.reasoning_effort not in get_args(ReasoningEffort):
            raise InvalidRequest(f"reasoning_effort must be low, medium or high, not "
                                 f"{self.reasoning_effort!r}", param="reasoning_effort")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise InvalidRequest("tool names must be unique", param="tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            if choice.name not in names:
                raise InvalidRequest(f"tool_choice names {choice.name!r}, which is not in tools",
                                     param="tool_choice")
        elif choice not in ("auto", "none", "required"):
            raise InvalidRequest(f"unknown tool_choice {choice!r}", param="tool_choice")
        elif choice == "required" and not self.tools:
            raise InvalidRequest("tool_choice 'required' needs at least one tool",
                                 param="tool_choice")

    def visible_tools(self) -> list[ToolDef]:
        """The tools the model is shown: none for tool_choice "none", only the named one for a named choice."""
        if self.tool_choice == "none":
            return []
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools if t.name == self.tool_choice.name]
        return list(self.tools)

    @property
    def call_required(self) -> bool:
        """tool_choice "required" or a named function: the turn must end in a call of a visible tool."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)


# ---- output side -------------------------------------------------------------------------------


class DeltaKind(str, Enum):
    REASONING = "reasoning"  # chain of thought text
    CONTENT = "content"  # answer text (final channel, preambles, or unparseable output)
    TOOL_CALL_START = "tool_call_start"  # a new tool call: tool_index, tool_call_id, tool_name
    TOOL_CALL_ARGS = "tool_call_args"  # more argument JSON text for tool call `tool_index`


@dataclass(slots=True)
class Delta:
    kind: DeltaKind
    text: str = ""
    tool_index: int | None = None
    tool_call_id: str | None = None
    tool_name: str | None = None


@dataclass(slots=True)
class ParsedCompletion:
    """The whole generated turn. `reasoning` / `content` are None when nothing of that kind was
    generated (OpenAI sends `content: null` for a pure tool-call turn)."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: FinishReason


# ---- the plug-in interface ---------------------------------------------------------------------


class StreamParser(Protocol):
    """Parses one request's generated token ids; never raises on any model output."""

    def feed(self, token_ids: Sequence[int]) -> list[Delta]: ...

    def finish(self, finish_reason_hint: FinishReason) -> tuple[list[Delta], ParsedCompletion]: ...


class ChatFormat(Protocol):
    """A chat format: prompt rendering, the stop tokens of an assistant turn, output parsing."""

    def render(self, prompt: ChatPrompt) -> list[int]: ...

    def stop_token_ids(self) -> list[int]: ...

    def new_parser(self) -> StreamParser: ...

"""OpenAI request bodies (pydantic, the HTTP edge only) and their conversion into the router's typed
chat model / wire sampling spec. Unsupported features are refused with a clear 400, never ignored
silently."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.errors import InvalidRequest
from router.chat_types import ChatMessage, ChatPrompt, NamedToolChoice, ResponseFormat, ToolCall, ToolDef
from router.structured import (ResponseFormatIn, call_grammar, check_combination, final_format, grammars, meta_error,
                               tool_grammar)
from wire.protocol import GrammarSpec, LogitBias, SamplingSpec
from router.tokenizer import VOCAB_SIZE


class _Model(BaseModel):
    # An unknown field is a 400 naming it (api.py), never silently ignored.
    model_config = ConfigDict(extra="forbid")


def _refuse(cond: bool, param: str, why: str) -> None:
    if cond:
        raise InvalidRequest(why, param=param)


class ContentPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str = ""


class ToolCallIn(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # present when a client rebuilt the call from stream deltas


class MessageIn(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # vLLM's spelling of the chain of thought
    reasoning: str | None = None
    # What the openai client sends back when a response message is appended to the history as is.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    def check_unsupported(self, i: int) -> None:
        where = f"messages[{i}]"
        _refuse(self.name is not None and self.role != "tool", f"{where}.name",
                "name is only supported on tool messages")
        _refuse(bool(self.refusal), f"{where}.refusal", "assistant refusals cannot be rendered")
        _refuse(bool(self.annotations), f"{where}.annotations", "annotations are not supported")
        _refuse(self.audio is not None, f"{where}.audio", "audio is not supported")
        _refuse(self.function_call is not None, f"{where}.function_call",
                "function_call (deprecated) is not supported; use tool_calls")


class FunctionDef(_Model):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # true: the arguments are constrained to `parameters` (router.structured)


class ToolIn(_Model):
    type: Literal["function"]
    function: FunctionDef


class _Named(_Model):
    name: str


class NamedToolChoiceIn(_Model):
    type: Literal["function"]
    function: _Named


class StreamOptions(_Model):
    include_usage: bool = False


# Every integer has an upper bound too: the values cross the wire as msgpack (64-bit at most).
INT32 = 2**31 - 1
NonNegInt = Annotated[int, Field(ge=0, le=INT32)]


class _SamplingFields(_Model):
    model: str
    max_tokens: Annotated[int, Field(ge=1, le=INT32)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: NonNegInt | None = None  # vLLM extension
    min_tokens: NonNegInt = 0  # vLLM extension
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None  # vLLM extension
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # token id (as a string) -> bias
    user: str | None = None
    safety_identifier: str | None = None
    return_token_ids: bool = False  # vLLM extension: generated ids on each choice
    priority: Annotated[int, Field(ge=-INT32, le=INT32)] = 0  # vLLM extension: lower is admitted sooner when queued
    service_tier: str | None = None

    def check_unsupported(self) -> None:
        _refuse(self.service_tier not in (None, "auto", "default"), "service_tier",
                f"service_tier {self.service_tier!r} is not supported")
        _refuse(self.stream_options is not None and not self.stream, "stream_options",
                "stream_options is only allowed when stream is true")

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 8 or any(not s for s in stops):
            raise InvalidRequest("stop takes up to 8 non-empty strings", param="stop")
        return stops


class ChatCompletionRequest(_SamplingFields):
    messages: list[MessageIn] = Field(min_length=1)
    tools: list[ToolIn] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormatIn | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    verbosity: str | None = None
    # A cache-routing hint: accepted and not needed (the prefix cache is keyed by content, placement follows it)
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        _refuse(bool(self.store), "store", "stored chat completions are not supported (the Responses API "
                "stores responses)")
        _refuse(self.metadata is not None, "metadata", "metadata is only kept with store, which is not supported")
        _refuse(self.modalities not in (None, ["text"]), "modalities", "only the text modality is supported")
        for name in ("audio", "prediction", "web_search_options", "functions", "function_call"):
            _refuse(getattr(self, name) is not None, name, f"{name} is not supported")
        _refuse(self.verbosity not in (None, "medium"), "verbosity", "verbosity is not supported")
        _refuse(self.top_logprobs is not None and not self.logprobs, "top_logprobs",
                "top_logprobs needs logprobs: true")
        for i, m in enumerate(self.messages):
            m.check_unsupported(i)


class CompletionRequest(_SamplingFields):
    prompt: str | list[Annotated[int, Field(ge=0, le=INT32)]] | list[str] | list[list[Annotated[int, Field(ge=0, le=INT32)]]]
    max_tokens: Annotated[int, Field(ge=0, le=INT32)] | None = None  # 0: with echo, score the prompt only
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    suffix: str | None = None
    skip_special_tokens: bool = True  # vLLM extension
    best_of: Annotated[int, Field(ge=1)] | None = None
    response_format: ResponseFormatIn | None = None  # vLLM extension: constrains Harmony final messages

    def check_unsupported(self) -> None:
        super().check_unsupported()
        _refuse(self.best_of not in (None, 1, self.n), "best_of", "best_of other than n (or 1) is not supported")
        # max_tokens 0 is OpenAI's legacy form of scoring a prompt (with echo + logprobs): nothing to generate
        _refuse(self.max_tokens == 0 and not self.echo, "max_tokens", "max_tokens 0 needs echo (it returns the "
                "prompt only); otherwise max_tokens must be at least 1")


# ---- conversion ---------------------------------------------------------------------------------
def _text(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.text for p in content)


def tool_def(t: ToolIn, param: str = "tools") -> ToolDef:
    params = t.function.parameters
    if params is not None:
        error = meta_error(params)
        if error is not None:
            raise InvalidRequest(f"tool {t.function.name!r}: parameters is not a valid JSON schema: {error}",
                                 param="tools")
        if params.get("type", "object") != "object":
            raise InvalidRequest(f"tool {t.function.name!r}: parameters must describe an object", param="tools")
    strict = tool_grammar(t.function.name, params, f"{param}.parameters").schema if t.function.strict else None
    return ToolDef(t.function.name, t.function.description, params, strict)


def to_chat_prompt(req: ChatCompletionRequest, current_date: str, knowledge_cutoff: str) -> ChatPrompt:
    msgs = []
    for m in req.messages:
        calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
        msgs.append(ChatMessage(role=m.role, content=_text(m.content), reasoning=m.reasoning_content or m.reasoning,
                                tool_calls=calls, tool_call_id=m.tool_call_id, name=m.name))
    tools = [tool_def(t, f"tools[{i}].function") for i, t in enumerate(req.tools or [])]
    choice: Any = req.tool_choice or "auto"
    if isinstance(choice, NamedToolChoiceIn):
        choice = NamedToolChoice(choice.function.name)
    return ChatPrompt(messages=msgs, tools=tools, tool_choice=choice, reasoning_effort=req.reasoning_effort or "medium",
                      knowledge_cutoff=knowledge_cutoff, current_date=current_date,
                      response_format=final_format(req.response_format, "response_format"))


def prompt_grammars(prompt: ChatPrompt, min_tokens: int) -> list[GrammarSpec]:
    """The grammars of a chat prompt: its answer format, its strict tools (visible or not: the model can
    only call the tools it was shown), and a required call (tool_choice "required" or named)."""
    out = grammars(prompt.response_format, prompt.tools)
    if prompt.call_required:
        out.append(call_grammar(prompt.visible_tools()))
    check_combination(bool(out), min_tokens)
    return out


def completion_grammars(req: CompletionRequest) -> list[GrammarSpec]:
    fmt: ResponseFormat | None = final_format(req.response_format, "response_format")
    out = grammars(fmt, [])
    check_combination(bool(out), req.min_tokens)
    return out


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice i of an n > 1 request samples with seed + i (wrapping in int64), so each choice of a
    seeded request reproduces and the choices differ."""
    if seed is None:
        return None
    return (seed + i + 2**63) % 2**64 - 2**63


def sampling_spec(req: _SamplingFields, max_tokens: int, stop_ids: list[int], logprobs: int | None,
                  grammar_specs: list[GrammarSpec] | None = None) -> SamplingSpec:
    extra = list(req.stop_token_ids or [])
    if any(t >= VOCAB_SIZE for t in extra):
        raise InvalidRequest("stop_token_ids must be inside the vocabulary", param="stop_token_ids")
    if req.min_tokens > max_tokens:
        raise InvalidRequest("min_tokens exceeds max_tokens", param="min_tokens")
    return SamplingSpec(
        max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed,
        stop_token_ids=sorted(set(stop_ids + extra)), ignore_eos=req.ignore_eos, logprobs=logprobs,
        min_tokens=req.min_tokens, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        logit_bias=_logit_bias(req.logit_bias), grammars=list(grammar_specs or []))


def _logit_bias(bias: dict[str, float] | None) -> list[LogitBias]:
    """OpenAI's {"token id": bias} map, checked against the vocabulary (the engine adds it to the logits)."""
    out = []
    for key, value in (bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= tok < VOCAB_SIZE:
            raise InvalidRequest(f"logit_bias token {tok} is outside the vocabulary", param="logit_bias")
        out.append(LogitBias(tok, float(value)))
    if len(out) > 1024:
        raise InvalidRequest("logit_bias takes at most 1024 entries", param="logit_bias")
    return out

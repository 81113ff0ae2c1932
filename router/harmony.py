"""Harmony, gpt-oss's chat format: prompt rendering and a streaming output parser.

Role: the router's chat-format plug-in (router.chat_types.ChatFormat). `HarmonyFormat.render` maps a
ChatPrompt onto harmony messages and lets openai-harmony render them
(`render_conversation_for_completion`: prompt ends with `<|start|>assistant`, prior analysis is
dropped after a final answer but kept across tool calls). `HarmonyFormat.new_parser()` returns one
`HarmonyStreamParser` per request, wrapping harmony's `StreamableParser`.

Lifecycle of one request: render -> engine generates until <|return|> or <|call|> (stop tokens
included in what is fed back) -> parser.feed(chunk) per streamed chunk -> parser.finish(hint).

Output mapping: analysis channel -> reasoning; recipient `functions.NAME` (in the role or the
channel part of the header) -> a tool call (start delta with a fresh `call_...` id, then argument
text); everything else an assistant says (final, commentary preambles) -> content; messages the
model writes as another role are dropped.

Model output is untrusted (the demo model is random): the parser never raises. When the stream
stops being Harmony (a harmony parse error, a header that is not a header), the rest is decoded as
plain content, until a `<|start|>` lets it resynchronise.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from openai_harmony import (Author, DeveloperContent, HarmonyEncoding, HarmonyError,
                            Message, ReasoningEffort, Role, StreamableParser, StreamState,
                            SystemContent, TextContent, ToolDescription)

from common.errors import InvalidRequest
from router.chat_types import (TOOL_NAME_PATTERN, ChatFormat, ChatMessage, ChatPrompt, Delta,
                               DeltaKind, FinishReason, NamedToolChoice, ParsedCompletion,
                               StreamParser, ToolCall)
from router.harmony_render import DEFAULT_MAX_TOKENS, RenderCache
from router.tokenizer import (ASSISTANT_STOP_TOKEN_IDS, CALL, CHANNEL, CONSTRAIN, FIRST_SPECIAL_ID,
                              MESSAGE, START, IncrementalDetokenizer, Tokenizer, in_vocab,
                              load_encoding)

__all__ = ["ChatFormat", "StreamParser", "HarmonyFormat", "HarmonyStreamParser"]

_EFFORT = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM,
           "high": ReasoningEffort.HIGH}
_FUNCTIONS = "functions."
# A real header is a handful of tokens (`<|channel|>commentary to=functions.NAME <|constrain|>json`);
# one that runs longer than this is prose, not Harmony.
MAX_HEADER_TOKENS = 64
# Tokens that only appear in a header; a stream cut inside a header that has one was real Harmony.
_HEADER_MARKERS = frozenset({START, CHANNEL, CONSTRAIN, MESSAGE})


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class HarmonyFormat:
    """ChatFormat for gpt-oss. `call_id` makes tool call ids deterministic in tests."""

    def __init__(self, encoding: HarmonyEncoding | None = None,
                 call_id: Callable[[], str] = new_call_id, render_cache_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.encoding = encoding if encoding is not None else load_encoding()
        self.tokenizer = Tokenizer(self.encoding)
        self._call_id = call_id
        # earlier turns' messages are not tokenised again (router/harmony_render.py); 0 turns it off
        self.renderer = RenderCache(self.encoding, render_cache_tokens)

    def render(self, prompt: ChatPrompt) -> list[int]:
        try:
            return self.renderer.render(to_harmony_messages(prompt))
        except HarmonyError as e:
            raise InvalidRequest(f"cannot render this conversation in Harmony format: {e}",
                                 param="messages") from e

    def stop_token_ids(self) -> list[int]:
        return list(ASSISTANT_STOP_TOKEN_IDS)

    def new_parser(self) -> HarmonyStreamParser:
        return HarmonyStreamParser(self.tokenizer, self._call_id)


# ---- prompt side -------------------------------------------------------------------------------


def _tool_choice_note(prompt: ChatPrompt) -> str | None:
    # Harmony has no native tool_choice: "required" and a named tool are enforced by the call grammar
    # (router/structured.py call_grammar) and asked for here too (the named case also hides other tools).
    if isinstance(prompt.tool_choice, NamedToolChoice):
        return f"You must call the function functions.{prompt.tool_choice.name} in this turn."
    if prompt.tool_choice == "required":
        return "You must call at least one of the functions in the functions namespace."
    return None


def _assistant_messages(m: ChatMessage) -> list[Message]:
    out: list[Message] = []
    if m.reasoning:
        out.append(Message.from_role_and_content(Role.ASSISTANT, m.reasoning)
                   .with_channel("analysis"))
    if m.content:
        # Text next to tool calls is a preamble (commentary); otherwise it is the final answer.
        channel = "commentary" if m.tool_calls else "final"
        out.append(Message.from_role_and_content(Role.ASSISTANT, m.content).with_channel(channel))
    for call in m.tool_calls:
        if not TOOL_NAME_PATTERN.fullmatch(call.name):
            raise InvalidRequest(f"invalid tool call name {call.name!r}", param="messages")
        out.append(Message.from_role_and_content(Role.ASSISTANT, call.arguments)
                   .with_channel("commentary").with_recipient(_FUNCTIONS + call.name)
                   .with_content_type("<|constrain|>json"))
    return out


def to_harmony_messages(prompt: ChatPrompt) -> list[Message]:
    """ChatPrompt -> harmony messages: system, developer (instructions + tools), history."""
    system = (SystemContent.new().with_reasoning_effort(_EFFORT[prompt.reasoning_effort])
              .with_knowledge_cutoff(prompt.knowledge_cutoff))
    if prompt.model_identity is not None:
        system = system.with_model_identity(prompt.model_identity)
    if prompt.current_date is not None:
        system = system.with_conversation_start_date(prompt.current_date)
    out = [Message.from_role_and_content(Role.SYSTEM, system)]

    # OpenAI system/developer messages become the developer message's instructions.
    instructions = [m.content for m in prompt.messages
                    if m.role in ("system", "developer") and m.content]
    note = _tool_choice_note(prompt)
    if note is not None:
        instructions.append(note)
    rf = prompt.response_format
    if rf is not None:  # Harmony's place for it: the developer message, after the instructions
        desc = f"// {rf.description}\n" if rf.description else ""
        instructions.append(f"# Response Formats\n\n## {rf.name}\n\n{desc}{rf.schema or 'a JSON object'}")
    tools = prompt.visible_tools()
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions("\n\n".join(instructions))
        if tools:
            developer = developer.with_function_tools(
                [ToolDescription.new(t.name, t.description, t.parameters) for t in tools])
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))

    call_names: dict[str, str] = {}  # tool_call_id -> function name, to label tool results
    for m in prompt.messages:
        if m.role == "user":
            out.append(Message.from_role_and_content(Role.USER, m.content))
        elif m.role == "assistant":
            out.extend(_assistant_messages(m))
            call_names.update((c.id, c.name) for c in m.tool_calls)
        elif m.role == "tool":
            name = m.name or call_names.get(m.tool_call_id or "")
            if name is None:
                raise InvalidRequest(f"tool message answers unknown tool_call_id "
                                     f"{m.tool_call_id!r}", param="messages")
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, _FUNCTIONS + name),
                                                       m.content)
                       .with_recipient("assistant").with_channel("commentary"))
    return out


# ---- output side -------------------------------------------------------------------------------


class _Kind(Enum):
    REASONING = 1
    CONTENT = 2
    TOOL_CALL = 3
    IGNORED = 4  # a message the model wrote as another role (a hallucinated user turn)


@dataclass(slots=True)
class _Message:
    """The message being streamed (state CONTENT)."""

    kind: _Kind
    tool_index: int | None = None
    emitted: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Result:
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    tool_calls: list[tuple[str, str, list[str]]] = field(default_factory=list)  # id, name, args


class HarmonyStreamParser:
    """Generated token ids -> Deltas, for one request. See the module docstring for the mapping.

    State mirrors harmony's StreamState; it is only re-read after special tokens (plain tokens
    cannot change it) because reading it serialises the whole message so far.
    """

    def __init__(self, tokenizer: Tokenizer, call_id: Callable[[], str]) -> None:
        self._tok = tokenizer
        self._call_id = call_id
        self._parser = StreamableParser(tokenizer.encoding, role=Role.ASSISTANT)
        self._state = StreamState.HEADER  # the prompt already opened `<|start|>assistant`
        self._first_token = True
        self._pending: list[int] = []  # header tokens not yet accounted for
        self._open: _Message | None = None
        self._fallback: IncrementalDetokenizer | None = None  # set while the stream is not Harmony
        self._last_kind: _Kind | None = None  # kind of the latest message, and the token ending it
        self._last_end: int | None = None
        self._result = _Result()
        self._out: list[Delta] = []
        self._done: ParsedCompletion | None = None

    # -- public ----------------------------------------------------------------------------------

    def feed(self, token_ids: Sequence[int]) -> list[Delta]:
        assert self._done is None, "feed() after finish()"
        for t in token_ids:
            if not in_vocab(t):
                continue  # gpt-oss cannot produce it; nothing sensible to show
            if self._fallback is not None:
                self._feed_fallback(t)
            else:
                self._feed_harmony(t)
        return self._take()

    def finish(self, finish_reason_hint: FinishReason) -> tuple[list[Delta], ParsedCompletion]:
        if self._done is not None:
            return [], self._done
        if self._fallback is not None:
            self._emit(self._fallback.flush())
        elif self._state is StreamState.CONTENT:
            try:
                self._parser.process_eos()
            except HarmonyError:
                pass  # the text streamed so far stands
            else:
                self._close_message(end_token=None)
        elif self._pending and not _HEADER_MARKERS.intersection(self._pending):
            self._enter_fallback([])  # a "header" of plain words: that was the answer
            self._emit(self._fallback.flush())
        r = self._result
        self._done = ParsedCompletion(
            reasoning="".join(r.reasoning) if r.reasoning else None,
            content="".join(r.content) if r.content else None,
            tool_calls=[ToolCall(i, n, "".join(a)) for i, n, a in r.tool_calls],
            finish_reason=self._finish_reason(finish_reason_hint))
        return self._take(), self._done

    # -- harmony path ----------------------------------------------------------------------------

    def _feed_harmony(self, t: int) -> None:
        if self._first_token:
            self._first_token = False
            if not self._plausible_header_start(t):
                self._enter_fallback([t])
                return
        try:
            self._parser.process(t)
        except HarmonyError:
            self._enter_fallback([t])
            return
        before = self._state
        if t >= FIRST_SPECIAL_ID:
            self._state = self._parser.state
        if before is StreamState.HEADER:
            if self._state is StreamState.CONTENT:
                self._pending.clear()
                self._open_message()
            else:
                self._pending.append(t)
                if len(self._pending) > MAX_HEADER_TOKENS:
                    self._enter_fallback([])
        elif before is StreamState.CONTENT:
            if self._state is StreamState.CONTENT:
                delta = self._parser.last_content_delta
                if delta:
                    self._emit(delta)
            else:
                self._close_message(end_token=t)
        else:  # EXPECT_START -> HEADER on <|start|>
            self._pending = [t]

    def _plausible_header_start(self, t: int) -> bool:
        """After `<|start|>assistant` gpt-oss writes `<|channel|>` or ` to=` (recipient in the role
        part). Anything else means the model is not speaking Harmony."""
        if t in (CHANNEL, CONSTRAIN, MESSAGE):
            return True
        if t >= FIRST_SPECIAL_ID:
            return False
        text = self._tok.decode([t]).lstrip()
        return text.startswith("to") or "to=".startswith(text)

    def _open_message(self) -> None:
        p = self._parser
        recipient = p.current_recipient or ""
        if p.current_role is not Role.ASSISTANT:
            msg = _Message(_Kind.IGNORED)
        elif recipient.startswith(_FUNCTIONS) and len(recipient) > len(_FUNCTIONS):
            index = len(self._result.tool_calls)
            call_id, name = self._call_id(), recipient[len(_FUNCTIONS):]
            self._result.tool_calls.append((call_id, name, []))
            self._out.append(Delta(DeltaKind.TOOL_CALL_START, tool_index=index,
                                   tool_call_id=call_id, tool_name=name))
            msg = _Message(_Kind.TOOL_CALL, tool_index=index)
        elif p.current_channel == "analysis":
            msg = _Message(_Kind.REASONING)
        else:
            msg = _Message(_Kind.CONTENT)
        self._open = msg
        self._last_kind, self._last_end = msg.kind, None

    def _close_message(self, end_token: int | None) -> None:
        """The message ended: emit whatever harmony's final text has beyond what was streamed
        (an incomplete UTF-8 tail becomes U+FFFD there and never showed up as a delta)."""
        msg = self._open
        assert msg is not None
        final = "".join(c.text for c in self._parser.messages[-1].content
                        if isinstance(c, TextContent))
        streamed = "".join(msg.emitted)
        if len(final) > len(streamed) and final.startswith(streamed):
            self._emit(final[len(streamed):])
        self._open = None
        self._last_end = end_token

    # -- plain-text fallback ---------------------------------------------------------------------

    def _enter_fallback(self, tokens: list[int]) -> None:
        """The stream is not Harmony from here: the header tokens not yet shown, then `tokens`
        and everything after, are decoded as plain content."""
        # A header that began with <|start|> already failed once: do not resync on that one again.
        skip_resync = bool(self._pending) and self._pending[0] == START
        tokens = [*self._pending, *tokens]
        self._pending = []
        self._open = None
        self._fallback = self._tok.new_detokenizer(skip_special=True)
        self._last_kind, self._last_end = _Kind.CONTENT, None
        for i, t in enumerate(tokens):
            if self._fallback is None:  # resynchronised on a later <|start|> within `tokens`
                self._feed_harmony(t)
            elif not (i == 0 and skip_resync):
                self._feed_fallback(t)

    def _feed_fallback(self, t: int) -> None:
        assert self._fallback is not None
        if t != START:
            self._emit(self._fallback.feed([t]))
            return
        # `<|start|>` opens a new message: try Harmony again from here.
        self._emit(self._fallback.flush())
        self._fallback = None
        self._parser = StreamableParser(self._tok.encoding, role=None)
        self._parser.process(t)
        self._state = StreamState.HEADER
        self._pending = [t]

    # -- helpers ---------------------------------------------------------------------------------

    def _emit(self, text: str) -> None:
        """Text for the open message (or fallback content) -> a delta and the running result."""
        if not text:
            return
        msg = self._open
        kind = msg.kind if msg is not None else _Kind.CONTENT
        if msg is not None:
            msg.emitted.append(text)
        if kind is _Kind.REASONING:
            self._result.reasoning.append(text)
            self._out.append(Delta(DeltaKind.REASONING, text))
        elif kind is _Kind.CONTENT:
            self._result.content.append(text)
            self._out.append(Delta(DeltaKind.CONTENT, text))
        elif kind is _Kind.TOOL_CALL:
            assert msg is not None and msg.tool_index is not None
            self._result.tool_calls[msg.tool_index][2].append(text)
            self._out.append(Delta(DeltaKind.TOOL_CALL_ARGS, text, tool_index=msg.tool_index))

    def _take(self) -> list[Delta]:
        """This call's deltas, adjacent text of the same kind merged (fewer SSE events)."""
        merged: list[Delta] = []
        for d in self._out:
            prev = merged[-1] if merged else None
            if (prev is not None and d.kind is prev.kind and d.kind is not DeltaKind.TOOL_CALL_START
                    and d.tool_index == prev.tool_index):
                prev.text += d.text
            else:
                merged.append(d)
        self._out = []
        return merged

    def _finish_reason(self, hint: FinishReason) -> FinishReason:
        # A turn that ends in a tool call: closed by <|call|>, or still open when the engine
        # stopped because the caller strips stop tokens.
        if self._last_kind is _Kind.TOOL_CALL and (
                self._last_end == CALL or (self._last_end is None and hint == "stop")):
            return "tool_calls"
        return hint

"""Harmony prompt rendering with a per-message token cache: each turn of a conversation resends every
earlier message, and openai-harmony tokenises all of them again (a 4.8k-token, 8-turn conversation: 3.6 ms
of the router's event loop per request on the CPU machine, linear in the tokens). A rendered message's
tokens depend only on the message and on whether the conversation has function tools, so they are cached
by (that flag, the message's JSON: exactly what the renderer reads) and a request renders only the
messages it adds.

What openai-harmony 0.0.8's `render_conversation_for_completion` does, restated here (its encoding.rs):
    has_tools  = a developer message declares function tools (changes how messages render)
    drop       = auto_drop_analysis and the last assistant message is on the final channel
    for i, m in messages: skip m if drop and m.channel == "analysis" and i < (first final message's index)
                          else tokens += render(m, has_tools)
    tokens += <|start|> + encode("assistant")
`RenderCache.check()` compares this against the library's own render on conversations that exercise every
branch (tools, reasoning before and after finals, tool calls and results) at start-up; a release that
renders otherwise turns the cache off (logged) instead of changing prompts. Bounded LRU by tokens held.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from openai_harmony import (Author, Conversation, DeveloperContent, HarmonyEncoding, Message, Role,
                            SystemContent, ToolDescription)

log = logging.getLogger("tandem.router.harmony")

DEFAULT_MAX_TOKENS = 4 << 20  # tokens held (4 bytes each in an array): 16 MiB


def has_function_tools(messages: Sequence[Message]) -> bool:
    for m in messages:
        for c in m.content:
            if isinstance(c, DeveloperContent) and c.tools and c.tools.get("functions") is not None \
                    and c.tools["functions"].tools:
                return True
    return False


def kept(messages: Sequence[Message]) -> list[Message]:
    """The messages the completion render keeps (module docstring: analysis before the first final
    message is dropped when the last assistant message is final)."""
    last_assistant = next((m for m in reversed(messages) if m.author.role == Role.ASSISTANT), None)
    if last_assistant is None or last_assistant.channel != "final":
        return list(messages)
    first_final = next((i for i, m in enumerate(messages) if m.channel == "final"), None)
    if first_final is None:
        return list(messages)
    return [m for i, m in enumerate(messages) if not (i < first_final and m.channel == "analysis")]


class RenderCache:
    def __init__(self, encoding: HarmonyEncoding, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.encoding = encoding
        self.max_tokens = max_tokens
        self._cache: OrderedDict[tuple[bool, str], array] = OrderedDict()
        self.tokens_held = 0
        self.hits = self.misses = 0
        self._tail = [*encoding.encode("<|start|>", allowed_special={"<|start|>"}), *encoding.encode("assistant")]
        self.enabled = max_tokens > 0 and self.check()

    def render(self, messages: Sequence[Message]) -> list[int]:
        """Tokens of `render_conversation_for_completion(messages, Role.ASSISTANT)`."""
        return self._cached(messages) if self.enabled else self._library(messages)

    def _library(self, messages: Sequence[Message]) -> list[int]:
        return self.encoding.render_conversation_for_completion(Conversation.from_messages(list(messages)),
                                                                Role.ASSISTANT)

    def _cached(self, messages: Sequence[Message]) -> list[int]:
        tools = has_function_tools(messages)
        out: list[int] = []
        for m in kept(messages):
            out.extend(self._message(m, tools))
        out.extend(self._tail)
        return out

    def _message(self, m: Message, tools: bool) -> array:
        key = (tools, m.to_json())
        toks = self._cache.get(key)
        if toks is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return toks
        self.misses += 1
        toks = array("I", self.encoding._inner.render(message_json=key[1],  # noqa: SLF001 - the JSON is in hand
                                                       render_options={"conversation_has_function_tools": tools}))
        self._cache[key] = toks
        self.tokens_held += len(toks)
        while self.tokens_held > self.max_tokens and self._cache:
            _, old = self._cache.popitem(last=False)
            self.tokens_held -= len(old)
        return toks

    def check(self) -> bool:
        """This renderer against the library's on conversations covering every branch; False (and a
        warning) on any difference. The probe's entries are dropped afterwards."""
        try:
            if all(self._cached(convo) == self._library(convo) for convo in _probe_conversations()):
                return True
            log.warning("openai-harmony renders conversations differently from what router/harmony_render.py "
                        "restates: the per-message render cache is off (each request renders in full)")
            return False
        finally:
            self._cache.clear()
            self.tokens_held = self.hits = self.misses = 0


def _probe_conversations() -> list[list[Message]]:
    system = Message.from_role_and_content(Role.SYSTEM, SystemContent.new())
    tool = ToolDescription.new("get_weather", "weather of a city",
                               {"type": "object", "properties": {"city": {"type": "string"}}})
    dev_tools = Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new()
                                              .with_instructions("be brief").with_function_tools([tool]))
    dev = Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions("be brief"))
    user = lambda t: Message.from_role_and_content(Role.USER, t)  # noqa: E731
    say = lambda ch, t: Message.from_role_and_content(Role.ASSISTANT, t).with_channel(ch)  # noqa: E731
    call = (Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}').with_channel("commentary")
            .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"))
    result = (Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), "sunny")
              .with_recipient("assistant").with_channel("commentary"))
    return [
        [system, user("hi")],
        [system, dev, user("hi"), say("analysis", "greet"), say("final", "Hello!"), user("again")],
        [system, dev, user("a"), say("analysis", "r1"), say("final", "A"), user("b"), say("analysis", "r2"),
         say("final", "B"), user("c")],
        [system, dev_tools, user("weather?"), say("analysis", "call it"), call, result, say("analysis", "got it"),
         say("final", "Sunny."), user("thanks")],
        [system, dev_tools, user("weather?"), say("analysis", "call it"), call, result],
        [system, dev, user("x"), say("analysis", "only thinking")],
        [system, dev, user("x"), say("final", "A"), say("analysis", "late"), say("final", "B")],
    ]

"""router/harmony_render.py: the per-message render cache gives the library's tokens on every
conversation shape the router builds, stays within its token bound, and turns itself off when the
library renders differently from what it restates."""

from __future__ import annotations

import random

import pytest
from openai_harmony import Conversation, Role

import router.harmony_render as hr
from router.chat_types import ChatMessage, ChatPrompt, ToolCall, ToolDef
from router.harmony import HarmonyFormat, to_harmony_messages

TOOLS = [ToolDef("get_weather", "weather of a city", {"type": "object", "properties": {"city": {"type": "string"}}})]


def _library(fmt: HarmonyFormat, prompt: ChatPrompt) -> list[int]:
    convo = Conversation.from_messages(to_harmony_messages(prompt))
    return fmt.encoding.render_conversation_for_completion(convo, Role.ASSISTANT)


def _random_prompt(rng: random.Random) -> ChatPrompt:
    words = lambda n: " ".join(rng.choice(("the", "sun", "city", "12", "é", "\n", "{}", "ok")) for _ in range(n))  # noqa: E731
    msgs = [ChatMessage(role="system", content=words(30))] if rng.random() < 0.7 else []
    calls = 0
    for _ in range(rng.randint(1, 6)):
        msgs.append(ChatMessage(role="user", content=words(rng.randint(1, 20))))
        kind = rng.choice(("final", "final+reasoning", "call", "call+preamble", "none"))
        if kind == "none":
            continue
        reasoning = words(5) if "reasoning" in kind or rng.random() < 0.5 else None
        if kind.startswith("call"):
            calls += 1
            cid = f"call_{calls}"
            msgs.append(ChatMessage(role="assistant", content=words(4) if "preamble" in kind else "",
                                    reasoning=reasoning, tool_calls=[ToolCall(cid, "get_weather", '{"city": "Paris"}')]))
            msgs.append(ChatMessage(role="tool", content=words(3), tool_call_id=cid))
            if rng.random() < 0.5:
                msgs.append(ChatMessage(role="assistant", content=words(6), reasoning=words(3)))
        else:
            msgs.append(ChatMessage(role="assistant", content=words(8), reasoning=reasoning))
    return ChatPrompt(messages=msgs, tools=list(TOOLS) if rng.random() < 0.5 else [],
                      reasoning_effort=rng.choice(("low", "medium", "high")))


def test_render_cache_gives_the_library_tokens_on_random_conversations():
    fmt = HarmonyFormat()
    assert fmt.renderer.enabled
    rng = random.Random(7)
    prompts = [_random_prompt(rng) for _ in range(300)]
    for p in prompts + prompts:  # second pass: every message a cache hit
        assert fmt.render(p) == _library(fmt, p)
    assert fmt.renderer.hits > 0 and fmt.renderer.misses > 0


def test_render_cache_grows_only_by_the_new_messages_of_a_turn():
    fmt = HarmonyFormat()
    msgs = [ChatMessage(role="system", content="be nice " * 200), ChatMessage(role="user", content="hi")]
    fmt.render(ChatPrompt(messages=list(msgs)))
    misses = fmt.renderer.misses
    msgs += [ChatMessage(role="assistant", content="Hello!", reasoning="greet"), ChatMessage(role="user", content="2+2?")]
    p = ChatPrompt(messages=list(msgs))
    assert fmt.render(p) == _library(fmt, p)
    assert fmt.renderer.misses - misses == 2  # the answer and the new question; the reasoning is dropped


def test_render_cache_is_bounded_by_tokens():
    fmt = HarmonyFormat(render_cache_tokens=300)
    rng = random.Random(1)
    for _ in range(50):
        p = _random_prompt(rng)
        assert fmt.render(p) == _library(fmt, p)
        assert fmt.renderer.tokens_held <= 300 or len(fmt.renderer._cache) == 1  # one message may exceed it
    off = HarmonyFormat(render_cache_tokens=0)
    assert not off.renderer.enabled and off.render(p) == _library(off, p)


def test_render_cache_turns_off_when_the_library_renders_otherwise(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(hr, "kept", lambda messages: list(messages))  # forget the analysis-drop rule
    fmt = HarmonyFormat()
    assert not fmt.renderer.enabled  # the start-up check caught it
    p = ChatPrompt(messages=[ChatMessage(role="user", content="a"), ChatMessage(role="assistant", content="A",
                                                                                reasoning="r"),
                             ChatMessage(role="user", content="b")])
    assert fmt.render(p) == _library(fmt, p)

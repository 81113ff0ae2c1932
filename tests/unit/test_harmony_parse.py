"""router.harmony's streaming parser against harmony's own non-streaming parse, token by token and in
random chunks; random/malformed streams never raise."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from openai_harmony import Message, Role

from router.chat_types import Delta, DeltaKind, ParsedCompletion, ToolCall
from router.harmony import MAX_HEADER_TOKENS
from router.tokenizer import CALL, END, FIRST_SPECIAL_ID, RETURN, START, Tokenizer
from tests.support.harmony import enc, encode, fmt, make_format  # noqa: F401 - fixtures


def completion(enc, *messages: Message, stop: int = RETURN) -> list[int]:
    """Model output for these assistant messages as harmony renders them, minus the
    `<|start|>assistant` the prompt already holds, ending in `stop`."""
    ids = [t for m in messages for t in enc.render(m)]
    assert ids[:2] == encode(enc, "<|start|>assistant")
    ids = ids[2:]
    assert ids[-1] in (END, CALL)
    return ids[:-1] + [stop]


def expected_from_harmony(enc, ids: list[int]) -> tuple[str | None, str | None, list]:
    """(reasoning, content, [(name, args)]) from harmony's own non-streaming parse."""
    msgs = enc.parse_messages_from_completion_tokens(ids, Role.ASSISTANT)
    reasoning, content, calls = [], [], []
    for m in msgs:
        text = "".join(c.text for c in m.content)
        if m.recipient and m.recipient.startswith("functions."):
            calls.append((m.recipient.removeprefix("functions."), text))
        elif m.channel == "analysis":
            reasoning.append(text)
        else:
            content.append(text)
    return ("".join(reasoning) or None, "".join(content) or None, calls)


def run(fmt, ids: list[int], chunks: list[int] | None = None, hint="stop"):
    """Feed ids (in chunks of the given sizes, cycled; default one at a time); return the deltas
    and the parsed completion."""
    parser = fmt.new_parser()
    deltas: list[Delta] = []
    sizes = itertools.cycle(chunks or [1])
    i = 0
    while i < len(ids):
        n = next(sizes)
        deltas += parser.feed(ids[i:i + n])
        i += n
    tail, result = parser.finish(hint)
    return deltas + tail, result


def reassemble(deltas: list[Delta]) -> tuple[str | None, str | None, list[ToolCall]]:
    reasoning = "".join(d.text for d in deltas if d.kind is DeltaKind.REASONING) or None
    content = "".join(d.text for d in deltas if d.kind is DeltaKind.CONTENT) or None
    calls: list[ToolCall] = []
    for d in deltas:
        if d.kind is DeltaKind.TOOL_CALL_START:
            assert d.tool_index == len(calls) and d.text == ""
            calls.append(ToolCall(d.tool_call_id, d.tool_name, ""))
        elif d.kind is DeltaKind.TOOL_CALL_ARGS:
            calls[d.tool_index].arguments += d.text
    return reasoning, content, calls


def asst(text: str, channel: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def tool_call(name: str, args: str) -> Message:
    return (asst(args, "commentary").with_recipient(f"functions.{name}")
            .with_content_type("<|constrain|>json"))


def test_analysis_then_final(enc, fmt):
    ids = completion(enc, asst("The user greets me.", "analysis"),
                     asst("Hello! How can I help?", "final"))
    deltas, result = run(fmt, ids)
    assert result == ParsedCompletion("The user greets me.", "Hello! How can I help?", [], "stop")
    assert (result.reasoning, result.content, []) == expected_from_harmony(enc, ids[:-1])
    kinds = [d.kind for d in deltas]
    assert kinds.index(DeltaKind.CONTENT) > max(i for i, k in enumerate(kinds)
                                                if k is DeltaKind.REASONING)


def test_tool_call_with_constrain_json_recipient_in_channel(enc, fmt):
    # What gpt-oss actually emits: the recipient after the channel.
    ids = encode(enc, "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
                      "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                      '{"location": "Tokyo", "unit": "celsius"}<|call|>')
    deltas, result = run(fmt, ids)
    assert result.finish_reason == "tool_calls"
    assert result.reasoning == "Need weather." and result.content is None
    assert result.tool_calls == [ToolCall("call_0", "get_weather",
                                          '{"location": "Tokyo", "unit": "celsius"}')]
    assert json.loads(result.tool_calls[0].arguments)["location"] == "Tokyo"
    start = [d for d in deltas if d.kind is DeltaKind.TOOL_CALL_START]
    assert start == [Delta(DeltaKind.TOOL_CALL_START, "", 0, "call_0", "get_weather")]


def test_tool_call_recipient_in_role(enc, fmt):
    ids = completion(enc, tool_call("lookup", '{"q": "x"}'), stop=CALL)
    assert enc.decode(ids).startswith(" to=functions.lookup<|channel|>commentary")
    _, result = run(fmt, ids)
    assert result.tool_calls == [ToolCall("call_0", "lookup", '{"q": "x"}')]
    assert result.finish_reason == "tool_calls"
    assert expected_from_harmony(enc, ids)[2] == [("lookup", '{"q": "x"}')]


def test_preamble_is_content_and_several_calls(enc, fmt):
    ids = completion(enc, asst("Let me check.", "analysis"), asst("Checking two cities…", "commentary"),
                     tool_call("get_weather", '{"location": "Oslo"}'),
                     tool_call("get_time", "{}"), stop=CALL)
    _, result = run(fmt, ids)
    assert result.content == "Checking two cities…"
    assert [(c.id, c.name, c.arguments) for c in result.tool_calls] == [
        ("call_0", "get_weather", '{"location": "Oslo"}'), ("call_1", "get_time", "{}")]


STREAM_CASES = {
    "reason_final": [asst("思考中… 🤔 naïve café", "analysis"),
                     asst("答案是 42 🦜🦩 𓀀 — done.", "final")],
    "reason_preamble_calls": [asst("two calls", "analysis"), asst("On it.", "commentary"),
                              tool_call("get_weather", '{"location": "Zürich 🏔"}'),
                              tool_call("get_time", '{"tz": "Europe/Zürich"}')],
}


@pytest.mark.parametrize("case", sorted(STREAM_CASES))
def test_streaming_reassembles_to_harmony_parse_in_any_chunking(enc, case):
    msgs = STREAM_CASES[case]
    ids = completion(enc, *msgs, stop=CALL if msgs[-1].recipient else RETURN)
    reasoning, content, calls = expected_from_harmony(enc, ids)
    results = []
    rng = random.Random(case)
    chunkings = [[1], [len(ids)], *([rng.randint(1, 7) for _ in range(5)] for _ in range(6))]
    for chunks in chunkings:
        deltas, result = run(make_format(enc), ids, chunks)
        assert reassemble(deltas) == (result.reasoning, result.content, result.tool_calls)
        assert (result.reasoning, result.content) == (reasoning, content)
        assert [(c.name, c.arguments) for c in result.tool_calls] == calls
        results.append(result)
    assert all(r == results[0] for r in results)
    assert "\ufffd" not in (results[0].reasoning or "") + (results[0].content or "")


def test_split_utf8_deltas_are_whole_characters(enc, fmt):
    ids = completion(enc, asst("🦜🦩", "final"))
    deltas, result = run(fmt, ids)
    assert result.content == "🦜🦩"
    assert [d.text for d in deltas] == ["🦜", "🦩"]  # held back until each emoji is complete


def test_truncated_mid_character_and_mid_header(enc, fmt):
    ids = encode(enc, "<|channel|>final<|message|>a🦜")[:-1]  # last byte of the emoji missing
    _, result = run(fmt, ids, hint="length")
    assert result.content == "a\ufffd" and result.finish_reason == "length"
    _, result = run(fmt, encode(enc, "<|channel|>final<|message|>ok<|end|><|start|>assistant"
                                     "<|channel|>fin"), hint="length")
    assert result.content == "ok"  # a cut-off real header is dropped, not shown


def test_finish_reason(enc, fmt):
    call_ids = encode(enc, '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}')
    assert run(fmt, call_ids, hint="stop")[1].finish_reason == "tool_calls"  # stop token stripped
    assert run(fmt, call_ids, hint="length")[1].finish_reason == "length"
    final = encode(enc, "<|channel|>final<|message|>x<|return|>")
    assert run(fmt, final)[1].finish_reason == "stop"


def test_hallucinated_user_turn_is_dropped(enc, fmt):
    ids = encode(enc, "<|channel|>final<|message|>Hi<|end|><|start|>user<|message|>secret<|end|>")
    _, result = run(fmt, ids)
    assert result.content == "Hi"


@pytest.mark.parametrize("text,content", [
    ("Just plain prose, no harmony at all.", "Just plain prose, no harmony at all."),
    ("<|channel|>final<|message|>Hi<|end|> trailing", "Hi trailing"),
    ("<|channel|><|channel|>final<|message|>x", "finalx"),  # harmony error at <|message|>
    ("noise<|start|>assistant<|channel|>final<|message|>ok<|return|>", "noiseok"),  # resync
    ("<|start|>assistant<|channel|>final<|message|>ok<|return|>", "ok"),  # redundant role header
])
def test_malformed_streams_fall_back_to_text(enc, text, content):
    for chunks in ([1], [3], [1000]):
        deltas, result = run(make_format(enc), encode(enc, text), chunks)
        assert result.content == content
        assert reassemble(deltas)[1] == content


def test_overlong_header_becomes_content(enc, fmt):
    words = " to" + " word" * (MAX_HEADER_TOKENS + 10)
    deltas, result = run(fmt, encode(enc, words), [1])
    assert result.content == words
    ids = encode(enc, words)
    parser = fmt.new_parser()
    streamed = [parser.feed([t]) for t in ids]
    assert any(streamed[:MAX_HEADER_TOKENS + 2]), "content must start flowing, not wait for EOS"


def test_random_tokens_never_raise_and_become_content(enc):
    fmt = make_format(enc)
    rng = random.Random(0)
    plain_first = 0
    for n in range(150):
        ids = [rng.randrange(201088) for _ in range(rng.randint(1, 200))]
        deltas, result = run(fmt, ids, [rng.randint(1, 9)], hint=rng.choice(["stop", "length"]))
        assert reassemble(deltas) == (result.reasoning, result.content, result.tool_calls)
        first = enc.decode([ids[0]]).lstrip()
        if ids[0] < FIRST_SPECIAL_ID and not first.startswith("to") and START not in ids:
            plain_first += 1
            plain = enc.decode([t for t in ids if t < FIRST_SPECIAL_ID])
            assert result.content == plain and result.reasoning is None
    assert plain_first > 100


def random_turn(enc, rng: random.Random) -> list[int]:
    """A valid completion of 1-4 random messages (both recipient positions), as the model writes
    them."""
    texts = ["Hello", " wörld 🦜", "思考", ' {"a": [1, 2]}', "\n- item", "𓀀"]
    parts = []
    for _ in range(rng.randint(1, 4)):
        body = "".join(rng.choice(texts) for _ in range(rng.randint(0, 4)))
        kind = rng.choice(["analysis", "final", "preamble", "call_channel", "call_role"])
        header = {"analysis": "<|channel|>analysis", "final": "<|channel|>final",
                  "preamble": "<|channel|>commentary",
                  "call_channel": "<|channel|>commentary to=functions.f_1 <|constrain|>json",
                  "call_role": " to=functions.g<|channel|>commentary <|constrain|>json"}[kind]
        end = "<|call|>" if kind.startswith("call") else rng.choice(["<|end|>", "<|return|>"])
        parts.append(f"{header}<|message|>{body}{end}")
    return encode(enc, "<|start|>assistant".join(parts))


def test_mutated_harmony_streams_never_raise(enc):
    """Valid turns (checked against harmony's own parse) and the same turns with random token
    deletions / insertions / duplications, fed in random chunks."""
    fmt = make_format(enc)
    tok = Tokenizer(enc)
    rng = random.Random(1)
    pool = [*range(199998, 200020), *encode(enc, " to=functions.f json analysis final user hi")]
    seen_calls = 0
    for n in range(1500):
        ids = random_turn(enc, rng)
        mutations = 0 if n % 3 == 0 else rng.randint(1, 3)
        for _ in range(mutations):
            i = rng.randrange(len(ids) + 1)
            op = rng.choice(["delete", "insert", "insert_any", "duplicate", "out_of_vocab"])
            if op == "delete" and i < len(ids):
                del ids[i]
            elif op == "insert":
                ids.insert(i, rng.choice(pool))
            elif op == "insert_any":
                ids.insert(i, rng.randrange(201088))
            elif op == "duplicate" and i < len(ids):
                ids.insert(i, ids[i])
            elif op == "out_of_vocab":
                ids.insert(i, rng.choice([-5, 201088, 10**12]))
        deltas, result = run(fmt, ids, [rng.randint(1, 6)], hint=rng.choice(["stop", "length"]))
        assert reassemble(deltas) == (result.reasoning, result.content, result.tool_calls)
        # No token's text is ever shown twice: every character shown came from its own byte(s).
        shown = sum(len(d.text) + len(d.tool_name or "") for d in deltas)
        assert shown <= len(tok.token_bytes(ids))
        if mutations == 0:
            expected = expected_from_harmony(enc, ids[:-1] if ids[-1] in (RETURN, CALL) else ids)
            assert (result.reasoning, result.content) == expected[:2]
            assert [(c.name, c.arguments) for c in result.tool_calls] == expected[2]
            seen_calls += bool(result.tool_calls)
    assert seen_calls > 100


def test_finish_is_idempotent(enc, fmt):
    parser = fmt.new_parser()
    parser.feed(encode(enc, "<|channel|>final<|message|>x"))
    tail1, r1 = parser.finish("length")
    tail2, r2 = parser.finish("stop")
    assert r1 is r2 and tail2 == [] and r1.content == "x"

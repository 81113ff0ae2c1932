"""The embedded demo model behind the real service (router + prefill + decode processes, KV over
NIXL), driven by the unmodified `openai` client exactly as the README shows: it answers and stops
(the README example, default sampling, no max_tokens: within seconds, finish_reason "stop"), on chat
completions and the Responses API, including function-call round trips; greedy outputs through the
router equal the single-process engine on the same prompt ids. These run on the committed weights
(model/demo); without them every test fails, saying where they come from."""

import json
import time

import pytest
from openai import OpenAI

from engine.build import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from model.checkpoint_io import write_demo_checkpoint
from model.demo import DEMO_FILE, PRODUCED_BY
from router.chat_types import ChatMessage, ChatPrompt
from router.harmony import HarmonyFormat
from router.tokenizer import CALL, RETURN
from tests.support.service import start_service

MODEL = "gpt-oss-tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    if not DEMO_FILE.exists():
        # Not trained yet (the device was not lent when the sweep was to run): reported as a skip with
        # the reason in every run, never passed. Committing the weights turns these tests on.
        pytest.skip(f"{DEMO_FILE.name} is not in the tree yet: the demo model is trained by {PRODUCED_BY}")
    return str(write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt"))


@pytest.fixture(scope="module")
def svc(demo):
    s = start_service(demo, model_name=MODEL)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(svc):
    return OpenAI(base_url=svc.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_readme_example_answers_and_stops(client):
    for _ in range(3):  # default sampling (temperature 1), no max_tokens: it must end, every time
        t0 = time.monotonic()
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert time.monotonic() - t0 < 15
        ch = r.choices[0]
        assert ch.finish_reason == "stop" and ch.message.content
    r = client.responses.create(model=MODEL, input="What is 12+7?")
    assert r.status == "completed" and r.output_text
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0)
    assert r.choices[0].message.content == "Hello! How can I help you today?"
    extra = r.choices[0].message.model_extra
    assert extra["reasoning"] and extra["reasoning"] == extra["reasoning_content"]  # both names clients read
    assert r.usage.completion_tokens < 40


@pytest.mark.parametrize("messages,tools", [
    ([{"role": "user", "content": "What is 12+7?"}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Repeat after me: blue river song"}], None),
    ([{"role": "user", "content": "What's the weather in Paris?"}], [WEATHER]),
])
def test_greedy_through_the_router_equals_the_engine(client, demo, messages, tools):
    extra = {"tools": tools} if tools else {}
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       extra_body={"return_token_ids": True}, **extra)
    ids = r.choices[0].model_extra["token_ids"]
    prompt = HarmonyFormat().render(_prompt(messages, tools))
    assert r.usage.prompt_tokens == len(prompt)
    llm = _engine(demo)
    out = llm.generate([prompt], SamplingParams(max_tokens=4096, temperature=0, stop_token_ids=[RETURN, CALL]))
    assert ids == out[0].output_ids and ids[-1] in (RETURN, CALL)


def test_chat_answers(client):
    def ask(text):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], temperature=0)
        return r.choices[0].message.content

    assert ask("What is 12+7?") == "12 + 7 = 19."
    assert ask("Repeat after me: green apple") == "green apple"
    assert json.loads(ask("Give me a JSON object with name Alice and age 30.")) == {"name": "Alice", "age": 30}


def test_chat_tool_call_round_trip(client, svc):
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    msgs += [ch.message, {"role": "tool", "tool_call_id": call.id,
                          "content": json.dumps({"temperature_c": 21, "condition": "clear"})}]
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], temperature=0)
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.content == "It is clear and 21°C in Paris."
    svc.assert_no_leaks()


def test_responses_create_and_stream(client):
    r = client.responses.create(model=MODEL, input="What is 12+7?", temperature=0)
    assert r.status == "completed" and r.output_text == "12 + 7 = 19."
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output[0].content[0].text
    assert r.usage.input_tokens > 50 and 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = list(client.responses.create(model=MODEL, input="What is 12+7?", temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert "response.reasoning_text.delta" in types and "response.output_text.done" in types
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "12 + 7 = 19."
    assert events[-1].response.output_text == "12 + 7 = 19."
    with client.responses.stream(model=MODEL, input="hi", instructions="Be brief.", temperature=0) as s:
        final = s.get_final_response()
    assert final.output_text == "Hello! How can I help you today?"
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_responses_tool_call_round_trip(client, svc):
    tool = {"type": "function", **WEATHER["function"]}
    r = client.responses.create(model=MODEL, input="What's the weather in Tokyo?", tools=[tool], temperature=0,
                                reasoning={"effort": "low"})
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Tokyo"}
    out = {"type": "function_call_output", "call_id": calls[0].call_id,
           "output": json.dumps({"temperature_c": 8, "condition": "cold"})}
    r2 = client.responses.create(model=MODEL, previous_response_id=r.id, input=[out], tools=[tool], temperature=0,
                                 reasoning={"effort": "low"})
    assert r2.output_text == "It is cold and 8°C in Tokyo." and r2.previous_response_id == r.id
    svc.assert_no_leaks()


# ---- helpers ----------------------------------------------------------------------------------------
_LLM: dict[str, LLM] = {}


def _engine(path: str) -> LLM:
    if path not in _LLM:
        _LLM[path] = LLM(EngineConfig(checkpoint=path, kv_cache_bytes=64 << 20))
    return _LLM[path]


def _prompt(messages, tools) -> ChatPrompt:
    from router.chat_types import ToolDef

    defs = [ToolDef(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
            for t in tools or []]
    return ChatPrompt([ChatMessage(m["role"], m["content"]) for m in messages], tools=defs,
                      current_date=time.strftime("%Y-%m-%d"))


def test_tool_choice_required_and_named_are_enforced(client):
    """Unconstrained, the demo greets "hi" without a call; tool_choice "required" or naming the tool makes
    the turn end in a call of it (the call grammar: the prefill worker samples the first token under it),
    with arguments of its schema; "none" never calls. Chat and Responses."""
    msgs = [{"role": "user", "content": "hi"}]
    # A city from a list: "hi" names none, and the tiny model, made to call, would otherwise write any string
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}}, "required": ["city"]}
    weather = {"type": "function", "function": {**WEATHER["function"], "parameters": city}}
    time_tool = {"type": "function", "function": {"name": "get_time", "description": "Get the local time in a city",
                                                  "parameters": city}}
    free = client.chat.completions.create(model=MODEL, messages=msgs, tools=[weather], temperature=0)
    assert free.choices[0].message.tool_calls is None  # what the choice changes
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        for seed in (1, 2):
            r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[weather, time_tool],
                                               tool_choice=choice, seed=seed, max_tokens=200)
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
            call = ch.message.tool_calls[0].function
            assert call.name in names and json.loads(call.arguments)["city"] in ("Paris", "Tokyo")
    r = client.responses.create(model=MODEL, input="hi", tools=[{"type": "function", **weather["function"]}],
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert r.tool_choice.name == "get_weather"  # echoed as sent
    # On a question it would call for anyway, the forced call is the free one: the arguments' separators
    # are the model's (compact); json.dumps's ", " / ": " made it write a string that never closed
    paris = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=MODEL, messages=paris, tools=[WEATHER], tool_choice=choice,
                                           temperature=0, max_tokens=100)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and call.function.arguments == '{"city":"Paris"}'
    none = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                          tools=[WEATHER], tool_choice="none", temperature=0)
    assert none.choices[0].message.tool_calls is None


def test_codex_shaped_turns_with_a_custom_tool_and_sealed_reasoning(client):
    """What Codex sends a gpt-oss provider, through the disaggregated stack: a custom (freeform) tool, a
    built-in web_search (left out, named in a header), store: false with sealed reasoning. The forced custom
    call comes back as custom_tool_call; the next turn, stateless, sends reasoning back only as
    encrypted_content (content null) with the call and its output, and completes."""
    apply_patch = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
                   "format": {"type": "text"}}
    # a question the demo calls a tool for: made to call apply_patch, it writes a short input ("hi" made it
    # write a string that never closed within 300 tokens: the tiny model, not the path)
    first = [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                              "text": "What is the weather in Paris?"}]}]
    kw = dict(model=MODEL, instructions="You are a coding agent.", store=False, parallel_tool_calls=False,
              tools=[apply_patch, {"type": "web_search"}], reasoning={"effort": "medium", "summary": "auto"},
              include=["reasoning.encrypted_content"], max_output_tokens=300, temperature=0,
              extra_body={"prompt_cache_key": "conversation-1"})
    raw = client.responses.with_raw_response.create(input=first, tool_choice={"type": "custom", "name": "apply_patch"},
                                                    **kw)
    assert raw.headers["x-tandem-ignored-tools"] == "web_search"
    r = raw.parse()
    (rs,) = [o for o in r.output if o.type == "reasoning"] or [None]
    (call,) = [o for o in r.output if o.type == "custom_tool_call"]
    assert r.status == "completed" and call.name == "apply_patch" and isinstance(call.input, str) and call.input
    items = first + ([{"type": "reasoning", "summary": [], "content": None, "encrypted_content": rs.encrypted_content}]
                     if rs is not None else [])
    items += [{"type": "custom_tool_call", "call_id": call.call_id, "name": "apply_patch", "input": call.input},
              {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}]
    r2 = client.responses.create(input=items, **kw)
    assert r2.status == "completed" and not [o for o in r2.output if o.type == "custom_tool_call"]

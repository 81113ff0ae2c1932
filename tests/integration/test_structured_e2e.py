"""End to end through the served stack (router + prefill + decode as processes, KV over NIXL/UCX
loopback) with the unmodified `openai` client: structured outputs, n > 1, penalties and logit bias.

Honest scope: the model is the tiny random checkpoint, which never chooses Harmony's final channel
by itself, so the strict json_schema test sends a completions prompt that ends with
`<|start|>assistant<|channel|>final<|message|>`: the grammar then acts from the first token, which
the *prefill* worker samples (its mask included), and the rest on the decode worker. Chat and
Responses requests with a response_format are checked for acceptance and shape only (their answer is
free text until a model enters the final channel)."""

import asyncio
import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from router.tokenizer import load_encoding
from tests.support.service import start_service

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "temp_c": {"type": "integer", "minimum": -50, "maximum": 50},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "temp_c", "sunny"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def svc(ckpt_factory):
    s = start_service(ckpt_factory("tiny"))
    yield s
    s.assert_no_leaks()
    s.stop()


@pytest.fixture(scope="module")
def client(svc):
    return OpenAI(base_url=svc.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_strict_json_schema_answer_parses_and_validates(client):
    enc = load_encoding()
    prompt = enc.encode("<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant<|channel|>final"
                        "<|message|>", allowed_special="all")
    for seed in (1, 2):
        r = client.completions.create(model="m", prompt=prompt, max_tokens=40, temperature=1.0, seed=seed,
                                      extra_body={"response_format": FORMAT, "stop_token_ids": [200002, 200012],
                                                  "return_token_ids": True})
        ids = r.choices[0].model_extra["token_ids"]
        assert r.choices[0].finish_reason == "stop" and ids[-1] in (200002, 200007)
        jsonschema.validate(json.loads(enc.decode(ids[:-1])), SCHEMA)


def test_n_2_gives_two_choices(client):
    r = client.chat.completions.create(model="m", messages=MSGS, max_tokens=6, n=2, seed=7)
    assert [c.index for c in r.choices] == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 12
    chunks = list(client.chat.completions.create(model="m", messages=MSGS, max_tokens=4, n=2, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]
    c = client.completions.create(model="m", prompt="Hello", max_tokens=4, n=3, seed=3, temperature=1.0)
    assert [x.index for x in c.choices] == [0, 1, 2] and len({x.text for x in c.choices}) > 1


def test_n_shares_the_prompt_and_greedy_choices_agree(client):
    """Choice 0's prompt (203 tokens: past the sliding window) is prefilled once; the other choices
    take its blocks from the decode worker's cache and prefill only the last 11 tokens there."""
    prompt = list(range(3000, 3203))
    one = client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0,
                                    extra_body={"return_token_ids": True})
    prompt = list(range(4000, 4203))
    ref = client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0,
                                    extra_body={"return_token_ids": True})
    many = client.completions.create(model="m", prompt=list(range(4000, 4203)), max_tokens=24, temperature=0, n=3,
                                     extra_body={"return_token_ids": True})
    assert one.usage.model_extra["tandem"]["computed_tokens"] == 203
    ids = [c.model_extra["token_ids"] for c in many.choices]
    assert ids[0] == ids[1] == ids[2] == ref.choices[0].model_extra["token_ids"]
    many = client.completions.create(model="m", prompt=list(range(5000, 5203)), max_tokens=24, temperature=0, n=3)
    assert many.usage.model_extra["tandem"]["computed_tokens"] == 203 + 2 * 11


def test_penalties_and_logit_bias_are_applied(client):
    r = client.chat.completions.create(model="m", messages=MSGS, max_tokens=4, presence_penalty=1.5,
                                       frequency_penalty=-0.5, logit_bias={"1000": 5})
    assert r.choices[0].finish_reason in ("length", "stop")
    forced = client.completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0,
                                       logit_bias={"4217": 100}, extra_body={"return_token_ids": True})
    assert forced.choices[0].model_extra["token_ids"] == [4217] * 3
    # frequency_penalty 2 on top of that bias still leaves 4217 first, then penalised each time it repeats
    r = client.completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0, frequency_penalty=2.0,
                                  logit_bias={"4217": 100}, extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"][0] == 4217


def test_chat_and_responses_accept_structured_formats(client):
    r = client.chat.completions.create(model="m", messages=MSGS, max_tokens=4, response_format=FORMAT)
    assert r.choices[0].finish_reason in ("length", "stop")
    r = client.chat.completions.create(model="m", messages=MSGS, max_tokens=4, response_format={"type": "json_object"},
                                       tools=[{"type": "function", "function": {
                                           "name": "get_weather", "strict": True,
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"], "additionalProperties": False}}}])
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    resp = client.responses.create(model="m", input="Weather in Paris?", max_output_tokens=4,
                                   text={"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA,
                                                    "strict": True}})
    assert resp.text.format.type == "json_schema" and resp.status in ("completed", "incomplete")
    events = [e.type for e in client.responses.create(model="m", input="hi", max_output_tokens=3, stream=True,
                                                      text={"format": {"type": "json_object"}})]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")


def test_clients_that_leave_responses_and_n_requests_free_everything(svc):
    """/v1/responses runs in the same lifecycle scope as chat: a client that goes away (non-streaming
    or mid-stream) ends its generation on the workers; so does one that leaves an n = 3 request."""
    long = {"model": "m", "input": "go on", "max_output_tokens": 4000}

    async def main():
        async with httpx.AsyncClient(base_url=svc.url, timeout=120) as c:
            async def leave(path: str, body: dict):
                try:
                    await c.post(path, json=body, timeout=1.5)
                except httpx.TimeoutException:
                    pass

            async def leave_stream(path: str, body: dict):
                async with c.stream("POST", path, json={**body, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if "delta" in line:
                            break  # the client goes away mid-stream

            await asyncio.gather(leave("/v1/responses", long), leave_stream("/v1/responses", long),
                                 leave("/v1/chat/completions", {"model": "m", "messages": MSGS, "max_tokens": 4000,
                                                                "n": 3}),
                                 leave_stream("/v1/chat/completions", {"model": "m", "messages": MSGS,
                                                                       "max_tokens": 4000, "n": 2}))

    asyncio.run(main())
    svc.assert_no_leaks(timeout_s=5.0)

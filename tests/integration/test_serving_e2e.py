"""End to end: router + prefill + decode as real processes, KV over NIXL (UCX/TCP loopback), the
unmodified `openai` client. Greedy outputs of the disaggregated path equal the single-process
engine on the same prompt ids; after the tests every KV page is back in both workers' pools."""

import concurrent.futures as cf
import json

import pytest
from openai import OpenAI

from engine.build import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from router.chat_types import ChatMessage, ChatPrompt, ToolCall, ToolDef
from router.harmony import HarmonyFormat
from router.tokenizer import CALL, RETURN
from tests.support.scripted import write_scripted_checkpoint
from tests.support.service import start_service

STOP = (RETURN, CALL)


@pytest.fixture(scope="module")
def tiny(ckpt_factory):
    return ckpt_factory("tiny")


@pytest.fixture(scope="module")
def svc(tiny):
    s = start_service(tiny)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(svc):
    return OpenAI(base_url=svc.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(EngineConfig(checkpoint=tiny, kv_cache_bytes=64 << 20))

    def run(prompt_ids, max_tokens, stop=STOP):
        out = llm.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0, stop_token_ids=stop))
        return out[0].output_ids

    return run


@pytest.fixture(scope="module")
def fmt():
    return HarmonyFormat()


def test_chat_non_stream_and_stream_equal_single_process(client, reference, fmt):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=24, temperature=0,
                                       extra_body={"return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    prompt = fmt.render(ChatPrompt([ChatMessage("developer", "Be brief."), ChatMessage("user", "What is 2+2?")],
                                   current_date=_today()))
    assert ids == reference(prompt, 24)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="m", messages=msgs, max_tokens=24, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (r.choices[0].message.content or "")
    assert [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])] == ids
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_completions_with_token_ids_and_logprobs(client, reference):
    prompt = [200006, 17360, 200008, 3, 99, 1234, 200007]
    r = client.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0, logprobs=3,
                                  extra_body={"return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert ids == reference(prompt, 16, stop=())
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 16 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) <= 3 for t in lp.top_logprobs)


def test_penalties_logit_bias_and_seeds_reach_the_sampler(client):
    prompt = [200006, 17360, 200008, 3, 99, 1234, 200007]
    r = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0, logit_bias={"4321": 100},
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == [4321] * 4
    r = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0, frequency_penalty=2.0,
                                  presence_penalty=1.0, logit_bias={"4321": 100}, extra_body={"return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert ids[0] == 4321 and len(ids) == 8  # accepted and applied (a +100 bias outweighs 8 tokens of penalty)
    seeded = [client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=1.0, seed=7,
                                        extra_body={"return_token_ids": True}).choices[0].model_extra["token_ids"]
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    with pytest.raises(Exception, match="logit_bias"):
        client.completions.create(model="m", prompt=prompt, max_tokens=2, logit_bias={"999999999": 1})


def test_sixteen_concurrent_streams(client, reference):
    prompts = [[200006, 17360, 200008] + [1000 + 37 * i + j for j in range(3 + i)] for i in range(16)]

    def one(p):
        s = client.completions.create(model="m", prompt=p, max_tokens=12, temperature=0, stream=True,
                                      extra_body={"return_token_ids": True})
        return [t for c in s for t in (c.choices[0].model_extra.get("token_ids") or [])]

    with cf.ThreadPoolExecutor(16) as ex:
        got = list(ex.map(one, prompts))
    for p, ids in zip(prompts, got):
        assert ids == reference(p, 12, stop=())


def test_ttft_breakdown_metrics(client, svc):
    import re
    import urllib.request

    client.completions.create(model="m", prompt=[1, 2, 3, 4], max_tokens=2, temperature=0)
    text = urllib.request.urlopen(svc.url + "/metrics", timeout=10).read().decode()
    for part in ("decode_admission", "prefill_queue", "prefill_compute", "kv_transfer_tail", "result_to_router"):
        m = re.search(rf'tandem_ttft_breakdown_seconds_count{{component="{part}"}} (\S+)', text)
        assert m and float(m.group(1)) >= 1, part
    compute = re.search(r'tandem_ttft_breakdown_seconds_sum{component="prefill_compute"} (\S+)', text)
    assert float(compute.group(1)) > 0
    for part in ("admit", "launch", "hooks", "wait", "gpu"):  # prefill_compute's own parts, from the prefill worker
        m = re.search(rf'tandem_prefill_compute_split_seconds_count{{part="{part}"}} (\S+)', text)
        assert m and float(m.group(1)) >= 1, part


def test_pages_all_returned(client, svc):
    client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=4, temperature=0)
    svc.assert_no_leaks()


# ---- a model we control: real tool calls through the whole path --------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, fmt):
    from openai_harmony import Message, Role

    call = Message.from_role_and_content(Role.ASSISTANT, '{"city":"Paris"}').with_channel("commentary") \
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json")
    toks = fmt.encoding.render(call)
    chain = toks[1:]  # 'assistant' (the prompt's last token) -> ' to' -> ... -> <|call|>
    path = write_scripted_checkpoint(tmp_path_factory.mktemp("scripted"), chain)
    s = start_service(str(path))
    yield s, OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    s.stop()


def test_tool_call_round_trip(scripted):
    svc, client = scripted
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=40, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # streamed: the same call, arguments arriving as deltas
    chunks = list(client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=40,
                                                 temperature=0, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # round trip: the call and its result go back into the history
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    r2 = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=40, temperature=0)
    assert r2.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    svc.assert_no_leaks()


def _today() -> str:
    import time
    return time.strftime("%Y-%m-%d")

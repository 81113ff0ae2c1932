"""/v1/completions with echo + logprobs on the served stack (what lm-eval's loglikelihood requests send): the prompt's
token log probabilities equal the single-process engine's, from a prefill worker (disaggregated) and from the decode
worker's own prefill (colocated), streamed and not, with max_tokens 0 (score only), after the prompt was cached."""

import httpx
import pytest
from openai import BadRequestError, OpenAI

from engine.build import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.support.service import start_service

PROMPTS = [[200006, 17360, 200008, 3, 99, 1234, 200007, 45, 46, 47], list(range(1000, 1100))]


@pytest.fixture(scope="module")
def tiny(ckpt_factory):
    return ckpt_factory("tiny")


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def svc(request, tiny):
    s = start_service(tiny, colocated=request.param == "colocated")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(svc):
    return OpenAI(base_url=svc.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(EngineConfig(checkpoint=tiny, kv_cache_bytes=64 << 20))

    def run(prompt, n):
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=n))
        return out[0]

    return run


def check_echo(lp, prompt, ref, n, generated):
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + generated
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
    got = lp.token_logprobs[1:len(prompt)]
    want = [e.logprob for e in ref.prompt_logprobs]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3
    for k, e in enumerate(ref.prompt_logprobs, start=1):
        assert 0 < len(lp.top_logprobs[k]) <= n if n else lp.top_logprobs[k] == {}  # a dict: alike tokens collapse
        if n:
            best = max(lp.top_logprobs[k].values())
            assert abs(best - e.top[0][1]) < 1e-3


def test_echo_logprobs_score_prompts_like_the_engine(client, reference):
    r = client.completions.create(model="m", prompt=PROMPTS, max_tokens=1, temperature=0, echo=True, logprobs=2)
    assert len(r.choices) == 2
    for c, p in zip(r.choices, PROMPTS, strict=True):
        ref = reference(p, 2)
        check_echo(c.logprobs, p, ref, 2, generated=1)
        assert c.logprobs.token_logprobs[-1] <= 0


def test_max_tokens_zero_returns_the_prompt_only(client, reference):
    p = PROMPTS[1]
    r = client.completions.create(model="m", prompt=p, max_tokens=0, echo=True, logprobs=0)
    c = r.choices[0]
    check_echo(c.logprobs, p, reference(p, 0), 0, generated=0)
    assert c.finish_reason == "length" and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(p)
    plain = client.completions.create(model="m", prompt=p, max_tokens=0, echo=True)
    assert plain.choices[0].text == c.text and plain.choices[0].logprobs is None
    with pytest.raises(BadRequestError, match="max_tokens"):
        client.completions.create(model="m", prompt=p, max_tokens=0)


def test_streamed_echo_carries_the_prompt_logprobs(client, reference):
    p = PROMPTS[0]
    chunks = list(client.completions.create(model="m", prompt=p, max_tokens=3, temperature=0, echo=True, logprobs=1,
                                            stream=True))
    first = chunks[0].choices[0]
    check_echo(first.logprobs, p, reference(p, 1), 1, generated=0)
    rest = [c.choices[0] for c in chunks[1:] if c.choices and c.choices[0].logprobs]
    assert sum(len(c.logprobs.tokens) for c in rest) == 3
    tokens = first.logprobs.tokens + [t for c in rest for t in c.logprobs.tokens]  # offsets run on across events
    assert [o for c in [first] + rest for o in c.logprobs.text_offset] == [sum(map(len, tokens[:k]))
                                                                         for k in range(len(tokens))]


def test_a_cached_prompt_is_scored_whole(client, svc, reference):
    """A prompt the workers hold in their prefix caches is recomputed for its logprobs (and still scored right)."""
    p = list(range(2000, 2200))
    client.completions.create(model="m", prompt=p, max_tokens=2, temperature=0)
    plain = client.completions.create(model="m", prompt=p + [7], max_tokens=2, temperature=0)
    assert plain.usage.prompt_tokens_details.cached_tokens >= 160
    r = client.completions.create(model="m", prompt=p + [7], max_tokens=1, temperature=0, echo=True, logprobs=1)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    check_echo(r.choices[0].logprobs, p + [7], reference(p + [7], 1), 1, generated=1)
    svc.assert_no_leaks()


def test_logprobs_out_of_range_is_a_400(svc):
    r = httpx.post(svc.url + "/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "echo": True,
                                                      "logprobs": 21, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400

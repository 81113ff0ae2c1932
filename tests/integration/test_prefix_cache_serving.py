"""Prefix caching through the served stack (router + prefill + decode processes, KV over NIXL): a
conversation's second turn reports its cached prefix in usage, is prefilled on the decode worker
that holds it, produces the single-process engine's greedy tokens, and every page comes back."""

import json
import re

import httpx
import pytest
import torch

from engine.build import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.support.service import start_service


@pytest.fixture(scope="module")
def tiny(ckpt_factory):
    return ckpt_factory("tiny")


@pytest.fixture(scope="module")
def svc(tiny):
    s = start_service(tiny)
    yield s
    s.stop()


def complete(client, prompt, n, stream=False):
    body = {"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    if not stream:
        r = client.post("/v1/completions", json=body)
        r.raise_for_status()
        doc = r.json()
        return doc["choices"][0]["token_ids"], doc["usage"]
    ids, usage = [], None
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices") or []:
                    ids += c.get("token_ids") or []
    return ids, usage


def test_prefix_second_turn_is_cached_local_and_exact(svc, tiny):
    g = torch.Generator().manual_seed(13)
    p1 = torch.randint(1000, 100000, (300,), generator=g).tolist()
    with httpx.Client(base_url=svc.url, timeout=120) as client:
        out1, u1 = complete(client, p1, 8)
        assert u1["prompt_tokens_details"]["cached_tokens"] == 0
        assert u1["tandem"]["prefill"] == "remote" and u1["tandem"]["kv_bytes_shipped"] > 0
        p2 = p1 + out1 + torch.randint(1000, 100000, (30,), generator=g).tolist()
        out2, u2 = complete(client, p2, 8, stream=True)
        # decode holds turn 1's prompt and answer but the last token (no KV), block-aligned: 304 of 307
        assert u2["prompt_tokens_details"]["cached_tokens"] == 304
        assert u2["tandem"] == {"computed_tokens": len(p2) - 304, "decode_cached_tokens": 0, "kv_bytes_shipped": 0,
                                "prefill": "local"}
        metrics = client.get("/metrics").text
    cached = re.search(r'^tandem_prefix_cached_tokens_total\{role="decode"\} (\S+)', metrics, re.M)
    assert cached and float(cached.group(1)) >= 304
    ref = LLM(EngineConfig(checkpoint=tiny, enable_prefix_caching=False))
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert [o.output_ids for o in ref.generate([p1, p2], sp)] == [out1, out2]
    svc.assert_no_leaks()


def test_prefix_branch_new_conversations_share_the_system_prompt(svc, tiny):
    """Three new conversations with one system prompt (engine/prefix_branch.py): the second keeps its KV on the
    prefill worker, the third's first turn reports it cached; tokens equal the uncached engine's."""
    g = torch.Generator().manual_seed(14)
    system = torch.randint(1000, 100000, (300,), generator=g).tolist()  # 18 complete blocks + 12 tokens
    prompts = [system + torch.randint(1000, 100000, (40,), generator=g).tolist() for _ in range(3)]
    with httpx.Client(base_url=svc.url, timeout=120) as client:
        got = [complete(client, p, 8) for p in prompts]
    assert [u["prompt_tokens_details"]["cached_tokens"] for _, u in got] == [0, 0, 288]
    assert got[2][1]["tandem"]["prefill"] == "remote" and got[2][1]["tandem"]["computed_tokens"] == 340 - 288
    ref = LLM(EngineConfig(checkpoint=tiny, enable_prefix_caching=False))
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert [o.output_ids for o in ref.generate(prompts, sp)] == [out for out, _ in got]
    svc.assert_no_leaks()

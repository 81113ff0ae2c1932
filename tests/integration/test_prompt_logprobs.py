"""Prompt log probabilities (SamplingParams.prompt_logprobs, engine/prompt_logprobs.py): the engine's entries
equal log_softmax of one full forward over the prompt, whatever the chunking, batching, preemption or prefix
cache; a sequence asking for them computes its whole prompt (a cached token has no logits)."""

import pytest
import torch

from engine.sampling import SamplingParams
from engine.scheduler import SchedulerConfig
from model.context import SeqStep, build_step_meta
from tests.integration.test_engine import prompts_for


def reference(llm, prompt):
    """[P - 1, V] log-softmax at positions 0..P-2: one forward over the whole prompt, no cache."""
    m = llm.engine.model
    meta = build_step_meta([SeqStep(None, 0, len(prompt))], None)
    return torch.log_softmax(m.compute_logits(m(torch.tensor(prompt), meta, None)), -1)[:-1]


def check(entries, prompt, ref, n):
    assert [e.token_id for e in entries] == prompt[1:]
    got = torch.tensor([e.logprob for e in entries])
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for k, e in enumerate(entries):
        top = ref[k].topk(n)
        assert [t for t, _ in e.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in e.top]), top.values, atol=1e-4, rtol=0)


def test_prompt_logprobs_match_one_forward_chunked_and_batched(ckpt_factory, make_llm):
    path = ckpt_factory("tiny-a")
    prompts = prompts_for(512, [1, 2, 6, 40, 23])
    # 7-token chunks: prompts cross several steps, sharing them with each other's prefill and decode rows
    llm = make_llm(path, kv_cache_bytes=1 << 20,
                   scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=7, max_model_len=512))
    asks = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=n) for n in (2, 0, 3, 5, 1)]
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts + prompts[3:4], asks + [plain])
    for p, o, sp in zip(prompts, outs, asks, strict=False):
        check(o.prompt_logprobs, p, reference(llm, p), sp.prompt_logprobs)
    assert outs[-1].prompt_logprobs == [] and outs[-1].output_ids == outs[3].output_ids  # same tokens either way


def test_prompt_logprobs_skip_the_prefix_cache(ckpt_factory, make_llm):
    path = ckpt_factory("tiny")  # window 128, page 16: a 200-token prompt caches 12 blocks
    llm = make_llm(path, kv_cache_bytes=64 << 20)
    prompt = prompts_for(201088, [200])[0]
    plain = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([prompt], plain)
    rid = llm.engine.add_request(prompt + [5], plain)
    seq = llm.engine.seqs[rid]
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert seq.num_cached_prefix >= 160  # a plain request hits the cached prompt...
    rid = llm.engine.add_request(prompt + [5], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                              prompt_logprobs=1))
    seq = llm.engine.seqs[rid]
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert seq.num_cached_prefix == 0  # ...one asking for prompt logprobs computes all of it
    check(seq.prompt_logprobs, prompt + [5], reference(llm, prompt + [5]), 1)


def test_prompt_logprobs_once_under_preemption(ckpt_factory, make_llm):
    """Recomputed prompts (preemption frees the pages, the prompt runs again) keep one entry per token."""
    from model.config import preset
    from model.kv_cache import PageGroup, plan_kv_cache

    path = ckpt_factory("tiny-a")
    prompts = prompts_for(512, [6, 11, 7, 13, 5, 9])
    spec = plan_kv_cache(preset("tiny-a"), 1 << 20, page_size=16, max_num_seqs=6, dtype=torch.float32)
    budget = 12 * spec.page_bytes(PageGroup.FULL) + spec.num_pages[1] * spec.page_bytes(PageGroup.SLIDING)
    llm = make_llm(path, kv_cache_bytes=budget,
                   scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=256))
    outs = llm.generate(prompts, SamplingParams(max_tokens=28, temperature=0, ignore_eos=True, prompt_logprobs=2))
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs, strict=True):
        check(o.prompt_logprobs, p, reference(llm, p), 2)


def test_prompt_logprobs_bounds():
    from common.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="logprobs"):
        SamplingParams(prompt_logprobs=21)

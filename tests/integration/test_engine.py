"""The paged, batched engine against HF generate; preemption, chunked prefill, page accounting."""

import pytest
import torch

from engine.sampling import SamplingParams
from engine.scheduler import SchedulerConfig


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=hf.config.pad_token_id)
    return out[0, len(prompt):].tolist()


def prompts_for(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_batch_of_mixed_lengths_matches_hf(ckpt_factory, hf_factory, make_llm):
    path = ckpt_factory("tiny-a")  # window 4: prompts shorter and longer than the window
    hf = hf_factory(path)
    prompts = prompts_for(512, [1, 3, 4, 5, 9, 17, 33, 2])
    llm = make_llm(path, kv_cache_bytes=1 << 20)
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.output_ids == hf_greedy(hf, p, 24), p


def test_real_window_128_ring_bound_and_hf_parity(ckpt_factory, hf_factory, make_llm):
    """The embedded preset (window 128, page 16): prompts around and past the window; the sliding
    ring of every sequence stays within ceil(128/16)+1 = 9 pages at every step."""
    path = ckpt_factory("tiny")
    hf = hf_factory(path)
    prompts = prompts_for(201088, [100, 127, 128, 129, 300])
    llm = make_llm(path, kv_cache_bytes=64 << 20,
                   scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=160, max_model_len=4096))
    eng = llm.engine
    rids = [eng.add_request(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) for p in prompts]
    seqs = [eng.seqs[r] for r in rids]
    ring = eng.kv.spec.ring_pages
    assert ring == 9
    while eng.has_unfinished():
        eng.step()
        for s in seqs:
            assert len(s.pages.ring) <= ring
            assert len(s.pages.full) == -(-s.num_cached // 16) or s.finished or s.num_cached < s.num_tokens
    for p, s in zip(prompts, seqs, strict=True):
        assert s.output_ids == hf_greedy(hf, p, 40)


def test_preemption_by_recompute_keeps_outputs_exact(ckpt_factory, hf_factory, make_llm):
    path = ckpt_factory("tiny-a")
    hf = hf_factory(path)
    prompts = prompts_for(512, [6, 11, 7, 13, 5, 9])
    # ~34 full pages of 16 tokens for 6 sequences that grow to ~37 tokens each: they cannot all fit.
    from model.kv_cache import PageGroup, plan_kv_cache
    from model.config import preset

    spec = plan_kv_cache(preset("tiny-a"), 1 << 20, page_size=16, max_num_seqs=6, dtype=torch.float32)
    budget = 12 * spec.page_bytes(PageGroup.FULL) + spec.num_pages[1] * spec.page_bytes(PageGroup.SLIDING)
    llm = make_llm(path, kv_cache_bytes=budget,
                   scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=256))
    outs = llm.generate(prompts, SamplingParams(max_tokens=28, temperature=0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs, strict=True):
        assert o.output_ids == hf_greedy(hf, p, 28)


def test_chunked_prefill_matches_unchunked(ckpt_factory, make_llm):
    path = ckpt_factory("tiny-b")
    prompts = prompts_for(384, [40, 3, 25])
    a = make_llm(path, kv_cache_bytes=1 << 20).generate(prompts, GREEDY)
    b = make_llm(path, kv_cache_bytes=1 << 20, scheduler=SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=7, max_model_len=512)).generate(prompts, GREEDY)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]


def test_stop_tokens_max_tokens_and_min_tokens(ckpt_factory, make_llm):
    path = ckpt_factory("tiny-a")
    llm = make_llm(path, kv_cache_bytes=1 << 20)
    prompt = prompts_for(512, [8])[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop_at = free.output_ids[4]
    first = free.output_ids.index(stop_at)
    o = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,)))[0]
    assert o.output_ids == free.output_ids[:first + 1] and o.finish_reason.value == "stop"
    o = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,),
                                              min_tokens=first + 2))[0]
    assert len(o.output_ids) > first + 1
    o = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(o.output_ids) == 5 and o.finish_reason.value == "length"


def test_refuses_what_cannot_fit(ckpt_factory, make_llm):
    from common.errors import InvalidRequest

    llm = make_llm(ckpt_factory("tiny-a"), kv_cache_bytes=1 << 20)
    with pytest.raises(InvalidRequest, match="maximum context length"):
        llm.engine.add_request([1] * 4000, SamplingParams(max_tokens=200))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        llm.engine.add_request([1, 9999], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match="empty"):
        llm.engine.add_request([], SamplingParams(max_tokens=2))


def test_seeded_sampling_is_reproducible_and_batch_independent(ckpt_factory, make_llm):
    path = ckpt_factory("tiny-a")
    prompts = prompts_for(512, [5, 7, 9])
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    alone = make_llm(path, kv_cache_bytes=1 << 20).generate([prompts[1]], sp)[0].output_ids
    batched = make_llm(path, kv_cache_bytes=1 << 20, seed=99).generate(prompts, sp)[1].output_ids
    assert alone == batched
    other = make_llm(path, kv_cache_bytes=1 << 20).generate([prompts[1]], SamplingParams(
        max_tokens=10, temperature=1.0, top_p=0.9, seed=4321))[0].output_ids
    assert other != alone


def test_logprobs_are_log_softmax_of_the_model(ckpt_factory, make_llm):
    path = ckpt_factory("tiny-a")
    llm = make_llm(path, kv_cache_bytes=1 << 20)
    prompt = prompts_for(512, [6])[0]
    o = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=5))[0]
    assert len(o.logprobs) == 3
    from model.context import SeqStep, build_step_meta

    m = llm.engine.model
    ids = prompt + o.output_ids[:2]
    meta = build_step_meta([SeqStep(None, 0, len(ids))], None)
    lp = torch.log_softmax(m.compute_logits(m(torch.tensor(ids), meta, None)), -1)[len(prompt) - 1:]
    for k, tl in enumerate(o.logprobs):
        assert tl.token_id == o.output_ids[k] and abs(tl.logprob - lp[k, tl.token_id].item()) < 1e-4
        top = lp[k].topk(5)
        assert [t for t, _ in tl.top] == top.indices.tolist()
        assert tl.top[0][0] == tl.token_id  # greedy picks the top-1

"""The overlapped step loop (engine.core) against the synchronous one: the same greedy tokens with
mixed lengths, stop tokens hit mid-batch, forced preemption and aborts while a step is in flight;
every page returned; seeded sampling reproducible across runs and batch compositions."""

import pytest
import torch

from engine.build import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.scheduler import SchedulerConfig
from model.kv_cache import PageGroup, plan_kv_cache

SCHED = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=4096)


def prompts_for(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def llm_pair(path, **kw):
    """(overlapped, synchronous) engines on the same checkpoint and settings."""
    sched = kw.pop("scheduler", SCHED)
    return (LLM(EngineConfig(checkpoint=path, scheduler=sched, async_decode=True, **kw)),
            LLM(EngineConfig(checkpoint=path, scheduler=sched, async_decode=False, **kw)))


def run_all(llm, prompts, params):
    out = llm.generate(prompts, params)
    llm.kv.assert_all_free()
    return [(o.output_ids, o.finish_reason.value) for o in out]


def record_calls(runner) -> list[tuple[str, int]]:
    """The runner's launch and collect calls from now on, in order, as (name, step no)."""
    calls = []
    launch, collect = runner.launch, runner.collect
    runner.launch = lambda items, prev=None, no=0, **kw: (calls.append(("launch", no)), launch(items, prev, no, **kw))[1]
    runner.collect = lambda h: (calls.append(("collect", h.no)), collect(h))[1]
    return calls


def test_async_decode_overlaps_launch_and_collect(ckpt_factory):
    """Step N+1 is launched before step N's tokens are read: the order of runner calls proves it."""
    fast, _ = llm_pair(ckpt_factory("tiny-a"), kv_cache_bytes=1 << 20)
    eng = fast.engine
    calls = record_calls(eng.runner)
    eng.add_request(prompts_for(512, [5])[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    # prefill (1), then decode steps 2-4 each launched while the previous one is in flight; the
    # 4th token's length stop is known at launch, so there is no surplus step 5
    assert calls == [("launch", 1), ("launch", 2), ("collect", 1), ("launch", 3), ("collect", 2),
                     ("launch", 4), ("collect", 3), ("collect", 4)]
    fast.kv.assert_all_free()


def test_async_decode_collects_a_finished_step_before_the_next_launch(ckpt_factory):
    """engine.core: a step the GPU already finished (runner.ready) is collected before the next step
    is planned, so its tokens leave one launch earlier; one still running keeps the overlap."""
    fast, _ = llm_pair(ckpt_factory("tiny-a"), kv_cache_bytes=1 << 20)
    eng = fast.engine
    calls = record_calls(eng.runner)
    eng.runner.ready = lambda h: h.no == 2  # step 2 reads as done when step 3 is planned; the others as running
    eng.add_request(prompts_for(512, [5])[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert calls == [("launch", 1), ("launch", 2), ("collect", 1), ("collect", 2), ("launch", 3),
                     ("launch", 4), ("collect", 3), ("collect", 4)]
    fast.kv.assert_all_free()


def test_async_decode_waits_a_bounded_time_for_steps_with_first_tokens(ckpt_factory):
    """engine.core first_token_wait_s: a running step that sampled a prompt's first token is waited for
    (runner.wait_ready, bounded) before the next launch; running decode-only steps are not."""
    fast, _ = llm_pair(ckpt_factory("tiny-a"), kv_cache_bytes=1 << 20)
    eng = fast.engine
    eng.core.first_token_wait_s = 0.003
    calls = record_calls(eng.runner)
    waited = []
    eng.runner.ready = lambda h: False  # everything reads as still running
    eng.runner.wait_ready = lambda h, timeout_s: (waited.append((h.no, timeout_s)), True)[1]
    eng.add_request(prompts_for(512, [5])[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    # step 1 prefills (samples the first token): waited for and collected before step 2's launch;
    # decode steps 2-4 keep the overlap
    assert waited == [(1, 0.003)]
    assert calls == [("launch", 1), ("collect", 1), ("launch", 2), ("launch", 3), ("collect", 2),
                     ("launch", 4), ("collect", 3), ("collect", 4)]
    fast.kv.assert_all_free()
    eng.core.first_token_wait_s = 0.0  # off: no wait at all
    waited.clear()
    eng.add_request(prompts_for(512, [6])[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert waited == []


@pytest.mark.parametrize("pattern", ["every", "odd"])
def test_async_decode_collect_first_greedy_equals_sync_with_stops_and_preemption(ckpt_factory, pattern):
    """Steps collected before the next launch (every one, or every other) give the synchronous
    loop's tokens: stop tokens mid-batch (no surplus token to drop) and preemption under page pressure."""
    path = ckpt_factory("tiny-a")
    from model.config import preset

    spec = plan_kv_cache(preset("tiny-a"), 1 << 20, page_size=16, max_num_seqs=6, dtype=torch.float32)
    budget = 12 * spec.page_bytes(PageGroup.FULL) + spec.num_pages[1] * spec.page_bytes(PageGroup.SLIDING)
    sched = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=256)
    fast, slow = llm_pair(path, kv_cache_bytes=budget, scheduler=sched)
    fast.engine.runner.ready = (lambda h: True) if pattern == "every" else (lambda h: h.no % 2 == 1)
    prompts = prompts_for(512, [6, 11, 7, 13, 5, 9])
    free = run_all(slow, prompts, SamplingParams(max_tokens=28, temperature=0, ignore_eos=True))
    stops = tuple(sorted({ids[k] for k, (ids, _) in zip([3, 9, 17, 5, 21, 12], free)}))
    params = SamplingParams(max_tokens=28, temperature=0, stop_token_ids=stops)
    a, b = run_all(fast, prompts, params), run_all(slow, prompts, params)
    assert a == b and any(r == "stop" for _, r in a)
    long = SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)  # every sequence runs: pages run out
    assert run_all(fast, prompts, long) == free
    assert fast.engine.scheduler.num_preemptions > 0


def test_async_decode_greedy_equals_sync_mixed_lengths_and_stops(ckpt_factory):
    path = ckpt_factory("tiny-a")
    fast, slow = llm_pair(path, kv_cache_bytes=1 << 20)
    prompts = prompts_for(512, [1, 3, 4, 5, 9, 17, 33, 2])
    free = run_all(slow, prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    # stop tokens taken from the free runs, so sequences stop at different steps mid-batch
    stops = tuple(sorted({ids[k] for k, (ids, _) in zip([2, 5, 9, 14, 1, 7, 11, 3], free)}))
    params = [SamplingParams(max_tokens=6 + i, temperature=0, stop_token_ids=stops) for i in range(len(prompts))]
    a, b = run_all(fast, prompts, params), run_all(slow, prompts, params)
    assert a == b
    assert any(r == "stop" for _, r in a) and any(r == "length" for _, r in a)
    assert fast.engine.core.num_steps >= 1


def test_async_decode_preemption_keeps_outputs(ckpt_factory):
    path = ckpt_factory("tiny-a")
    prompts = prompts_for(512, [6, 11, 7, 13, 5, 9])
    from model.config import preset

    spec = plan_kv_cache(preset("tiny-a"), 1 << 20, page_size=16, max_num_seqs=6, dtype=torch.float32)
    budget = 12 * spec.page_bytes(PageGroup.FULL) + spec.num_pages[1] * spec.page_bytes(PageGroup.SLIDING)
    sched = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=256)
    fast, slow = llm_pair(path, kv_cache_bytes=budget, scheduler=sched)
    params = SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)
    a, b = run_all(fast, prompts, params), run_all(slow, prompts, params)
    assert fast.engine.scheduler.num_preemptions > 0
    assert a == b


def test_async_decode_abort_in_flight_returns_pages(ckpt_factory):
    path = ckpt_factory("tiny-a")
    prompts = prompts_for(512, [4, 9, 6, 12])
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = run_all(llm_pair(path, kv_cache_bytes=1 << 20)[1], prompts, params)
    fast = llm_pair(path, kv_cache_bytes=1 << 20)[0]
    eng = fast.engine
    rids = [eng.add_request(p, params) for p in prompts]
    seqs = {r: eng.seqs[r] for r in rids}
    for _ in range(4):
        eng.step()
    assert eng.core.inflight is not None  # a step that writes the victims' pages is in flight
    in_flight = {id(it.seq) for it in eng.core.inflight.items}
    victims = [r for r in rids[1:3] if id(seqs[r]) in in_flight]
    assert victims
    free_before = eng.kv.num_free()
    for r in victims:
        eng.abort(r)
    assert eng.kv.num_free() == free_before  # fenced: the step in flight may still write them
    eng.step()  # collects that step: the fenced pages come back
    assert eng.kv.num_free()[PageGroup.FULL] > free_before[PageGroup.FULL]
    while eng.has_unfinished():
        eng.step()
    fast.kv.assert_all_free()
    for r, (ids, reason) in zip(rids, ref):
        if r in victims:
            assert seqs[r].finish_reason.value == "abort" and seqs[r].output_ids == ids[:len(seqs[r].output_ids)]
        else:
            assert (seqs[r].output_ids, seqs[r].finish_reason.value) == (ids, reason)


def test_async_decode_seeded_sampling_reproducible_across_runs_and_batches(ckpt_factory):
    path = ckpt_factory("tiny-a")
    prompts = prompts_for(512, [5, 7, 9, 3])
    sp = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=100 + i) for i in range(4)]
    batch1 = run_all(LLM(EngineConfig(checkpoint=path, scheduler=SCHED, kv_cache_bytes=1 << 20)), prompts, sp)
    batch2 = run_all(LLM(EngineConfig(checkpoint=path, scheduler=SCHED, kv_cache_bytes=1 << 20, seed=7)), prompts, sp)
    assert batch1 == batch2
    for i in (1, 3):  # alone, and in another batch composition, with the synchronous loop too
        alone = run_all(LLM(EngineConfig(checkpoint=path, scheduler=SCHED, kv_cache_bytes=1 << 20,
                                         async_decode=False)), [prompts[i]], sp[i])
        assert alone[0] == batch1[i]
    mixed = run_all(LLM(EngineConfig(checkpoint=path, scheduler=SCHED, kv_cache_bytes=1 << 20)),
                    [prompts[3], prompts[0]], [sp[3], sp[0]])
    assert mixed == [batch1[3], batch1[0]]
    assert len({tuple(ids) for ids, _ in batch1}) == 4


@pytest.mark.parametrize("overlap", [True, False])
def test_async_decode_penalties_and_bias_run_in_both_loops(ckpt_factory, overlap):
    path = ckpt_factory("tiny-a")
    llm = LLM(EngineConfig(checkpoint=path, scheduler=SCHED, kv_cache_bytes=1 << 20, async_decode=overlap))
    prompt = prompts_for(512, [6])[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].output_ids
    pen = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                frequency_penalty=2.0, presence_penalty=2.0))[0].output_ids
    assert len(set(pen)) >= len(set(plain))  # repeated tokens are discouraged
    biased = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                   logit_bias=((77, 100.0),)))[0].output_ids
    assert biased == [77] * 5
    llm.kv.assert_all_free()

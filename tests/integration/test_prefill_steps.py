"""prefill_steps="separate" (engine/scheduler.py): prompt work runs in steps of its own, never two in a row while
sequences decode, with the mixed order's greedy tokens (staggered arrivals, prefix hits, stops, preemption) and
every page returned."""

import pytest
import torch

from engine.build import EngineConfig
from engine.llm import LLMEngine
from engine.sampling import SamplingParams
from engine.scheduler import SchedulerConfig, _decoding


def prompts_for(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def engine(path, mode: str, overlap: bool, **kw) -> LLMEngine:
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=kw.pop("budget", 48), max_model_len=1024,
                            prefill_steps=mode)
    return LLMEngine(EngineConfig(checkpoint=path, scheduler=sched, async_decode=overlap,
                                  kv_cache_bytes=kw.pop("kv_cache_bytes", 1 << 20), **kw))


def run_staggered(eng: LLMEngine, prompts, params, arrive_at):
    """Requests added at given step numbers (so prompts arrive while others decode). Returns the outputs by
    request and each scheduled step as (rows of sequences that were decoding, other rows: prompt chunks,
    admissions, recomputes)."""
    shapes, outs, added, k = [], {}, 0, 0
    schedule = eng.scheduler.schedule

    def spy(*a, **kw):
        decoding = {id(s) for s in eng.scheduler.running if _decoding(s)}
        items = schedule(*a, **kw)
        if items:
            d = sum(id(it.seq) in decoding for it in items)
            shapes.append((d, len(items) - d))
        return items

    eng.scheduler.schedule = spy
    rids = []
    while added < len(prompts) or eng.has_unfinished():
        while added < len(prompts) and arrive_at[added] <= k:
            rids.append(eng.add_request(prompts[added], params[added]))
            added += 1
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        k += 1
    eng.kv.assert_all_free()
    return [outs[r] for r in rids], shapes


@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_separate_prefill_steps_same_tokens_as_mixed(ckpt_factory, overlap):
    path = ckpt_factory("tiny")  # window 128: a finished request's blocks stay usable for a hit (tiny-a's is 4)
    shared = prompts_for(201088, [40])[0]  # a shared head: later prompts hit the prefix cache
    prompts = [shared + p for p in prompts_for(201088, [7, 30, 3, 90, 12, 5], seed=1)]
    params = [SamplingParams(max_tokens=12 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    arrive = [0, 0, 3, 5, 40, 44]  # the last two after the first finished: prefix hits
    mixed, mixed_shapes = run_staggered(engine(path, "mixed", overlap, kv_cache_bytes=16 << 20), prompts, params, arrive)
    sep_eng = engine(path, "separate", overlap, kv_cache_bytes=16 << 20)
    sep, shapes = run_staggered(sep_eng, prompts, params, arrive)
    assert sep == mixed
    assert any(d and c for d, c in mixed_shapes)  # the mixed order did mix: the comparison means something
    # prompt work never shares a step with decode rows, and a prompt-only step is followed by a decode-only one
    # while sequences decode: two prompt-only steps in a row only where nothing was decoding
    assert not any(d and c for d, c in shapes), shapes
    assert any(d == 0 and c > 0 for d, c in shapes[2:]) and any(d > 0 and c == 0 for d, c in shapes)
    assert sep_eng.scheduler.prompt_only_steps >= 3
    assert sep_eng.kv.cache is not None and sep_eng.kv.cache.stats.hit_tokens > 0


def test_separate_prefill_steps_with_chunked_prompts_and_preemption(ckpt_factory):
    """Prompts longer than the step budget (chunks across steps) and page pressure (preemption and
    re-admission): the mixed order's tokens, every page back."""
    path = ckpt_factory("tiny-a")
    from model.config import preset
    from model.kv_cache import PageGroup, plan_kv_cache

    spec = plan_kv_cache(preset("tiny-a"), 1 << 20, page_size=16, max_num_seqs=8, dtype=torch.float32)
    budget = 14 * spec.page_bytes(PageGroup.FULL) + spec.num_pages[1] * spec.page_bytes(PageGroup.SLIDING)
    prompts = prompts_for(512, [70, 9, 55, 13, 6, 33], seed=2)
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * len(prompts)
    arrive = [0, 1, 2, 4, 4, 9]
    mixed, _ = run_staggered(engine(path, "mixed", True, kv_cache_bytes=budget, budget=32), prompts, params, arrive)
    eng = engine(path, "separate", True, kv_cache_bytes=budget, budget=32)
    sep, shapes = run_staggered(eng, prompts, params, arrive)
    assert sep == mixed
    assert eng.scheduler.num_preemptions > 0
    assert not any(d and c for d, c in shapes)

"""Prefix caching in the engine (CPU, fp32): greedy outputs with the cache equal outputs without it,
multi-turn conversations hit the previous turn, no page leaks over thousands of turns, eviction
under memory pressure, and the overlapped loop's page fence."""

import pytest
import torch

from engine.build import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.scheduler import SchedulerConfig
from model.kv_cache import PageGroup

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def rand_ids(n, vocab, g):
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def make(path, cache=True, **kw):
    sched = kw.pop("scheduler", SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=96, max_model_len=4096))
    return LLM(EngineConfig(checkpoint=path, scheduler=sched, enable_prefix_caching=cache, **kw))


def conversation(llm, system, turns, g, vocab, params=GREEDY, user_len=(20, 45)):
    """Turn k+1's prompt = turn k's prompt + its answer + new user tokens. Returns the outputs and
    the cached-prefix tokens each turn got."""
    prompt, outs, hits = list(system), [], []
    for _ in range(turns):
        prompt = prompt + rand_ids(int(torch.randint(*user_len, (1,), generator=g)), vocab, g)
        rid = llm.engine.add_request(prompt, params)
        seq = llm.engine.seqs[rid]
        while llm.engine.has_unfinished():
            llm.engine.step()
        outs.append(list(seq.output_ids))
        hits.append(seq.num_cached_prefix)
        prompt = prompt + seq.output_ids
    return outs, hits


@pytest.mark.parametrize("preset,vocab,page", [("tiny", 201088, 16), ("tiny-a", 512, 16), ("tiny", 201088, 8),
                                               ("tiny", 201088, 32)])
def test_prefix_multi_turn_greedy_equals_uncached(ckpt_factory, preset, vocab, page):
    """tiny: window 128 (a hit needs 8 sliding blocks of 16 tokens; 16 of 8, 4 of 32: --page-size); tiny-a: window 4.
    Small chunks force hits followed by chunked prefill over the ring."""
    path = ckpt_factory(preset)
    res = {}
    for cache in (True, False):
        llm = make(path, cache, kv_cache_bytes=16 << 20, page_size=page)
        g = torch.Generator().manual_seed(7)
        system = rand_ids(150, vocab, g)
        res[cache] = conversation(llm, system, 4, g, vocab)
        llm.kv.assert_all_free()
    (outs_c, hits_c), (outs_n, hits_n) = res[True], res[False]
    assert outs_c == outs_n
    assert hits_n == [0, 0, 0, 0]
    assert hits_c[0] == 0 and all(h > 0 for h in hits_c[1:]), hits_c
    # turn k+1 hits (almost) everything turn k computed: its prompt and all but the last answer token
    assert all(h >= 150 for h in hits_c[1:])


def test_prefix_shared_system_prompt_concurrent_batch(ckpt_factory):
    """Many sequences with one system prompt in one batch, then again: the second round hits the
    first round's blocks and produces the same tokens."""
    path = ckpt_factory("tiny")
    g = torch.Generator().manual_seed(3)
    system = rand_ids(200, 201088, g)
    prompts = [system + rand_ids(10 + i, 201088, g) for i in range(6)]
    ref = make(path, False, kv_cache_bytes=16 << 20).generate(prompts, GREEDY)
    llm = make(path, True, kv_cache_bytes=16 << 20)
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)
    assert [o.output_ids for o in first] == [o.output_ids for o in ref] == [o.output_ids for o in again]
    st = llm.kv.cache.stats
    assert st.hit_tokens >= 6 * 192  # the second round: every prompt's complete blocks
    llm.kv.assert_all_free()


class TokenRunner:
    """A runner without a model: the engine core, scheduler, KV manager and prefix cache run for
    real; each sampled token is a function of the sequence's tokens so far (so a wrong page
    mapping cannot be noticed here: the KV contents are checked by the model tests above)."""

    supports_overlap = True

    def launch(self, items, prev, no):
        from engine.runner import StepHandle

        rows = [i for i, it in enumerate(items) if it.sample]
        toks = [(items[i].start + items[i].q_len) * 7919 % 500 for i in rows]
        return StepHandle(no, items, rows, {}, None, toks, None)

    def collect(self, h):
        out = [None] * len(h.items)
        for j, i in enumerate(h.rows):
            out[i] = h.host[j]
        return out, [None] * len(h.items)


def core_with_cache(full_pages, sliding_pages, overlap):
    from engine.core import EngineCore
    from engine.scheduler import Scheduler
    from model.config import preset
    from model.kv_cache import KVManager, plan_kv_cache
    import dataclasses

    spec = plan_kv_cache(preset("tiny"), 1 << 30, page_size=16, max_num_seqs=8, dtype=torch.float32)
    spec = dataclasses.replace(spec, num_pages=(full_pages, sliding_pages))
    kv = KVManager(spec, "test-identity")
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048), kv, ())
    return EngineCore(sched, TokenRunner(), overlap), kv


@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_no_leaks_over_thousands_of_turns_and_eviction(overlap):
    """3000 short turns (12 conversations x 250 rounds) through a small cache (the window-128
    layout): the LRU evicts, nothing leaks after any round, hits keep coming, and the cache
    empties fully."""
    from engine.sequence import Sequence

    core, kv = core_with_cache(160, 8 * 9 + 100, overlap)
    g = torch.Generator().manual_seed(11)
    convs = [rand_ids(40, 500, g) for _ in range(12)]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    hits = turns = 0
    for _ in range(250):
        seqs = []
        for c in range(len(convs)):
            if len(convs[c]) > 200:
                convs[c] = convs[c][:40]  # a new conversation with the same opening
            convs[c] = convs[c] + rand_ids(5, 500, g)
            seq = Sequence(f"c{c}-{len(convs[c])}", list(convs[c]), params)
            core.scheduler.add(seq)
            seqs.append((c, seq))
        while core.has_work:
            core.step()
        for c, s in seqs:
            assert s.finished and len(s.output_ids) == 3
            convs[c] = convs[c] + s.output_ids
            hits += s.num_cached_prefix > 0
            turns += 1
        kv.assert_all_free()
    assert turns == 3000
    evicted = kv.cache.num_evicted()
    assert evicted[0] > 160 and evicted[1] > 0, evicted  # memory pressure: the LRU cycled
    assert hits > 2000, hits
    kv.clear_cache()
    for a in kv.alloc:
        a.assert_all_free()


def test_prefix_referenced_pages_are_never_evicted(ckpt_factory):
    from model.prefix_cache import Hit

    llm = make(ckpt_factory("tiny-a"), True, kv_cache_bytes=1 << 20)
    kv = llm.engine.kv
    g = torch.Generator().manual_seed(5)
    prompt = rand_ids(70, 512, g)
    out = llm.generate([prompt], GREEDY)[0].output_ids  # 82 tokens, KV for 81
    sched = llm.engine.scheduler
    from engine.sequence import Sequence

    # The window-4 ring kept blocks 4 and 5 only: a hit at 64 would need block 3's sliding KV.
    assert sched.lookup(Sequence("y", prompt[:64] + [1, 2], GREEDY)).num_tokens == 0
    seq = Sequence("x", prompt + out + [1, 2], GREEDY)
    hit = sched.lookup(seq)
    assert isinstance(hit, Hit) and hit.num_tokens == 80 and list(hit.sliding) == [4]
    sched.admit_pages(seq, hit, 84)
    # every cached page this sequence maps is referenced: eviction cannot take them
    kv.clear_cache()
    assert all(p in kv.cache.full.hash_of for p in hit.full)
    with pytest.raises(AssertionError, match="still reference"):
        kv.alloc[0].free_unreferenced(hit.full[0])
    kv.release(seq.pages)
    kv.clear_cache()
    kv.alloc[0].assert_all_free()


def test_prefix_fence_cached_pages_released_in_flight_are_not_reused(ckpt_factory):
    """A sequence that finishes while a step is in flight registers its blocks at once (the next
    turn must find them; readers are later steps), but until that step completed its pages are
    neither free nor evictable."""
    llm = make(ckpt_factory("tiny-a"), True, kv_cache_bytes=1 << 20)
    eng = llm.engine
    g = torch.Generator().manual_seed(9)
    rid = eng.add_request(rand_ids(40, 512, g), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    seq = eng.seqs[rid]
    for _ in range(4):
        eng.step()
    assert eng.core.inflight is not None
    pages = list(seq.pages.full)
    before = eng.kv.num_free()
    eng.abort(rid)
    assert eng.kv.num_free() == before  # fenced: not free, not evictable
    cached = pages[:seq.num_cached // 16]
    assert cached and all(p in eng.kv.cache.full.hash_of and p not in eng.kv.cache.full.lru for p in cached)
    eng.core.flush()
    assert all(p in eng.kv.cache.full.lru for p in cached)
    assert eng.kv.num_free()[0] == before[0] + len(pages)
    eng.kv.assert_all_free()


def test_prefix_next_turn_hits_while_the_finishing_step_is_in_flight():
    """The overlapped loop releases a finished sequence's pages one step late; its next turn,
    arriving right after the last token while other sequences keep the loop busy, still hits."""
    from engine.sequence import Sequence

    core, kv = core_with_cache(400, 8 * 9 * 2, True)
    g = torch.Generator().manual_seed(2)
    busy = Sequence("busy", rand_ids(50, 500, g), SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    turn1 = Sequence("t1", rand_ids(200, 500, g), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    core.scheduler.add(busy)
    core.scheduler.add(turn1)
    while not turn1.finished:
        core.step()
    assert core.inflight is not None and not busy.finished  # a step is in flight: turn 1's pages are fenced
    turn2 = Sequence("t2", turn1.all_ids + rand_ids(30, 500, g), SamplingParams(max_tokens=3, temperature=0,
                                                                               ignore_eos=True))
    core.scheduler.add(turn2)
    core.step()
    assert turn2.num_cached_prefix == 192  # 204 tokens computed (the last answer token has no KV): 12 blocks
    while core.has_work:
        core.step()
    kv.assert_all_free()

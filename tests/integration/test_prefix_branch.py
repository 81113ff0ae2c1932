"""Branch points in the engine (CPU, fp32; engine/prefix_branch.py): new conversations that share only a
system prompt hit its KV once one of them kept it (full blocks by reference, the ring's window copied),
greedy outputs equal the uncached engine's, a repeated prompt hits its own earlier run, and every page
comes back."""

import torch

from engine.build import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.scheduler import SchedulerConfig
from tests.integration.test_prefix_cache_engine import TokenRunner

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
VOCAB = 201088


def make(path, cache=True, budget=256):
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=4096)
    return LLM(EngineConfig(checkpoint=path, scheduler=sched, enable_prefix_caching=cache, kv_cache_bytes=16 << 20))


def rand_ids(n, g):
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def run_one(llm, prompt):
    rid = llm.engine.add_request(prompt, GREEDY)
    seq = llm.engine.seqs[rid]
    steps = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        steps += 1
    return seq, steps


def test_prefix_branch_new_conversations_hit_the_shared_system_prompt(ckpt_factory):
    path = ckpt_factory("tiny")
    g = torch.Generator().manual_seed(5)
    system = rand_ids(200, g)  # 12 complete blocks + 8 tokens, past the 128-token window
    prompts = [system + rand_ids(30, g) for _ in range(4)]
    ref = [o.output_ids for o in make(path, cache=False).generate(prompts, GREEDY)]
    llm = make(path)
    seqs = [run_one(llm, p) for p in prompts]
    # A: nothing seen. B: A's blocks 0-11 seen, no usable hit (A's ring kept only its tail) -> keeps 192:
    # its 230-token prompt runs as chunks [0, 192) and [192, 230), one step more than A's. C, D hit 192.
    assert [s.num_cached_prefix for s, _ in seqs] == [0, 0, 192, 192]
    assert seqs[1][1] == seqs[0][1] + 1 and seqs[2][1] == seqs[0][1]
    assert [s.output_ids for s, _ in seqs] == ref
    assert llm.kv.cache.stats.branch_snapshots == 1
    llm.kv.assert_all_free()


def test_prefix_branch_concurrent_arrivals_and_a_repeated_prompt(ckpt_factory):
    """Six prompts in one batch: the second keeps the system prompt, the others (admitted while it is
    pending) compute as before; the next round hits. A repeated prompt keeps its own last block."""
    path = ckpt_factory("tiny")
    g = torch.Generator().manual_seed(6)
    system = rand_ids(300, g)
    first = [system + rand_ids(20 + i, g) for i in range(6)]
    second = [system + rand_ids(25 + i, g) for i in range(3)]
    ref = [o.output_ids for o in make(path, cache=False, budget=4096).generate(first + second, GREEDY)]
    llm = make(path, budget=4096)
    out1 = llm.generate(first, GREEDY)
    out2 = llm.generate(second, GREEDY)
    assert [o.output_ids for o in out1 + out2] == ref
    assert llm.kv.cache.stats.branch_snapshots == 1
    assert llm.kv.cache.stats.hit_tokens == 3 * 288  # the second round: the system prompt's 18 complete blocks
    # a prompt sent again after its first run decoded past the window (its ring kept only the answer's
    # tail): the second run keeps the prompt's last complete block, in its last chunk (no split), the third
    # hits it
    again = system + rand_ids(40, g)  # 340 tokens: 21 complete blocks, 18 of them the system prompt's
    long = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    runs = []
    for _ in range(3):
        rid = llm.engine.add_request(again, long)
        runs.append(llm.engine.seqs[rid])
        while llm.engine.has_unfinished():
            llm.engine.step()
    assert [r.num_cached_prefix for r in runs] == [288, 288, 336]
    assert llm.kv.cache.stats.branch_snapshots == 2
    assert runs[0].output_ids == runs[1].output_ids == runs[2].output_ids
    assert runs[0].output_ids == make(path, cache=False).generate([again], long)[0].output_ids
    llm.kv.assert_all_free()


def test_prefix_branch_sequence_aborted_right_after_its_snapshot_returns_every_page(ckpt_factory):
    """The snapshot's copies are queued behind the launch that wrote the ring; the sequence ends before any
    step follows them: the loop settles the fenced pages instead of holding them until the next request."""
    path = ckpt_factory("tiny")
    g = torch.Generator().manual_seed(8)
    system = rand_ids(200, g)
    llm = make(path)
    run_one(llm, system + rand_ids(30, g))
    rid = llm.engine.add_request(system + rand_ids(30, g), GREEDY)
    while llm.kv.cache.stats.branch_snapshots == 0:
        llm.engine.step()
    llm.engine.abort(rid)
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.step()  # the loop's iteration after the abort: nothing left to launch
    assert not llm.engine.scheduler.has_fenced
    llm.kv.assert_all_free()
    seq, _ = run_one(llm, system + rand_ids(30, g))
    assert seq.num_cached_prefix == 192  # the snapshot's copies ran: the next conversation hits
    llm.kv.assert_all_free()


class CopyingTokenRunner(TokenRunner):
    """test_prefix_cache_engine's TokenRunner with page copies (recorded, not performed): the scheduler's branch
    points, snapshots, fences and the loop's settling run for real."""

    supports_page_copies = True

    def __init__(self):
        self.copies = 0

    def copy_sliding_pages(self, src, dst):
        assert len(src) == len(dst) and src
        self.copies += 1

    def sync_copies(self):
        pass


def test_prefix_branch_no_leaks_over_thousands_of_turns_with_aborts_and_eviction():
    """2,400 turns of conversations that restart on one of two shared 200-token openings through a small cache,
    a tenth of them aborted after a random number of steps (some right after their snapshot): nothing leaks after
    any round, branch points keep being taken (the LRU evicts them), new conversations hit their opening."""
    import dataclasses

    from engine.core import EngineCore
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    from model.config import preset
    from model.kv_cache import KVManager, plan_kv_cache

    spec = plan_kv_cache(preset("tiny"), 1 << 30, page_size=16, max_num_seqs=8, dtype=torch.float32)
    kv = KVManager(dataclasses.replace(spec, num_pages=(220, 8 * 9 + 60)), "test-identity")
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048), kv, ())
    for overlap in (True, False):
        runner = CopyingTokenRunner()
        core = EngineCore(sched, runner, overlap)
        g = torch.Generator().manual_seed(12 + overlap)
        openings = [rand_ids(200, g) for _ in range(2)]
        convs = [list(openings[c % 2]) for c in range(8)]
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        opening_hits = 0
        for rnd in range(150):
            seqs = []
            for c in range(8):
                if len(convs[c]) > 400:
                    convs[c] = list(openings[(c + rnd) % 2])  # a new conversation
                convs[c] = convs[c] + rand_ids(int(torch.randint(5, 40, (1,), generator=g)), g)
                seq = Sequence(f"r{rnd}c{c}", list(convs[c]), params)
                sched.add(seq)
                seqs.append((c, seq))
            doomed = {c: int(torch.randint(1, 6, (1,), generator=g)) for c in range(8) if torch.rand(1, generator=g) < 0.1}
            steps = 0
            while core.has_work:
                core.step()
                steps += 1
                for c, s in seqs:
                    if doomed.get(c) == steps and not s.finished:
                        core.abort(s)
            for c, s in seqs:
                assert s.finished
                if s.finish_reason.value == "length":
                    convs[c] = convs[c] + s.output_ids
                else:  # aborted: the conversation starts over
                    convs[c] = list(openings[c % 2])
                opening_hits += len(s.prompt_ids) < 260 and s.num_cached_prefix >= 192
            assert not sched.has_fenced
            kv.assert_all_free()
        assert opening_hits > 50, opening_hits
    assert kv.cache.stats.branch_snapshots > 10 and runner.copies > 0
    assert kv.cache.num_evicted()[1] > 0  # the small sliding group cycled
    kv.clear_cache()
    for a in kv.alloc:
        a.assert_all_free()

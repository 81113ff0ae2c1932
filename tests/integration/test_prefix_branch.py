"""Branch points in the engine (CPU, fp32; engine/prefix_branch.py): new conversations that share only a
system prompt hit its KV once one of them kept it (full blocks by reference, the ring's window copied),
greedy outputs equal the uncached engine's, a repeated prompt hits its own earlier run, and every page
comes back."""

import torch

from engine.build import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.scheduler import SchedulerConfig

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

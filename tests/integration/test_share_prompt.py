"""n > 1 on one engine: a sequence flagged share_prompt indexes its prompt's KV as soon as its
prefill step launched (full blocks by reference, the sliding ring's blocks copied into cache-owned
pages: model/prefix_share.py), so the other choices hit it while it decodes; their greedy tokens
equal the sharing sequence's, also after the ring has wrapped (prompt > the 128-token window,
output past several blocks), and every page comes back."""

import dataclasses

from engine.build import EngineConfig
from engine.llm import LLMEngine
from engine.sampling import SamplingParams


def test_later_choices_hit_the_running_prompt_and_decode_the_same(ckpt_factory):
    eng = LLMEngine(EngineConfig(checkpoint=ckpt_factory("tiny"), kv_cache_bytes=16 << 20))
    prompt = list(range(2000, 2203))  # 12 complete blocks + 11 tokens, past the sliding window
    greedy = SamplingParams(max_tokens=24, temperature=0)  # crosses blocks 13 and 14: their ring slots held 4 and 5
    first = eng.add_request(prompt, dataclasses.replace(greedy, share_prompt=True))
    while not eng.seqs[first].output_ids:
        eng.step()
    later = [eng.add_request(prompt, greedy) for _ in range(2)]
    seqs = {rid: eng.seqs[rid] for rid in [first, *later]}
    while eng.has_unfinished():
        eng.step()
    assert [seqs[r].num_cached_prefix for r in later] == [192, 192]  # every complete prompt block
    outs = [seqs[r].output_ids for r in [first, *later]]
    assert outs[1] == outs[0] and outs[2] == outs[0] and len(outs[0]) == 24
    eng.kv.assert_all_free()

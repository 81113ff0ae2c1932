"""engine/warmup.py on the tiny model (CPU): the plan covers the step shapes it promises, the engine
is left as found (pages, prefix cache, its stats), and serving afterwards matches an engine that
never warmed up."""

from __future__ import annotations

import pytest

from engine.build import EngineConfig, build_engine_parts
from engine.core import EngineCore
from engine.sampling import SamplingParams
from engine.scheduler import SchedulerConfig
from engine.sequence import Sequence
from engine.warmup import token_counts, warm_up, warmup_plan


def test_warmup_token_counts():
    c = token_counts(4096)
    assert c[0] == 2 and c[-1] == 4096 and c == sorted(set(c))
    assert all(b <= a * 1.5 + 16 for a, b in zip(c, c[1:]))  # no gap a tile-table bucket could hide in
    assert sum(x % 16 == 0 for x in c) >= 10 and sum(x % 16 != 0 for x in c) >= 10
    assert any(600 < x < 768 for x in c) and any(768 <= x < 1100 for x in c)  # around 20b's DeepGEMM MoE threshold


def test_warmup_plan_fits_and_mixes():
    plan = warmup_plan(256, 4096, 16)
    assert plan[0].prompt_len > 256  # a full chunk, then a chunk on top of it
    assert any(r.shared_prefix for r in plan) and all(r.shared_prefix % 16 == 0 for r in plan)
    assert {r.temperature for r in plan} == {0.0, 1.0}
    assert any(r.prompt_len % 2 for r in plan) and any(r.prompt_len % 16 == 0 for r in plan)
    assert all(r.prompt_len + r.max_tokens <= 4096 for r in plan)
    small = warmup_plan(64, 100, 16)  # a short context: everything still fits
    assert all(0 < r.prompt_len and r.prompt_len + r.max_tokens <= 100 for r in small)


def _parts(caching: bool):
    # "tiny": the real sliding window (128), so a later turn's hit finds its sliding blocks in the ring
    cfg = EngineConfig(random_preset="tiny", device="cpu", dtype="float32", kv_cache_bytes=16 << 20,
                       scheduler=SchedulerConfig(8, 64, 512), enable_prefix_caching=caching)
    return build_engine_parts(cfg)


def _generate(parts, prompts: list[list[int]]) -> list[list[int]]:
    from engine.scheduler import Scheduler  # noqa: PLC0415

    sched = Scheduler(parts.scheduler.cfg, parts.kv, ())
    core = EngineCore(sched, parts.runner)
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0.0)) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    while core.has_work:
        core.step()
    core.flush()
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("caching", [True, False])
def test_warmup_prefix_leaves_engine_as_found(caching):
    parts = _parts(caching)
    free = parts.kv.num_free()
    rep = warm_up(parts)
    sweep = token_counts(64)
    assert list(rep.step_tokens[:len(sweep)]) == sweep  # the sweep: one step per size
    assert rep.mixed_steps >= 2  # then decode rows beside prefills
    assert len({t % 16 == 0 for t in rep.step_tokens}) == 2  # both Triton specialisations of a token count
    assert (rep.hit_tokens > 0) == caching
    assert parts.kv.num_free() == free
    parts.kv.assert_all_free()
    if caching:
        c = parts.kv.cache
        assert c.num_evicted() == (0, 0) and c.stats.queried_tokens == 0 and c.stats.hit_tokens == 0
        assert parts.kv.num_cached() == (0, 0)
        assert c.events_since(0)[2] == []  # a router reading events from the start sees none
    prompts = [[5, 6, 7] * 30, [9] * 70, [5, 6, 7] * 30 + [1, 2]]
    fresh = _parts(caching)
    assert _generate(parts, prompts) == _generate(fresh, prompts)

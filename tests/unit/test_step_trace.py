"""engine/step_trace.py: one JSON line per step with its size and host times (--step-trace)."""

from __future__ import annotations

import json

from engine.build import EngineConfig, build_engine_parts
from engine.core import EngineCore
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence
from engine.step_trace import StepTrace


def test_step_trace_lines(tmp_path):
    parts = build_engine_parts(EngineConfig(random_preset="tiny-a", kv_cache_bytes=2 << 20,
                                            scheduler=SchedulerConfig(8, 32, 256)))
    core = EngineCore(Scheduler(parts.scheduler.cfg, parts.kv, ()), parts.runner)
    core.trace = StepTrace(str(tmp_path / "steps-%p.jsonl"))
    core.scheduler.add(Sequence("a", list(range(1, 41)), SamplingParams(max_tokens=3, temperature=0.0)))
    while core.has_work:
        core.step()
    core.trace.close()
    (path,) = tmp_path.glob("steps-*.jsonl")
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    launched = [r for r in rows if r["step"]]
    assert [r["tokens"] for r in launched] == [32, 8, 1, 1]  # 40 prompt tokens in chunks of 32, then decodes
    assert [r["chunks"] for r in launched] == [1, 1, 0, 0] and launched[0]["max_chunk"] == 32
    assert all(r["launch_ms"] >= 0 and r["wait_ms"] >= 0 for r in rows)
    assert rows[-1]["collected"] == launched[-1]["step"]  # the last iteration only collects
    # the launch's parts: metadata + plans, the forward, the sampler; inside launch_ms (the CPU runs them in turn)
    for r in launched:  # the first chunk samples nothing
        assert {"meta_ms", "forward_ms"} <= set(r) and ("sample_ms" in r) == (r["step"] > 1), r
        assert r["meta_ms"] + r["forward_ms"] + r.get("sample_ms", 0) <= r["launch_ms"] + 0.01, r
        assert r["forward_ms"] > 0


def test_slow_steps_are_logged_with_their_shape(monkeypatch, caplog):
    import engine.core

    parts = build_engine_parts(EngineConfig(random_preset="tiny-a", kv_cache_bytes=2 << 20,
                                            scheduler=SchedulerConfig(8, 32, 256)))
    core = EngineCore(Scheduler(parts.scheduler.cfg, parts.kv, ()), parts.runner)
    core.scheduler.add(Sequence("a", list(range(1, 41)), SamplingParams(max_tokens=2, temperature=0.0)))
    monkeypatch.setattr(engine.core, "SLOW_STEP_S", 0.0)  # every step is "slow"
    with caplog.at_level("WARNING", logger="tandem.engine"):
        core.step()
    assert "slow step 1" in caplog.text and "1 seqs, 32 tokens (largest chunk 32)" in caplog.text

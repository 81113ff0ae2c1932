"""Fixtures of the integration tests."""

import pytest

from engine.build import EngineConfig
from engine.llm import LLM
from engine.scheduler import SchedulerConfig


@pytest.fixture
def make_llm():
    made = []

    def make(path, **kw):
        sched = kw.pop("scheduler", SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=4096))
        llm = LLM(EngineConfig(checkpoint=path, scheduler=sched, **kw))
        made.append(llm)
        return llm

    yield make
    for llm in made:  # after every test: every page back in the free pool
        llm.kv.assert_all_free()

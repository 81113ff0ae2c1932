"""A request that names no max_tokens may run to the end of its context, as on OpenAI and vLLM (it was cut
at 4096 tokens: a long gpt-oss reasoning turn ended 'length', which Codex reports as an error): the room
left by the router's --max-model-len and by every ready decode worker's own context and KV cache
(WorkerStatus.max_model_len, its pages), the smallest; --default-max-tokens still sets a fixed default."""

from __future__ import annotations

import dataclasses
import math
import time
from types import SimpleNamespace

from router.config import RouterConfig
from router.fleet import Discovery, Fleet, WorkerState
from router.handlers import Handlers
from wire.protocol import WorkerStatus, decode, encode

BASE = WorkerStatus(role="decode", worker_id="d", epoch=1, ready=True, draining=False, queue_depth=0, queued_tokens=0,
                    running=0, kv_free_pages=1000, kv_total_pages=100000, kv_free_sliding_pages=10,
                    kv_total_sliding_pages=10, page_size=16, max_num_seqs=8, busy_seconds=0.0, max_model_len=32768)


def fleet_of(*statuses: WorkerStatus) -> Fleet:
    fleet = Fleet(Discovery(decode=[f"d{i}" for i in range(len(statuses))]), ctx=None)  # type: ignore[arg-type]
    for i, s in enumerate(statuses):
        client = SimpleNamespace(last_disconnect=-math.inf)
        fleet.workers[f"d{i}"] = WorkerState(client=client, status=s, last_ok=time.monotonic())  # type: ignore[arg-type]
        fleet.roles[f"d{i}"] = "decode"
    return fleet


def handlers(fleet: Fleet, **cfg) -> Handlers:
    h = Handlers.__new__(Handlers)  # only the length policy: no orchestrator loop, tokenizer or format
    h.cfg, h.orch = RouterConfig(model_name="m", **cfg), SimpleNamespace(fleet=fleet)
    return h


def test_the_default_is_the_room_the_smallest_context_leaves():
    small_kv = dataclasses.replace(BASE, worker_id="d1", kv_total_pages=1000, page_size=16)  # 16,000 tokens of KV
    fleet = fleet_of(BASE, small_kv)
    assert fleet.context_limit() == 16000
    assert handlers(fleet).default_max_tokens(1000) == 15000
    assert handlers(fleet_of(BASE)).default_max_tokens(1000) == 32768 - 1000  # the worker's max_model_len
    assert handlers(fleet_of(BASE), max_model_len=8192).default_max_tokens(1000) == 7192  # the router's
    assert handlers(fleet_of(BASE), default_max_tokens=4096).default_max_tokens(1000) == 4096  # fixed, as asked
    unready = dataclasses.replace(small_kv, ready=False)
    assert fleet_of(BASE, unready).context_limit() == 32768  # a worker not taking requests does not limit
    assert fleet_of(dataclasses.replace(BASE, max_model_len=0)).context_limit() is None  # an older worker
    assert handlers(fleet_of(), max_model_len=4096).default_max_tokens(100) == 3996


def test_status_carries_the_context_limit_over_the_wire():
    assert decode(encode(BASE)).max_model_len == 32768

"""The served decode step, as the decode worker runs it: scheduler, metadata, attention plan, CUDA
graph replay, sampling on the device and the host reading the tokens (engine.core), over B
sequences already holding `context` tokens of random KV. Reported next to the bare graph replay,
so the gap is the host work the GPU waited for.

    ms = engine_loop_ms(model, pool, kv, graphs, batch=128, context=8192, overlap=True)
"""

from __future__ import annotations

import time

import torch

from engine.core import EngineCore
from engine.runner import ModelRunner
from engine.sampling import Sampler, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence, SeqStatus
from model.kv_cache import KVManager, KVPool, SeqPages

EXTRA_TOKENS = 160  # room every sequence needs beyond its context for warm-up + timed steps


def engine_loop_ms(model, pool: KVPool, kv: KVManager, pages: list[SeqPages], graphs, context: int,
                   overlap: bool, warmup: int = 8, steps: int = 40) -> float:
    """Wall milliseconds per step of EngineCore over sequences whose first `context` tokens are
    cached in `pages` (greedy, no stop token: every step decodes every sequence)."""
    b = len(pages)
    assert warmup + steps < EXTRA_TOKENS
    sched = Scheduler(SchedulerConfig(max_num_seqs=b, max_num_batched_tokens=max(8192, b),
                                      max_model_len=context + EXTRA_TOKENS + 16), kv, model.cfg.eos_token_ids)
    runner = ModelRunner(model, pool, Sampler(model.device, 0, model.cfg.eos_token_ids))
    runner.graphs = graphs
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=10 * EXTRA_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(pages):
        prompt = torch.randint(0, model.cfg.vocab_size, (context,), generator=g).tolist()
        seq = Sequence(f"bench-{i}", prompt, params, pages=p, num_cached=context - 1)
        seq.status = SeqStatus.RUNNING
        sched.running.append(seq)  # the prompt's KV is "cached": random contents, as the benchmark's pool
    core = EngineCore(sched, runner, overlap=overlap)
    for _ in range(warmup):
        core.step()
    _sync(model.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    core.flush()
    _sync(model.device)
    ms = (time.perf_counter() - t0) * 1e3 / steps
    for seq in list(sched.running):  # hand the pages back to the caller's bookkeeping untouched
        sched.running.remove(seq)
    return ms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()

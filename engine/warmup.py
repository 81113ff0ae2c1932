"""Start-up warm-up: a few throw-away requests through the worker's own step loop before it reports
ready, so first-use costs land at start-up instead of on a request's TTFT.

Triton compiles one kernel variant per specialisation of its integer arguments (a value of 1, or
divisible by 16) and per constexpr; the MoE takes another path below and above its rows-per-expert
threshold; attention plans differently for a fresh prefill, a chunk on top of cached tokens and a
mixed step with decode rows; a prefix-cache hit copies sliding pages. Each first use compiles or
builds something (seconds on a GPU); on the H200, two such first uses cost multi-turn traffic two
TTFT stalls of 2.3-2.5 s in its first turns (benchmarks/results/2026-12-03/multi-turn-colocated-1-1).

First a sweep of step sizes (`token_counts`: one fresh prefill each), then requests (`warmup_plan`),
all through a fresh Scheduler on the worker's KVManager and an
EngineCore on its runner (on a TP worker, rank 0's group runner: the followers run the same steps):
  * a fresh prefill longer than one step (a full `max_num_batched_tokens` chunk, then a chunk on top);
  * while it decodes, a prompt sharing its first blocks (a prefix-cache hit on its shared prompt
    when caching is on, else a plain prefill) and short odd and 16-aligned prompts: mixed steps of several sizes;
  * greedy and temperature-1 rows (both sampler paths).
Afterwards every page is free again and the prefix cache is reset (no warm-up blocks, stats or
events remain), so serving starts from the state it would have had without the warm-up.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from engine.build import EngineParts
from engine.core import EngineCore
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.step_trace import StepTrace

log = logging.getLogger("tandem.warmup")


@dataclass(frozen=True, slots=True)
class WarmupRequest:
    prompt_len: int
    after_step: int  # added once this many steps ran (0: at the start)
    shared_prefix: int = 0  # its first tokens are request 0's (a prefix-cache hit when caching is on)
    temperature: float = 0.0
    max_tokens: int = 3
    share_prompt: bool = False  # indexed once its prompt is computed (model/prefix_share.py), as fan-out's choice 0


def warmup_plan(max_batched_tokens: int, max_model_len: int, page_size: int) -> list[WarmupRequest]:
    """The requests, fitted to the engine's limits. Request 0 takes two steps to prefill (a full chunk,
    then 37 tokens on top of it); the others arrive while it decodes and share steps with it."""
    cap = max_model_len - 8  # room for max_tokens
    first = min(max_batched_tokens + 37, cap)
    # The ring holds a prompt's last window only, so a hit extends a whole prompt (a later turn):
    # request 1 is request 0's complete blocks plus new tokens.
    shared = first // page_size * page_size
    plan = [WarmupRequest(first, 0, share_prompt=True),
            WarmupRequest(min(shared + 211, cap), 3, shared_prefix=min(shared, cap - 1), temperature=1.0),
            WarmupRequest(min(17, cap), 2), WarmupRequest(min(256, cap), 3, temperature=1.0),
            WarmupRequest(min(33, cap), 4), WarmupRequest(min(max_batched_tokens // 3 | 1, cap), 5)]
    return [r for r in plan if 0 < r.prompt_len]


@dataclass(frozen=True, slots=True)
class WarmupReport:
    seconds: float
    steps: int
    step_tokens: tuple[int, ...]  # tokens of each step, in order
    mixed_steps: int  # steps with decode rows and a prefill chunk together
    hit_tokens: int  # prompt tokens a prefix-cache hit supplied (0 without caching)


def token_counts(max_batched_tokens: int) -> list[int]:
    """Step sizes for the shape sweep: ~1.5x apart from 2 to the step budget, each size >= 16 also
    rounded down to a multiple of 16 (Triton specialises an integer argument divisible by 16), so
    every tile-table bucket (the MoE's rows per expert, the GEMMs' M) and the DeepGEMM threshold are
    crossed with both specialisations."""
    out, c = set(), 2
    while c < max_batched_tokens:
        out.add(c)
        if c >= 16:
            out.add(c // 16 * 16)
        c = -(-c * 3 // 2)
    out.add(max_batched_tokens)
    return sorted(out)


def warm_up(parts: EngineParts, seed: int = 0) -> WarmupReport:
    """The shape sweep (one fresh prefill per `token_counts` size, each a step of its own), then
    `warmup_plan`'s mixed requests; leaves `parts` as found."""
    t0 = time.monotonic()
    kv, sched_cfg = parts.kv, parts.scheduler.cfg
    plan = warmup_plan(sched_cfg.max_num_batched_tokens, sched_cfg.max_model_len, kv.spec.page_size)
    scheduler = Scheduler(sched_cfg, kv, ())  # no EOS: each request runs its max_tokens
    core = EngineCore(scheduler, parts.runner, overlap=getattr(parts.runner, "supports_overlap", False))
    core.trace = StepTrace()  # in memory: the report's step sizes
    free_before = kv.num_free()
    vocab_size = parts.model.cfg.vocab_size
    rng = random.Random(seed)
    ids_made: list[str] = []
    iterations = 0

    def add(rid: str, ids: list[int], **params) -> None:
        ids_made.append(rid)
        scheduler.add(Sequence(rid, ids, SamplingParams(**params)))

    def step() -> None:
        nonlocal iterations
        core.step()
        iterations += 1
        if iterations > 10_000:  # a bug, not a slow GPU: the warm-up needs a few hundred steps
            raise RuntimeError("warm-up did not finish in 10,000 steps")

    for n in token_counts(min(sched_cfg.max_num_batched_tokens, sched_cfg.max_model_len - 1)):
        add(f"warmup-shape-{n}", [rng.randrange(vocab_size) for _ in range(n)], max_tokens=1, temperature=0.0)
        while core.has_work:
            step()
    base = [rng.randrange(vocab_size) for _ in range(max(r.prompt_len for r in plan))]
    pending = sorted(enumerate(plan), key=lambda x: x[1].after_step)
    steps = 0
    while pending or core.has_work:
        while pending and pending[0][1].after_step <= steps:
            i, r = pending.pop(0)
            own = [rng.randrange(vocab_size) for _ in range(r.prompt_len - r.shared_prefix)]
            ids = base[:r.shared_prefix] + own if r.shared_prefix else (base[:r.prompt_len] if i == 0 else own)
            add(f"warmup-{i}", ids, max_tokens=r.max_tokens, temperature=r.temperature, seed=i,
                share_prompt=r.share_prompt)
        step()
        steps += 1
    core.flush()
    for rid in ids_made:
        parts.sampler.forget(rid)
    hits = kv.cache.stats.hit_tokens if kv.cache is not None else 0
    kv.reset_cache()
    if kv.num_free() != free_before:  # graphs' padding pages stay held: compare counts, not "all free"
        raise RuntimeError(f"warm-up leaked KV pages: free (full, sliding) {free_before} -> {kv.num_free()}")
    launched = [r for r in core.trace.rows if r["step"]]
    # mixed: decode rows (not chunks) beside a chunk of more than one token
    mixed = sum(r["seqs"] > r["chunks"] and r["max_chunk"] > 1 for r in launched)
    rep = WarmupReport(time.monotonic() - t0, len(launched), tuple(r["tokens"] for r in launched), mixed, hits)
    log.info("warm-up: %d steps (a sweep of %d step sizes up to %d tokens, then %d mixed requests: %d mixed steps, "
             "%d cached tokens hit) in %.2f s", rep.steps, len(ids_made) - len(plan),
             sched_cfg.max_num_batched_tokens, len(plan), mixed, hits, rep.seconds)
    return rep

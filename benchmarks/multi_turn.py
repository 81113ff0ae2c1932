"""`tandem bench serve --multi-turn`: chat / agent traffic where every turn resends the whole
conversation, with and without prefix caching.

A run, top to bottom:
  plan      C conversations of T turns from one seeded generator: a shared system prompt (S token
            ids), then per turn U new user tokens; turn k+1's prompt = turn k's prompt + turn k's
            answer (the token ids the server returned) + new user tokens; A answer tokens per turn
            (ignore_eos, so exactly A)
  run       every conversation is one client task sending its turns one after the other (the next
            turn is only known once the answer arrived); conversations start together, or staggered
            by --conversation-gap-ms; with --client-procs N the conversations are dealt round-robin
            to N client processes (each its own event loop), which start at one agreed instant
  measure   per request: TTFT, end-to-end, and what the server says it did in usage:
            prompt_tokens_details.cached_tokens, tandem.computed_tokens (prefill tokens computed),
            tandem.kv_bytes_shipped, tandem.prefill (local / remote)
  leaks     after the load: every worker's KV pages are free or merely cached (no sequence holds
            one), nothing running or queued
Reported per run, for turn 1 and for turns 2+: TTFT p50/p99, prefill tokens computed per turn, KV
bytes shipped per turn and per new token, the prefix hit rate (cached / prompt tokens).

    tandem bench serve --multi-turn --launch both --compare-caching --conversations 64 --turns 8 \\
        --system-len 2048 --user-len 100:300 --output-len 100:300
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import httpx
import numpy as np

from benchmarks.loadgen import LengthRange, sse_json
from common.errors import ConfigError
from common.event_loop import loop_and_parser


@dataclass(frozen=True, slots=True)
class MultiTurnSpec:
    base_url: str
    model: str
    conversations: int = 64
    turns: int = 8
    system_len: int = 2048
    user_len: LengthRange = LengthRange(100, 300)
    output_len: LengthRange = LengthRange(100, 300)
    conversation_gap_s: float = 0.0
    seed: int = 0
    token_id_range: tuple[int, int] = (1000, 100_000)
    request_timeout_s: float = 300.0
    # Load client processes. One asyncio loop parses every stream's SSE events: at 64 conversations x ~80 tokens/s
    # a first token can wait behind a step's ~60 other chunks in the client itself, which adds to every TTFT
    # measured, cached or not (the server's parts are in ttft_parts).
    client_procs: int = 1

    def __post_init__(self) -> None:
        if self.conversations < 1 or self.turns < 1 or self.system_len < 0:
            raise ConfigError("--conversations and --turns must be >= 1, --system-len >= 0")
        if not 1 <= self.client_procs <= self.conversations:
            raise ConfigError("--client-procs must be between 1 and --conversations")


@dataclass(slots=True)
class TurnResult:
    conversation: int
    turn: int  # 1-based
    prompt_tokens: int
    new_tokens: int  # tokens whose KV the conversation never computed: the user's new tokens and the previous
    # answer's last token (turn 1: the whole prompt)
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int | None = None
    computed_tokens: int | None = None
    kv_bytes: int | None = None
    prefill: str = ""
    decode_worker: str = ""  # the server's x-tandem-decode header: where it ran (placement)
    queue_wait_s: float | None = None  # x-tandem-queue-wait-s: time in the router's admission queue
    start_s: float | None = None  # sent, seconds after the load started (a timeline: stalls hit requests in flight)
    ttft_parts: dict[str, float] = field(default_factory=dict)  # x-tandem-ttft-breakdown: component -> seconds


def plan(spec: MultiTurnSpec) -> tuple[list[int], list[list[tuple[list[int], int]]]]:
    """(system prompt, per conversation per turn (new user tokens, answer length))."""
    rng = np.random.default_rng(spec.seed)
    lo, hi = spec.token_id_range
    system = rng.integers(lo, hi, size=spec.system_len).tolist()
    convs = []
    for _ in range(spec.conversations):
        users = spec.user_len.sample(rng, spec.turns)
        outs = spec.output_len.sample(rng, spec.turns)
        convs.append([(rng.integers(lo, hi, size=int(u)).tolist(), int(o)) for u, o in zip(users, outs)])
    return system, convs


async def one_turn(client: aiohttp.ClientSession, spec: MultiTurnSpec, r: TurnResult, prompt: list[int],
                   max_tokens: int, t_load: float) -> TurnResult:
    """One streamed turn. The client is aiohttp: with httpx (line iteration in Python) the load client's own
    event loop added ~12 ms to every TTFT at 64 conversations x ~115 tokens/s on the CPU machine (a fake worker
    behind the real router: TTFT minus the server's parts 17.0 ms p50 with httpx, 4.7 ms with aiohttp)."""
    body = {"model": spec.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True}
    t0 = time.perf_counter()
    r.start_s = t0 - t_load
    try:
        async with asyncio.timeout(spec.request_timeout_s):
            async with client.post(spec.base_url.rstrip("/") + "/v1/completions", json=body) as resp:
                r.decode_worker = resp.headers.get("x-tandem-decode", "")
                wait = resp.headers.get("x-tandem-queue-wait-s")
                r.queue_wait_s = float(wait) if wait else None
                r.ttft_parts = {k: float(v) for k, _, v in (p.partition("=") for p in
                                resp.headers.get("x-tandem-ttft-breakdown", "").split(";") if p)}
                if resp.status != 200:
                    r.error = f"http_{resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
                    return r
                async for chunk in sse_json(resp.content):  # byte lines, each with its newline
                    if "error" in chunk:
                        r.error = str(chunk["error"])
                        return r
                    if chunk.get("usage"):
                        u = chunk["usage"]
                        r.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
                        t = u.get("tandem") or {}
                        r.computed_tokens, r.kv_bytes, r.prefill = (t.get("computed_tokens"),
                                                                    t.get("kv_bytes_shipped"), t.get("prefill", ""))
                    for ch in chunk.get("choices") or []:
                        ids = ch.get("token_ids") or []
                        if ids and r.ttft_s is None:
                            r.ttft_s = time.perf_counter() - t0
                        r.output_ids += ids
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # ValueError: bad JSON or UTF-8, a line over 64 KiB
        r.error = f"{type(e).__name__}: {e}"
        return r
    r.e2e_s = time.perf_counter() - t0
    r.ok = r.ttft_s is not None and len(r.output_ids) == max_tokens
    if not r.ok and not r.error:
        r.error = f"got {len(r.output_ids)} of {max_tokens} tokens"
    return r


async def run_conversations(spec: MultiTurnSpec, part: tuple[int, int] = (0, 1)) -> tuple[list[TurnResult], float]:
    """The conversations c with c % n == k, part = (k, n); all of them by default."""
    system, convs = plan(spec)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)  # one keep-alive connection per conversation
    timeout = aiohttp.ClientTimeout(total=None, connect=10.0)  # the request's own deadline: one_turn
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:

        async def conversation(c: int) -> list[TurnResult]:
            await asyncio.sleep(c * spec.conversation_gap_s)
            prompt, out = list(system), []
            for k, (user, max_tokens) in enumerate(convs[c]):
                new = len(user) + (len(system) if k == 0 else 1)
                prompt = prompt + user
                r = await one_turn(client, spec, TurnResult(c, k + 1, len(prompt), new), prompt, max_tokens, t0)
                out.append(r)
                if not r.ok:
                    break  # the conversation cannot continue without its answer
                prompt = prompt + r.output_ids
            return out

        t0 = time.perf_counter()
        results = [r for conv in await asyncio.gather(*(conversation(c) for c in range(part[0], spec.conversations,
                                                                                         part[1])))
                   for r in conv]
        return results, time.perf_counter() - t0


def _run_part(spec: MultiTurnSpec, k: int, start_at: float) -> tuple[list[TurnResult], float]:
    """One client process's share (conversations c % client_procs == k), started at wall-clock `start_at`."""
    time.sleep(max(0.0, start_at - time.time()))
    return _run_loop(run_conversations(spec, (k, spec.client_procs)))


def run_load(spec: MultiTurnSpec) -> tuple[list[TurnResult], float]:
    """Every conversation, in this process or dealt to spec.client_procs spawned ones (results merged in
    conversation order; the duration is the longest process's)."""
    if spec.client_procs == 1:
        return _run_loop(run_conversations(spec))
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    n = spec.client_procs
    with ProcessPoolExecutor(n, mp_context=mp.get_context("spawn")) as ex:
        start_at = time.time() + 3.0  # spawned interpreters import aiohttp and numpy first
        parts = list(ex.map(_run_part, [spec] * n, range(n), [start_at] * n))
    results = sorted((r for rs, _ in parts for r in rs), key=lambda r: (r.conversation, r.turn))
    return results, max(d for _, d in parts)


def _pct(values: list[float], scale: float = 1.0) -> dict:
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p99": None}
    a = np.asarray(values, dtype=float) * scale
    return {"n": len(values), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99))}


def summarize(results: list[TurnResult], duration_s: float, kv_bytes_per_token: int | None = None) -> dict:
    """kv_bytes_per_token: one token's KV over all layers (the decode worker's WorkerStatus), for the
    goal "a later turn ships no more than its new tokens' KV"."""
    ok = [r for r in results if r.ok]
    groups = {"turn1": [r for r in ok if r.turn == 1], "turns2plus": [r for r in ok if r.turn > 1]}
    out: dict = {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
                 "first_errors": [r.error for r in results if not r.ok][:5], "duration_s": duration_s}
    for name, rs in groups.items():
        prompt = sum(r.prompt_tokens for r in rs)
        cached = sum(r.cached_tokens or 0 for r in rs)
        out[name] = {
            "requests": len(rs),
            "ttft_ms": _pct([r.ttft_s for r in rs], 1e3),
            # time per output token after the first: what a loop change that helps TTFT must not cost decoding
            "tpot_ms": _pct([(r.e2e_s - r.ttft_s) / (len(r.output_ids) - 1) for r in rs
                             if r.e2e_s is not None and len(r.output_ids) > 1], 1e3),
            "prompt_tokens_per_turn": prompt / len(rs) if rs else None,
            "computed_tokens_per_turn": sum(r.computed_tokens or 0 for r in rs) / len(rs) if rs else None,
            "new_tokens_per_turn": sum(r.new_tokens for r in rs) / len(rs) if rs else None,
            "kv_bytes_per_turn": sum(r.kv_bytes or 0 for r in rs) / len(rs) if rs else None,
            "hit_rate": cached / prompt if prompt else None,
            "prefilled_locally": sum(r.prefill == "local" for r in rs),
        }
    t1, t2 = out["turn1"], out["turns2plus"]
    for name, rs in groups.items():  # where the TTFT went, per component (the server's breakdown)
        comps = sorted({k for r in rs for k in r.ttft_parts})
        out[name]["ttft_breakdown_ms"] = {k: _pct([r.ttft_parts[k] for r in rs if k in r.ttft_parts], 1e3)
                                          for k in comps}
    out["by_decode_worker"] = {
        w: {"turn1": sum(r.turn == 1 for r in rs), "turns2plus": sum(r.turn > 1 for r in rs),
            "ttft_ms_turns2plus": _pct([r.ttft_s for r in rs if r.turn > 1], 1e3)}
        for w in sorted({r.decode_worker for r in ok if r.decode_worker})
        for rs in [[r for r in ok if r.decode_worker == w]]}
    out["kv_bytes_per_token"] = kv_bytes_per_token
    # the goal: a later turn ships no more than its new tokens' KV (all layers). The cached prefix is
    # block-aligned (up to 15 earlier tokens go again), the sliding layers need only their last W tokens.
    out["turns2plus_bytes_over_new_token_kv"] = (t2["kv_bytes_per_turn"] / (kv_bytes_per_token * t2["new_tokens_per_turn"])
                                                 if kv_bytes_per_token and t2["new_tokens_per_turn"] else None)
    out["ttft_p50_turn1_over_turns2plus"] = (t1["ttft_ms"]["p50"] / t2["ttft_ms"]["p50"]
                                             if t1["ttft_ms"]["p50"] and t2["ttft_ms"]["p50"] else None)
    return out


def _run_loop(coro):
    """The load client's loop: the router's choice (common/event_loop.py), so the client's own event
    handling adds as little as it can to the TTFT it measures, and the A/B switches both."""
    if loop_and_parser()[0] == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def warm_up(spec: MultiTurnSpec, conversations: int) -> dict:
    """Conversations of two turns with another seed (their prompts share no block with the measured
    ones) before the measured load: a fresh server's first long prefills, first short prefills into
    a running batch and first batch sizes compile kernels (Triton, DeepGEMM, FlashInfer JIT) that a
    later launch finds in the on-disk caches; without this the first launched configuration pays
    them in its TTFT (multi-turn-1 on the H200: turn 1 of the first run shifted by ~1.9 s)."""
    from dataclasses import replace

    results, duration = _run_loop(run_conversations(
        replace(spec, conversations=conversations, turns=min(2, spec.turns), seed=spec.seed + 1000,
                conversation_gap_s=0.0, client_procs=1)))
    return {"conversations": conversations, "requests": len(results), "failed": sum(not r.ok for r in results),
            "duration_s": duration}


def run(spec: MultiTurnSpec, label: str, workers: list[str] = (), warmup: int = 0) -> dict:
    """One load against a service (after `warmup` warm-up conversations, when > 0); `workers` (its
    decode and prefill addresses): KV bytes per token from their status, and the leak check after
    the load."""
    warm = warm_up(spec, warmup) if warmup else None
    before = ttft_breakdown(spec.base_url)
    results, duration = run_load(spec)
    after = ttft_breakdown(spec.base_url)
    doc = asdict(spec)
    sts = worker_status(list(workers))
    per_token = next((st.kv_bytes_per_token for st in sts if st is not None and st.role == "decode"), None)
    parts = {k: {"n": n, "mean_ms": 1e3 * s / n} for k, (s, n) in
             ((k, (after[k][0] - before.get(k, (0.0, 0))[0], after[k][1] - before.get(k, (0.0, 0))[1])) for k in after)
             if n > 0}
    return {"label": label, "load": doc, "warmup": warm, "summary": summarize(results, duration, per_token),
            "ttft_breakdown": parts,
            "leaks": worker_leaks(list(workers)) if workers else None,
            "requests": [{k: v for k, v in asdict(r).items() if k != "output_ids"} | {"output_tokens": len(r.output_ids)}
                         for r in results]}


def ttft_breakdown(base_url: str) -> dict[str, tuple[float, int]]:
    """The router's tandem_ttft_breakdown_seconds: component -> (sum of seconds, count); {} when it
    does not answer (the load's own numbers do not depend on it)."""
    import re

    try:
        text = httpx.get(base_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, list] = {}
    for kind, comp, val in re.findall(r'^tandem_ttft_breakdown_seconds_(sum|count)\{component="([^"]+)"\} (\S+)$',
                                      text, re.M):
        out.setdefault(comp, [0.0, 0])[kind == "count"] = float(val)
    return {k: (v[0], int(v[1])) for k, v in out.items()}


def format_runs(runs: list[dict]) -> str:
    cols = ("TTFT p50 t1", "hit rate t1", "TTFT p50 t2+", "TTFT p99 t2+", "TPOT p50 t2+", "computed/turn t2+",
            "KV bytes/turn t2+", "/new tokens' KV", "hit rate t2+", "local t2+", "leaks")
    lines = [f"{'':28}" + "".join(f"{c:>18}" for c in cols)]
    for r in runs:
        s = r["summary"]
        t1, t2 = s["turn1"], s["turns2plus"]
        vals = [t1["ttft_ms"]["p50"], t1["hit_rate"], t2["ttft_ms"]["p50"], t2["ttft_ms"]["p99"], t2["tpot_ms"]["p50"],
                t2["computed_tokens_per_turn"], t2["kv_bytes_per_turn"], s["turns2plus_bytes_over_new_token_kv"], t2["hit_rate"], t2["prefilled_locally"],
                (r.get("leaks") or {}).get("leaked")]
        cells = [f"{v:18.3f}" if isinstance(v, float) else f"{str(v):>18}" for v in vals]
        lines.append(f"{r['label']:28}" + "".join(cells) + ("" if not s["failed"] else f"  failed {s['failed']}"))
    return "\n".join(lines)


def worker_status(addresses: list[str]) -> list:
    """Each worker's WorkerStatus (None where it did not answer within 5 s)."""
    import zmq

    from wire.protocol import StatusRequest, decode, encode

    ctx = zmq.Context.instance()
    out = []
    for addr in addresses:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        try:
            s.send(encode(StatusRequest()))
            out.append(decode(s.recv()) if s.poll(5000) else None)
        finally:
            s.close(0)
    return out


def worker_leaks(addresses: list[str], timeout_s: float = 15.0) -> dict:
    """Every worker's pages back (free, or held by the prefix cache alone), nothing running: polled
    until true or timeout (a finished request's pages return one step later)."""
    t_end = time.monotonic() + timeout_s
    while True:
        bad = []
        for addr, st in zip(addresses, worker_status(addresses)):
            if st is None or st.kv_free_pages != st.kv_total_pages or st.running or st.queue_depth \
                    or st.kv_free_sliding_pages != st.kv_total_sliding_pages:
                bad.append({"worker": addr, "status": None if st is None else
                            {k: getattr(st, k) for k in ("kv_free_pages", "kv_total_pages", "kv_free_sliding_pages",
                                                         "kv_total_sliding_pages", "running", "queue_depth")}})
        if not bad or time.monotonic() > t_end:
            return {"leaked": bool(bad), "workers_checked": len(addresses), "problems": bad}
        time.sleep(0.5)

"""Correctness checks `tandem bench serve` can run after a load (the overload figures of issue 24).

- replay: every completed greedy stream against a single-process replay (engine.llm.LLM on the
  same checkpoint and the same prompt ids): identical, tokens lost (the stream is a strict prefix
  of the replay), tokens duplicated (the replay is a strict prefix of the stream, or a token
  repeats where the replay has the next one), or different;
- worker status: KV pages still held, sequences still running or queued on each worker (ZMQ
  StatusRequest, the router's own poll), after the load has ended;
- queue waits: the longest wait in the router's admission queue, from the per-response header.
"""

from __future__ import annotations

import time

from benchmarks.loadgen import PlannedRequest, RequestResult


def classify(served: list[int], ref: list[int]) -> str:
    if served == ref:
        return "equal"
    if len(served) < len(ref) and ref[:len(served)] == served:
        return "lost"
    if len(served) > len(ref) and served[:len(ref)] == ref:
        return "duplicated"
    i = next(i for i, (a, b) in enumerate(zip(served, ref)) if a != b)

    def same(a: list[int], b: list[int]) -> bool:  # agree over up to 8 tokens both have
        n = min(8, len(a), len(b))
        return n > 0 and a[:n] == b[:n]

    if i > 0 and served[i] == served[i - 1] and same(served[i + 1:], ref[i:]):
        return "duplicated"
    if same(served[i:], ref[i + 1:]):
        return "lost"
    return "different"


def replay_greedy(checkpoint: str, planned: list[PlannedRequest], results: list[RequestResult],
                  kv_cache_mib: int = 512, batch: int = 64) -> dict:
    """Compare each completed stream with the offline engine's greedy output of the same prompt."""
    import torch

    from engine.build import EngineConfig
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    torch.set_num_threads(1)  # as the CPU workers run

    done = [(p, r) for p, r in zip(planned, results) if r.ok]
    if any(not r.token_ids for _, r in done):
        raise ValueError("replay needs token ids in the streams (--no-extras was given?)")
    llm = LLM(EngineConfig(checkpoint=checkpoint, kv_cache_bytes=kv_cache_mib << 20))
    t0 = time.perf_counter()
    counts = {"equal": 0, "lost": 0, "duplicated": 0, "different": 0}
    lost_tokens = dup_tokens = 0
    first_bad: list[int] = []
    for i in range(0, len(done), batch):
        part = done[i:i + batch]
        outs = llm.generate([list(p.prompt_ids) for p, _ in part],
                            [SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True)
                             for p, _ in part])
        for (p, r), o in zip(part, outs):
            kind = classify(r.token_ids, o.output_ids)
            counts[kind] += 1
            lost_tokens += max(0, len(o.output_ids) - len(r.token_ids))
            dup_tokens += max(0, len(r.token_ids) - len(o.output_ids))
            if kind != "equal" and len(first_bad) < 5:
                first_bad.append(p.index)
    return {"streams": len(done), **counts, "tokens_lost": lost_tokens, "tokens_duplicated": dup_tokens,
            "first_mismatches": first_bad, "replay_s": time.perf_counter() - t0}


def worker_status(addresses: list[str], timeout_s: float = 5.0) -> list[dict]:
    """Pages held and sequences left on each worker (its answer to the router's status poll)."""
    import zmq

    from wire.protocol import StatusRequest, decode, encode

    out = []
    ctx = zmq.Context.instance()
    for addr in addresses:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        try:
            s.send(encode(StatusRequest()))
            if not s.poll(int(timeout_s * 1000)):
                out.append({"address": addr, "error": "no answer"})
                continue
            st = decode(s.recv())
            out.append({"address": addr, "role": st.role, "running": st.running, "queue_depth": st.queue_depth,
                        "pages_held": st.kv_total_pages - st.kv_free_pages,
                        "sliding_pages_held": st.kv_total_sliding_pages - st.kv_free_sliding_pages})
        finally:
            s.close(0)
    return out


def settled_status(addresses: list[str], timeout_s: float = 10.0) -> list[dict]:
    """Worker status once nothing is left running (or at the deadline: then what leaked)."""
    t_end = time.monotonic() + timeout_s
    while True:
        sts = worker_status(addresses)
        busy = [s for s in sts if s.get("error") or s["running"] or s["queue_depth"] or s["pages_held"]
                or s["sliding_pages_held"]]
        if not busy or time.monotonic() > t_end:
            return sts
        time.sleep(0.2)


def queue_waits(results: list[RequestResult]) -> dict:
    waits = sorted(r.queue_wait_s for r in results if r.queue_wait_s is not None)
    if not waits:
        return {"count": 0, "max_s": None, "p50_s": None, "p99_s": None}
    return {"count": len(waits), "max_s": waits[-1], "p50_s": waits[len(waits) // 2],
            "p99_s": waits[min(len(waits) - 1, int(0.99 * len(waits)))]}

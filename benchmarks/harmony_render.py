"""The router's prompt rendering on the multi-turn workload (CPU): per request, Harmony rendering of the
whole conversation with the per-message token cache (router/harmony_render.py) against without it, on the
same requests in the same process, every prompt checked equal token for token.

    python -m benchmarks.harmony_render [--conversations 64 --turns 8 --system-len 2048 --user-len 100:300
                                         --output-len 100:200] [--out FILE]

The conversations are `tandem bench serve --multi-turn`'s shape (a shared system prompt, then user turns
and assistant answers of the given word counts, one word ~ one token), sent turn by turn across all
conversations (turn 1 of every conversation, then turn 2, ...), as a served run interleaves them.
Assistant answers carry a reasoning string too, which Harmony drops from earlier turns.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from benchmarks.common import environment, out_dir
from benchmarks.loadgen import WORDS
from router.chat_types import ChatMessage, ChatPrompt
from router.harmony import HarmonyFormat


def _range(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(":")
    return int(lo), int(hi or lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--user-len", default="100:300")
    ap.add_argument("--output-len", default="100:200")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    system = words(a.system_len)
    convos = [[ChatMessage(role="system", content=system)] for _ in range(a.conversations)]
    cached, plain = HarmonyFormat(), HarmonyFormat(render_cache_tokens=0)
    assert cached.renderer.enabled, "the render cache's start-up check failed"
    rows = []
    for turn in range(1, a.turns + 1):
        for msgs in convos:
            msgs.append(ChatMessage(role="user", content=words(rng.randint(*_range(a.user_len)))))
            prompt = ChatPrompt(messages=list(msgs))
            t0 = time.perf_counter()
            want = plain.render(prompt)
            t1 = time.perf_counter()
            got = cached.render(prompt)
            t2 = time.perf_counter()
            assert got == want, f"turn {turn}: the cached render differs"
            rows.append({"turn": turn, "tokens": len(want), "plain_ms": (t1 - t0) * 1e3, "cached_ms": (t2 - t1) * 1e3})
            msgs.append(ChatMessage(role="assistant", content=words(rng.randint(*_range(a.output_len))),
                                    reasoning=words(40)))
    by_turn = {}
    print(f"{a.conversations} conversations x {a.turns} turns, system {a.system_len} words; per request (p50 ms):")
    print("turn  tokens  plain  cached  speed-up")
    for turn in range(1, a.turns + 1):
        r = [x for x in rows if x["turn"] == turn]
        p, c = statistics.median(x["plain_ms"] for x in r), statistics.median(x["cached_ms"] for x in r)
        tok = statistics.median(x["tokens"] for x in r)
        by_turn[turn] = {"tokens_p50": tok, "plain_ms_p50": p, "cached_ms_p50": c}
        print(f"{turn:>4}  {tok:>6.0f}  {p:5.2f}  {c:6.2f}  {p / c:7.1f}x")
    later = [x for x in rows if x["turn"] >= 2]
    p, c = statistics.median(x["plain_ms"] for x in later), statistics.median(x["cached_ms"] for x in later)
    print(f"turns 2+: plain {p:.2f} ms, cached {c:.2f} ms p50 ({p / c:.1f}x); all {len(rows)} prompts equal; "
          f"cache {cached.renderer.tokens_held} tokens held, {cached.renderer.hits} hits, {cached.renderer.misses} misses")
    res = {"env": environment(), "args": vars(a), "by_turn": by_turn,
           "turns_2plus": {"plain_ms_p50": p, "cached_ms_p50": c, "speedup": p / c}, "requests": len(rows),
           "all_equal": True, "cache": {"tokens_held": cached.renderer.tokens_held, "hits": cached.renderer.hits,
                                        "misses": cached.renderer.misses}}
    path = a.out or str(out_dir() / "harmony_render.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

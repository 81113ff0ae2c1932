"""The router side of prefix caching: the per-worker index mirrored from cache events, the
cache-aware placement, the local/remote prefill cost model and where its default comes from."""

import json
from pathlib import Path

from common.prefix_hash import block_hashes, identity_root
from router.placement import FleetSnapshot, WorkerView, place
from router.prefill_cost import DEFAULT_REMOTE_PREFILL_MIN_TOKENS, PrefillCost
from router.prefix_index import EVICTED_FULL, STORED_FULL, STORED_SLIDING, PrefixIndex, PromptHashes
from wire.protocol import WorkerStatus

ROOT = Path(__file__).resolve().parents[2]
IDENT = "gpt-oss-x/page16/bfloat16"


def status(events, *, cursor, reset=False, epoch=1, identity=IDENT):
    return WorkerStatus("decode", "w", epoch, True, False, 0, 0, 0, 100, 100, 50, 50, 16, 64, 0.0, identity, 128,
                        cursor, reset, [x for kh in events for x in kh], 0)


def test_prefix_index_mirrors_events_and_applies_the_hit_rule():
    prompt = list(range(1000, 1000 + 300))  # 18 complete blocks, 300 tokens
    hs = block_hashes(prompt, 16, identity_root(IDENT))
    ix = PrefixIndex()
    ix.apply(status([(STORED_FULL, h) for h in hs[:18]] + [(STORED_SLIDING, h) for h in hs[8:16]], cursor=26))
    assert ix.cursor == 26 and ix.enabled
    assert ix.match(hs, 300) == 16 * 16  # full to 18, sliding window 8..15 -> hit at 256
    ix.apply(status([(EVICTED_FULL, hs[3])], cursor=27))
    assert ix.match(hs, 300) == 0  # block 3 gone: a hit at 3 blocks would need sliding blocks 0..2
    ix.apply(status([(STORED_FULL, h) for h in hs[:5]], cursor=5, reset=True))
    assert ix.full == set(hs[:5]) and ix.sliding == set()
    ix.apply(status([], cursor=0, epoch=2))  # a restarted worker: nothing holds
    assert ix.full == set() and ix.cursor == 0
    ix.apply(status([], cursor=0, identity=""))
    assert not ix.enabled and ix.match(hs, 300) == 0


def test_prefix_index_provisional_entries_bridge_the_poll_interval():
    ix = PrefixIndex()
    ix.apply(status([], cursor=0))
    tokens = list(range(5000, 5000 + 200))
    ph = PromptHashes(tokens[:150])
    hs = ph.of(ix, tokens)
    assert hs[:9] == ph.of(ix) and len(hs) == 12
    ix.predict(hs, 199)  # a finished request: prompt + output, last token's KV not computed
    nxt = block_hashes(tokens + [7] * 40, 16, identity_root(IDENT))
    assert ix.match(nxt, 240) == 192  # 12 blocks: full 0..11, sliding 4..11 (its ring's last complete blocks)
    ix.apply(status([(STORED_FULL, h) for h in hs] + [(STORED_SLIDING, h) for h in hs[4:]], cursor=20))
    assert not ix.provisional and ix.match(nxt, 240) == 192


def w(addr, *, queued=0, running=0, free=1000, max_seqs=64):
    return WorkerView(addr, True, True, 0, queued, running, free, 16, max_seqs)


def test_prefix_placement_prefers_the_cached_decode_within_the_load_slack():
    fleet = FleetSnapshot(prefill=(w("p1"), w("p2")), decode=(w("d1", running=2, free=2000), w("d2", running=6)))
    assert place(3000, 10, fleet).decode == "d1"  # no cache anywhere: room, then load
    cached = {"d2": 2800, "p2": 2000}
    p = place(3000, 10, fleet, matches=cached)
    assert p.decode == "d2"
    assert p.prefill is None  # 200 uncached tokens on a decode worker that holds the rest: local
    assert place(3000, 10, fleet, matches=cached, cost=PrefillCost(0)).prefill == "p2"  # 0 = always remote
    busy = FleetSnapshot(prefill=fleet.prefill, decode=(w("d1", running=1), w("d2", running=40, free=300)))
    assert place(3000, 10, busy, matches=cached).decode == "d1"  # beyond the slack: load wins
    # prefill: queued tokens + what it would compute
    pf = FleetSnapshot(prefill=(w("p1", queued=500), w("p2", queued=1500)), decode=(w("d1"),))
    assert place(3000, 10, pf, matches={"p2": 2900}).prefill == "p2"
    assert place(3000, 10, pf).prefill == "p1"
    # a cold prompt never prefills locally, however short
    assert place(50, 10, FleetSnapshot((w("p1"),), (w("d1"),))).prefill == "p1"


def test_prefix_cost_model_thresholds():
    c = PrefillCost(600)
    assert c.prefer_local(1000, 0, 599, 0, 599) and not c.prefer_local(1000, 0, 601, 0, 601)
    assert not c.prefer_local(1000, 5000, 100, 0, 100)  # decode has a queue of its own
    assert c.prefer_local(1000, 0, 800, 0, 1800)  # the prefill worker would recompute much more
    assert not c.prefer_local(0, 0, 10, 0, 10)
    assert not c.prefer_local(64, 0, 200, 0, 200)  # a chat template's preamble is not a conversation


def test_prefix_default_threshold_comes_from_committed_figures():
    serve = json.loads((ROOT / "benchmarks/results/2026-12-02/served/serve/serve_gpu.json").read_text())
    ttft = {r["label"]: r["summary"]["ttft_ms"]["p50"] for r in serve["runs"]}
    model = json.loads((ROOT / "benchmarks/results/2026-12-01/dg17/model_dg17-moe_deepgemm-lin_scaled_mm-bf16attn.json")
                       .read_text())
    ms_2k = next(r["ms"] for r in model["prefill"]["rows"] if r["tokens"] == 2048)
    overhead = ttft["disaggregated single"] - ttft["colocated single"]
    assert round(overhead / (ms_2k / 2048)) == DEFAULT_REMOTE_PREFILL_MIN_TOKENS

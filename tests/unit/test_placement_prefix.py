"""Cache-aware decode placement (router/placement.py), table-driven: a prefix every worker holds does
not attract load, a conversation stays with the worker holding its history until that worker's
backlog costs more than recomputing it, and load decides beyond the balance slack. Plus a burst
simulation and the hit rule that decides what "holds a prefix" means for a shared system prompt."""

from dataclasses import replace

import pytest

from common.prefix_hash import block_hashes, identity_root
from router.placement import FleetSnapshot, WorkerView, place, ttft_cost
from router.prefill_cost import RUNNING_TOKENS
from router.prefix_index import STORED_FULL, STORED_SLIDING, PrefixIndex
from wire.protocol import WorkerStatus

PROMPT = 3000


def d(addr, *, queued=0, running=0, free=10_000, max_seqs=128):
    return WorkerView(addr, True, True, 0, queued, running, free, 16, max_seqs)


CASES = [
    # (case, decode workers, matches, expected decode)
    ("no cache anywhere: room, then load",
     (d("d1", running=8), d("d2", running=3)), {}, "d2"),
    ("a prefix every worker holds (shared system prompt) does not attract load",
     (d("d1", running=9), d("d2", running=3)), {"d1": 2048, "d2": 2048}, "d2"),
    ("... also with the address order reversed",
     (d("d1", running=3), d("d2", running=9)), {"d1": 2048, "d2": 2048}, "d1"),
    ("a conversation stays with its history at similar load",
     (d("d1", running=10), d("d2", running=4)), {"d1": 2800}, "d1"),
    ("its history loses to a prefill backlog larger than the tokens it saves",
     (d("d1", queued=4000), d("d2")), {"d1": 2800}, "d2"),
    ("... but not to a backlog smaller than that",
     (d("d1", queued=2000), d("d2")), {"d1": 2800}, "d1"),
    ("a slightly longer match does not beat a much lighter batch",
     (d("d1", running=14), d("d2", running=2)), {"d1": 2048, "d2": 2000}, "d2"),
    ("running sequences beyond the balance slack (128 // 8 = 16): the fewest running",
     (d("d1", running=20), d("d2", running=3)), {"d1": 2800}, "d2"),
    ("... even though the cached prefix leaves more free KV where it is held",
     (d("d1", running=20, free=9000), d("d2", running=3, free=8000)), {"d1": 2800}, "d2"),
    ("an idle fleet: the worker with the smaller cache takes a new conversation",
     (replace(d("d1"), cached_pages=10), replace(d("d2"), cached_pages=300)), {}, "d1"),
    ("a worker without room is never chosen, whatever it holds",
     (d("d1", free=10), d("d2")), {"d1": 2800}, "d2"),
]


@pytest.mark.parametrize("case,decode,matches,expected", CASES, ids=[c[0] for c in CASES])
def test_placement_prefix_decode_choice(case, decode, matches, expected):
    fleet = FleetSnapshot(prefill=(), decode=decode)
    assert place(PROMPT, 100, fleet, matches=matches).decode == expected


def test_placement_prefix_ttft_cost_counts_backlog_suffix_and_batch():
    w = d("d1", queued=500, running=10)
    assert ttft_cost(w, PROMPT, {"d1": 2800}) == 500 + 200 + 10 * RUNNING_TOKENS
    assert ttft_cost(w, PROMPT, {}) == 500 + PROMPT + 10 * RUNNING_TOKENS


def test_placement_prefix_burst_with_one_holder_spreads_once_its_queue_costs_more():
    """New conversations sharing a prefix only d1 holds, placed one after another (each adds its
    uncached tokens to the chosen worker's queue, as Fleet's router-side events do): d1 takes them
    while its queue costs less than recomputing the prefix on d2, then d2 gets one; d1 keeps the
    larger share (each request costs it 252 tokens instead of 2300) and the balance slack bounds the
    batch difference. The old rule (the longest match wins within the slack) sent the first 17 to d1
    however long its queue."""
    fleet = (d("d1"), d("d2"))
    held, prompt = {"d1": 2048}, 2300
    chosen = []
    for _ in range(60):
        name = place(prompt, 100, FleetSnapshot((), fleet), matches=held).decode
        chosen.append(name)
        fleet = tuple(replace(w, queued_tokens=w.queued_tokens + prompt - held.get(w.address, 0),
                              running=w.running + 1,
                              kv_free_pages=w.kv_free_pages - (prompt - held.get(w.address, 0)) // 16 - 1)
                      if w.address == name else w for w in fleet)
        assert abs(fleet[0].running - fleet[1].running) <= 16 + 1
    # d1 until 266 k + 252 > 2300 (its queue and batch against recomputing 2048 tokens on d2)
    assert chosen.index("d2") == 8, chosen
    assert chosen.count("d1") > chosen.count("d2") >= 20, chosen


def status(events, identity="gpt-oss-x/page16/bfloat16"):
    return WorkerStatus("decode", "w", 1, True, False, 0, 0, 0, 100, 100, 50, 50, 16, 64, 0.0, identity, 128,
                        len(events), False, [x for kh in events for x in kh], 0)


def test_placement_prefix_shared_system_prompt_alone_is_no_match():
    """What a worker can serve from its cache (common/prefix_hash.py): the full-attention blocks of a
    shared system prompt are cached by every conversation that used it, but a hit also needs the
    sliding-window blocks just before its boundary, and a sequence leaves only its own tail's sliding
    blocks cached. So a new conversation matches nothing on a worker that served others with the same
    system prompt, while the next turn of a conversation matches its whole history there."""
    ident = "gpt-oss-x/page16/bfloat16"
    root = identity_root(ident)
    system = list(range(1000, 1000 + 2048))
    conv_a = system + list(range(50_000, 50_200)) + list(range(60_000, 60_150))  # turn 1 + answer
    ha = block_hashes(conv_a, 16, root)
    n_valid = len(conv_a) - 1  # the last answer token has no KV
    last = (n_valid - 1) // 16
    ix = PrefixIndex()
    ix.apply(status([(STORED_FULL, h) for h in ha[:n_valid // 16]]
                    + [(STORED_SLIDING, h) for h in ha[last - 8:n_valid // 16]], ident))
    conv_b = system + list(range(70_000, 70_200))
    assert ix.match(block_hashes(conv_b, 16, root), len(conv_b)) == 0
    turn2 = conv_a + list(range(80_000, 80_180))
    assert ix.match(block_hashes(turn2, 16, root), len(turn2)) == n_valid // 16 * 16

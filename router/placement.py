"""Placement: a pure function of a fleet snapshot. No I/O, no clocks; unit-tested on tables.

Decode is chosen by KV room and running load (it must be able to reserve the prompt's pages now
and keep decoding) and by its cached prefix of the prompt (`matches`, router/prefix_index.py):
among decode workers with room, the one holding the longest prefix wins unless the running loads
differ by more than `balance_slack` sequences (then load decides: a cache-aware policy with a
load guard, as SGLang's router). Prefill by the prefill work ahead of this request's first token:
queued prompt tokens + the tokens it would compute (prompt minus its cached prefix). When the
decode worker holds a prefix and the uncached suffix is short, the request prefills there
(router/prefill_cost.py). When the fleet has no prefill workers the request runs colocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.errors import AdmissionRejected, WorkerUnavailable
from router.prefill_cost import PrefillCost


@dataclass(frozen=True, slots=True)
class WorkerView:
    address: str
    healthy: bool  # answered its last status poll in time
    ready: bool  # model loaded, self-test passed, not draining
    queue_depth: int
    queued_tokens: int  # includes router-side requests sent but not yet reflected in a poll
    running: int
    kv_free_pages: int
    page_size: int
    max_num_seqs: int


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    prefill: tuple[WorkerView, ...]
    decode: tuple[WorkerView, ...]


@dataclass(frozen=True, slots=True)
class Placement:
    decode: str
    prefill: str | None  # None = colocated


def _pages(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)


def place(prompt_len: int, max_tokens: int, fleet: FleetSnapshot, exclude: frozenset[str] = frozenset(),
          colocated: bool = False, matches: dict[str, int] | None = None,
          cost: PrefillCost = PrefillCost()) -> Placement:
    """Pick (decode, prefill); prefill None = prefill on the decode worker. `matches`: address ->
    prompt tokens that worker holds in its prefix cache. Raises WorkerUnavailable when no live
    worker of a needed role exists, AdmissionRejected when live decode workers exist but none has
    room right now."""
    matches = matches or {}
    live_decode = [w for w in fleet.decode if w.healthy and w.ready and w.address not in exclude]
    if not live_decode:
        raise WorkerUnavailable("no decode worker is up and ready")
    page = live_decode[0].page_size

    def need(w: WorkerView) -> int:  # pages to reserve: the cached prefix is already there
        return _pages(prompt_len + 1, page) - matches.get(w.address, 0) // page

    roomy = [w for w in live_decode if w.kv_free_pages >= need(w) + w.running and w.running < w.max_num_seqs]
    if not roomy:
        raise AdmissionRejected(f"no decode worker has KV room for {prompt_len} prompt tokens right now")
    decode = max(roomy, key=_decode_key(roomy, matches, need))
    if colocated:
        return Placement(decode.address, None)
    live_prefill = [w for w in fleet.prefill if w.healthy and w.ready and w.address not in exclude]
    if not fleet.prefill:
        return Placement(decode.address, None)
    if not live_prefill:
        raise WorkerUnavailable("no prefill worker is up and ready")
    prefill = min(live_prefill, key=lambda w: (w.queued_tokens + prompt_len - matches.get(w.address, 0),
                                               w.queue_depth, w.address))
    cached_d = matches.get(decode.address, 0)
    if cost.prefer_local(cached_d, decode.queued_tokens, prompt_len - cached_d, prefill.queued_tokens,
                         prompt_len - matches.get(prefill.address, 0)):
        return Placement(decode.address, None)
    return Placement(decode.address, prefill.address)


def _decode_key(roomy: list[WorkerView], matches: dict[str, int], need):
    """Most free KV after this request, then fewest running sequences; address breaks ties stably.
    With a cached prefix somewhere and loads within `balance_slack`, the longest prefix first."""
    def base(w: WorkerView) -> tuple:
        return (w.kv_free_pages - need(w) - w.running, -w.running, w.address)

    running = [w.running for w in roomy]
    slack = max(4, max(w.max_num_seqs for w in roomy) // 8)
    if not any(matches.get(w.address, 0) for w in roomy) or max(running) - min(running) > slack:
        return base
    return lambda w: (matches.get(w.address, 0), *base(w))

"""Placement: a pure function of a fleet snapshot. No I/O, no clocks; unit-tested on tables.

Decode is chosen by KV room and running load (it must be able to reserve the prompt's pages now
and keep decoding) and by its cached prefix of the prompt (`matches`, router/prefix_index.py):
among decode workers with room, the one holding the longest prefix wins unless the running loads
differ by more than `balance_slack` sequences (then load decides: a cache-aware policy with a
load guard, as SGLang's router). Prefill by the prefill work ahead of this request's first token:
queued prompt tokens + the tokens it would compute (prompt minus its cached prefix). When the
decode worker holds a prefix and the uncached suffix is short, the request prefills there
(router/prefill_cost.py). When the fleet has no prefill workers the request runs colocated.

Three outcomes the admission queue (router.admission) acts on: a Placement; AdmissionRejected
(live workers, no room now: the request waits); WorkerUnavailable (no live worker of a needed
role: 503) and InvalidRequest (larger than any live decode worker's whole KV cache: 400) end it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.errors import AdmissionRejected, InvalidRequest, WorkerUnavailable
from router.prefill_cost import PrefillCost


@dataclass(frozen=True, slots=True)
class WorkerView:
    address: str
    healthy: bool  # answered its last status poll in time
    ready: bool  # model loaded, self-test passed, not draining
    queue_depth: int
    queued_tokens: int  # includes router-side requests sent but not yet reflected in a poll
    running: int  # decode: sequences holding a slot (running, waiting, awaiting KV, placed since the poll)
    kv_free_pages: int  # decode: net of the router's placements since the last poll
    page_size: int
    max_num_seqs: int
    kv_total_pages: int = 0  # 0: unknown (no status yet)


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


def _live(workers: tuple[WorkerView, ...], exclude: frozenset[str]) -> list[WorkerView]:
    """Live workers, other than the excluded ones (where this request already failed) when possible:
    a request is retried on the same worker rather than not at all."""
    live = [w for w in workers if w.healthy and w.ready]
    return [w for w in live if w.address not in exclude] or live


def place(prompt_len: int, max_tokens: int, fleet: FleetSnapshot, exclude: frozenset[str] = frozenset(),
          colocated: bool = False, max_prefill_queue: int | None = None, matches: dict[str, int] | None = None,
          cost: PrefillCost = PrefillCost()) -> Placement:
    """Pick (decode, prefill); prefill None = prefill on the decode worker. `matches`: address ->
    prompt tokens that worker holds in its prefix cache. Raises WorkerUnavailable when no live
    worker of a needed role exists, InvalidRequest when the request is larger than every live decode
    worker's KV cache, and AdmissionRejected when live decode workers exist but none has room right
    now, or every live prefill worker already has `max_prefill_queue` requests (a prefill backlog
    would spend the decode reservation's transfer deadline in the prefill queue; the router queue
    holds it instead)."""
    matches = matches or {}
    live_decode = _live(fleet.decode, exclude)
    if not live_decode:
        raise WorkerUnavailable("no decode worker is up and ready")
    live_prefill = _live(fleet.prefill, exclude)
    if fleet.prefill and not colocated and not live_prefill:
        raise WorkerUnavailable("no prefill worker is up and ready")
    page = live_decode[0].page_size
    whole = [w.kv_total_pages for w in live_decode if w.kv_total_pages]
    if whole and _pages(prompt_len + max_tokens, page) > max(whole):
        raise InvalidRequest(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the KV cache "
                             f"of every decode worker ({max(whole) * page} tokens)", param="max_tokens")

    def need(w: WorkerView) -> int:  # pages to reserve: the cached prefix is already there
        return _pages(prompt_len + 1, page) - matches.get(w.address, 0) // page

    roomy = [w for w in live_decode if w.kv_free_pages >= need(w) + w.running and w.running < w.max_num_seqs]
    if not roomy:
        raise AdmissionRejected(f"no decode worker has KV room for {prompt_len} prompt tokens right now")
    decode = max(roomy, key=_decode_key(roomy, matches, need))
    if colocated or not fleet.prefill:
        return Placement(decode.address, None)
    if max_prefill_queue is not None:
        live_prefill = [w for w in live_prefill if w.queue_depth < max_prefill_queue]
        if not live_prefill:
            raise AdmissionRejected(f"every prefill worker has {max_prefill_queue} requests queued")
    prefill = min(live_prefill, key=lambda w: (w.queued_tokens + prompt_len - matches.get(w.address, 0),
                                               w.queue_depth, w.address))
    cached_d = matches.get(decode.address, 0)
    if cost.prefer_local(cached_d, decode.queued_tokens, prompt_len - cached_d, prefill.queued_tokens,
                         prompt_len - matches.get(prefill.address, 0)):
        return Placement(decode.address, None)
    return Placement(decode.address, prefill.address)


def pages_for(prompt_len: int, page_size: int) -> int:
    """Full-attention pages a decode worker reserves at admission (prompt + the first token)."""
    return _pages(prompt_len + 1, page_size)


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

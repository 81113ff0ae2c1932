"""Placement: a pure function of a fleet snapshot. No I/O, no clocks; unit-tested on tables.

Decode is chosen by KV room and running load (it must be able to reserve the prompt's pages now
and keep decoding); prefill by queued prompt tokens (prefill is batch 1, so queued tokens are its
waiting time). When the fleet has no prefill workers the request runs colocated on the decode
worker (it prefills locally).

Three outcomes the admission queue (router.admission) acts on: a Placement; AdmissionRejected
(live workers, no room now: the request waits); WorkerUnavailable (no live worker of a needed
role: 503) and InvalidRequest (larger than any live decode worker's whole KV cache: 400) end it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.errors import AdmissionRejected, InvalidRequest, WorkerUnavailable


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
          colocated: bool = False, max_prefill_queue: int | None = None) -> Placement:
    """Pick (decode, prefill). Raises WorkerUnavailable when no live worker of a needed role exists,
    InvalidRequest when the request is larger than every live decode worker's KV cache, and
    AdmissionRejected when live decode workers exist but none has room right now, or every live
    prefill worker already has `max_prefill_queue` requests (a prefill backlog would spend the
    decode reservation's transfer deadline in the prefill queue; the router queue holds it instead)."""
    live_decode = _live(fleet.decode, exclude)
    if not live_decode:
        raise WorkerUnavailable("no decode worker is up and ready")
    live_prefill = _live(fleet.prefill, exclude)
    if fleet.prefill and not colocated and not live_prefill:
        raise WorkerUnavailable("no prefill worker is up and ready")
    page_size = live_decode[0].page_size
    whole = [w.kv_total_pages for w in live_decode if w.kv_total_pages]
    if whole and _pages(prompt_len + max_tokens, page_size) > max(whole):
        raise InvalidRequest(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the KV cache "
                             f"of every decode worker ({max(whole) * page_size} tokens)", param="max_tokens")
    need = _pages(prompt_len + 1, page_size)
    roomy = [w for w in live_decode if w.kv_free_pages >= need + w.running and w.running < w.max_num_seqs]
    if not roomy:
        raise AdmissionRejected(f"no decode worker has KV room for {prompt_len} prompt tokens right now")
    # Most free KV after this request, then fewest running sequences; address breaks ties stably.
    decode = max(roomy, key=lambda w: (w.kv_free_pages - need - w.running, -w.running, w.address))
    if colocated or not fleet.prefill:
        return Placement(decode.address, None)
    if max_prefill_queue is not None:
        live_prefill = [w for w in live_prefill if w.queue_depth < max_prefill_queue]
        if not live_prefill:
            raise AdmissionRejected(f"every prefill worker has {max_prefill_queue} requests queued")
    prefill = min(live_prefill, key=lambda w: (w.queued_tokens, w.queue_depth, w.address))
    return Placement(decode.address, prefill.address)


def pages_for(prompt_len: int, page_size: int) -> int:
    """Full-attention pages a decode worker reserves at admission (prompt + the first token)."""
    return _pages(prompt_len + 1, page_size)

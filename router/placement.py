"""Placement: a pure function of a fleet snapshot. No I/O, no clocks; unit-tested on tables.

Decode is chosen by KV room and running load (it must be able to reserve the prompt's pages now
and keep decoding); prefill by queued prompt tokens (prefill is batch 1, so queued tokens are its
waiting time). When the fleet has no prefill workers the request runs colocated on the decode
worker (it prefills locally).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.errors import AdmissionRejected, WorkerUnavailable


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
          colocated: bool = False) -> Placement:
    """Pick (decode, prefill). Raises WorkerUnavailable when no live worker of a needed role exists,
    AdmissionRejected when live decode workers exist but none has room right now."""
    live_decode = [w for w in fleet.decode if w.healthy and w.ready and w.address not in exclude]
    if not live_decode:
        raise WorkerUnavailable("no decode worker is up and ready")
    need = _pages(prompt_len + 1, live_decode[0].page_size)
    roomy = [w for w in live_decode if w.kv_free_pages >= need + w.running and w.running < w.max_num_seqs]
    if not roomy:
        raise AdmissionRejected(f"no decode worker has KV room for {prompt_len} prompt tokens right now")
    # Most free KV after this request, then fewest running sequences; address breaks ties stably.
    decode = max(roomy, key=lambda w: (w.kv_free_pages - need - w.running, -w.running, w.address))
    if colocated:
        return Placement(decode.address, None)
    live_prefill = [w for w in fleet.prefill if w.healthy and w.ready and w.address not in exclude]
    if not fleet.prefill:
        return Placement(decode.address, None)
    if not live_prefill:
        raise WorkerUnavailable("no prefill worker is up and ready")
    prefill = min(live_prefill, key=lambda w: (w.queued_tokens, w.queue_depth, w.address))
    return Placement(decode.address, prefill.address)

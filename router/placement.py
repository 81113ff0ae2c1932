"""Placement: a pure function of a fleet snapshot. No I/O, no clocks; unit-tested on tables.

Decode is chosen among the workers that can reserve the prompt's pages now and have a free
sequence slot ("roomy"), in one of two ways:
  * by load: when the running loads differ by more than `balance_slack` sequences, the fewest
    running (decode fairness; SGLang's router has the same guard); when no worker's prefix cache
    holds more of the prompt than another's, the most free KV after this request, then the fewest
    running (a prefix every worker holds, such as a shared system prompt, saves the same
    everywhere and must not attract load);
  * by estimated time to the first token, in prefill-token equivalents (router/prefill_cost.py):
        queued prefill tokens + this prompt's uncached tokens there + RUNNING_TOKENS x running
    A cached prefix wins by the tokens it saves, and loses once the worker holding it is that much
    busier (a prefill backlog, a larger batch): a conversation stays on the worker that holds its
    history unless that worker's queue costs more than recomputing the history elsewhere. As
    Dynamo's KV router and llm-d's prefix scorer do, the match is weighed, never taken blindly.
Prefill by the prefill work ahead of this request's first token: queued prompt tokens + the tokens
it would compute (prompt minus its cached prefix). When the decode worker holds a prefix and the
uncached suffix is short, the request prefills there (router/prefill_cost.py). When the fleet has
no prefill workers the request runs colocated.

Liveness: a worker is live (healthy and ready), late (it stopped answering its status polls, but
it was ready and answered one within the grace period: `is_late`) or gone. Late is not gone: on a
saturated host a worker can miss several polls and come back, and "overload queues rather than
fails".

Outcomes the admission queue (router.admission) acts on: a Placement; AdmissionRejected (live
workers, no room now: the request waits); WorkerLate, a subclass (no live worker of a needed role,
but a late one: the request waits for it); WorkerUnavailable (a needed role has no live and no
late worker: 503) and InvalidRequest (larger than any live decode worker's whole KV cache: 400)
end it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.errors import AdmissionRejected, InvalidRequest, WorkerLate, WorkerUnavailable
from router.prefill_cost import RUNNING_TOKENS, PrefillCost


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
    cached_pages: int = 0  # decode: pages its prefix cache alone holds (evictable; counted in kv_free_pages)
    late: bool = False  # not healthy, but trusted to come back (is_late): requests wait for it


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


def is_late(*, healthy: bool, was_ready: bool, answered_ago_s: float, disconnected: bool, grace_s: float) -> bool:
    """A worker marked down for missed status polls is late, not gone, when its last answer, less than
    `grace_s` ago, said ready and not draining, and its connection has not dropped since. Never ready
    (still loading, or never answered) or draining: gone, nothing to wait for. A dropped connection
    means the process exited or restarted (no heartbeats run on the connection, so a live process,
    however starved, keeps it): a restart reloads the model, far longer than any grace period, and
    its first answered poll takes it back anyway; waiting would only delay the 503 that lets the
    client go elsewhere."""
    return not healthy and was_ready and not disconnected and answered_ago_s < grace_s


def _live(workers: tuple[WorkerView, ...], exclude: frozenset[str]) -> list[WorkerView]:
    """Live workers, other than the excluded ones (where this request already failed) when possible:
    a request is retried on the same worker rather than not at all."""
    live = [w for w in workers if w.healthy and w.ready]
    return [w for w in live if w.address not in exclude] or live


def place(prompt_len: int, max_tokens: int, fleet: FleetSnapshot, exclude: frozenset[str] = frozenset(),
          colocated: bool = False, max_prefill_queue: int | None = None, matches: dict[str, int] | None = None,
          cost: PrefillCost = PrefillCost()) -> Placement:
    """Pick (decode, prefill); prefill None = prefill on the decode worker. `matches`: address ->
    prompt tokens that worker holds in its prefix cache. Raises WorkerUnavailable when a needed role
    has no live and no late worker, WorkerLate when a needed role has only late ones, InvalidRequest when the request is larger than every live decode
    worker's KV cache, and AdmissionRejected when live decode workers exist but none has room right
    now, or every live prefill worker already has `max_prefill_queue` requests (a prefill backlog
    would spend the decode reservation's transfer deadline in the prefill queue; the router queue
    holds it instead)."""
    matches = matches or {}
    live_decode = _live(fleet.decode, exclude)
    live_prefill = _live(fleet.prefill, exclude)
    missing = [(role, workers) for role, workers, live in (("decode", fleet.decode, live_decode),
                                                          ("prefill", fleet.prefill, live_prefill))
               if not live and (role == "decode" or (fleet.prefill and not colocated))]
    for role, workers in missing:  # a role with nothing to wait for ends it, whatever the other does
        if not any(w.late for w in workers):
            raise WorkerUnavailable(f"no {role} worker is up and ready")
    if missing:
        raise WorkerLate(f"no {missing[0][0]} worker answers its status polls right now; waiting for a late one")
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
    decode = max(roomy, key=_decode_key(roomy, matches, need, prompt_len))
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


def balance_slack(roomy: list[WorkerView]) -> int:
    """Running sequences two decode workers may differ by before load alone decides."""
    return max(4, max(w.max_num_seqs for w in roomy) // 8)


def ttft_cost(w: WorkerView, prompt_len: int, matches: dict[str, int]) -> int:
    """Work ahead of this request's first token on decode worker w, in prefill-token equivalents:
    its queued prefill tokens, this prompt's tokens it would compute, and its running batch."""
    return w.queued_tokens + prompt_len - matches.get(w.address, 0) + RUNNING_TOKENS * w.running


def _decode_key(roomy: list[WorkerView], matches: dict[str, int], need, prompt_len: int = 0):
    """The max() key choosing among roomy decode workers (module docstring): the fewest running
    when the loads differ beyond the slack; room then load when the cached prefixes do not differ;
    else the lowest estimated time to first token. Room and load break ties, then the smaller
    cache (SGLang's router sends an unmatched request to the worker with the smallest tree: without
    it an idle fleet gave every new conversation to the same worker, the highest address, and
    stickiness then kept their later turns there), the address last."""
    def base(w: WorkerView) -> tuple:  # on an idle fleet, the least cached: new conversations spread
        return (w.kv_free_pages - need(w) - w.running, -w.running, -w.cached_pages, w.address)

    running = [w.running for w in roomy]
    if max(running) - min(running) > balance_slack(roomy):
        return lambda w: (-w.running, *base(w))  # not room first: a cached prefix needs fewer pages
    if len({matches.get(w.address, 0) for w in roomy}) == 1:
        return base
    return lambda w: (-ttft_cost(w, prompt_len, matches), *base(w))

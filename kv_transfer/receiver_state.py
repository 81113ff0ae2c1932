"""ReceiverBook: the decode side's per-request bookkeeping, free of I/O (the NIXL and loopback
receivers feed it events and act on what it returns; tests drive it directly).

Lifecycle of one request on one decode rank:

  expect ──► WAITING ──claim accepted──► TRANSFERRING ──every expected sender wrote every layer──► DONE
                │                              │
                └── deadline / abort / peer dead / a sender refuses ──► FAILED
                                                   │
          no accepted claim, or every claimant ended or is dead ──► releasable ──take_releasable()──► owner frees
          otherwise ──► quarantined (a claimant may still write)

Fail-closed rules:
  * A sender writes nothing before its Claim is accepted, and a claim is refused once the request
    failed, so a failed request without accepted claims can release its pages at once.
  * A claimant's writes are over when it sends Ended (it has no WRITE in flight and posts none),
    or when its epoch is known dead: the transport reports it gone, the owner says so
    (`peer_dead`), or the same sender identity shows up with a newer epoch (it restarted).
  * Stale input (another decode epoch, an unknown request, a sender that is not the claimant) is
    dropped and counted, never applied.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kv_transfer.interface import (FailureReason, QuarantinedPages, ReleasedPages, TransferOutcome,
                                   TransferStatus)
from kv_transfer.messages import Cancel, Claim, ClaimReply, Ended, KVCompat, LayerDone
from kv_transfer.plan import src_ranks_for
from model.kv_cache import SeqPages

_REMEMBER_FINISHED = 4096  # recently finished request ids, so late claims are refused, not retried


@dataclass(slots=True)
class _Claimant:
    agent: str
    layers: set[int] = field(default_factory=set)
    ended: bool = False
    dead: bool = False

    @property
    def settled(self) -> bool:
        return self.ended or self.dead


@dataclass(slots=True)
class _Request:
    request_id: str
    pages: SeqPages
    num_tokens: int
    deadline: float  # monotonic
    started: float
    status: TransferStatus = TransferStatus.WAITING
    reason: FailureReason | None = None
    detail: str = ""
    sender_tp: int = 0  # learnt from the first accepted claim
    claims: dict[int, _Claimant] = field(default_factory=dict)  # by sender rank
    num_bytes: int = 0
    ended_at: float | None = None

    def settled(self) -> bool:
        return all(c.settled for c in self.claims.values())


class ReceiverBook:
    def __init__(self, epoch: int, tp_rank: int, tp_size: int, compat: KVCompat,
                 on_terminal: Callable[[TransferOutcome], None] | None = None) -> None:
        self.epoch, self.tp_rank, self.tp_size, self.compat = epoch, tp_rank, tp_size, compat
        self._on_terminal = on_terminal  # metrics hook, called once per request
        self.layers = frozenset(compat.full_layers) | frozenset(compat.sliding_layers)
        self._reqs: dict[str, _Request] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._latest_epoch: dict[tuple[str, int], tuple[int, str]] = {}  # (engine, rank) -> (epoch, agent)
        self._dead_agents: set[str] = set()
        self._outbox: list[tuple[str, Cancel]] = []  # (claimant agent, message) to send
        self.num_stale = 0

    # ---- owner calls ---------------------------------------------------------------------------
    def expect(self, request_id: str, pages: SeqPages, num_tokens: int, deadline: float, now: float) -> None:
        assert request_id not in self._reqs, f"request {request_id} already expected"
        self._finished.pop(request_id, None)
        self._reqs[request_id] = _Request(request_id, pages, num_tokens, deadline, now)

    def status(self, request_id: str) -> TransferStatus:
        return self._reqs[request_id].status

    def outcome(self, request_id: str, now: float) -> TransferOutcome:
        r = self._reqs[request_id]
        return TransferOutcome(r.request_id, r.status, r.reason, r.detail, r.num_bytes,
                               (r.ended_at if r.ended_at is not None else now) - r.started)

    def abort(self, request_id: str, reason: FailureReason, detail: str, now: float) -> None:
        """Fail a request (no-op once terminal); its claimants get a Cancel."""
        r = self._reqs[request_id]
        if not r.status.terminal:
            self._fail(r, reason, detail or "aborted by decode", now)

    def take_cancels(self) -> list[tuple[str, Cancel]]:
        """Cancel messages owed to claimants of requests that failed here since the last call."""
        out, self._outbox = self._outbox, []
        return out

    def finish(self, request_id: str) -> None:
        r = self._reqs[request_id]
        assert r.status == TransferStatus.DONE, f"finish() of a {r.status.name} request; failed pages come back via take_releasable()"
        self._forget(request_id)

    def take_releasable(self) -> list[ReleasedPages]:
        out = [ReleasedPages(r.request_id, r.pages) for r in self._reqs.values()
               if r.status == TransferStatus.FAILED and r.settled()]
        for rel in out:
            self._forget(rel.request_id)
        return out

    def quarantined(self) -> list[QuarantinedPages]:
        return [QuarantinedPages(r.request_id, r.pages, tuple(c.agent for c in r.claims.values() if not c.settled),
                                 r.reason or FailureReason.ABORTED)
                for r in self._reqs.values() if r.status == TransferStatus.FAILED and not r.settled()]

    def tick(self, now: float) -> None:
        """Enforce deadlines."""
        for r in self._reqs.values():
            if not r.status.terminal and now > r.deadline:
                self._fail(r, FailureReason.DEADLINE, "transfer deadline exceeded", now)

    def live_claimants(self) -> set[str]:
        """Agents that may still write into some request's pages (to probe for liveness)."""
        return {c.agent for r in self._reqs.values() if r.status != TransferStatus.DONE
                for c in r.claims.values() if not c.settled}

    # ---- network events ------------------------------------------------------------------------
    def on_claim(self, c: Claim, now: float) -> ClaimReply:
        def refuse(reason: FailureReason, detail: str, *, fail_request: bool = False) -> ClaimReply:
            r = self._reqs.get(c.request_id)
            if fail_request and r is not None and not r.status.terminal:
                self._fail(r, reason, detail, now)
            return ClaimReply(c.request_id, False, False, reason, detail)

        if c.decode_epoch != self.epoch:
            return refuse(FailureReason.EPOCH_MISMATCH, f"decode epoch is {self.epoch}, claim names {c.decode_epoch}")
        if c.compat != self.compat:
            return refuse(FailureReason.HANDSHAKE_MISMATCH, "incompatible KV layout: " + "; ".join(self.compat.diff(c.compat)),
                          fail_request=True)
        if not self._note_epoch(c.sender_engine_id, c.sender_rank, c.sender_epoch, c.sender_agent, now):
            return refuse(FailureReason.EPOCH_MISMATCH, f"sender epoch {c.sender_epoch} is older than one seen before")
        r = self._reqs.get(c.request_id)
        if r is None:
            if c.request_id in self._finished:
                return refuse(FailureReason.ABORTED, "request is no longer expected here")
            return ClaimReply(c.request_id, False, True, None, "not expected yet")
        if r.status.terminal:
            return refuse(r.reason or FailureReason.ABORTED, f"request already {r.status.name}: {r.detail}")
        if r.sender_tp and r.sender_tp != c.sender_tp:
            return refuse(FailureReason.HANDSHAKE_MISMATCH, f"sender TP {c.sender_tp} != {r.sender_tp} of earlier claims",
                          fail_request=True)
        if c.sender_rank not in src_ranks_for(self.compat.total_num_kv_heads, self.tp_rank, self.tp_size, c.sender_tp):
            return refuse(FailureReason.HANDSHAKE_MISMATCH, f"prefill rank {c.sender_rank}/{c.sender_tp} holds no "
                          f"heads of decode rank {self.tp_rank}/{self.tp_size}", fail_request=True)
        prev = r.claims.get(c.sender_rank)
        if prev is not None and prev.agent != c.sender_agent:
            return refuse(FailureReason.ABORTED, f"rank {c.sender_rank} already claimed by {prev.agent}")
        r.sender_tp = c.sender_tp
        r.claims[c.sender_rank] = prev or _Claimant(c.sender_agent)
        r.status = TransferStatus.TRANSFERRING
        return ClaimReply(c.request_id, True, False, None, "")

    def on_layer_done(self, msg: LayerDone, agent: str, now: float) -> bool:
        """Returns False (and counts) when the notification is stale."""
        r = self._reqs.get(msg.request_id)
        claim = r.claims.get(msg.sender_rank) if r is not None else None
        if (msg.decode_epoch != self.epoch or r is None or claim is None or claim.agent != agent
                or r.status.terminal or not self.layers.issuperset(msg.layers)):
            self.num_stale += 1
            return False
        if not claim.layers.issuperset(msg.layers):
            claim.layers.update(msg.layers)
            r.num_bytes += msg.num_bytes
        expected = src_ranks_for(self.compat.total_num_kv_heads, self.tp_rank, self.tp_size, r.sender_tp)
        if all(s in r.claims and r.claims[s].layers == self.layers for s in expected):
            r.status, r.ended_at = TransferStatus.DONE, now
            if self._on_terminal is not None:
                self._on_terminal(self.outcome(r.request_id, now))
        return True

    def on_ended(self, msg: Ended, now: float) -> bool:
        r = self._reqs.get(msg.request_id)
        if msg.decode_epoch != self.epoch or r is None:
            self.num_stale += 1
            return False
        claim = r.claims.get(msg.sender_rank)
        if claim is not None and claim.agent == msg.sender_agent:
            claim.ended = True
        elif claim is not None or msg.ok:
            self.num_stale += 1
            return False
        if not msg.ok and not r.status.terminal:
            # A claimant that gave up, or an assigned prefill rank refusing before it claimed.
            self._fail(r, msg.reason or FailureReason.ABORTED, f"prefill ended the transfer: {msg.detail}", now)
        return True

    def on_peer_dead(self, agent: str, detail: str, now: float) -> None:
        """The agent's epoch is dead: its claims are settled and its unfinished requests fail."""
        self._dead_agents.add(agent)
        for r in self._reqs.values():
            hit = [c for c in r.claims.values() if c.agent == agent]
            for c in hit:
                c.dead = True
            if hit and not r.status.terminal:
                self._fail(r, FailureReason.PEER_DEAD, detail, now)

    # ---- internals -----------------------------------------------------------------------------
    def _note_epoch(self, engine_id: str, rank: int, epoch: int, agent: str, now: float) -> bool:
        """Track the newest epoch per sender identity; a newer one proves the older is dead."""
        if agent in self._dead_agents:
            return False
        key = (engine_id, rank)
        seen = self._latest_epoch.get(key)
        if seen is not None and epoch < seen[0]:
            return False
        self._latest_epoch[key] = (epoch, agent)
        if seen is not None and epoch > seen[0]:
            self.on_peer_dead(seen[1], f"sender restarted (epoch {seen[0]} -> {epoch})", now)
        return True

    def _fail(self, r: _Request, reason: FailureReason, detail: str, now: float) -> None:
        r.status, r.reason, r.detail, r.ended_at = TransferStatus.FAILED, reason, detail, now
        if self._on_terminal is not None:
            self._on_terminal(self.outcome(r.request_id, now))
        self._outbox += [(c.agent, Cancel(r.request_id, self.epoch, reason, detail))
                         for c in r.claims.values() if not c.settled]

    def _forget(self, request_id: str) -> None:
        del self._reqs[request_id]
        self._finished[request_id] = None
        while len(self._finished) > _REMEMBER_FINISHED:
            self._finished.popitem(last=False)

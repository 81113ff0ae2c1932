"""Rank 0's stand-ins for the runner, the KV sender and the KV receiver of a TP worker.

DecodeEngine and PrefillEngine keep calling `runner.run`, `tx.start/poll/finish`,
`rx.expect/progress/poll/take_releasable` as if the worker were one process; each call becomes
one command to the group (engine.tp.messages) plus rank 0's own share, and the answers are
combined so the engines see ONE worker:
  status   MIN over ranks (TransferStatus is ordered FAILED < WAITING < TRANSFERRING < DONE): one
           failed rank fails the request, DONE needs every rank. A request failed on some ranks
           only is aborted on the others at once (fail-closed: no rank keeps writing / waiting).
  pages    a failed request's decode pages are handed back only when EVERY rank's receiver
           released them (each may wait for its own writers to confirm they stopped).
  outcome  the first failing rank's reason and detail; bytes summed, seconds the longest.
`rx.poll(rid)` answers from the statuses gathered by the latest `progress()` (one collective for
all tracked requests per loop iteration) and only polls the group itself when that snapshot was
already read for this request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from common.errors import ConfigError, ProtocolError, WorkerUnavailable
from engine.build import EngineParts
from engine.runner import ModelRunner, StepHandle
from engine.scheduler import ScheduledSeq
from engine.sequence import TokenLogprob
from engine.tp import messages as m
from engine.tp.group import RankGroup
from engine.tp.local_kv import LocalKV
from engine.tp.step import StepEncoder
from kv_transfer.interface import (FailureReason, KVReceiver, KVSender, QuarantinedPages, ReleasedPages,
                                   TransferOutcome, TransferStatus)
from kv_transfer.messages import TransferRequest
from kv_transfer.messages import encode as encode_kv
from model.kv_cache import SeqPages


@dataclasses.dataclass(slots=True)
class RankParts:
    """What `setup` builds on every rank: the engine parts and this rank's KV endpoint."""

    parts: EngineParts
    sender: KVSender | None = None
    receiver: KVReceiver | None = None


def lead(group: RankGroup, rp: RankParts) -> RankParts:
    """Rank 0, after its own setup: the parts the worker's engine uses (proxies when TP > 1)."""
    if group.world == 1:
        return rp
    kv = LocalKV(rp.sender, rp.receiver)
    group.local_bye = kv.bye
    group.serving()
    parts = dataclasses.replace(rp.parts, runner=GroupRunner(group, rp.parts.runner))
    return RankParts(parts, GroupSender(group, kv) if rp.sender else None,
                     GroupReceiver(group, kv) if rp.receiver else None)


def _raise_errors(replies: list[m.Done]) -> None:
    for r, d in enumerate(replies):
        if d.error:
            raise ProtocolError(d.error if r == 0 else f"tensor-parallel rank {r}: {d.error}")


def _combine(rid: str, outs: list[m.Outcome], cause: int | None = None) -> TransferOutcome:
    """`cause`: the rank that failed first (the others were aborted because of it)."""
    status = min(TransferStatus(o.status) for o in outs)
    ranks = ([cause] if cause is not None else []) + list(range(len(outs)))
    failed = next(((r, outs[r]) for r in ranks if outs[r].known and outs[r].status == TransferStatus.FAILED), None)
    reason, detail = None, ""
    if status == TransferStatus.FAILED:
        r, o = failed if failed is not None else (0, outs[0])
        reason = FailureReason(o.reason) if o.reason else FailureReason.ABORTED
        detail = o.detail if r == 0 else f"tensor-parallel rank {r}: {o.detail}"
    return TransferOutcome(rid, status, reason, detail, sum(o.num_bytes for o in outs), max(o.seconds for o in outs))


class GroupRunner:
    """ModelRunner.run for the group: STEP to the followers, then rank 0's forward and sampling."""

    interruptible = False  # leaving the forward early would strand the followers in its all-reduces
    # Overlapped like a single rank: when a step's inputs include tokens the step in flight sampled,
    # the followers get the ids by a device broadcast from rank 0 (Step.ids_on_device).
    supports_overlap = True

    def __init__(self, group: RankGroup, local: ModelRunner) -> None:
        self.group, self.local, self.encoder = group, local, StepEncoder()

    @property
    def device(self):
        return self.local.device

    def launch(self, items: list[ScheduledSeq], prev: StepHandle | None = None, no: int = 0,
               on_layer_done: Callable[[int], None] | None = None) -> StepHandle:
        step = self.encoder.encode(items, on_layer_done is not None)
        self.group.command(step)
        self.local.share_inputs = self.group.broadcast_inputs if step.ids_on_device else None
        try:
            return self.local.launch(items, prev, no, on_layer_done)
        except RuntimeError as e:  # the forward's all-reduce: a follower died mid-step
            lost = self.group.lost(wait_s=2.0)
            if lost is None:
                raise
            raise lost from e

    def collect(self, h: StepHandle) -> tuple[list[int | None], list[TokenLogprob | None]]:
        return self.local.collect(h)

    def finish_sample(self, h: StepHandle) -> None:
        self.local.finish_sample(h)  # sampling is rank 0's alone

    def run(self, items: list[ScheduledSeq], on_layer_done: Callable[[int], None] | None = None
            ) -> tuple[list[int | None], list[TokenLogprob | None]]:
        return self.collect(self.launch(items, None, 0, on_layer_done))


class GroupReceiver(KVReceiver):
    def __init__(self, group: RankGroup, kv: LocalKV) -> None:
        self.group, self.kv, self.rx = group, kv, kv.rx
        self._tracked: dict[str, SeqPages] = {}  # expected, not finished, pages not yet released everywhere
        self._status: dict[str, TransferStatus] = {}  # group status as of the latest progress()
        self._fresh: set[str] = set()  # statuses not yet read by poll()
        self._failures: dict[str, TransferOutcome] = {}
        self._released: dict[str, set[int]] = {}  # request -> ranks whose receiver released its pages
        self._ready: list[ReleasedPages] = []

    @property
    def endpoint(self) -> str:
        return self.rx.endpoint

    @property
    def epoch(self) -> int:
        return self.rx.epoch

    def set_rank_endpoints(self, endpoints: tuple[str, ...], epochs: tuple[int, ...]) -> None:
        raise ConfigError("a TP group sets its rank endpoints once, at start-up (engine.tp.group.gather_endpoints)")

    def expect(self, request_id: str, pages: SeqPages, num_tokens: int, deadline_unix: float,
               first_token: int = 0) -> TransferRequest:
        cmd = m.RxExpect(request_id, list(pages.full), list(pages.ring), num_tokens, deadline_unix, first_token)
        _raise_errors(self.group.call(cmd, lambda: self.kv.handle(cmd)))
        self._tracked[request_id] = pages
        self._status[request_id] = TransferStatus.WAITING
        assert self.kv.last_request is not None
        return self.kv.last_request

    def progress(self) -> None:
        """One RX_POLL for every tracked request. Nothing tracked: nothing to learn from the group,
        so no collective; rank 0 moves its own receiver as followers do between commands."""
        rids = list(self._tracked)
        if not rids:
            self._status, self._failures, self._fresh = {}, {}, set()
            self.rx.progress()
            return
        cmd = m.RxPoll(rids)
        replies: list[m.Polled] = self.group.call(cmd, lambda: self.kv.handle(cmd))
        # Entries of requests released everywhere lived one iteration longer, for poll/outcome.
        self._status = {rid: s for rid, s in self._status.items() if rid in self._tracked}
        self._failures = {rid: o for rid, o in self._failures.items() if rid in self._tracked}
        partial = []
        for i, rid in enumerate(rids):
            per_rank = [TransferStatus(r.statuses[i]) for r in replies]
            self._status[rid] = min(per_rank)
            if self._status[rid] == TransferStatus.FAILED and max(per_rank) != TransferStatus.FAILED:
                partial.append(rid)
        for r, rep in enumerate(replies):
            for f in rep.failures:
                if f.request_id not in self._failures:
                    detail = f.detail if r == 0 else f"tensor-parallel rank {r}: {f.detail}"
                    self._failures[f.request_id] = TransferOutcome(f.request_id, TransferStatus.FAILED,
                                                                   FailureReason(f.reason), detail, 0, 0.0)
            for rid in rep.released:
                self._released.setdefault(rid, set()).add(r)
        if partial:
            self._abort(partial, FailureReason.ABORTED, "another tensor-parallel rank failed the transfer")
        for rid in [rid for rid, ranks in self._released.items() if len(ranks) == self.group.world]:
            self._ready.append(ReleasedPages(rid, self._tracked.pop(rid)))
            del self._released[rid]
        self._fresh = set(rids)

    def poll(self, request_id: str) -> TransferStatus:
        if request_id not in self._fresh:
            self.progress()
        self._fresh.discard(request_id)
        return self._status.get(request_id, TransferStatus.FAILED)

    def outcome(self, request_id: str) -> TransferOutcome:
        if self._status.get(request_id) == TransferStatus.FAILED and request_id in self._failures:
            return self._failures[request_id]
        cmd = m.RxOutcome(request_id)
        return _combine(request_id, self.group.call(cmd, lambda: self.kv.handle(cmd)))

    def abort(self, request_id: str, reason: FailureReason = FailureReason.ABORTED, detail: str = "") -> None:
        self._abort([request_id], reason, detail)

    def _abort(self, request_ids: list[str], reason: FailureReason, detail: str) -> None:
        cmd = m.RxAbort(request_ids, int(reason), detail)
        _raise_errors(self.group.call(cmd, lambda: self.kv.handle(cmd)))

    def finish(self, request_id: str) -> TransferOutcome:
        cmd = m.RxFinish(request_id)
        out = _combine(request_id, self.group.call(cmd, lambda: self.kv.handle(cmd)))
        self._tracked.pop(request_id, None)
        self._status.pop(request_id, None)
        return out

    def take_releasable(self) -> list[ReleasedPages]:
        out, self._ready = self._ready, []
        return out

    def quarantined(self) -> list[QuarantinedPages]:
        cmd = m.RxQuarantined()
        merged: dict[str, QuarantinedPages] = {}
        for rep in self.group.call(cmd, lambda: self.kv.handle(cmd)):
            for q in rep.items:
                old = merged.get(q.request_id)
                waiting = tuple(dict.fromkeys((old.waiting_on if old else ()) + tuple(q.waiting_on)))
                merged[q.request_id] = QuarantinedPages(q.request_id, SeqPages(q.full, q.ring), waiting,
                                                        FailureReason(q.reason))
        return list(merged.values())

    def peer_dead(self, agent_name: str) -> None:
        cmd = m.RxPeerDead(agent_name)
        _raise_errors(self.group.call(cmd, lambda: self.kv.handle(cmd)))

    def close(self) -> None:
        """Rank 0's receiver; the followers close theirs when the group shuts down."""
        self.rx.close()


class GroupSender(KVSender):
    def __init__(self, group: RankGroup, kv: LocalKV) -> None:
        self.group, self.kv, self.tx = group, kv, kv.tx
        self._cause: dict[str, int] = {}  # request -> the rank that failed it first

    def start(self, request: TransferRequest, pages: SeqPages) -> None:
        cmd = m.TxStart(encode_kv(request), list(pages.full), list(pages.ring))
        replies = self.group.call(cmd, lambda: self.kv.handle(cmd))
        if any(d.error for d in replies) and not replies[0].error:
            # Every rank validated the same request: only a bug makes them disagree.
            raise WorkerUnavailable(f"tensor-parallel ranks disagree on starting {request.request_id}: "
                                    f"{[d.error for d in replies]}")
        _raise_errors(replies)

    def layer_done(self, layer: int) -> None:
        """Rank 0's own sender only: every follower's forward calls its own (STEP.layer_done)."""
        self.tx.layer_done(layer)

    def progress(self) -> None:
        self._poll([])

    def poll(self, request_id: str) -> TransferStatus:
        return self._poll([request_id])[0]

    def _poll(self, rids: list[str]) -> list[TransferStatus]:
        cmd = m.TxPoll(rids)
        replies: list[m.Statuses] = self.group.call(cmd, lambda: self.kv.handle(cmd))
        out, partial = [], []
        for i, rid in enumerate(rids):
            per_rank = [TransferStatus(r.statuses[i]) for r in replies]
            out.append(min(per_rank))
            if out[-1] == TransferStatus.FAILED and max(per_rank) != TransferStatus.FAILED:
                partial.append(rid)
                self._cause.setdefault(rid, per_rank.index(TransferStatus.FAILED))
        if partial:  # stop the other ranks' writes now, not at finish()
            self.abort_many(partial, FailureReason.ABORTED, "another tensor-parallel rank failed the transfer")
        return out

    def outcome(self, request_id: str) -> TransferOutcome:
        cmd = m.TxOutcome(request_id)
        return _combine(request_id, self.group.call(cmd, lambda: self.kv.handle(cmd)), self._cause.get(request_id))

    def abort(self, request_id: str, reason: FailureReason = FailureReason.ABORTED, detail: str = "") -> None:
        self.abort_many([request_id], reason, detail)

    def abort_many(self, request_ids: list[str], reason: FailureReason, detail: str) -> None:
        cmd = m.TxAbort(request_ids, int(reason), detail)
        self.group.call(cmd, lambda: self.kv.handle(cmd))

    def finish(self, request_id: str) -> TransferOutcome:
        cmd = m.TxFinish(request_id)
        outs = self.group.call(cmd, lambda: self.kv.handle(cmd))
        return _combine(request_id, outs, self._cause.pop(request_id, None))

    def close(self) -> None:
        """Rank 0's sender; the followers close theirs when the group shuts down."""
        self.tx.close()

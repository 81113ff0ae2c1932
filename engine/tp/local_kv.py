"""LocalKV: one TP rank's KV transfer endpoint driven by rank-group commands.

The same code runs on every rank: followers call `handle` for each KV command they receive, and
rank 0's proxies (engine.tp.proxies) call it for rank 0's share of the same command, so all ranks
do exactly the same thing to their own sender / receiver. It keeps the per-rank bookkeeping the
combined answers need:
  receiver: requests expected and not yet finished or released here (`open_rx`), failures already
            reported (each reported once, before its pages may be released here)
  sender:   requests started and not yet finished here (`open_tx`)
A request this rank no longer knows answers FAILED: it can only have been released after failing.
"""

from __future__ import annotations

from common.errors import ProtocolError, TandemError
from engine.tp import messages as m
from kv_transfer.interface import FailureReason, KVReceiver, KVSender, TransferOutcome, TransferStatus
from kv_transfer.messages import TransferRequest
from kv_transfer.messages import decode as decode_kv
from model.kv_cache import SeqPages

FAILED = int(TransferStatus.FAILED)


def outcome_msg(o: TransferOutcome | None) -> m.Outcome:
    if o is None:
        return m.Outcome(False, FAILED, 0, "", 0, 0.0)
    return m.Outcome(True, int(o.status), int(o.reason or 0), o.detail, o.num_bytes, o.seconds)


class LocalKV:
    def __init__(self, sender: KVSender | None, receiver: KVReceiver | None) -> None:
        self.tx, self.rx = sender, receiver
        self.open_rx: set[str] = set()
        self.reported: set[str] = set()
        self.open_tx: set[str] = set()
        self.last_request: TransferRequest | None = None  # rank 0 forwards it to prefill

    def idle(self) -> None:
        """Between commands: keep side channels, deadlines and failed transfers moving."""
        if self.rx is not None:
            self.rx.progress()
        if self.tx is not None:
            self.tx.progress()

    def bye(self) -> m.Bye:
        quarantined = sum(len(q.pages.full) + len(q.pages.ring) for q in self.rx.quarantined()) if self.rx else 0
        return m.Bye(len(self.open_rx), len(self.open_tx), quarantined)

    def handle(self, cmd: m.CommandMsg) -> object:
        match cmd:
            case m.RxExpect():
                return self._expect(cmd)
            case m.RxPoll():
                return self._rx_poll(cmd.request_ids)
            case m.RxOutcome():
                return outcome_msg(self.rx.outcome(cmd.request_id) if cmd.request_id in self.open_rx else None)
            case m.RxAbort():
                for rid in cmd.request_ids:
                    if rid in self.open_rx:
                        self.rx.abort(rid, FailureReason(cmd.reason), cmd.detail)
                return m.Done("")
            case m.RxFinish():
                self.open_rx.discard(cmd.request_id)
                self.reported.discard(cmd.request_id)
                return outcome_msg(self.rx.finish(cmd.request_id))
            case m.RxQuarantined():
                return m.Quarantine([m.QuarantineItem(q.request_id, q.pages.full, q.pages.ring, list(q.waiting_on),
                                                      int(q.reason)) for q in self.rx.quarantined()])
            case m.RxPeerDead():
                self.rx.peer_dead(cmd.agent_name)
                return m.Done("")
            case m.TxStart():
                return self._tx_start(cmd)
            case m.TxPoll():
                self.tx.progress()
                return m.Statuses([int(self.tx.outcome(r).status) if r in self.open_tx else FAILED
                                   for r in cmd.request_ids])
            case m.TxOutcome():
                return outcome_msg(self.tx.outcome(cmd.request_id) if cmd.request_id in self.open_tx else None)
            case m.TxAbort():
                for rid in cmd.request_ids:
                    if rid in self.open_tx:
                        self.tx.abort(rid, FailureReason(cmd.reason), cmd.detail)
                return m.Done("")
            case m.TxFinish():
                return self._tx_finish(cmd.request_id)
        raise ProtocolError(f"not a KV command: {type(cmd).__name__}")

    # ---- receiver ----------------------------------------------------------------------------------
    def _expect(self, cmd: m.RxExpect) -> m.Done:
        try:
            self.last_request = self.rx.expect(cmd.request_id, SeqPages(list(cmd.full), list(cmd.ring)),
                                               cmd.num_tokens, cmd.deadline_unix, cmd.first_token)
        except TandemError as e:
            return m.Done(e.message)
        self.open_rx.add(cmd.request_id)
        return m.Done("")

    def _rx_poll(self, request_ids: list[str]) -> m.Polled:
        self.rx.progress()
        statuses, failures = [], []
        for rid in request_ids:
            if rid not in self.open_rx:
                statuses.append(FAILED)
                continue
            o = self.rx.outcome(rid)
            statuses.append(int(o.status))
            if o.status == TransferStatus.FAILED and rid not in self.reported:
                self.reported.add(rid)
                failures.append(m.Failure(rid, int(o.reason or FailureReason.ABORTED), o.detail))
        released = []
        for rel in self.rx.take_releasable():  # polled ids: their failure was reported just above
            self.open_rx.discard(rel.request_id)
            self.reported.discard(rel.request_id)
            released.append(rel.request_id)
        return m.Polled(statuses, failures, released)

    # ---- sender ------------------------------------------------------------------------------------
    def _tx_start(self, cmd: m.TxStart) -> m.Done:
        try:
            req = decode_kv(cmd.request, TransferRequest)
            self.tx.start(req, SeqPages(list(cmd.full), list(cmd.ring)))
        except TandemError as e:
            return m.Done(e.message)
        self.open_tx.add(req.request_id)
        return m.Done("")

    def _tx_finish(self, rid: str) -> m.Outcome:
        if rid not in self.open_tx:
            return outcome_msg(None)
        if not self.tx.poll(rid).terminal:  # another rank failed it: stop writing here too
            self.tx.abort(rid, FailureReason.ABORTED, "another tensor-parallel rank failed the transfer")
        self.open_tx.discard(rid)
        return outcome_msg(self.tx.finish(rid))

"""Loopback backend: the KVSender / KVReceiver contract with same-process tensor copies.

For colocated prefill and decode (one process, possibly two GPUs) and for unit tests. It keeps the
protocol of the NIXL backend (claim before writing, per-layer completion, Ended, Cancel, epochs,
deadlines) by calling the receiver's ReceiverBook directly instead of over a side channel. Copies
are stream-ordered torch ops, so no layer event is needed and nothing is ever in flight after a
call returns: a failed loopback transfer never quarantines pages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common.errors import ProtocolError
from kv_transfer import metrics
from kv_transfer.interface import (FailureReason, KVReceiver, KVSender, QuarantinedPages, ReleasedPages,
                                   TransferConfig, TransferOutcome, TransferStatus, check_rank_endpoints,
                                   new_epoch, sender_outcome)
from kv_transfer.messages import Cancel, Claim, ClaimReply, Ended, KVCompat, LayerDone, TransferRequest
from kv_transfer.plan import HeadRun, check_source_pages, head_runs, page_pairs
from kv_transfer.receiver_state import ReceiverBook
from model.kv_cache import KVPool, PageGroup, SeqPages


class LoopbackHub:
    """Receivers and senders of one process, by endpoint / agent name."""

    def __init__(self) -> None:
        self._receivers: dict[str, LoopbackReceiver] = {}
        self._senders: dict[str, LoopbackSender] = {}
        self._next = 0

    def add_receiver(self, rx: LoopbackReceiver) -> str:
        self._next += 1
        endpoint = f"loopback://{id(self):x}/{self._next}"
        self._receivers[endpoint] = rx
        return endpoint

    def receiver(self, endpoint: str) -> LoopbackReceiver | None:
        return self._receivers.get(endpoint)

    def add_sender(self, tx: LoopbackSender) -> None:
        self._senders[tx.agent_name] = tx

    def sender(self, agent: str) -> LoopbackSender | None:
        return self._senders.get(agent)

    def remove(self, name: str) -> None:
        self._receivers.pop(name, None)
        self._senders.pop(name, None)


_DEFAULT_HUB = LoopbackHub()


def default_hub() -> LoopbackHub:
    return _DEFAULT_HUB


class LoopbackReceiver(KVReceiver):
    def __init__(self, pool: KVPool, config: TransferConfig, hub: LoopbackHub | None = None) -> None:
        self.pool, self.config, self.hub = pool, config, hub or default_hub()
        self._epoch = new_epoch()
        self.agent_name = f"{config.engine_id}/decode/{config.tp_rank}/{self._epoch}"
        self.compat = KVCompat.from_pool(pool, config.model_name, config.tp_size)
        self.book = ReceiverBook(self._epoch, config.tp_rank, config.tp_size, self.compat,
                                 on_terminal=lambda o: metrics.record_outcome("decode", o))
        self._endpoint = self.hub.add_receiver(self)
        self._endpoints: tuple[str, ...] = (self._endpoint,) if config.tp_size == 1 else ()
        self._epochs: tuple[int, ...] = (self._epoch,) if config.tp_size == 1 else ()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_rank_endpoints(self, endpoints: tuple[str, ...], epochs: tuple[int, ...]) -> None:
        self._endpoints, self._epochs = check_rank_endpoints(self.config, self._endpoint, self._epoch, endpoints, epochs)

    def expect(self, request_id: str, pages: SeqPages, num_tokens: int, deadline_unix: float,
               first_token: int = 0) -> TransferRequest:
        assert self._endpoints, "set_rank_endpoints() first (TP > 1)"
        req = TransferRequest(request_id, self.config.engine_id, self._endpoints, self._epochs, tuple(pages.full),
                              tuple(pages.ring), num_tokens, deadline_unix, first_token)
        req.validate()
        now = time.monotonic()
        self.book.expect(request_id, pages, num_tokens, now + (deadline_unix - time.time()), now)
        return req

    def progress(self) -> None:
        self.book.tick(time.monotonic())
        self._deliver_cancels()

    def poll(self, request_id: str) -> TransferStatus:
        self.progress()
        return self.book.status(request_id)

    def outcome(self, request_id: str) -> TransferOutcome:
        return self.book.outcome(request_id, time.monotonic())

    def abort(self, request_id: str, reason: FailureReason = FailureReason.ABORTED, detail: str = "") -> None:
        self.book.abort(request_id, reason, detail, time.monotonic())
        self._deliver_cancels()

    def finish(self, request_id: str) -> TransferOutcome:
        out = self.outcome(request_id)
        self.book.finish(request_id)
        return out

    def take_releasable(self) -> list[ReleasedPages]:
        return self.book.take_releasable()

    def quarantined(self) -> list[QuarantinedPages]:
        return self.book.quarantined()

    def peer_dead(self, agent_name: str) -> None:
        self.book.on_peer_dead(agent_name, "declared dead by the owner", time.monotonic())
        self._deliver_cancels()

    def close(self) -> None:
        self.hub.remove(self._endpoint)

    # ---- called by in-process senders ---------------------------------------------------------
    def handle_claim(self, claim: Claim) -> ClaimReply:
        self.book.tick(time.monotonic())  # a claim after the deadline must be refused
        reply = self.book.on_claim(claim, time.monotonic())
        self._deliver_cancels()
        return reply

    def handle_layer_done(self, msg: LayerDone, agent: str) -> None:
        self.book.on_layer_done(msg, agent, time.monotonic())

    def handle_ended(self, msg: Ended) -> None:
        self.book.on_ended(msg, time.monotonic())

    def _deliver_cancels(self) -> None:
        for agent, cancel in self.book.take_cancels():
            tx = self.hub.sender(agent)
            if tx is not None:
                tx.handle_cancel(cancel)


@dataclass(slots=True)
class _Target:
    run: HeadRun
    endpoint: str
    epoch: int  # the decode rank's epoch named by the request
    accepted: bool = False
    pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # by group
    written: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Tx:
    request: TransferRequest
    pages: SeqPages
    deadline: float
    started: float
    targets: list[_Target]
    computed: list[int] = field(default_factory=list)
    status: TransferStatus = TransferStatus.WAITING
    reason: FailureReason | None = None
    detail: str = ""
    num_bytes: int = 0
    ended_at: float | None = None


class LoopbackSender(KVSender):
    def __init__(self, pool: KVPool, config: TransferConfig, hub: LoopbackHub | None = None) -> None:
        self.pool, self.config, self.hub = pool, config, hub or default_hub()
        self.spec = pool.spec
        self.epoch = new_epoch()
        self.agent_name = f"{config.engine_id}/prefill/{config.tp_rank}/{self.epoch}"
        self.compat = KVCompat.from_pool(pool, config.model_name, config.tp_size)
        self.layers = frozenset(self.spec.full_layers) | frozenset(self.spec.sliding_layers)
        self._txs: dict[str, _Tx] = {}
        self.hub.add_sender(self)

    def start(self, request: TransferRequest, pages: SeqPages) -> None:
        assert request.request_id not in self._txs, f"request {request.request_id} already started"
        runs = head_runs(self.compat.total_num_kv_heads, self.config.tp_rank, self.config.tp_size,
                         request.decode_tp_size)
        check_source_pages(self.spec, request, pages)
        now = time.monotonic()
        targets = [_Target(r, request.decode_endpoints[r.dst_rank], request.decode_epochs[r.dst_rank]) for r in runs]
        tx = _Tx(request, pages, now + (request.deadline_unix - time.time()), now, targets)
        self._txs[request.request_id] = tx
        self._advance(tx)

    def layer_done(self, layer: int) -> None:
        assert layer in self.layers, f"unknown layer {layer}"
        for tx in self._txs.values():
            if not tx.status.terminal and layer not in tx.computed:
                tx.computed.append(layer)
                self._advance(tx)

    def progress(self) -> None:
        for tx in self._txs.values():
            self._advance(tx)

    def poll(self, request_id: str) -> TransferStatus:
        self.progress()
        return self._txs[request_id].status

    def outcome(self, request_id: str) -> TransferOutcome:
        return sender_outcome(request_id, self._txs[request_id])

    def abort(self, request_id: str, reason: FailureReason = FailureReason.ABORTED, detail: str = "") -> None:
        tx = self._txs[request_id]
        if not tx.status.terminal:
            self._fail(tx, reason, detail or "aborted by prefill")

    def finish(self, request_id: str) -> TransferOutcome:
        out = self.outcome(request_id)
        assert out.status.terminal, f"finish() of a {out.status.name} transfer"
        del self._txs[request_id]
        return out

    def close(self) -> None:
        for tx in self._txs.values():
            if not tx.status.terminal:
                self._fail(tx, FailureReason.ABORTED, "sender closed")
        self.hub.remove(self.agent_name)

    def handle_cancel(self, cancel: Cancel) -> None:
        tx = self._txs.get(cancel.request_id)
        if tx is not None and not tx.status.terminal and any(t.epoch == cancel.decode_epoch for t in tx.targets):
            self._fail(tx, cancel.reason, f"cancelled by decode: {cancel.detail}")

    # ---- internals -----------------------------------------------------------------------------
    def _advance(self, tx: _Tx) -> None:
        if tx.status.terminal:
            return
        if time.monotonic() > tx.deadline:
            return self._fail(tx, FailureReason.DEADLINE, "transfer deadline exceeded")
        for t in tx.targets:
            if not t.accepted and not self._claim(tx, t):
                return
        for t in tx.targets:
            if t.accepted:
                for layer in tx.computed:
                    if layer not in t.written and not tx.status.terminal:
                        self._write(tx, t, layer)
        if tx.status.terminal:
            return
        if all(t.accepted and t.written == self.layers for t in tx.targets):
            tx.status, tx.ended_at = TransferStatus.DONE, time.monotonic()
            self._send_ended(tx, ok=True)
            metrics.record_outcome("prefill", self.outcome(tx.request.request_id))
        elif any(t.accepted for t in tx.targets):
            tx.status = TransferStatus.TRANSFERRING

    def _claim(self, tx: _Tx, t: _Target) -> bool:
        """Returns False when the transfer failed."""
        rx = self.hub.receiver(t.endpoint)
        if rx is None:
            self._fail(tx, FailureReason.PEER_DEAD, f"no decode receiver at {t.endpoint}")
            return False
        reply = rx.handle_claim(Claim(tx.request.request_id, t.epoch, self.agent_name,
                                      self.config.engine_id, self.epoch, self.config.tp_rank, self.config.tp_size,
                                      b"", self.compat))
        if reply.accepted:
            t.accepted = True
            spec_d = rx.pool.spec
            dst = SeqPages(list(tx.request.full_pages), list(tx.request.ring_pages))
            try:
                for g in PageGroup:
                    if self.spec.layers(g):
                        sp, dp = page_pairs(g, tx.pages, dst, tx.request.num_tokens, self.spec.page_size,
                                            self.spec.sliding_window, self.spec.num_pages[g], spec_d.num_pages[g],
                                            tx.request.first_token)
                        t.pairs[g] = (torch.from_numpy(sp).to(self.pool.pools[g].device),
                                      torch.from_numpy(dp).to(rx.pool.pools[g].device))
            except ProtocolError as e:
                self._fail(tx, FailureReason.HANDSHAKE_MISMATCH, f"request does not fit the decode pool: {e}")
                return False
            return True
        if not reply.retry:
            self._fail(tx, reply.reason or FailureReason.ABORTED, f"claim refused: {reply.detail}")
            return False
        return True

    def _write(self, tx: _Tx, t: _Target, layer: int) -> None:
        rx = self.hub.receiver(t.endpoint)
        if rx is None:
            return self._fail(tx, FailureReason.PEER_DEAD, f"decode receiver at {t.endpoint} closed")
        g, li = self.spec.group_of(layer)
        sp, dp = t.pairs[g]
        r = t.run
        # pages move as bytes (CUDA's index_put_ takes no float8 type): [2, NP, Hkv, P, D * element size]
        src = self.pool.pools[g][li].view(torch.uint8)
        dst = rx.pool.pools[g][li].view(torch.uint8)
        block = src[:, sp, r.src_head:r.src_head + r.num_heads]  # [2, N, h, P, D * element size] bytes
        dst[:, dp, r.dst_head:r.dst_head + r.num_heads] = block.to(dst.device)
        nbytes = block.numel() * block.element_size()
        t.written.add(layer)
        tx.num_bytes += nbytes
        metrics.BYTES.labels(role="prefill").inc(nbytes)
        rx.handle_layer_done(LayerDone(tx.request.request_id, t.epoch, self.config.tp_rank, (layer,),
                                       nbytes), self.agent_name)

    def _fail(self, tx: _Tx, reason: FailureReason, detail: str) -> None:
        tx.status, tx.reason, tx.detail, tx.ended_at = TransferStatus.FAILED, reason, detail, time.monotonic()
        self._send_ended(tx, ok=False)
        metrics.record_outcome("prefill", self.outcome(tx.request.request_id))

    def _send_ended(self, tx: _Tx, ok: bool) -> None:
        for t in tx.targets:
            rx = self.hub.receiver(t.endpoint)
            if rx is not None:
                rx.handle_ended(Ended(tx.request.request_id, t.epoch, self.agent_name,
                                      self.config.tp_rank, ok, tx.reason, tx.detail))


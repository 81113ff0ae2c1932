"""NixlSender: the prefill rank's side of a NIXL KV transfer (push, layer by layer).

Lifecycle: built once per prefill TP rank over its KVPool (registered once with NIXL) with a fresh
epoch. Per request: `start(request, src_pages)` right before the forward that completes the
prompt; the model calls `layer_done(i)` after layer i stored its K/V; the prefill loop polls until
terminal, then frees its source pages and calls `finish()`.

Per decode rank this rank writes to (a target), an ordered state machine:
  HANDSHAKE: fetch (once per decode epoch, cached per endpoint) the decode rank's Handshake: NIXL
             metadata, pool addresses, compatibility. A different epoch than the request's is an
             epoch mismatch (decode restarted); a different layout a handshake mismatch.
  CLAIM:     send Claim, wait for ClaimReply (retry while decode has not registered the request).
  READY:     post the computed, unwritten layers as one WRITE (K and V, every page pair, the head
             run this rank shares with the target), with LayerDone naming them as its NIXL
             notification: one layer per WRITE while prefill runs ahead of the transfer, several at
             once when the claim or the transport lagged (fewer posts, each ~50 us of host time).
With the data path "ipc", a target on this node that exported its pools gets those WRITEs as a
copy into its mapped pool plus the same notification (kv_transfer/ipc.py); others get NIXL WRITEs.
The request is DONE when every target completed every layer; then Ended(ok) goes out.
On failure (deadline, Cancel from decode, peer gone, abort) no new WRITE is posted, in-flight ones
are cancelled or waited out, and only then Ended(ok=False) tells decode its pages are free of us.
FAILED is reported at once: a WRITE still draining only reads our source pages into a destination
decode holds quarantined until that Ended, so the owner may already reuse the source pages.

GPU: layer_done records a CUDA event; a layer is posted once its event completed (its K/V are in
memory). To keep writes overlapping compute, layer_done waits for the layer `max_layers_ahead`
back, which bounds how far the CPU runs ahead of the GPU (it only queues launches meanwhile).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch
import zmq

from common.errors import ConfigError, ProtocolError
from kv_transfer import metrics
from kv_transfer.interface import (FailureReason, KVSender, TransferConfig, TransferOutcome, TransferStatus, new_epoch,
                                   sender_outcome)
from kv_transfer.messages import (Cancel, Claim, ClaimReply, Ended, Handshake, HandshakeRequest, KVCompat, LayerDone,
                                  TransferRequest, decode, encode)
from kv_transfer.ipc import DATA_PATHS, IpcPaths
from kv_transfer.nixl_backend import NixlAgent, PeerGone, SideChannelClient, TransportError, descriptors
from kv_transfer.plan import (GroupGeometry, HeadRun, WritePlan, check_source_pages, head_runs, layer_copies,
                              page_pairs)
from model.kv_cache import KVPool, PageGroup, SeqPages

log = logging.getLogger(__name__)


class _Phase(IntEnum):
    HANDSHAKE = 0
    CLAIM = 1
    READY = 2


@dataclass(slots=True)
class _Peer:
    """One decode rank's side channel and its cached handshake."""

    chan: SideChannelClient
    handshake: Handshake | None = None
    asked_at: float | None = None  # an outstanding HandshakeRequest
    answered_for: float = float("-inf")  # asked_at of the request the cached handshake answers
    error: str = ""  # the last handshake could not be used (version, validation)


@dataclass(slots=True)
class _Target:
    run: HeadRun
    endpoint: str
    epoch: int  # the decode rank's epoch named by the request
    phase: _Phase = _Phase.HANDSHAKE
    claim_at: float | None = None
    next_claim: float = 0.0
    plan: dict[int, WritePlan] = field(default_factory=dict)  # page group -> WRITE plan
    written: set[int] = field(default_factory=set)
    completed: set[int] = field(default_factory=set)
    inflight: list[tuple[tuple[int, ...], Any]] = field(default_factory=list)  # (layers, handle), posting order
    io: Any = None  # who moves the bytes: the NixlAgent, or an IpcTarget (same write_layers/done/release)


MAX_DESCS_PER_WRITE = 4096  # a backlog is split so one post never blocks the loop for long


@dataclass(slots=True)
class _Tx:
    request: TransferRequest
    pages: SeqPages
    deadline: float
    started: float
    targets: list[_Target]
    marked: set[int] = field(default_factory=set)  # layer_done called
    computed: list[int] = field(default_factory=list)  # K/V in memory, may be written
    status: TransferStatus = TransferStatus.WAITING
    reason: FailureReason | None = None
    detail: str = ""
    num_bytes: int = 0
    ended_at: float | None = None
    ended_sent: bool = False

    def draining(self) -> bool:
        return any(t.inflight for t in self.targets)


class NixlSender(KVSender):
    def __init__(self, pool: KVPool, config: TransferConfig, *, data_path: str = "nixl") -> None:
        if data_path not in DATA_PATHS:
            raise ConfigError(f"kv sender: data path {data_path!r} is not one of {DATA_PATHS}")
        self.pool, self.spec, self.config = pool, pool.spec, config
        self.epoch = new_epoch()
        self.agent_name = f"{config.engine_id}/prefill/{config.tp_rank}/{self.epoch}"
        self.compat = KVCompat.from_pool(pool, config.model_name, config.tp_size)
        self.layers = frozenset(self.spec.full_layers) | frozenset(self.spec.sliding_layers)
        self.nixl = NixlAgent(self.agent_name, pool, config.backends)
        self._metadata = self.nixl.metadata()
        self._src = {lay.group: lay for lay in self.nixl.layouts}
        elt = torch.empty((), dtype=self.spec.dtype).element_size()
        self._src_geo = {g: GroupGeometry(len(self.spec.layers(g)), self.spec.num_pages[g], self.spec.num_kv_heads,
                                          self.spec.page_size, self.spec.head_dim, elt) for g in PageGroup}
        self._ctx = zmq.Context()
        self._peers: dict[str, _Peer] = {}
        self._txs: dict[str, _Tx] = {}
        self._detached: list[_Tx] = []  # finished by the owner while still draining
        self._events: deque[tuple[int, torch.cuda.Event, list[_Tx]]] = deque()
        self._on_gpu = pool.pools[0].device.type == "cuda"
        self._ipc = IpcPaths(self.nixl, pool) if data_path == "ipc" else None
        self.data_paths: dict[str, str] = {}  # decode agent -> "nixl" | "ipc", as chosen at its handshake

    # ---- KVSender ------------------------------------------------------------------------------
    def start(self, request: TransferRequest, pages: SeqPages) -> None:
        assert request.request_id not in self._txs, f"request {request.request_id} already started"
        runs = head_runs(self.compat.total_num_kv_heads, self.config.tp_rank, self.config.tp_size,
                         request.decode_tp_size)
        check_source_pages(self.spec, request, pages)
        now = time.monotonic()
        targets = [_Target(r, request.decode_endpoints[r.dst_rank], request.decode_epochs[r.dst_rank]) for r in runs]
        self._txs[request.request_id] = _Tx(request, pages, now + (request.deadline_unix - time.time()), now, targets)
        self.progress()

    def layer_done(self, layer: int) -> None:
        assert layer in self.layers, f"unknown layer {layer}"
        txs = [tx for tx in self._txs.values() if not tx.status.terminal and layer not in tx.marked]
        for tx in txs:
            tx.marked.add(layer)
        if self._on_gpu:
            ev = torch.cuda.Event()
            ev.record()
            self._events.append((layer, ev, txs))
            while len(self._events) > self.config.max_layers_ahead:
                self._events[0][1].synchronize()
                self._computed(*self._events.popleft()[::2])
        else:
            self._computed(layer, txs)
        self.progress()

    def poll(self, request_id: str) -> TransferStatus:
        self.progress()
        return self._txs[request_id].status

    def outcome(self, request_id: str) -> TransferOutcome:
        return sender_outcome(request_id, self._txs[request_id])

    def abort(self, request_id: str, reason: FailureReason = FailureReason.ABORTED, detail: str = "") -> None:
        tx = self._txs[request_id]
        if not tx.status.terminal:
            self._fail(tx, reason, detail or "aborted by prefill")
        self.progress()

    def finish(self, request_id: str) -> TransferOutcome:
        out = self.outcome(request_id)
        assert out.status.terminal, f"finish() of a {out.status.name} transfer"
        tx = self._txs.pop(request_id)
        if tx.status == TransferStatus.FAILED and not tx.ended_sent:
            self._detached.append(tx)
        return out

    def close(self) -> None:
        for tx in self._txs.values():
            if not tx.status.terminal:
                self._fail(tx, FailureReason.ABORTED, "sender closed")
        end = time.monotonic() + 1.0  # bounded: in-flight WRITEs get a moment to end cleanly
        while any(not tx.ended_sent for tx in [*self._txs.values(), *self._detached]
                  if tx.status == TransferStatus.FAILED) and time.monotonic() < end:
            self.progress()
        for peer in self._peers.values():
            peer.chan.close()
        if self._ipc is not None:
            self._ipc.close()
        self._ctx.term()
        self.nixl.close()

    # ---- progress ------------------------------------------------------------------------------
    def progress(self) -> None:
        now = time.monotonic()
        for endpoint, peer in self._peers.items():
            for data in peer.chan.recv_all():
                self._on_message(endpoint, peer, data, now)
        while self._events and self._events[0][1].query():
            self._computed(*self._events.popleft()[::2])
        for tx in self._txs.values():
            self._advance(tx, now)
        for tx in [*self._txs.values(), *self._detached]:
            if tx.status == TransferStatus.FAILED and not tx.ended_sent:
                self._drain(tx)
        self._detached = [tx for tx in self._detached if not tx.ended_sent]
        self.nixl.notifs()  # decode's liveness probes: nothing to do but consume them

    def _computed(self, layer: int, txs: list[_Tx]) -> None:
        for tx in txs:
            if not tx.status.terminal:
                tx.computed.append(layer)

    def _on_message(self, endpoint: str, peer: _Peer, data: bytes, now: float) -> None:
        try:
            msg = decode(data, Handshake, ClaimReply, Cancel)
        except ProtocolError as e:
            log.warning("side channel: bad message from %s: %s", endpoint, e)
            if peer.asked_at is not None:  # most likely the answer to our handshake (e.g. another version)
                peer.error = f"unusable handshake from {endpoint}: {e}"
                peer.answered_for, peer.asked_at = peer.asked_at, None
            return
        if isinstance(msg, Handshake):
            old = peer.handshake
            if old is not None and old.agent_name != msg.agent_name:
                self.nixl.remove_remote(old.agent_name)
                if self._ipc is not None:
                    self._ipc.forget(old.agent_name)
            if old is None or old.agent_name != msg.agent_name:
                try:
                    self.nixl.add_remote(msg.agent_metadata)
                except TransportError as e:
                    peer.error, peer.answered_for, peer.asked_at = str(e), peer.asked_at or now, None
                    return
            peer.handshake, peer.error = msg, ""
            peer.answered_for, peer.asked_at = peer.asked_at or now, None
            return
        tx = self._txs.get(msg.request_id)
        if tx is None or tx.status.terminal:
            return
        if isinstance(msg, Cancel):
            if any(t.endpoint == endpoint and t.epoch == msg.decode_epoch for t in tx.targets):
                self._fail(tx, msg.reason, f"cancelled by decode: {msg.detail}")
            return
        t = next((t for t in tx.targets if t.endpoint == endpoint and t.phase == _Phase.CLAIM), None)
        if t is None:
            return
        if msg.accepted:
            t.phase = _Phase.READY
        elif msg.retry:
            t.claim_at, t.next_claim = None, now + self.config.claim_retry_s
        else:
            self._fail(tx, msg.reason or FailureReason.ABORTED, f"decode refused the claim: {msg.detail}")

    def _advance(self, tx: _Tx, now: float) -> None:
        if tx.status.terminal:
            return
        if now > tx.deadline:
            return self._fail(tx, FailureReason.DEADLINE, "transfer deadline exceeded")
        for t in tx.targets:
            if t.phase == _Phase.HANDSHAKE:
                self._handshake_step(tx, t, now)
            if t.phase == _Phase.CLAIM and t.claim_at is None and now >= t.next_claim:
                self._send_claim(tx, t, now)
            elif t.phase == _Phase.CLAIM and t.claim_at is not None and now - t.claim_at > self.config.handshake_timeout_s:
                self._send_claim(tx, t, now)  # the receiver treats a repeated claim idempotently
            if t.phase == _Phase.READY and not tx.status.terminal:
                self._write_step(tx, t)
            if tx.status.terminal:
                return
        if all(t.phase == _Phase.READY and t.completed == self.layers for t in tx.targets):
            tx.status, tx.ended_at = TransferStatus.DONE, now
            self._send_ended(tx, ok=True)
            metrics.record_outcome("prefill", self.outcome(tx.request.request_id))
        elif any(t.phase == _Phase.READY for t in tx.targets):
            tx.status = TransferStatus.TRANSFERRING

    def _handshake_step(self, tx: _Tx, t: _Target, now: float) -> None:
        peer = self._peers.get(t.endpoint)
        if peer is None:
            try:
                peer = self._peers[t.endpoint] = _Peer(SideChannelClient(self._ctx, t.endpoint, self.agent_name))
            except zmq.ZMQError as e:  # an endpoint ZMQ cannot connect to (validated, so unlikely)
                return self._fail(tx, FailureReason.HANDSHAKE_MISMATCH, f"cannot connect to {t.endpoint}: {e}")
        hs = peer.handshake
        if hs is not None and hs.epoch == t.epoch:
            problem = self._check_handshake(tx, t, hs)
            if problem:
                return self._fail(tx, FailureReason.HANDSHAKE_MISMATCH, problem)
            t.phase = _Phase.CLAIM
            return
        if peer.error and peer.answered_for >= tx.started:
            return self._fail(tx, FailureReason.HANDSHAKE_MISMATCH, peer.error)
        if hs is not None and peer.answered_for >= tx.started:
            return self._fail(tx, FailureReason.EPOCH_MISMATCH, f"decode rank at {t.endpoint} is at epoch {hs.epoch}, "
                              f"the request was made by epoch {t.epoch}")
        if peer.asked_at is None or now - peer.asked_at > self.config.handshake_timeout_s:
            peer.asked_at = now
            peer.chan.send(encode(HandshakeRequest(self.agent_name)))

    def _check_handshake(self, tx: _Tx, t: _Target, hs: Handshake) -> str:
        if hs.compat != self.compat:
            return "incompatible KV layout: " + "; ".join(self.compat.diff(hs.compat))
        if hs.tp_size != tx.request.decode_tp_size or hs.tp_rank != t.run.dst_rank:
            return f"endpoint {t.endpoint} is decode rank {hs.tp_rank}/{hs.tp_size}, expected {t.run.dst_rank}/" \
                   f"{tx.request.decode_tp_size}"
        dst = SeqPages(list(tx.request.full_pages), list(tx.request.ring_pages))
        try:
            for g in PageGroup:
                if not self.spec.layers(g):
                    continue
                pool = hs.pool(g)
                geo = GroupGeometry(len(self.spec.layers(g)), pool.num_pages, hs.num_kv_heads, self.spec.page_size,
                                    self.spec.head_dim, self._src_geo[g].elt_size)
                if geo.nbytes != pool.nbytes:
                    return f"decode pool of group {g.name} is {pool.nbytes} bytes, its layout says {geo.nbytes}"
                pairs = page_pairs(g, tx.pages, dst, tx.request.num_tokens, self.spec.page_size,
                                   self.spec.sliding_window, self.spec.num_pages[g], pool.num_pages,
                                   tx.request.first_token)
                sg, src = self._src_geo[g], self._src[g]
                cp = layer_copies(sg, geo, 0, pairs, t.run)
                t.plan[g] = WritePlan(descriptors(src.base_addr, cp.src, cp.nbytes, src.device_id),
                                       descriptors(pool.base_addr, cp.dst, cp.nbytes, pool.device_id),
                                       2 * sg.num_pages * sg.page_bytes, 2 * geo.num_pages * geo.page_bytes,
                                       cp.total_bytes)
        except ProtocolError as e:
            return f"request does not fit decode rank {hs.tp_rank}: {e}"
        t.io = (self._ipc.target(hs) if self._ipc is not None else None) or self.nixl
        self.data_paths[hs.agent_name] = t.io.path
        return ""

    def _send_claim(self, tx: _Tx, t: _Target, now: float) -> None:
        t.claim_at = now
        c = self.config
        self._peers[t.endpoint].chan.send(encode(Claim(
            tx.request.request_id, t.epoch, self.agent_name, c.engine_id, self.epoch, c.tp_rank,
            c.tp_size, self._metadata, self.compat)))

    def _write_step(self, tx: _Tx, t: _Target) -> None:
        hs = self._peers[t.endpoint].handshake
        assert hs is not None
        try:
            pending = [layer for layer in tx.computed if layer not in t.written]
            while pending:
                layers, parts, num_descs, nbytes = [], [], 0, 0
                while pending:
                    g, li = self.spec.group_of(pending[0])
                    plan = t.plan[g]
                    if layers and num_descs + len(plan.src) > MAX_DESCS_PER_WRITE:
                        break
                    layers.append(pending.pop(0))
                    parts.append((plan, li))
                    num_descs += len(plan.src)
                    nbytes += plan.layer_bytes
                notif = encode(LayerDone(tx.request.request_id, t.epoch, self.config.tp_rank, tuple(sorted(layers)),
                                         nbytes))
                h = t.io.write_layers(hs.agent_name, hs.mem_type, parts, notif)
                t.written.update(layers)
                t.inflight.append((tuple(layers), h))
                tx.num_bytes += nbytes
                metrics.BYTES.labels(role="prefill").inc(nbytes)
                metrics.WRITES.labels(path=t.io.path).inc()
            # Completion is checked in posting order and stops at the first WRITE still running: a
            # later one that already finished is collected on a later call (cheap polls, no O(n^2)).
            while t.inflight and t.io.done(t.inflight[0][1]):
                layers, h = t.inflight.pop(0)
                t.io.release(h)
                t.completed.update(layers)
        except PeerGone as e:
            self._fail(tx, FailureReason.PEER_DEAD, str(e))
        except TransportError as e:
            self._fail(tx, FailureReason.PEER_DEAD, f"transport error: {e}")

    # ---- failure -------------------------------------------------------------------------------
    def _fail(self, tx: _Tx, reason: FailureReason, detail: str) -> None:
        log.warning("kv transfer %s failed (%s): %s", tx.request.request_id, reason.label, detail)
        tx.status, tx.reason, tx.detail, tx.ended_at = TransferStatus.FAILED, reason, detail, time.monotonic()
        metrics.record_outcome("prefill", self.outcome(tx.request.request_id))
        self._drain(tx)

    def _drain(self, tx: _Tx) -> None:
        """Cancel or wait out in-flight WRITEs; once none is left, tell decode we are done."""
        for t in tx.targets:
            still = []
            for layers, h in t.inflight:
                # Releasing an active WRITE cancels it if the backend can; a refusal means it is
                # still running, so we keep it and try again on the next progress().
                if not t.io.release(h):
                    still.append((layers, h))
            t.inflight = still
        if not tx.draining():
            self._send_ended(tx, ok=False)

    def _send_ended(self, tx: _Tx, ok: bool) -> None:
        tx.ended_sent = True
        for t in tx.targets:
            peer = self._peers.get(t.endpoint)
            if peer is not None:
                peer.chan.send(encode(Ended(tx.request.request_id, t.epoch, self.agent_name,
                                            self.config.tp_rank, ok, tx.reason, tx.detail)))

"""NixlReceiver: the decode rank's side of a NIXL KV transfer.

Lifecycle: built once per decode TP rank over its KVPool (registered once with NIXL; with the data
path "ipc" also exported for same-node writers, kv_transfer/ipc.py) with a fresh epoch; binds its
side channel; the worker gathers every rank's `endpoint` and calls `set_rank_endpoints`. Per
request: `expect()` after admission reserved pages; the returned TransferRequest travels to the
prefill worker; the decode loop calls `poll()` (or `progress()`) every step until DONE (then
`finish()`) or FAILED (then the pages come back through `take_releasable()`, possibly after a
quarantine).

One `progress()` pass, in order (later steps see what earlier ones learnt):
  1. side channel: answer HandshakeRequest, decide Claims (loading the claimant's NIXL metadata so
     it can be probed), record Ended;
  2. NIXL notifications: LayerDone (each arrives after its layer's data);
  3. deadlines;
  4. liveness probes of claimants that may still write (NIXL reports a dead peer);
  5. send the Cancels the book owes to claimants of requests that failed here.
"""

from __future__ import annotations

import logging
import time

import zmq

from common.errors import ConfigError, ProtocolError
from kv_transfer import metrics
from kv_transfer.interface import (FailureReason, KVReceiver, QuarantinedPages, ReleasedPages, TransferConfig,
                                   TransferOutcome, TransferStatus, check_rank_endpoints, new_epoch)
from kv_transfer.messages import (Claim, ClaimReply, Ended, Handshake, HandshakeRequest, KVCompat, LayerDone, Probe,
                                  TransferRequest, decode, encode)
from kv_transfer.ipc import DATA_PATHS, export_pools
from kv_transfer.nixl_backend import NixlAgent, PeerGone, SideChannelServer, TransportError
from kv_transfer.receiver_state import ReceiverBook
from model.kv_cache import KVPool, PageGroup, SeqPages

log = logging.getLogger(__name__)


class NixlReceiver(KVReceiver):
    def __init__(self, pool: KVPool, config: TransferConfig, *, data_path: str = "nixl") -> None:
        if data_path not in DATA_PATHS:
            raise ConfigError(f"kv receiver: data path {data_path!r} is not one of {DATA_PATHS}")
        self.config = config
        self._epoch = new_epoch()
        self.agent_name = f"{config.engine_id}/decode/{config.tp_rank}/{self._epoch}"
        self.compat = KVCompat.from_pool(pool, config.model_name, config.tp_size)
        self.book = ReceiverBook(self._epoch, config.tp_rank, config.tp_size, self.compat,
                                 on_terminal=lambda o: metrics.record_outcome("decode", o))
        # Before NIXL registers the pools: on CPU the export moves them into shared memory.
        ipc = export_pools(pool) if data_path == "ipc" else ()
        self.nixl = NixlAgent(self.agent_name, pool, config.backends)
        self._ctx = zmq.Context()
        self._server = SideChannelServer(self._ctx, config.host, config.port)
        self._endpoints: tuple[str, ...] = (self._server.endpoint,) if config.tp_size == 1 else ()
        self._epochs: tuple[int, ...] = (self._epoch,) if config.tp_size == 1 else ()
        self._handshake = encode(Handshake(
            config.engine_id, self.agent_name, self.nixl.metadata(), self.epoch, config.tp_rank, config.tp_size,
            self.nixl.mem_type, pool.spec.num_kv_heads, self.nixl.layouts, self.compat, self.compat.digest(), ipc))
        self._probe = encode(Probe(self.epoch))
        self._remote: dict[str, float] = {}  # claimant agent -> last probe time
        log.info("kv receiver %s: side channel %s, %s pools%s", self.agent_name, self._server.endpoint,
                 self.nixl.mem_type, ", exported for same-node writers" if ipc else "")

    # ---- KVReceiver ----------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return self._server.endpoint

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_rank_endpoints(self, endpoints: tuple[str, ...], epochs: tuple[int, ...]) -> None:
        self._endpoints, self._epochs = check_rank_endpoints(self.config, self.endpoint, self._epoch, endpoints, epochs)

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
        now = time.monotonic()
        self._serve_side_channel(now)
        self._collect_notifications(now)
        self.book.tick(now)
        self._probe_claimants(now)
        for agent, cancel in self.book.take_cancels():
            self._server.send(agent.encode(), encode(cancel))
        for g in PageGroup:
            metrics.QUARANTINED_PAGES.labels(group=g.name.lower()).set(
                sum(len(q.pages.full if g == PageGroup.FULL else q.pages.ring) for q in self.book.quarantined()))

    def poll(self, request_id: str) -> TransferStatus:
        self.progress()
        return self.book.status(request_id)

    def outcome(self, request_id: str) -> TransferOutcome:
        return self.book.outcome(request_id, time.monotonic())

    def abort(self, request_id: str, reason: FailureReason = FailureReason.ABORTED, detail: str = "") -> None:
        self.book.abort(request_id, reason, detail, time.monotonic())
        self.progress()  # sends the Cancels now

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
        self._forget_agent(agent_name)
        self.progress()

    def close(self) -> None:
        """Pages of unfinished requests are not returned: the process is going away."""
        self._server.close()
        self._ctx.term()
        self.nixl.close()

    # ---- progress steps ------------------------------------------------------------------------
    def _serve_side_channel(self, now: float) -> None:
        for peer, data in self._server.recv_all():
            try:
                msg = decode(data, HandshakeRequest, Claim, Ended)
            except ProtocolError as e:
                # Includes another protocol version: the peer then times out on its handshake.
                log.warning("side channel: bad message from %r: %s", peer, e)
                metrics.STALE.labels(role="decode").inc()
                continue
            if isinstance(msg, HandshakeRequest):
                self._server.send(peer, self._handshake)
            elif isinstance(msg, Claim):
                self._server.send(peer, encode(self._claim(msg, peer, now)))
            elif isinstance(msg, Ended) and msg.sender_agent.encode() == peer:
                if not self.book.on_ended(msg, now):
                    metrics.STALE.labels(role="decode").inc()

    def _claim(self, claim: Claim, peer: bytes, now: float) -> ClaimReply:
        if claim.sender_agent.encode() != peer:  # Cancels are routed by agent name
            return ClaimReply(claim.request_id, False, False, FailureReason.HANDSHAKE_MISMATCH,
                              "side-channel identity differs from the claimed agent name")
        self.book.tick(now)  # a claim that arrives after the deadline is refused, never accepted
        reply = self.book.on_claim(claim, now)
        if reply.accepted and claim.sender_agent not in self._remote:
            try:  # so that we can probe whether the claimant is still alive
                self.nixl.add_remote(claim.sender_metadata)
                self._remote[claim.sender_agent] = now
            except TransportError as e:
                log.warning("cannot load metadata of %s (it will not be probed): %s", claim.sender_agent, e)
        return reply

    def _collect_notifications(self, now: float) -> None:
        for agent, msgs in self.nixl.notifs().items():
            for data in msgs:
                try:
                    msg = decode(data, LayerDone)
                except ProtocolError as e:
                    log.warning("notification from %s dropped: %s", agent, e)
                    metrics.STALE.labels(role="decode").inc()
                    continue
                if not self.book.on_layer_done(msg, agent, now):
                    metrics.STALE.labels(role="decode").inc()

    def _probe_claimants(self, now: float) -> None:
        for agent in self.book.live_claimants():
            last = self._remote.get(agent)
            if last is None or now - last < self.config.probe_interval_s:
                continue
            self._remote[agent] = now
            try:
                self.nixl.send_notif(agent, self._probe)
            except PeerGone:
                log.warning("kv claimant %s is gone: its epoch is dead", agent)
                self.book.on_peer_dead(agent, f"prefill agent {agent} disconnected", now)
                self._forget_agent(agent)
            except TransportError as e:
                log.info("probe of %s failed (kept quarantined): %s", agent, e)

    def _forget_agent(self, agent: str) -> None:
        if self._remote.pop(agent, None) is not None:
            self.nixl.remove_remote(agent)

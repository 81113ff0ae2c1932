"""KV transfer contract: the prefill side pushes each layer's KV straight into pages the decode
side reserved before prefill started.

Roles (split like vLLM's NIXL connector; state machine ordered like SGLang's sender/receiver):

  decode rank  (KVReceiver)                          prefill rank (KVSender)
  -------------------------                          -----------------------
  pages = kv.grow(...)          # admission
  req = rx.expect(rid, pages, n, deadline)  ──router──►  tx.start(req, src_pages)
                                             ◄─handshake/claim─  (side channel, once per peer)
  rx.poll(rid) -> TRANSFERRING               ◄──WRITE layer i──  model.forward(on_layer_done=tx.layer_done)
  rx.poll(rid) -> DONE                       ◄──last layer────   tx.poll(rid) -> DONE; free src pages
  rx.finish(rid)  # pages now belong to the running sequence

Statuses are ordered FAILED < WAITING < TRANSFERRING < DONE so the TP ranks of one worker agree on
a request with a MIN all-reduce: one failed rank fails the request, DONE needs every rank.

Ownership: neither side frees pages. The prefill owner frees its source pages once `poll` is
terminal. The decode owner frees a failed request's pages only when `take_releasable()` hands them
back: a peer that may still be writing into them keeps them *quarantined* until it confirms its
writes ended or its epoch is known dead (fail-closed: leak a little rather than corrupt another
request). `quarantined()` lists them; `peer_dead()` is the operator/health-check release path.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

from common.errors import ConfigError, ProtocolError
from kv_transfer.messages import FailureReason, TransferRequest
from model.kv_cache import SeqPages

__all__ = ["FailureReason", "KVReceiver", "KVSender", "QuarantinedPages", "ReleasedPages", "TransferConfig",
           "TransferOutcome", "TransferRequest", "TransferStatus", "new_epoch"]


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """One worker rank's transfer settings (built once in the worker's main from its config)."""

    engine_id: str  # the worker (all its TP ranks); with tp_rank it names one sender identity
    model_name: str  # part of the compatibility check
    tp_rank: int = 0
    tp_size: int = 1
    host: str = "127.0.0.1"  # decode: side-channel address to bind and advertise
    port: int = 0  # decode: side-channel port; 0 picks a free one
    backends: tuple[str, ...] = ("UCX",)  # NIXL backends
    handshake_timeout_s: float = 10.0  # cap on one handshake/claim round trip (within the deadline)
    claim_retry_s: float = 0.01  # decode ranks register a request in lockstep; retry until they have
    probe_interval_s: float = 0.25  # decode: how often to check that a claimant is still alive
    max_layers_ahead: int = 2  # prefill on GPU: CPU launch may run this many layers ahead of writes

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"kv transfer: tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if self.max_layers_ahead < 0 or self.handshake_timeout_s <= 0 or self.probe_interval_s <= 0:
            raise ConfigError("kv transfer: max_layers_ahead must be >= 0 and timeouts > 0")


def new_epoch() -> int:
    """A worker process's epoch: wall-clock nanoseconds at start, so a restart is always newer."""
    return time.time_ns()


class TransferStatus(IntEnum):
    """Ordered so that min() over TP ranks is the worker-wide status."""

    FAILED = 0
    WAITING = 1  # accepted, no data yet (handshake / claim / first layer pending)
    TRANSFERRING = 2
    DONE = 3

    @property
    def terminal(self) -> bool:
        return self in (TransferStatus.FAILED, TransferStatus.DONE)


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    request_id: str
    status: TransferStatus
    reason: FailureReason | None  # set iff status is FAILED
    detail: str
    num_bytes: int  # payload bytes written (sender) / confirmed landed (receiver)
    seconds: float  # start to terminal (or to now while running)


class SendState(Protocol):
    """What every sender keeps per transfer (the loopback and NIXL senders' records)."""

    status: TransferStatus
    reason: FailureReason | None
    detail: str
    num_bytes: int
    started: float
    ended_at: float | None


def sender_outcome(request_id: str, t: SendState) -> TransferOutcome:
    end = t.ended_at if t.ended_at is not None else time.monotonic()
    return TransferOutcome(request_id, t.status, t.reason, t.detail, t.num_bytes, end - t.started)


def check_rank_endpoints(config: TransferConfig, endpoint: str, epoch: int, endpoints: tuple[str, ...],
                         epochs: tuple[int, ...]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A decode rank's view of its worker's ranks must contain itself at its own rank."""
    if len(endpoints) != config.tp_size or endpoints[config.tp_rank] != endpoint:
        raise ProtocolError(f"rank endpoints {endpoints} do not fit rank {config.tp_rank} at {endpoint}")
    if len(epochs) != len(endpoints) or epochs[config.tp_rank] != epoch:
        raise ProtocolError(f"rank epochs {epochs} do not fit rank {config.tp_rank} at epoch {epoch}")
    return tuple(endpoints), tuple(epochs)


@dataclass(frozen=True, slots=True)
class ReleasedPages:
    """A failed request's decode pages that no peer can write into any more: free them."""

    request_id: str
    pages: SeqPages


@dataclass(frozen=True, slots=True)
class QuarantinedPages:
    """A failed request's decode pages that a peer may still write into."""

    request_id: str
    pages: SeqPages
    waiting_on: tuple[str, ...]  # agent names that have not confirmed their writes ended
    reason: FailureReason


class KVSender(abc.ABC):
    """Prefill side, one per prefill TP rank. Non-blocking except `layer_done` on GPU, which may
    wait for the layer `max_layers_ahead` back to finish on the stream (bounded CPU run-ahead)."""

    @abc.abstractmethod
    def start(self, request: TransferRequest, pages: SeqPages) -> None:
        """Begin a transfer of `pages` (this rank's source pages) into the decode pages named by
        `request`. Call it right before the forward that completes the prompt. Raises
        ProtocolError when the request is malformed (the transfer then never started)."""

    @abc.abstractmethod
    def layer_done(self, layer: int) -> None:
        """Layer `layer` has stored its K/V for every started, still computing request: write it."""

    @abc.abstractmethod
    def progress(self) -> None:
        """Advance every transfer (also failed ones still draining): call it every loop iteration,
        even when idle, so decode learns promptly that its quarantined pages are free of us."""

    @abc.abstractmethod
    def poll(self, request_id: str) -> TransferStatus:
        """progress(), then this request's status."""

    @abc.abstractmethod
    def outcome(self, request_id: str) -> TransferOutcome: ...

    @abc.abstractmethod
    def abort(self, request_id: str, reason: FailureReason = FailureReason.ABORTED, detail: str = "") -> None:
        """Stop writing; the receiver is told. poll() turns FAILED."""

    @abc.abstractmethod
    def finish(self, request_id: str) -> TransferOutcome:
        """Forget a terminal request (its source pages may be freed)."""

    @abc.abstractmethod
    def close(self) -> None: ...


class KVReceiver(abc.ABC):
    """Decode side, one per decode TP rank. Call `poll` (or `progress`) every engine step."""

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """This rank's side-channel address, to be gathered by the worker for set_rank_endpoints."""

    @property
    @abc.abstractmethod
    def epoch(self) -> int:
        """This rank's epoch, gathered with `endpoint`."""

    @abc.abstractmethod
    def set_rank_endpoints(self, endpoints: tuple[str, ...], epochs: tuple[int, ...]) -> None:
        """Side-channel endpoints and epochs of all decode TP ranks of this worker, in rank order
        (only needed for TP > 1)."""

    @abc.abstractmethod
    def expect(self, request_id: str, pages: SeqPages, num_tokens: int, deadline_unix: float,
               first_token: int = 0) -> TransferRequest:
        """Register reserved pages for a request; returns the message to forward to prefill. With
        first_token > 0 (page-aligned) the pages of [0, first_token) already hold that KV (a
        prefix-cache hit): the sender writes only the rest."""

    @abc.abstractmethod
    def progress(self) -> None:
        """Serve the side channel, collect completions, enforce deadlines, probe peers."""

    @abc.abstractmethod
    def poll(self, request_id: str) -> TransferStatus: ...

    @abc.abstractmethod
    def outcome(self, request_id: str) -> TransferOutcome: ...

    @abc.abstractmethod
    def abort(self, request_id: str, reason: FailureReason = FailureReason.ABORTED, detail: str = "") -> None:
        """Fail a not-yet-DONE request and tell its writers to stop; no-op once DONE."""

    @abc.abstractmethod
    def finish(self, request_id: str) -> TransferOutcome:
        """Forget a DONE request: its pages now belong to the running sequence."""

    @abc.abstractmethod
    def take_releasable(self) -> list[ReleasedPages]:
        """Failed requests whose pages may go back to the free pool (each returned once)."""

    @abc.abstractmethod
    def quarantined(self) -> list[QuarantinedPages]: ...

    @abc.abstractmethod
    def peer_dead(self, agent_name: str) -> None:
        """Declare a peer epoch dead (health check / orchestrator): its requests fail and their
        quarantined pages become releasable."""

    @abc.abstractmethod
    def close(self) -> None: ...

"""What rank 0 of a tensor-parallel worker tells its followers, and what every rank answers.

Rank 0 decides everything (scheduling, page allocation, sampling, the worker-wide transfer
status); followers mirror its decisions on their own shard. A command is one typed message,
broadcast on the control group; a command that returns something is answered by EVERY rank
(rank 0 included, with the same handler code) through one all-gather, so the group stays in
lockstep and rank 0 combines the answers:

  command          payload                                   answer (per rank)    combined by rank 0
  STEP             the step's sequences (token ids, start,   none (the forward's  -
                   page deltas), attach the KV sender?       all-reduces sync)
  RX_EXPECT        request, pages, tokens, deadline          Done                 any error raises
  RX_POLL          tracked request ids                       Polled               MIN status; releasable
                                                                                  once EVERY rank released
  RX_OUTCOME       request id                                Outcome              first failure, sum bytes
  RX_ABORT         request ids, reason, detail               Done
  RX_FINISH        request id (DONE on every rank)           Outcome
  RX_QUARANTINED   -                                         Quarantine           union
  RX_PEER_DEAD     agent name                                Done
  TX_START         TransferRequest bytes, source pages       Done                 any error raises
  TX_POLL          request ids                               Statuses             MIN status
  TX_OUTCOME       request id                                Outcome              first failure, sum bytes
  TX_ABORT         request ids, reason, detail               Done
  TX_FINISH        request id (ranks not terminal abort)     Outcome
  SHUTDOWN         -                                         Bye                  logged (leak check)

Wire format: msgpack `[kind, [field values]]`; decoding checks the kind and every field's type
against the class annotations. Both ends are the same program (rank 0 spawns the followers), so
there is no version field; the typing keeps dicts and pickles off the control plane.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar

from common.errors import ProtocolError
from wire.codec import build, pack, to_wire, unpack


class Command(IntEnum):
    STEP = 1
    RX_EXPECT = 2
    RX_POLL = 3
    RX_OUTCOME = 4
    RX_ABORT = 5
    RX_FINISH = 6
    RX_QUARANTINED = 7
    RX_PEER_DEAD = 8
    TX_START = 9
    TX_POLL = 10
    TX_OUTCOME = 11
    TX_ABORT = 12
    TX_FINISH = 13
    SHUTDOWN = 14


class Reply(IntEnum):
    DONE = 101
    POLLED = 102
    STATUSES = 103
    OUTCOME = 104
    QUARANTINE = 105
    BYE = 106
    AGREE = 107  # start-up: a value every rank must share
    ENDPOINT = 108  # start-up: a decode rank's KV side channel


# ---- commands ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StepSeq:
    """One sequence of a step. Page ids are rank 0's (every rank's pool has the same ids); full
    pages travel as a delta against the follower's mirror of the previous step."""

    request_id: str
    token_ids: list[int]  # the chunk: all_ids[start:start + q_len]
    start: int
    sample: bool  # rank 0 samples this row (followers only need it to take the same code path)
    full_from: int  # keep the mirror's first full_from pages (0: start a fresh page list)
    new_full: list[int]  # then append these
    ring: list[int]  # the whole sliding ring (at most R pages)
    copy_src: list[int]  # prefix hit: cached sliding pages copied into ring pages copy_dst before the forward
    copy_dst: list[int]


@dataclass(frozen=True, slots=True)
class Step:
    KIND: ClassVar[int] = Command.STEP
    seqs: list[StepSeq]
    layer_done: bool  # pass this rank's KV sender's layer_done to the forward
    # Some input tokens were sampled by the step still in flight (the overlapped loop): rank 0 does
    # not know them yet, their token_ids are placeholders, and the whole [T] id tensor arrives by a
    # device broadcast from rank 0 before the forward (RankGroup.broadcast_inputs)
    ids_on_device: bool = False
    # Prompt logprobs rank 0 computes from the step's rows (engine/prompt_logprobs.py): flat [row0, count, top_n, ...].
    # With a vocab-parallel lm_head every rank joins each slice's logits all-gather; a replicated one ignores them.
    prompt_rows: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RxExpect:
    KIND: ClassVar[int] = Command.RX_EXPECT
    request_id: str
    full: list[int]
    ring: list[int]
    num_tokens: int
    deadline_unix: float
    first_token: int  # a prefix-cache hit on decode: the sender writes from here


@dataclass(frozen=True, slots=True)
class RxPoll:
    KIND: ClassVar[int] = Command.RX_POLL
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class RxOutcome:
    KIND: ClassVar[int] = Command.RX_OUTCOME
    request_id: str


@dataclass(frozen=True, slots=True)
class RxAbort:
    KIND: ClassVar[int] = Command.RX_ABORT
    request_ids: list[str]
    reason: int  # FailureReason
    detail: str


@dataclass(frozen=True, slots=True)
class RxFinish:
    KIND: ClassVar[int] = Command.RX_FINISH
    request_id: str


@dataclass(frozen=True, slots=True)
class RxQuarantined:
    KIND: ClassVar[int] = Command.RX_QUARANTINED


@dataclass(frozen=True, slots=True)
class RxPeerDead:
    KIND: ClassVar[int] = Command.RX_PEER_DEAD
    agent_name: str


@dataclass(frozen=True, slots=True)
class TxStart:
    KIND: ClassVar[int] = Command.TX_START
    request: bytes  # kv_transfer.messages TransferRequest, as the router delivered it
    full: list[int]
    ring: list[int]


@dataclass(frozen=True, slots=True)
class TxPoll:
    KIND: ClassVar[int] = Command.TX_POLL
    request_ids: list[str]  # empty: progress only


@dataclass(frozen=True, slots=True)
class TxOutcome:
    KIND: ClassVar[int] = Command.TX_OUTCOME
    request_id: str


@dataclass(frozen=True, slots=True)
class TxAbort:
    KIND: ClassVar[int] = Command.TX_ABORT
    request_ids: list[str]
    reason: int  # FailureReason
    detail: str


@dataclass(frozen=True, slots=True)
class TxFinish:
    KIND: ClassVar[int] = Command.TX_FINISH
    request_id: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    KIND: ClassVar[int] = Command.SHUTDOWN


# ---- answers ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Done:
    KIND: ClassVar[int] = Reply.DONE
    error: str  # "" when the command succeeded on this rank


@dataclass(frozen=True, slots=True)
class Failure:
    """A request this rank saw fail (reported once, before its pages may be released)."""

    request_id: str
    reason: int  # FailureReason
    detail: str


@dataclass(frozen=True, slots=True)
class Polled:
    KIND: ClassVar[int] = Reply.POLLED
    statuses: list[int]  # TransferStatus per polled id, in order (FAILED once released here)
    failures: list[Failure]
    released: list[str]  # this rank's receiver released these pages (take_releasable)


@dataclass(frozen=True, slots=True)
class Statuses:
    KIND: ClassVar[int] = Reply.STATUSES
    statuses: list[int]  # TransferStatus per polled id, in order


@dataclass(frozen=True, slots=True)
class Outcome:
    KIND: ClassVar[int] = Reply.OUTCOME
    known: bool  # False: this rank already released or never saw the request
    status: int
    reason: int  # 0 = none
    detail: str
    num_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class QuarantineItem:
    request_id: str
    full: list[int]
    ring: list[int]
    waiting_on: list[str]
    reason: int


@dataclass(frozen=True, slots=True)
class Quarantine:
    KIND: ClassVar[int] = Reply.QUARANTINE
    items: list[QuarantineItem]


@dataclass(frozen=True, slots=True)
class Bye:
    """A follower's state as it stops: anything non-zero is transfer state it still held."""

    KIND: ClassVar[int] = Reply.BYE
    open_receives: int
    open_sends: int
    quarantined_pages: int


@dataclass(frozen=True, slots=True)
class Agree:
    KIND: ClassVar[int] = Reply.AGREE
    what: str
    values: list[int]


@dataclass(frozen=True, slots=True)
class Endpoint:
    KIND: ClassVar[int] = Reply.ENDPOINT
    endpoint: str
    epoch: int


CommandMsg = (Step | RxExpect | RxPoll | RxOutcome | RxAbort | RxFinish | RxQuarantined | RxPeerDead | TxStart
              | TxPoll | TxOutcome | TxAbort | TxFinish | Shutdown)
_KINDS: dict[int, type] = {c.KIND: c for c in (
    Step, RxExpect, RxPoll, RxOutcome, RxAbort, RxFinish, RxQuarantined, RxPeerDead, TxStart, TxPoll, TxOutcome,
    TxAbort, TxFinish, Shutdown, Done, Polled, Statuses, Outcome, Quarantine, Bye, Agree, Endpoint)}
assert set(_KINDS) == set(Command) | set(Reply), "every command and answer kind has one message class"


def encode(msg: typing.Any) -> bytes:
    if type(msg) not in _KINDS.values():
        raise TypeError(f"{type(msg).__name__} is not a rank-group message")
    return pack([msg.KIND, to_wire(msg)])


def decode(data: bytes, *expected: type) -> typing.Any:
    """Bytes -> a checked message; with `expected`, anything else is a ProtocolError."""
    frame = unpack(data, "rank group")
    if not isinstance(frame, list) or len(frame) != 2 or type(frame[0]) is not int or frame[0] not in _KINDS:
        raise ProtocolError("rank group: frame is not [known kind, fields]")
    cls = _KINDS[frame[0]]
    if expected and cls not in expected:
        raise ProtocolError(f"rank group: got {cls.__name__}, expected {' or '.join(c.__name__ for c in expected)}")
    return build(cls, frame[1], cls.__name__)

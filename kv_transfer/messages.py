"""Wire messages of the KV transfer: typed, versioned, size-bounded msgpack.

Every message is a frozen dataclass registered under a KIND number. On the wire it is the msgpack
array [PROTOCOL_VERSION, KIND, [field values in declaration order]]; `decode` checks the version,
the kind, every field's type (recursively, from the dataclass annotations) and then the message's
own `validate()`, so nothing untyped crosses a process boundary.

Who sends what (D = decode rank's side channel, P = a prefill rank, N = NIXL notification):
  P -> D  HandshakeRequest        D -> P  Handshake      (once per decode epoch; cached by P)
  P -> D  Claim                   D -> P  ClaimReply     (before P writes anything for a request)
  P -> D  (N, attached to each WRITE) LayerDone     (delivered after the data of the layers it names;
                                                     on the IPC data path sent once the copy completed)
  P -> D  Ended                                          (P will write no more for the request)
  D -> P  Cancel                                         (decode failed/aborted the request)
  D -> P  (N) Probe                                      (is a claimant's process still there?)
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import types
import typing
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar, TypeVar

import msgpack
import torch

from common.errors import ProtocolError
from model.kv_cache import KVCacheSpec, KVPool
from wire.codec import brief, unpack

# 2: LayerDone names the layers one WRITE carried (one WRITE may carry several).
# 3: Handshake.ipc: a decode rank may export its pools for same-node writers (TransferBackend.IPC).
# 4: KVCompat.kv_scales: FP8 pages are only meaningful with the writer's scales (and dtype names e4m3).
# 5: TransferRequest.first_token: decode holds a cached prefix; only the pages after it are written.
PROTOCOL_VERSION = 5
MAX_MESSAGE_BYTES = 4 << 20  # a 128k-token request names ~8k pages (~40 KB); metadata is KBs
MAX_ID_CHARS = 256
# What a side channel binds (nixl_backend) or the in-process hub names (loopback)
_ENDPOINT = re.compile(r"tcp://[^\s/]{1,250}:[0-9]{1,5}|loopback://[^\s]{1,250}")
# The pool layout both sides must share: per group [layers, K/V, pages, KV heads, page tokens, head dim].
KV_LAYOUT = "L,2,NP,Hkv,P,D"

M = TypeVar("M", bound="Message")
_REGISTRY: dict[int, type[Message]] = {}


class FailureReason(IntEnum):
    DEADLINE = 1
    EPOCH_MISMATCH = 2  # a restarted worker: what its predecessor promised is void
    PEER_DEAD = 3  # the transport reports the peer gone (or a transport error)
    HANDSHAKE_MISMATCH = 4  # incompatible layout, model, dtype, TP split or protocol version
    ABORTED = 5  # cancelled by either side's owner

    @property
    def label(self) -> str:
        return self.name.lower()


class Message:
    __slots__ = ()
    KIND: ClassVar[int]

    def validate(self) -> None:
        """Semantic checks after the type check; raise ProtocolError."""


def _register(kind: int):  # noqa: ANN202 - class decorator
    def wrap(cls: type[M]) -> type[M]:
        assert kind not in _REGISTRY, f"duplicate message kind {kind}"
        cls.KIND = kind
        _REGISTRY[kind] = cls
        return cls
    return wrap


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ProtocolError(msg)


def _check_id(name: str, value: str) -> None:
    _need(0 < len(value) <= MAX_ID_CHARS, f"{name} must have 1..{MAX_ID_CHARS} characters")


# ---- messages ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KVCompat(Message):
    """What two workers must agree on before one writes into the other's pages. Pages are bytes:
    the KV dtype (`dtype`, e.g. float8_e4m3fn vs bfloat16) and, for FP8, the table of dequantisation
    scales (`kv_scales`: source and digest, model.kv_scales.KVScales.tag; "none" otherwise) must be
    the same on both sides, or every value the reader decodes is wrong."""

    model_name: str
    dtype: str
    page_size: int
    sliding_window: int
    layout: str
    head_dim: int
    total_num_kv_heads: int
    full_layers: tuple[int, ...]
    sliding_layers: tuple[int, ...]
    kv_scales: str = "none"

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, model_name: str, tp_size: int, kv_scales: str = "none") -> KVCompat:
        return cls(model_name, dtype_name(spec.dtype), spec.page_size, spec.sliding_window,
                   KV_LAYOUT, spec.head_dim, spec.num_kv_heads * tp_size, spec.full_layers, spec.sliding_layers,
                   kv_scales)

    @classmethod
    def from_pool(cls, pool: KVPool, model_name: str, tp_size: int) -> KVCompat:
        return cls.from_spec(pool.spec, model_name, tp_size, pool.scales_tag)

    def digest(self) -> str:
        return hashlib.sha256(msgpack.packb(_to_wire(self), use_bin_type=True)).hexdigest()[:32]

    def diff(self, other: KVCompat) -> list[str]:
        return [f"{f.name}: {getattr(self, f.name)!r} here vs {getattr(other, f.name)!r} at the peer"
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True, slots=True)
class PoolLayout(Message):
    """One registered pool tensor [L_g, 2, NP_g, Hkv, P, D] of one decode rank."""

    group: int  # model.kv_cache.PageGroup
    base_addr: int
    nbytes: int
    device_id: int
    num_pages: int


@dataclass(frozen=True, slots=True)
class IpcPool(Message):
    """One decode pool tensor exported for a writer on the same node (kv_transfer/ipc.py). The
    handles are opaque to everyone but torch on the same host: `node_id` says which host."""

    group: int  # model.kv_cache.PageGroup
    kind: str  # "cuda": torch CUDA IPC of the storage; "shm": torch file_system shared memory
    node_id: str  # /proc/sys/kernel/random/boot_id of the exporting host
    device_uuid: str  # cuda: the pool's GPU (device indices differ between processes); shm: ""
    handle: bytes  # cuda: the allocation's IPC handle; shm: the shared-memory file name
    manager: bytes  # cuda: torch's ref-counter file name; shm: torch_shm_manager's socket
    nbytes: int  # storage bytes (the whole pool tensor)
    offset: int  # cuda: storage offset in its allocation; shm: 0
    ref_offset: int  # cuda: slot in the ref-counter file; shm: 0
    event_handle: bytes  # cuda: IPC event the mapper waits for before first use (b"" if none)
    event_sync: bool

    def validate(self) -> None:
        _need(self.kind in ("cuda", "shm"), f"unknown IPC pool kind {self.kind!r}")
        _need(self.nbytes > 0 and self.offset >= 0 and self.ref_offset >= 0, "IPC pool sizes must be >= 0")


@_register(2)
@dataclass(frozen=True, slots=True)
class HandshakeRequest(Message):
    requester: str  # agent name, for logs


@_register(3)
@dataclass(frozen=True, slots=True)
class Handshake(Message):
    """A decode rank's answer: how to reach its NIXL agent and where its pages live."""

    engine_id: str
    agent_name: str
    agent_metadata: bytes
    epoch: int
    tp_rank: int
    tp_size: int
    mem_type: str  # "DRAM" | "VRAM"
    num_kv_heads: int  # on this rank
    pools: tuple[PoolLayout, ...]
    compat: KVCompat
    compat_hash: str
    ipc: tuple[IpcPool, ...] = ()  # empty unless the rank exported its pools (data path "ipc")

    def validate(self) -> None:
        _check_id("agent_name", self.agent_name)
        _need(0 <= self.tp_rank < self.tp_size, f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        _need(self.mem_type in ("DRAM", "VRAM"), f"unknown mem_type {self.mem_type!r}")
        _need(self.compat_hash == self.compat.digest(), "compat_hash does not match the compat fields")
        _need(self.num_kv_heads * self.tp_size == self.compat.total_num_kv_heads, "KV heads do not add up")
        _need(len({p.group for p in self.pools}) == len(self.pools), "duplicate pool groups")
        _need({p.group for p in self.ipc} <= {p.group for p in self.pools} and
              len({p.group for p in self.ipc}) == len(self.ipc), "IPC pools must name distinct registered groups")
        for p in self.ipc:
            p.validate()

    def pool(self, group: int) -> PoolLayout:
        for p in self.pools:
            if p.group == group:
                return p
        raise ProtocolError(f"decode rank {self.tp_rank} registered no pool for page group {group}")


@_register(4)
@dataclass(frozen=True, slots=True)
class TransferRequest(Message):
    """Decode's promise: pages reserved for `request_id` on every decode TP rank, valid while each
    rank is still at the epoch named here, until the deadline."""

    request_id: str
    decode_engine_id: str
    decode_endpoints: tuple[str, ...]  # side channel of every decode TP rank, in rank order
    decode_epochs: tuple[int, ...]  # each rank's epoch (a rank restarted alone is caught too)
    full_pages: tuple[int, ...]  # logical order
    ring_pages: tuple[int, ...]  # sliding ring; logical page j lives in ring[j % R]
    num_tokens: int
    deadline_unix: float  # wall clock; each side converts it to its monotonic clock on receipt
    first_token: int = 0  # decode already holds [0, first_token) (a prefix-cache hit, page-aligned): write the rest

    def validate(self) -> None:
        _check_id("request_id", self.request_id)
        _need(len(self.decode_endpoints) > 0, "no decode endpoints")
        _need(len(self.decode_epochs) == len(self.decode_endpoints), "one epoch per decode endpoint")
        _need(all(_ENDPOINT.fullmatch(e) for e in self.decode_endpoints), "decode endpoints must be tcp://host:port (or loopback://)")
        _need(self.num_tokens > 0, "num_tokens must be > 0")
        _need(0 <= self.first_token < self.num_tokens, "first_token must be in [0, num_tokens)")
        _need(math.isfinite(self.deadline_unix), "deadline must be finite")
        _need(all(p >= 0 for p in self.full_pages) and all(p >= 0 for p in self.ring_pages),
              "page ids must be >= 0")

    @property
    def decode_tp_size(self) -> int:
        return len(self.decode_endpoints)


@_register(5)
@dataclass(frozen=True, slots=True)
class Claim(Message):
    """A prefill rank announces it will write `request_id` (nothing is written before acceptance)."""

    request_id: str
    decode_epoch: int
    sender_agent: str
    sender_engine_id: str
    sender_epoch: int
    sender_rank: int
    sender_tp: int
    sender_metadata: bytes  # NIXL metadata, so decode can probe whether the sender is alive
    compat: KVCompat

    def validate(self) -> None:
        _check_id("request_id", self.request_id)
        _check_id("sender_agent", self.sender_agent)
        _need(0 <= self.sender_rank < self.sender_tp, "sender_rank outside sender_tp")


@_register(6)
@dataclass(frozen=True, slots=True)
class ClaimReply(Message):
    request_id: str
    accepted: bool
    retry: bool  # decode has not registered the request yet (its TP ranks expect in lockstep)
    reason: FailureReason | None
    detail: str


@_register(7)
@dataclass(frozen=True, slots=True)
class LayerDone(Message):
    """Attached to one WRITE as its NIXL notification, so it arrives after the data. A WRITE
    carries every layer that was computed and not yet written when it was posted (one layer while
    prefill runs ahead of the transfer; several when the claim or the transport lagged)."""

    request_id: str
    decode_epoch: int
    sender_rank: int
    layers: tuple[int, ...]  # ascending, no repeats
    num_bytes: int

    def validate(self) -> None:
        if not self.layers or any(b <= a for a, b in zip(self.layers, self.layers[1:])) or self.layers[0] < 0:
            raise ProtocolError(f"LayerDone layers must be ascending, distinct and >= 0: {self.layers}")
        if self.num_bytes < 0:
            raise ProtocolError("LayerDone num_bytes < 0")


@_register(8)
@dataclass(frozen=True, slots=True)
class Ended(Message):
    """The sender has no write in flight and will post none: its claim on the pages is over."""

    request_id: str
    decode_epoch: int
    sender_agent: str
    sender_rank: int
    ok: bool
    reason: FailureReason | None
    detail: str


@_register(9)
@dataclass(frozen=True, slots=True)
class Cancel(Message):
    request_id: str
    decode_epoch: int
    reason: FailureReason
    detail: str


@_register(10)
@dataclass(frozen=True, slots=True)
class Probe(Message):
    """Decode -> a claimant, as a NIXL notification: if NIXL cannot deliver it because the remote
    disconnected, the claimant's epoch is dead. The sender drops it on receipt."""

    decode_epoch: int


# ---- codec ---------------------------------------------------------------------------------------
def encode(msg: Message) -> bytes:
    data = msgpack.packb([PROTOCOL_VERSION, msg.KIND, _to_wire(msg)], use_bin_type=True)
    _need(len(data) <= MAX_MESSAGE_BYTES, f"{type(msg).__name__} is {len(data)} bytes > {MAX_MESSAGE_BYTES}")
    return data


def decode(data: bytes, *expected: type[M]) -> M:
    """Bytes -> a validated message of one of the `expected` classes (any registered one if none)."""
    _need(len(data) <= MAX_MESSAGE_BYTES, f"message of {len(data)} bytes > {MAX_MESSAGE_BYTES}")
    obj = unpack(data, "kv side channel", max_bin_len=MAX_MESSAGE_BYTES)  # bounded lengths and nesting
    _need(isinstance(obj, list) and len(obj) == 3, "envelope must be [version, kind, body]")
    version, kind, body = obj
    _need(type(version) is int and version == PROTOCOL_VERSION,
          f"protocol version {brief(version)}, this side speaks {PROTOCOL_VERSION}")
    cls = _REGISTRY.get(kind) if type(kind) is int else None
    _need(cls is not None, f"unknown message kind {brief(kind)}")
    assert cls is not None
    _need(not expected or cls in expected,
          f"got {cls.__name__}, expected one of {[c.__name__ for c in expected]}")
    msg = _from_wire(cls, body, cls.__name__)
    msg.validate()
    return msg  # type: ignore[return-value]


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [_to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, tuple):
        return [_to_wire(v) for v in value]
    if isinstance(value, IntEnum):
        return int(value)
    assert value is None or isinstance(value, (int, float, str, bytes, bool)), f"unencodable {type(value)}"
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _from_wire(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            _need(type(None) in args, f"{path}: null not allowed")
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _from_wire(inner, value, path)
    if origin is tuple:
        elem, ellipsis = typing.get_args(tp)
        assert ellipsis is Ellipsis, "only homogeneous tuple[X, ...] fields are supported"
        _need(isinstance(value, list), f"{path}: expected a list, got {type(value).__name__}")
        return tuple(_from_wire(elem, v, f"{path}[{i}]") for i, v in enumerate(value))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = _HINTS.get(tp) or _HINTS.setdefault(tp, typing.get_type_hints(tp))
        fields = dataclasses.fields(tp)
        _need(isinstance(value, list) and len(value) == len(fields),
              f"{path}: expected {len(fields)} fields, got {brief(value)}")
        return tp(**{f.name: _from_wire(hints[f.name], v, f"{path}.{f.name}") for f, v in zip(fields, value)})
    if isinstance(tp, type) and issubclass(tp, IntEnum):
        _need(isinstance(value, int) and not isinstance(value, bool), f"{path}: expected an enum value")
        try:
            return tp(value)
        except ValueError as e:
            raise ProtocolError(f"{path}: {e}") from e
    if tp is bool:
        _need(isinstance(value, bool), f"{path}: expected bool, got {type(value).__name__}")
    elif tp is int:
        _need(isinstance(value, int) and not isinstance(value, bool), f"{path}: expected int, got {brief(value)}")
    elif tp is float:
        _need(isinstance(value, (int, float)) and not isinstance(value, bool), f"{path}: expected a number")
        return float(value)
    elif tp in (str, bytes):
        _need(isinstance(value, tp), f"{path}: expected {tp.__name__}, got {type(value).__name__}")
    else:
        raise AssertionError(f"unsupported field type {tp!r} at {path}")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

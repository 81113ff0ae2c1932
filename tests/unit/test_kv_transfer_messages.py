"""kv_transfer.messages: round trips, and every way a peer's bytes can be refused."""

import dataclasses

import msgpack
import pytest
import torch

from common.errors import ProtocolError
from kv_transfer.messages import (MAX_MESSAGE_BYTES, PROTOCOL_VERSION, Cancel, Claim, ClaimReply, Ended, FailureReason,
                                  Handshake, HandshakeRequest, IpcPool, KVCompat, LayerDone, PoolLayout, Probe,
                                  TransferRequest, decode, encode)
from model.kv_cache import KVCacheSpec

SPEC = KVCacheSpec(16, 4, 64, torch.bfloat16, 128, (1, 3), (0, 2), (100, 18))
COMPAT = KVCompat.from_spec(SPEC, "gpt-oss-120b", tp_size=2)


def _handshake(**kw):
    base = dict(engine_id="dec", agent_name="dec/decode/0/1", agent_metadata=b"\x00\x01md", epoch=1, tp_rank=0,
                tp_size=2, mem_type="VRAM", num_kv_heads=4,
                pools=(PoolLayout(0, 1 << 40, 4096, 1, 100), PoolLayout(1, 1 << 41, 512, 1, 18)), compat=COMPAT,
                compat_hash=COMPAT.digest())
    base.update(kw)
    return Handshake(**base)


IPC = (IpcPool(0, "cuda", "boot-1", "GPU-9f", b"\x01" * 64, b"/torch_1_2", 4096, 512, 3, b"\x02" * 64, True),
       IpcPool(1, "shm", "boot-1", "", b"/torch_1_3_0", b"/tmp/torch-shm-dir-x/manager.sock", 512, 0, 0, b"", False))

SAMPLES = [
    _handshake(),
    _handshake(ipc=IPC),
    HandshakeRequest("pre/prefill/0/5"),
    TransferRequest("req-1", "dec", ("tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"), (7, 8), (4, 2, 9), (1, 0), 40, 1.5e9),
    Claim("req-1", 7, "pre/prefill/1/5", "pre", 5, 1, 2, b"meta", COMPAT),
    ClaimReply("req-1", False, False, FailureReason.DEADLINE, "late"),
    ClaimReply("req-1", True, False, None, ""),
    LayerDone("req-1", 7, 1, (3, 35), 1 << 33),
    Ended("req-1", 7, "pre/prefill/1/5", 1, False, FailureReason.PEER_DEAD, "gone"),
    Cancel("req-1", 7, FailureReason.ABORTED, "client left"),
    Probe(7),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg
    assert decode(encode(msg), type(msg)) == msg


def test_compat_from_spec_counts_total_heads_and_names_layers():
    assert COMPAT.total_num_kv_heads == 8 and COMPAT.dtype == "bfloat16" and COMPAT.full_layers == (1, 3)
    other = dataclasses.replace(COMPAT, page_size=8, dtype="float16")
    assert other.digest() != COMPAT.digest()
    diff = COMPAT.diff(other)
    assert diff == ["dtype: 'bfloat16' here vs 'float16' at the peer", "page_size: 16 here vs 8 at the peer"]


def _raw(body, version=PROTOCOL_VERSION, kind=TransferRequest.KIND):
    return msgpack.packb([version, kind, body], use_bin_type=True)


def _req_body(**kw):
    body = [f.name for f in dataclasses.fields(TransferRequest)]
    vals = dict(request_id="r", decode_engine_id="d", decode_epochs=[1], decode_endpoints=["tcp://x:1"],
                full_pages=[1, 2], ring_pages=[3], num_tokens=20, deadline_unix=5.0, first_token=0)
    vals.update(kw)
    return [vals[k] for k in body]


@pytest.mark.parametrize("data,match", [
    (_raw(_req_body(), version=PROTOCOL_VERSION + 1), "protocol version"),
    (_raw(_req_body(), kind=99), "unknown message kind"),
    (_raw(_req_body(num_tokens="20")), "num_tokens: expected int"),
    (_raw(_req_body(decode_epochs=[True])), r"decode_epochs\[0\]: expected int"),
    (_raw(_req_body(decode_epochs=[1, 2])), "one epoch per decode endpoint"),
    (_raw(_req_body(full_pages=[1, "2"])), r"full_pages\[1\]: expected int"),
    (_raw(_req_body(decode_endpoints="tcp://x:1")), "decode_endpoints: expected a list"),
    (_raw(_req_body()[:-1]), "expected 9 fields"),
    (_raw(_req_body() + [1]), "expected 9 fields"),
    (_raw(_req_body(num_tokens=0)), "num_tokens must be > 0"),
    (_raw(_req_body(first_token=20)), r"first_token must be in \[0, num_tokens\)"),
    (_raw(_req_body(full_pages=[1, -2])), "page ids must be >= 0"),
    (_raw(_req_body(request_id="")), "request_id must have"),
    (_raw(_req_body(deadline_unix=float("nan"))), "deadline must be finite"),
    (b"\xc1\x00garbage", "not a msgpack frame"),
    (msgpack.packb({"a": 1}), "exceeds max_map_len"),  # no message has a map: refused by the unpacker
    (b"\x00" * (MAX_MESSAGE_BYTES + 1), "bytes >"),
])
def test_refused(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode(data)


def test_enum_and_expected_kind_checked():
    body = [*[f for f in ["r", 1]], 9, "x"]  # Cancel with reason 9: not a FailureReason
    with pytest.raises(ProtocolError, match="reason"):
        decode(_raw(body, kind=Cancel.KIND))
    with pytest.raises(ProtocolError, match="expected one of"):
        decode(encode(Probe(1)), Handshake, Claim)


def test_handshake_validation():
    with pytest.raises(ProtocolError, match="compat_hash"):
        decode(encode(_handshake(compat_hash="0" * 32)))
    with pytest.raises(ProtocolError, match="KV heads do not add up"):
        decode(encode(_handshake(num_kv_heads=2)))
    with pytest.raises(ProtocolError, match="mem_type"):
        decode(encode(_handshake(mem_type="HBM")))
    with pytest.raises(ProtocolError, match="outside tp_size"):
        decode(encode(_handshake(tp_rank=2)))
    hs = _handshake()
    assert hs.pool(1).num_pages == 18
    with pytest.raises(ProtocolError, match="no pool for page group 1"):
        _handshake(pools=(PoolLayout(0, 1, 4096, 1, 100),)).pool(1)


def test_handshake_ipc_export_validated():
    assert PROTOCOL_VERSION >= 3  # 3 added Handshake.ipc (4: KVCompat.kv_scales, 5: TransferRequest.first_token)
    assert _handshake().ipc == ()  # a receiver on the NIXL data path exports nothing
    with pytest.raises(ProtocolError, match="distinct registered groups"):
        decode(encode(_handshake(ipc=(IPC[0], IPC[0]))))
    with pytest.raises(ProtocolError, match="distinct registered groups"):
        decode(encode(_handshake(ipc=(dataclasses.replace(IPC[0], group=2),))))
    with pytest.raises(ProtocolError, match="unknown IPC pool kind"):
        decode(encode(_handshake(ipc=(dataclasses.replace(IPC[0], kind="rdma"),))))
    with pytest.raises(ProtocolError, match="sizes"):
        decode(encode(_handshake(ipc=(dataclasses.replace(IPC[1], nbytes=0),))))
    with pytest.raises(ProtocolError, match=r"ipc\[0\]\.event_sync: expected bool"):
        body = msgpack.unpackb(encode(_handshake(ipc=IPC[:1])))
        body[2][-1][0][-1] = 1
        decode(msgpack.packb(body, use_bin_type=True))


def test_oversized_message_is_not_sent():
    huge = TransferRequest("r", "d", ("e",), (1,), tuple(range(1 << 20, 2 << 20)), (), 1, 1.0)
    with pytest.raises(ProtocolError, match="bytes >"):
        encode(huge)


@pytest.mark.parametrize("layers", [[], [3, 3], [5, 2], [-1, 2]])
def test_layer_done_names_ascending_distinct_layers(layers):
    with pytest.raises(ProtocolError, match="ascending"):
        decode(_raw(["r", 1, 0, layers, 10], kind=LayerDone.KIND))

"""Bounds of the typed msgpack codec on untrusted bytes (wire.codec, used by the router<->worker
protocol, the TP control plane and the KV side channel): declared lengths past the caps or past the
frame itself, maps and ext types, nesting past msgpack's stack, nesting the message class does not
have, and a seeded mutation fuzz: every decoder raises ProtocolError and nothing else, quickly."""

from __future__ import annotations

import random
import struct
import time

import msgpack
import pytest

from common.errors import ProtocolError
from engine.tp import messages as tp_messages
from kv_transfer import messages as kv_messages
from wire import codec, protocol
from wire.protocol import PROTOCOL_VERSION, GenerateRequest, SamplingSpec, StatusRequest, TokenChunk, decode, encode

GENERATE = protocol._TAGS[GenerateRequest]
DECODERS = {"wire": decode, "kv side channel": kv_messages.decode, "tp control": tp_messages.decode}


def _header(kind: bytes, n: int) -> bytes:
    return kind + struct.pack(">I", n)


@pytest.mark.parametrize("data,match", [
    (_header(b"\xdd", 2**32 - 1) + b"\x00" * 16, "exceeds max_array_len"),  # array32 far past the frame
    (_header(b"\xdb", 2**31) + b"x" * 16, "incomplete input"),  # str32: checked against the frame first
    (_header(b"\xc6", 10**9) + b"\x00" * 16, "incomplete input"),  # bin32
    (_header(b"\xdf", 1) + b"\x00\x00", "exceeds max_map_len"),  # no message has a map
    (b"\xd6\x05abcd", "exceeds max_ext_len"),  # nor an ext type
    (b"\x91" * 2000 + b"\xc0", "not a msgpack frame"),  # deeper than msgpack's unpack stack
    (b"\x93\x01\x00", "not a msgpack frame"),  # truncated
    (b"\xc1", "not a msgpack frame"),  # never-used byte
])
def test_declared_lengths_maps_ext_and_depth_are_refused_before_allocation(data, match):
    t0 = time.perf_counter()
    for name, dec in DECODERS.items():
        with pytest.raises(ProtocolError, match=match):
            dec(data)
    assert time.perf_counter() - t0 < 0.5


def test_caps_hold_even_inside_a_large_frame():
    big = msgpack.packb("x" * (codec.MAX_STR_LEN + 1))
    with pytest.raises(ProtocolError, match="exceeds max_str_len"):
        codec.unpack(big, "t")
    assert codec.unpack(msgpack.packb("x" * codec.MAX_STR_LEN), "t") == "x" * codec.MAX_STR_LEN
    with pytest.raises(ProtocolError, match="exceeds max_bin_len"):
        codec.unpack(msgpack.packb(b"\x00" * 100), "t", max_bin_len=99)


def test_nesting_the_message_class_does_not_have_is_refused_at_its_first_level():
    deep = [1]
    for _ in range(1000):  # within msgpack's stack; a repr of it would overflow Python's recursion
        deep = [deep]
    for values, where in ((["r", deep, codec.to_wire(SamplingSpec())], "prompt_ids"),
                          (["r", [1, 2], deep], "SamplingSpec needs")):
        with pytest.raises(ProtocolError, match=where):
            decode(msgpack.packb([PROTOCOL_VERSION, GENERATE, values]))
    for version, tag in ((deep, GENERATE), (PROTOCOL_VERSION, deep), ([1], GENERATE)):
        with pytest.raises(ProtocolError, match="a list"):  # error texts never repr a value
            decode(msgpack.packb([version, tag, []]))
    with pytest.raises(ProtocolError):
        kv_messages.decode(msgpack.packb([deep, 4, []]))
    with pytest.raises(ProtocolError):
        tp_messages.decode(msgpack.packb([deep, []]))


def test_brief_is_bounded_whatever_the_value():
    assert codec.brief("x" * 10**6) == repr("x" * 40)
    assert codec.brief(2**64) == repr(2**64)
    assert codec.brief([[[]]]) == "a list"


def test_seeded_mutation_fuzz_raises_only_protocol_errors():
    rng = random.Random(7)
    valid = [encode(GenerateRequest("r", list(range(50)), SamplingSpec(max_tokens=3, stop_token_ids=[1]))),
             encode(TokenChunk("r", [1, 2], [-0.5, -0.1], [[], []], True, "stop", "")), encode(StatusRequest())]
    t0 = time.perf_counter()
    for _ in range(3000):
        b = bytearray(rng.choice(valid))
        op = rng.randrange(4)
        if op == 0:
            for _ in range(rng.randint(1, 6)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1:
            del b[rng.randrange(len(b)):]
        elif op == 2:
            i = rng.randrange(len(b))
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        else:
            b = bytearray(rng.randbytes(rng.randint(0, 64)))
        for dec in DECODERS.values():
            try:
                dec(bytes(b))
            except ProtocolError:
                pass
    assert time.perf_counter() - t0 < 30


def test_tp_control_plane_length_headers_are_bounded():
    """The ranks' gloo buffers carry a length header: one past the bound is corruption, refused
    before anything of that size is allocated (and nothing that large is ever sent)."""
    import torch

    from engine.tp import group

    head = group._pack(b"abc")
    assert group._length(head) == 3
    head[:8] = torch.frombuffer(bytearray((group.MAX_MESSAGE_BYTES + 1).to_bytes(8, "little")), dtype=torch.uint8)
    with pytest.raises(ProtocolError, match="declares"):
        group._length(head)

"""Hostile frames for a worker's router-facing socket (tests/integration/test_worker_faults.py).

`frames(rng, n)` mixes: random bytes; truncated and bit-flipped valid frames; valid msgpack of
wrong shapes; headers declaring huge lengths; deep nesting; wrong versions and tags; and typed
messages with nonsense values (negative, huge, NaN, empty, token ids past the vocabulary, random
KV targets). Request ids of the typed ones come from `ids` so the caller can Abort them all after.
"""

from __future__ import annotations

import random
import struct

import msgpack

from wire.protocol import (PROTOCOL_VERSION, Abort, AdmitRequest, GenerateRequest, LogitBias, PrefillRequest,
                           SamplingSpec, StartDecode, StatusRequest, TopLogprob, encode)

NASTY_INTS = [0, -1, 1, 2**31, -2**63, 2**64 - 1, 10**12, 200_000, 201_088]
NASTY_FLOATS = [0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e308, 3.0]


def _obj(rng: random.Random, depth: int = 0):
    c = rng.random()
    if depth > 3 or c < 0.4:
        return rng.choice([None, True, False, rng.choice(NASTY_INTS), rng.choice(NASTY_FLOATS), "x" * rng.randint(0, 9),
                           b"\x00" * rng.randint(0, 9)])
    if c < 0.85:
        return [_obj(rng, depth + 1) for _ in range(rng.randint(0, 6))]
    return {rng.choice(["k", "v", "w"]): _obj(rng, depth + 1) for _ in range(rng.randint(1, 3))}


def _spec(rng: random.Random) -> SamplingSpec:
    return SamplingSpec(max_tokens=rng.choice([0, 1, 4, -3, 10**9]), temperature=rng.choice(NASTY_FLOATS),
                        top_p=rng.choice([0.0, 0.5, 1.0, 2.0, float("nan")]), top_k=rng.choice(NASTY_INTS),
                        seed=rng.choice([None, -1, 2**64 - 1]), stop_token_ids=[rng.choice(NASTY_INTS)],
                        ignore_eos=rng.random() < 0.5, logprobs=rng.choice([None, 0, 5, 21, -1]),
                        min_tokens=rng.choice([0, 2, -1, 10**6]), presence_penalty=rng.choice(NASTY_FLOATS),
                        frequency_penalty=rng.choice([0.0, 1.0, float("nan")]),
                        logit_bias=[LogitBias(rng.choice(NASTY_INTS), rng.choice(NASTY_FLOATS))
                                    for _ in range(rng.choice([0, 1, 3]))])


def _prompt(rng: random.Random) -> list[int]:
    return rng.choice([[], [rng.choice(NASTY_INTS)], [1, 2, 3], [rng.randrange(200_000) for _ in range(rng.randint(1, 40))]])


def typed(rng: random.Random, ids: list[str]) -> bytes:
    """A well-formed frame of a real message with values no router would send."""
    rid = rng.choice(["", "x" * 300, f"fuzz-{len(ids)}"])
    ids.append(rid)
    kind = rng.randrange(6)
    if kind == 0:
        msg = AdmitRequest(rid, rng.choice(NASTY_INTS), rng.choice(NASTY_INTS), rng.choice(NASTY_INTS),
                           rng.choice(NASTY_FLOATS))
    elif kind == 1:
        msg = GenerateRequest(rid, _prompt(rng), _spec(rng))
    elif kind == 2:
        msg = StartDecode(rid, _prompt(rng), _spec(rng), rng.choice(NASTY_INTS), rng.choice([None, *NASTY_FLOATS]),
                          [TopLogprob(rng.choice(NASTY_INTS), rng.choice(NASTY_FLOATS))])
    elif kind == 3:
        target = rng.choice([b"", bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))),
                             msgpack.packb([3, 4, [rng.choice([rid, "other"]), "d", ["tcp://127.0.0.1:1"], [1], [0], [0], 3, 1e18]])])
        msg = PrefillRequest(rid, _prompt(rng), _spec(rng), target, rng.choice(NASTY_FLOATS))
    elif kind == 4:
        msg = Abort(rid, "x" * rng.randint(0, 500))
    else:
        msg = StatusRequest()
    return encode(msg)


def frames(rng: random.Random, n: int, ids: list[str]) -> list[list[bytes]]:
    """n multipart messages (a DEALER sends each as one ZMQ message)."""
    valid = [encode(GenerateRequest("v", [1, 2, 3], SamplingSpec(max_tokens=2))), encode(StatusRequest()),
             encode(Abort("v", "fuzz"))]
    out: list[list[bytes]] = []
    for _ in range(n):
        k = rng.randrange(10)
        if k == 0:
            f = [bytes(rng.randrange(256) for _ in range(rng.randint(0, 120)))]
        elif k == 1:
            v = rng.choice(valid)
            f = [v[:rng.randrange(len(v))]]
        elif k == 2:
            b = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            f = [bytes(b)]
        elif k == 3:
            f = [msgpack.packb(_obj(rng))]
        elif k == 4:  # headers that declare far more than the frame holds: array32, map32, str32, bin32, ext32
            head = rng.choice([b"\xdd", b"\xdf", b"\xdb", b"\xc6", b"\xc9"])
            f = [b"\x93\x01\x00" + head + struct.pack(">I", rng.choice([2**32 - 1, 2**31, 10**9])) + b"\x00" * 8]
        elif k == 5:  # nesting: within msgpack's stack and far past it
            d = rng.choice([64, 1000, 1100, 100_000])
            f = [b"\x93\x01\x0b" + b"\x91" * d + b"\xc0"]
        elif k == 6:  # wrong version / tag / field count
            f = [msgpack.packb([rng.choice([0, 2, -1, "1", [1], PROTOCOL_VERSION]),
                                rng.choice([-1, 14, 99, "x", None, 10]), _obj(rng)])]
        elif k == 7:
            f = [b"", rng.choice(valid)] if rng.random() < 0.5 else [rng.choice(valid), b"extra", b"parts"]
        else:
            f = [typed(rng, ids)]
        out.append(f)
    return out

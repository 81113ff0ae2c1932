import msgpack
import pytest

from common.errors import ProtocolError
from wire import protocol
from wire.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    AdmitRequest,
    PrefillResult,
    SamplingSpec,
    TokenChunk,
    TopLogprob,
    decode,
    encode,
)


def test_round_trip_every_field_kind():
    msgs = [SamplingSpec(max_tokens=3, seed=None, stop_token_ids=[1, 2], logprobs=2),
            AdmitRequest("r", 10, 20, 2, 30.5),
            AdmitRequest("r", 2, 20, 2, 30.5, [5, 6]),
            protocol.StatusRequest(17),
            protocol.WorkerStatus("decode", "w", 1, True, False, 0, 0, 0, 10, 10, 9, 9, 16, 4, 0.0, "id/page16",
                                  128, 40, True, [0, 2**64 - 1, 3, 5], 7),
            PrefillResult("r", True, 5, -0.5, [TopLogprob(5, -0.5)], "", 0.1, 1 << 40, 0.2),
            PrefillResult("r", True, 5, None, [], "", 0.1, 0, 0.2, 0.0, 0.01, 32,
                          protocol.ComputeSplit(0.001, 0.02, 0.004, 0.05)),
            TokenChunk("r", [1, 2], [-0.1, -0.2], [[TopLogprob(1, -0.1)], [TopLogprob(2, -0.2)]], True, "stop", "")]
    for m in msgs:
        assert decode(encode(m)) == m


@pytest.mark.parametrize("frame,match", [
    ([PROTOCOL_VERSION + 1, 0, []], "protocol version"),
    ([PROTOCOL_VERSION, 999, []], "unknown message tag"),
    ([PROTOCOL_VERSION, 0], "frame is not"),
    ([PROTOCOL_VERSION, 4, ["r", "ten", 20, 2, 30.5, []]], "AdmitRequest.prompt_len"),
    ([PROTOCOL_VERSION, 4, ["r", 10, 20, 2, 30.5]], "needs 6 fields"),
    ([PROTOCOL_VERSION, 4, ["r", True, 20, 2, 1.0, []]], "expected int, got bool"),
    ([PROTOCOL_VERSION, 4, ["r", 2, 20, 2, 1.0, [1, "2"]]], r"AdmitRequest.prompt_ids\[\]: expected int"),
])
def test_malformed_frames_are_refused(frame, match):
    with pytest.raises(ProtocolError, match=match):
        decode(msgpack.packb(frame))


def test_garbage_and_oversize(monkeypatch):
    with pytest.raises(ProtocolError):
        decode(b"\xc1\xc1\xc1")
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(b"\x00" * (MAX_FRAME_BYTES + 1))
    # The encode-side limit on a 4 KiB cap: packing a 64 MiB token list costs ~10 s of CI.
    monkeypatch.setattr(protocol, "MAX_FRAME_BYTES", 4096)
    encode(TokenChunk("r", list(range(512)), [], [], False, "", ""))  # ~1 KiB: under the cap
    with pytest.raises(ProtocolError, match="exceeds 4096"):
        encode(TokenChunk("r", list(range(4096)), [], [], False, "", ""))


def test_scalar_lists_take_the_one_pass_check_with_the_same_semantics():
    """wire.codec checks a list of scalars by its element types in one pass: a bool is still not
    an int, a float list still takes ints (as floats), and a TokenChunk's times survive."""
    ok = [PROTOCOL_VERSION, protocol._TAGS[AdmitRequest], ["r", 2, 20, 2, 1.0, list(range(5000))]]
    assert decode(msgpack.packb(ok)).prompt_ids == list(range(5000))
    for bad in ([1, True], [1, 2.0], [1, None]):
        frame = [PROTOCOL_VERSION, protocol._TAGS[AdmitRequest], ["r", 2, 20, 2, 1.0, bad]]
        with pytest.raises(ProtocolError, match=r"AdmitRequest.prompt_ids\[\]: expected int"):
            decode(msgpack.packb(frame))
    chunk = decode(msgpack.packb([PROTOCOL_VERSION, protocol._TAGS[TokenChunk],
                                  ["r", [1], [-1], [[]], False, "", "", 3, 0.25, 1, None]]))
    assert chunk.logprobs == [-1.0] and type(chunk.logprobs[0]) is float and chunk.prefill_seconds == 1.0
    assert decode(encode(TokenChunk("r", [7], [], [], False, "", "", 0, 0.5, 0.75))).queue_seconds == 0.5


def test_prompt_logprobs_cross_the_wire():
    """PromptLogprobs nested in the first TokenChunk and in PrefillResult: floats stay floats, tops keep order."""
    from wire.protocol import PrefillResult, PromptLogprobs, TopLogprob

    pl = PromptLogprobs([-1.5, -2], [[TopLogprob(5, -0.5)], [TopLogprob(9, -0.25), TopLogprob(3, -1.0)]])
    chunk = decode(encode(TokenChunk("r", [7], [], [], False, "", "", 0, 0.0, 0.0, pl)))
    assert chunk.prompt == pl and type(chunk.prompt.logprobs[1]) is float
    res = decode(encode(PrefillResult("r", True, 7, None, [], "", 0.1, 0, 0.0, prompt=pl)))
    assert res.prompt == pl and decode(encode(PrefillResult("r", True, 7, None, [], "", 0.1, 0, 0.0))).prompt is None
    frame = [PROTOCOL_VERSION, protocol._TAGS[TokenChunk], ["r", [1], [], [], False, "", "", 0, 0.0, 0.0, [["x"], []]]]
    with pytest.raises(ProtocolError, match="TokenChunk.prompt"):
        decode(msgpack.packb(frame))

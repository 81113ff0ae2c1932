"""Structured outputs on the worker side: where the grammar acts (only inside the Harmony message it
targets), what it allows once the JSON is complete (only that message's end tokens), the sampler's
bitmask batched with free rows, the wire round trip, and the engine loop (overlapped and not) on the
tiny random model, whose constrained answers parse and validate."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from common.grammar import (CALL, CALL_TARGET, CHANNEL, END, RETURN, VOCAB_SIZE, GrammarState, JsonGrammar,
                            default_compiler, fill_masks, schema_json)
from engine.sampling import GrammarMasks, SampleRow, Sampler, SamplingParams, apply_bitmask
from router.tokenizer import load_encoding
from wire.protocol import GenerateRequest, GrammarSpec, SamplingSpec, decode, encode

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["answer", "n", "ok"], "additionalProperties": False}
W = (VOCAB_SIZE + 31) // 32


@pytest.fixture(scope="module")
def enc():
    return load_encoding()


def ids(enc, text: str) -> list[int]:
    return enc.encode(text, allowed_special="all")


def allowed(state: GrammarState) -> set[int]:
    out = np.empty((1, W), dtype=np.int32)
    fill_masks([state], out)
    bits = np.unpackbits(out[0].view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:VOCAB_SIZE]).tolist())


def test_free_until_the_final_header_then_json_then_only_end_tokens(enc):
    prompt = ids(enc, "<|start|>user<|message|>hi<|end|><|start|>assistant")
    st = GrammarState(default_compiler(), [JsonGrammar("final", schema_json(SCHEMA))], prompt)
    analysis = ids(enc, '<|channel|>analysis<|message|>thinking {"not json<|end|><|start|>assistant<|channel|>final')
    for t in analysis:
        assert not st.active  # the analysis channel and the headers stay free
        st.advance(t)
    st.advance(ids(enc, "<|message|>")[0])
    assert st.active
    first = allowed(st)
    assert ids(enc, '{"')[0] in first and RETURN not in first and len(first) < 50
    for t in ids(enc, '{"answer": "no", "n": 7, "ok": true}'):
        assert t in allowed(st)
        st.advance(t)
    assert allowed(st) == {RETURN, END}  # the JSON is complete: only the final message's end tokens
    st.advance(END)
    assert not st.active and st.completed and not st.failed


def test_a_prompt_ending_in_the_final_header_is_constrained_from_its_first_token(enc):
    prompt = ids(enc, "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>")
    st = GrammarState(default_compiler(), [JsonGrammar("final", "")], prompt)
    assert st.active and "{" in {enc.decode([t])[:1] for t in allowed(st)}


def test_strict_tool_arguments_end_with_call(enc):
    tool = JsonGrammar("functions.get_weather", schema_json({"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}))
    st = GrammarState(default_compiler(), [tool], ids(enc, "<|start|>assistant"))
    for t in ids(enc, "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"):
        st.advance(t)
    assert st.active
    spaced = GrammarState(default_compiler(), [tool], ids(enc, "<|start|>assistant"))
    for t in ids(enc, "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"):
        spaced.advance(t)
    spaced_ids = ids(enc, '{"city": "Paris"}')  # json.dumps's separators: not how gpt-oss writes arguments
    for t in spaced_ids[:3]:
        spaced.advance(t)
    assert enc.decode(spaced_ids[3:4]) == " \"" and spaced_ids[3] not in allowed(spaced)
    for t in ids(enc, '{"city":"Paris"}'):  # compact, as gpt-oss writes them
        assert t in allowed(st), enc.decode([t])
        st.advance(t)
    assert allowed(st) == {CALL} and not st.failed
    st.advance(CALL)
    assert not st.active and not st.completed  # a tool call is not the answer


def test_other_targets_are_free(enc):
    st = GrammarState(default_compiler(), [JsonGrammar("final", "")], ids(enc, "<|start|>assistant"))
    for t in ids(enc, "<|channel|>commentary to=functions.f <|constrain|>json<|message|>"):
        st.advance(t)
    assert not st.active


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def call_state(enc, tools: dict) -> GrammarState:
    g = JsonGrammar(CALL_TARGET, json.dumps({k: schema_json(v) if v else "" for k, v in tools.items()}))
    return GrammarState(default_compiler(), [g], ids(enc, "<|start|>user<|message|>hi<|end|><|start|>assistant"))


def test_a_required_call_constrains_the_turn_from_its_first_token(enc):
    """tool_choice required / named: one analysis message stays free (it may end), then only a call of a tool,
    its arguments compact JSON of its schema, ending with <|call|>; never a final answer."""
    st = call_state(enc, {"get_weather": WEATHER, "get_time": None})
    assert st.active and allowed(st) == {CHANNEL}
    for t in ids(enc, "<|channel|>analysis<|message|>The user greets me."):
        assert t in allowed(st)
        st.advance(t)
    assert END in allowed(st) and not allowed(st) & {RETURN, CALL}  # analysis ends with <|end|> only
    for t in ids(enc, "<|end|><|start|>assistant<|channel|>"):
        st.advance(t)
    assert ids(enc, "final")[0] not in allowed(st) and ids(enc, "commentary")[0] in allowed(st)
    for t in ids(enc, 'commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}'):
        assert t in allowed(st), enc.decode([t])
        st.advance(t)
    assert allowed(st) == {CALL} and not st.failed
    st.advance(CALL)
    assert not st.active and not st.completed


def test_a_named_call_allows_only_that_tool(enc):
    st = call_state(enc, {"get_time": None})
    for t in ids(enc, "<|channel|>commentary to=functions.get_"):
        st.advance(t)
    assert ids(enc, "time")[0] in allowed(st) and ids(enc, "weather")[0] not in allowed(st)


def test_router_checks_give_the_same_error_when_remembered():
    """check_schema / check_call remember each grammar's verdict: a repeat answers from the cache with the
    same message and the caller's param, and a valid grammar stays valid."""
    from common.errors import InvalidRequest  # noqa: PLC0415
    from common.grammar import _grammar_error, check_call, check_schema  # noqa: PLC0415

    bad_schema = json.dumps({"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}})
    bad_tools = json.dumps({"not a name": ""})
    good_tools = json.dumps({"get_weather": schema_json(WEATHER)})
    _grammar_error.cache_clear()
    for _ in range(2):
        for param in ("response_format", "tools"):
            with pytest.raises(InvalidRequest) as e:
                check_schema(bad_schema, param)
            assert e.value.param == param and e.value.message.startswith("the JSON schema is not supported")
        with pytest.raises(InvalidRequest) as e:
            check_call(bad_tools)
        assert e.value.param == "tool_choice" and "invalid tool name" in e.value.message
        check_call(good_tools)
        check_schema(schema_json(WEATHER), "tools")
    info = _grammar_error.cache_info()
    assert info.misses == 4 and info.hits == 6  # 4 distinct grammars, 10 checks


def test_sampler_applies_the_bitmask_only_to_constrained_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)  # [R, V]
    bits = torch.zeros(1, 4, dtype=torch.int32)  # [Rc, ceil(V/32)]
    bits[0, 1] = 1 << 5  # only token 37 allowed
    rows = [SampleRow(f"r{i}", SamplingParams(temperature=t), 1000 + i, 7, 0) for i, t in enumerate((0, 1.0, 1.0))]
    out = Sampler(torch.device("cpu")).sample(logits, rows, GrammarMasks(torch.tensor([1]), bits)).token_ids
    free = Sampler(torch.device("cpu")).sample(logits, rows).token_ids
    assert out[1].item() == 37
    assert out[0] == free[0] and out[2] == free[2]  # the free rows sample as without masks (same noise)
    masked = apply_bitmask(logits.clone(), GrammarMasks(torch.tensor([0, 2]), bits.repeat(2, 1)))
    assert torch.isinf(masked[[0, 2]]).sum() == 2 * 99 and torch.equal(masked[1], logits[1])


def test_wire_round_trip_of_grammars():
    spec = SamplingSpec(max_tokens=8, grammars=[GrammarSpec("final", schema_json(SCHEMA)), GrammarSpec("functions.f")])
    msg = GenerateRequest("r", [1, 2], spec)
    assert decode(encode(msg)) == msg


def test_engine_constrained_answers_parse_and_validate(ckpt_factory, enc, monkeypatch):
    """The tiny random model, constrained, in the overlapped loop (deferred sampling; the synchronous
    loop samples inline, the simpler case): the final channel is reached deterministically by a
    prompt that ends with its header; a free row shares the batch."""
    from engine.build import EngineConfig
    from engine.llm import LLM

    llm = LLM(EngineConfig(checkpoint=ckpt_factory("tiny"), kv_cache_bytes=32 << 20, async_decode=True))
    final = ids(enc, "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>")
    g = (JsonGrammar("final", schema_json(SCHEMA)),)
    stop = (RETURN, CALL)
    tool_schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                   "additionalProperties": False}
    tool = (JsonGrammar("functions.get_weather", schema_json(tool_schema)),)
    call = ids(enc, "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>commentary "
                    "to=functions.get_weather <|constrain|>json<|message|>")
    params = [SamplingParams(max_tokens=24, temperature=0, stop_token_ids=stop, grammars=g),
              SamplingParams(max_tokens=24, temperature=1.0, seed=5, stop_token_ids=stop, grammars=g),
              SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=1.0, seed=6, stop_token_ids=stop, grammars=g + tool)]
    sampler, modes = llm.engine.runner.sampler, []
    sample = sampler.sample
    # deferred sampling (grammar rows) runs outside launch(): on a GPU its copies into the pinned
    # buffers, inference tensors, fail unless it too runs in inference mode (grammar-gpu run 1)
    monkeypatch.setattr(sampler, "sample", lambda *a, **k: (modes.append(torch.is_inference_mode_enabled()),
                                                             sample(*a, **k))[1])
    outs = llm.generate([final, final, final, call], params)
    assert modes and all(modes)
    for o in outs[:2]:
        assert o.finish_reason.value == "stop" and o.output_ids[-1] in (RETURN, END)
        jsonschema.validate(json.loads(enc.decode(o.output_ids[:-1])), SCHEMA)
    assert outs[2].finish_reason.value == "length"  # the free row is not constrained
    assert outs[3].output_ids[-1] == CALL  # a strict tool's arguments, then the call's end
    jsonschema.validate(json.loads(enc.decode(outs[3].output_ids[:-1])), tool_schema)


def test_parallel_masks_equal_one_thread(enc, monkeypatch):
    """Many rows on a many-core host go through llguidance's thread pool (the H200 host at batch 64)."""
    import common.grammar as grammar

    prompt = ids(enc, "<|start|>assistant<|channel|>final<|message|>")
    answer = ids(enc, '{"answer": "no", "n": 7, "ok": true}')
    states = [GrammarState(default_compiler(), [JsonGrammar("final", schema_json(SCHEMA))], prompt) for _ in range(17)]
    for k, st in enumerate(states):  # each row at its own place in the JSON, the last one complete
        for t in answer[:k if k < 16 else len(answer)]:
            st.advance(t)
    one = np.empty((17, W), dtype=np.int32)
    fill_masks(states, one)
    monkeypatch.setattr(grammar, "PARALLEL_MIN_CPUS", 1)
    pooled = np.empty((17, W), dtype=np.int32)
    fill_masks(states, pooled)
    assert (one == pooled).all()

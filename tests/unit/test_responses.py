"""/v1/responses without workers: input items -> chat messages, the output builder's events and
objects validated against the installed openai package's own types, the LRU store, and the 400s
for what is not supported."""

import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from common.errors import InvalidRequest, NotFound
from router.chat_types import Delta, DeltaKind, ParsedCompletion, ToolCall
from router.config import RouterConfig
from router.fleet import Discovery
from router.main import make_app
from router.responses import OutputBuilder, ResponseStore, StoredResponse
from router.responses_models import ResponsesRequest

EVENTS = TypeAdapter(ResponseStreamEvent)


def base_response() -> dict:
    return {"id": "resp_1", "object": "response", "created_at": 1, "status": "in_progress", "model": "m",
            "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None,
            "incomplete_details": None, "usage": None}


def usage() -> dict:
    return {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 15}


def test_builder_events_parse_as_openai_types_in_order():
    b = OutputBuilder(base_response())
    evs = b.start()
    evs += b.feed([Delta(DeltaKind.REASONING, "Think"), Delta(DeltaKind.REASONING, "ing.")])
    evs += b.feed([Delta(DeltaKind.TOOL_CALL_START, tool_index=0, tool_call_id="call_1", tool_name="get_weather"),
                   Delta(DeltaKind.TOOL_CALL_ARGS, '{"city":', tool_index=0),
                   Delta(DeltaKind.TOOL_CALL_ARGS, '"Paris"}', tool_index=0)])
    parsed = ParsedCompletion("Thinking.", None, [ToolCall("call_1", "get_weather", '{"city":"Paris"}')], "tool_calls")
    evs += b.finish(parsed, usage())
    typed = [EVENTS.validate_python(e) for e in evs]
    assert [e.sequence_number for e in typed] == list(range(len(typed)))
    assert [e.type for e in typed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = Response.model_validate(b.response)
    assert final.status == "completed" and final.usage.output_tokens_details.reasoning_tokens == 2
    rs, fc = final.output
    assert rs.type == "reasoning" and rs.content[0].text == "Thinking."
    assert fc.type == "function_call" and fc.call_id == "call_1" and fc.arguments == '{"city":"Paris"}'


def test_builder_message_and_incomplete():
    b = OutputBuilder(base_response())
    evs = b.start() + b.feed([Delta(DeltaKind.CONTENT, "Hel"), Delta(DeltaKind.CONTENT, "lo")])
    evs += b.finish(ParsedCompletion(None, "Hello", [], "length"), usage())
    typed = [EVENTS.validate_python(e) for e in evs]
    assert [e.type for e in typed][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]
    final = Response.model_validate(b.response)
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == "Hello" and final.output[0].status == "incomplete"


def test_items_become_one_assistant_turn_per_group():
    req = ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather", "arguments": "{}",
         "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": '{"t": 21}'},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "21 degrees.", "annotations": []}]},
        {"role": "user", "content": "thanks"}]})
    msgs = req.input_messages({})
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert msgs[2].reasoning == "Call it." and msgs[2].tool_calls[0].name == "get_weather"
    assert msgs[3].name == "get_weather" and msgs[4].content == "21 degrees."


@pytest.mark.parametrize("body,param", [
    ({"foo": 1}, "foo"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "strict": True,
                 "parameters": {"type": "object", "properties": 3}}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f", "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),  # no such tool
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"reasoning": {"effort": "minimal"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
    ({"reasoning": {"generate_summary": "concise"}}, "reasoning.summary"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "zzz"}]}, "input[0].encrypted_content"),
    ({"input": "x" * 20000}, "input"),
])
def test_unsupported_is_a_400_naming_the_parameter(http, body, param):
    r = http.post("/v1/responses", json={"model": "m", "input": "hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_reasoning_summary_auto_is_accepted():
    """Codex sends reasoning.summary "auto": the server's choice, and gpt-oss has no summariser (the reasoning
    text comes as reasoning_text content); only a summary style it cannot write is refused."""
    from router.responses_models import ResponsesRequest  # noqa: PLC0415

    ResponsesRequest.model_validate({"model": "m", "input": "hi", "reasoning": {"effort": "low", "summary": "auto"}}
                                    ).check_unsupported()


def test_unknown_previous_response_is_404(http):
    r = http.post("/v1/responses", json={"model": "m", "input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert http.get("/v1/responses/resp_nope").status_code == 404
    assert http.post("/v1/responses", json={"model": "x", "input": "hi"}).status_code == 404


def test_store_is_a_bounded_lru():
    s = ResponseStore(2)
    for i in range(3):
        s.put(f"r{i}", StoredResponse([], {}, {"id": f"r{i}"}))
    with pytest.raises(NotFound):
        s.get("r0")
    s.get("r1")  # r1 is now the most recent: r2 goes next
    s.put("r3", StoredResponse([], {}, {}))
    with pytest.raises(NotFound):
        s.get("r2")
    s.delete("r1")
    with pytest.raises(NotFound):
        s.get("r1")


@pytest.mark.parametrize("body,param", [
    ({"foo": 1}, "foo"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"store": True}, "store"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                  "parameters": {"type": "object", "properties": 3}}}]}, "tools"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x y", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
    ({"n": 129}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"300000": 1}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "hi", "foo": 1}]}, "messages.0.foo"),
])
def test_chat_unsupported_is_a_400_naming_the_parameter(http, body, param):
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_completions_unsupported_is_a_400(http):
    r = http.post("/v1/completions", json={"model": "m", "prompt": "x", "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    r = http.post("/v1/completions", json={"model": "m", "prompt": ["x"] * 3, "n": 50})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = http.post("/v1/completions", json={"model": "m", "prompt": ["x", "y"], "n": 2, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = http.post("/v1/completions", json={"model": "m", "prompt": "x", "suffix": "y"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


def test_invalid_request_is_typed():
    with pytest.raises(InvalidRequest):
        ResponsesRequest.model_validate({"model": "m", "input": "hi", "tool_choice": "any"}).tool_choice_mode()


@pytest.fixture(scope="module")
def http():
    cfg = RouterConfig(model_name="m", decode=("tcp://127.0.0.1:1",), poll_interval_s=0.2, max_model_len=2048)
    with TestClient(make_app(cfg, Discovery([], ["tcp://127.0.0.1:1"]))) as c:
        yield c

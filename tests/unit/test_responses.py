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
from router.responses import ResponseStore, StoredResponse
from router.responses_models import ResponsesRequest
from router.responses_output import OutputBuilder
from router.responses_tools import CUSTOM_PARAMETERS, seal_reasoning

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
    ({"tools": [{"type": "hosted_thing"}]}, "tools[0].type"),
    ({"tools": [{"type": "custom", "name": "f", "parameters": {"type": "object"}}]}, "tools[0].parameters"),
    ({"tools": [{"type": "function", "name": "f", "format": {"type": "text"}}]}, "tools[0].format"),
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
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "zzz"}]}, "input[0].encrypted_content"),
    ({"input": "x" * 20000}, "input"),
    ({"input": "hello " * 3000}, "input"),  # more tokens than the context (2048)
    ({"max_output_tokens": 100_000}, "max_output_tokens"),  # with the input, more than the context
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
    # max_tokens 0 is echo's scoring form only (tests/integration/test_serving_prompt_logprobs.py serves it)
    r = http.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens" and "echo" in r.json()["error"]["message"]


def test_invalid_request_is_typed():
    with pytest.raises(InvalidRequest):
        ResponsesRequest.model_validate({"model": "m", "input": "hi", "tool_choice": "any"}).tool_choice_mode()


@pytest.fixture(scope="module")
def http():
    cfg = RouterConfig(model_name="m", decode=("tcp://127.0.0.1:1",), poll_interval_s=0.2, max_model_len=2048)
    with TestClient(make_app(cfg, Discovery([], ["tcp://127.0.0.1:1"]))) as c:
        yield c


# ---- what Codex sends (router/responses_tools.py) ---------------------------------------------------
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
EXEC = {"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                       "additionalProperties": False}}


def codex_body(**kw) -> dict:
    """The shape of a Codex request to a gpt-oss provider (fields as its Responses client sends them)."""
    return {"model": "m", "instructions": "You are Codex.", "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: none"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix the bug"}]}],
        "tools": [EXEC, APPLY_PATCH, {"type": "web_search", "external_web_access": False}],
        "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "7f0c8c1e-conversation", "stream_options": {"include_obfuscation": False},
        "prompt_cache_retention": "in_memory", **kw}


def test_codex_request_is_accepted_tools_mapped_and_builtins_left_out():
    req = ResponsesRequest.model_validate(codex_body())
    req.check_unsupported()
    ts = req.tool_set("ignore")
    assert [t.name for t in ts.defs] == ["exec_command", "apply_patch"] and ts.custom == {"apply_patch"}
    assert ts.defs[1].parameters == CUSTOM_PARAMETERS and ts.defs[1].strict_schema  # constrained {"input": str}
    assert ts.ignored == ["web_search"] and req.seal_reasoning
    with pytest.raises(InvalidRequest) as e:
        req.tool_set("refuse")
    assert e.value.param == "tools[2].type" and "built-in" in e.value.message


def test_custom_calls_and_sealed_reasoning_round_trip_through_items():
    """A custom tool call comes out as custom_tool_call (input decoded from the model's {"input": ...}), a
    sealed reasoning item as encrypted_content; sent back by a stateless client (content null), both become
    the same assistant turn the model wrote."""
    b = OutputBuilder(base_response(), frozenset({"apply_patch"}), seal=True)
    evs = b.start() + b.feed([Delta(DeltaKind.REASONING, "Patch it.")])
    evs += b.feed([Delta(DeltaKind.TOOL_CALL_START, tool_index=0, tool_call_id="call_9", tool_name="apply_patch"),
                   Delta(DeltaKind.TOOL_CALL_ARGS, '{"input":"*** Begin Patch\\n', tool_index=0),
                   Delta(DeltaKind.TOOL_CALL_ARGS, '*** End Patch"}', tool_index=0)])
    evs += b.finish(ParsedCompletion("Patch it.", None, [ToolCall("call_9", "apply_patch", "{}")], "tool_calls"),
                    usage())
    typed = [EVENTS.validate_python(e) for e in evs]
    assert "response.custom_tool_call_input.done" in [e.type for e in typed]
    assert "response.function_call_arguments.delta" not in [e.type for e in typed]
    final = Response.model_validate(b.response)
    rs, ctc = final.output
    assert ctc.type == "custom_tool_call" and ctc.input == "*** Begin Patch\n*** End Patch" and ctc.call_id == "call_9"
    assert rs.encrypted_content and rs.content[0].text == "Patch it."
    sent_back = [{"type": "reasoning", "summary": [], "content": None, "encrypted_content": rs.encrypted_content},
                 {"type": "custom_tool_call", "call_id": "call_9", "name": "apply_patch", "input": ctc.input},
                 {"type": "custom_tool_call_output", "call_id": "call_9", "output": "Done!"}]
    msgs = ResponsesRequest.model_validate(codex_body(input=sent_back)).input_messages({})
    assert [m.role for m in msgs] == ["assistant", "tool"] and msgs[0].reasoning == "Patch it."
    assert msgs[0].tool_calls[0].arguments == '{"input":"*** Begin Patch\\n*** End Patch"}'
    assert msgs[1].name == "apply_patch" and msgs[1].content == "Done!"


def test_sealed_reasoning_from_elsewhere_or_tampered_is_a_400():
    good = seal_reasoning("x" * 100)
    for blob in ("gAAAAABo-openai-blob", good[:-4], good + "AAAA", "tandem-rs1:!!!"):
        req = ResponsesRequest.model_validate(codex_body(input=[
            {"type": "reasoning", "summary": [], "content": None, "encrypted_content": blob}]))
        with pytest.raises(InvalidRequest) as e:
            req.input_messages({})
        assert e.value.param == "input[0].encrypted_content", blob


def test_codex_request_passes_validation_over_http(http):
    """Past every 400 to placement (no worker here: 503); with --builtin-tools refuse the web_search tool is a 400."""
    r = http.post("/v1/responses", json=codex_body(stream=False))
    assert r.status_code == 503, r.text
    cfg = RouterConfig(model_name="m", decode=("tcp://127.0.0.1:1",), poll_interval_s=0.2, builtin_tools="refuse")
    with TestClient(make_app(cfg, Discovery([], ["tcp://127.0.0.1:1"]))) as c:
        r = c.post("/v1/responses", json=codex_body(stream=False))
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[2].type"


def test_tool_schemas_are_checked_once_per_text():
    """The meta-schema check of a tool's parameters is remembered by their text (Codex resends 12 tools a
    turn: ~9 ms of the router's loop each time): the same verdict, valid or not, from the cache."""
    from router.structured import _meta_error, meta_error  # noqa: PLC0415

    _meta_error.cache_clear()
    bad = {"type": "object", "properties": 3}
    for _ in range(3):
        assert meta_error(bad) and meta_error(EXEC["parameters"]) is None
    assert _meta_error.cache_info().misses == 2 and _meta_error.cache_info().hits == 4


def test_namespace_tools_are_flattened_and_calls_carry_their_namespace():
    """Codex 0.171 groups its sub-agent tools: {"type": "namespace", "name", "description", "tools": [...]}
    (seen in a captured request; a 400 before). The model sees them as functions (Harmony has one
    developer namespace); a call comes back as a function_call with `namespace`; names stay unique."""
    ns = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.",
          "tools": [{"type": "function", "name": "spawn_agent", "description": "Spawn one.", "strict": False,
                     "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]}
    req = ResponsesRequest.model_validate(codex_body(tools=[EXEC, ns, {"type": "web_search"}]))
    ts = req.tool_set("ignore")
    assert [t.name for t in ts.defs] == ["exec_command", "spawn_agent"]
    assert ts.namespaces == {"spawn_agent": "multi_agent_v1"} and "multi_agent_v1" in ts.defs[1].description
    b = OutputBuilder(base_response(), ts.custom, namespaces=ts.namespaces)
    evs = b.start() + b.feed([Delta(DeltaKind.TOOL_CALL_START, tool_index=0, tool_call_id="c1", tool_name="spawn_agent"),
                              Delta(DeltaKind.TOOL_CALL_ARGS, '{"task":"x"}', tool_index=0)])
    evs += b.finish(ParsedCompletion(None, None, [ToolCall("c1", "spawn_agent", '{"task":"x"}')], "tool_calls"), usage())
    [EVENTS.validate_python(e) for e in evs]
    (fc,) = Response.model_validate(b.response).output
    assert fc.type == "function_call" and fc.name == "spawn_agent" and fc.namespace == "multi_agent_v1"
    for tools, param in (([ns, {**ns, "name": "other"}], "tools[1].tools[0].name"),
                         ([{**ns, "tools": [{"type": "web_search"}]}], "tools[0].tools[0].type"),
                         ([{**ns, "tools": []}], "tools[0]")):
        with pytest.raises(InvalidRequest) as e:
            ResponsesRequest.model_validate(codex_body(tools=tools)).tool_set("ignore")
        assert e.value.param == param

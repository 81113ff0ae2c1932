"""Structured outputs at the HTTP edge: OpenAI's response_format (chat, completions), the Responses
API's text.format and strict function tools -> the wire's GrammarSpecs (wire.protocol), checked here
so a schema the grammar library cannot compile is a 400 naming the parameter, never a worker error.

    response_format {"type": "json_object"}              -> GrammarSpec("final", "")
    response_format {"type": "json_schema", json_schema} -> GrammarSpec("final", schema text)
    tools[i] {"strict": true, parameters}                -> GrammarSpec("functions.NAME", parameters text)
    tool_choice "required" / {"function": {"name"}}      -> GrammarSpec("call", {name: parameters text})

The workers constrain only inside the Harmony message the target names (common/grammar.py); the
schema is also shown to the model in the developer message (Harmony's "# Response Formats").
`strict: false` is constrained too (as vLLM does): the grammar never hurts a valid answer.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field

from common.errors import InvalidRequest
from common.grammar import CALL_TARGET, check_call, check_schema, schema_json
from router.chat_types import ResponseFormat, ToolDef
from wire.protocol import GrammarSpec

FORMAT_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class JsonSchemaIn(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(default="response", pattern=FORMAT_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatIn(BaseModel):
    """Chat / completions `response_format`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaIn | None = None


class TextFormatIn(BaseModel):
    """Responses `text.format`: the json_schema fields sit beside `type`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field(default="response", pattern=FORMAT_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


def meta_error(schema: dict[str, Any]) -> str | None:
    """Why `schema` is not a valid JSON schema (its draft's meta-schema), or None."""
    return _meta_error(schema_json(schema))


@functools.lru_cache(maxsize=1024)
def _meta_error(text: str) -> str | None:
    # Remembered by the schema's text: jsonschema's meta-schema walk took ~0.75 ms per tool, ~9 ms of the
    # router's event loop for each turn of a Codex session (12 tools, resent every turn).
    schema = json.loads(text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        return e.message
    return None


def _schema_text(schema: dict[str, Any] | None, param: str) -> str:
    if schema is None:
        raise InvalidRequest("json_schema needs a schema", param=param)
    text = schema_json(schema)
    error = _meta_error(text)
    if error is not None:
        raise InvalidRequest(f"not a valid JSON schema: {error}", param=param)
    check_schema(text, param)
    return text


def final_format(fmt: ResponseFormatIn | TextFormatIn | None, param: str) -> ResponseFormat | None:
    """The answer's format (None: free text)."""
    if fmt is None or fmt.type == "text":
        if isinstance(fmt, ResponseFormatIn) and fmt.json_schema is not None:
            raise InvalidRequest("json_schema is only allowed with type json_schema", param=f"{param}.json_schema")
        return None
    if fmt.type == "json_object":
        return ResponseFormat("json_object", "")
    if isinstance(fmt, ResponseFormatIn):
        js = fmt.json_schema
        if js is None:
            raise InvalidRequest("type json_schema needs json_schema", param=f"{param}.json_schema")
        return ResponseFormat(js.name, _schema_text(js.schema_, f"{param}.json_schema.schema"), js.description or "")
    return ResponseFormat(fmt.name, _schema_text(fmt.schema_, f"{param}.schema"), fmt.description or "")


def tool_grammar(name: str, parameters: dict[str, Any] | None, param: str) -> GrammarSpec:
    """A strict function tool: its arguments follow its parameters schema."""
    schema = parameters if parameters is not None else {"type": "object", "properties": {}}
    return GrammarSpec(f"functions.{name}", _schema_text(schema, param))


def grammars(fmt: ResponseFormat | None, tools: list[ToolDef]) -> list[GrammarSpec]:
    out = [GrammarSpec("final", fmt.schema)] if fmt is not None else []
    return out + [GrammarSpec(f"functions.{t.name}", t.strict_schema) for t in tools if t.strict_schema is not None]


def call_grammar(tools: list[ToolDef]) -> GrammarSpec:
    """tool_choice "required" (tools: every tool) or a named function (tools: that one): the turn must end
    in a call (common/grammar.py call_grammar_text). Arguments follow the tool's schema: a strict tool's,
    else its parameters where the grammar library compiles them, else any JSON object."""
    schemas = {}
    for t in tools:
        if t.strict_schema is not None:
            schemas[t.name] = t.strict_schema
            continue
        text = schema_json(t.parameters if t.parameters is not None else {"type": "object", "properties": {}})
        try:
            check_schema(text, "tools")
        except InvalidRequest:
            text = ""  # not strict: an object the library cannot enforce is still asked for
        schemas[t.name] = text
    spec = GrammarSpec(CALL_TARGET, json.dumps(schemas))
    check_call(spec.schema)
    return spec


def check_combination(fmt_or_tools: bool, min_tokens: int) -> None:
    if fmt_or_tools and min_tokens:
        raise InvalidRequest("min_tokens cannot be combined with structured outputs (the grammar may allow only "
                             "the end token before min_tokens)", param="min_tokens")


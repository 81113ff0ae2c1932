"""What agent clients of the Responses API send beyond function tools (Codex above all: the gpt-oss
coding agent), mapped onto what gpt-oss knows, which is Harmony function calls with JSON arguments:

- Custom (freeform) tools, `{"type": "custom", "name", "description", "format"}`: their input is free
  text (Codex's apply_patch). gpt-oss was trained on JSON function calls, so the model sees a function
  of one string argument, `{"input": "..."}`, constrained by decoding to that shape (strict), and the
  call comes back as a `custom_tool_call` item whose `input` is the string. A format's grammar (Lark or
  regex) is not enforced: the text travels inside a JSON string.
- Namespace tools, `{"type": "namespace", "name", "description", "tools": [...]}` (Codex's sub-agent tools):
  Harmony gives developer tools one `functions` namespace, so their tools are offered flat (names must stay
  unique; each description names its group) and a call comes back with `namespace` set
  (responses_models.ToolSet, responses_output.OutputBuilder).
- Built-in tools (web_search, file_search, code_interpreter, ...) run on OpenAI's servers; tandem has
  none of them. Codex sends web_search on every request, so by default (`--builtin-tools ignore`) the
  model is not offered them, the response says which were left out (header x-tandem-ignored-tools) and
  the router counts them; `--builtin-tools refuse` answers 400 instead.
- Reasoning round-trip for stateless clients (`store: false`, `include: ["reasoning.encrypted_content"]`):
  reasoning items carry `encrypted_content` that a later request sends back. gpt-oss's reasoning is
  returned in clear anyway (reasoning_text content), so the blob is the text compressed and encoded,
  not secret; it only has to come back intact. A blob from another server is a 400.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib

from common.errors import InvalidRequest

# Tool types OpenAI runs itself (its Responses API reference); any other unknown type stays a 400.
BUILTIN_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26", "file_search",
    "code_interpreter", "image_generation", "computer_use_preview", "computer_use", "mcp", "local_shell", "shell",
    "apply_patch", "tool_search",
})
BUILTIN_POLICIES = ("ignore", "refuse")
CUSTOM_INPUT = "input"
# A custom tool as gpt-oss sees it: one string argument (compact JSON, as strict tools are written).
CUSTOM_PARAMETERS = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}}, "required": [CUSTOM_INPUT],
                     "additionalProperties": False}
SEALED_PREFIX = "tandem-rs1:"
MAX_REASONING_BYTES = 16 << 20  # what a sealed blob may expand to


def custom_arguments(text: str) -> str:
    """A custom tool call's input as the JSON arguments the model writes (an input item sent back)."""
    return json.dumps({CUSTOM_INPUT: text}, separators=(",", ":"), ensure_ascii=False)


def custom_input(arguments: str) -> str:
    """The model's JSON arguments of a custom tool -> its free-text input. Decoding constrains them to
    {"input": string}; a call cut short (max tokens) keeps its raw text rather than losing it."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return value[CUSTOM_INPUT]
    return arguments


def seal_reasoning(text: str) -> str:
    return SEALED_PREFIX + base64.urlsafe_b64encode(zlib.compress(text.encode(), 6)).decode()


def open_reasoning(blob: str, param: str) -> str:
    """A reasoning item's encrypted_content, as this server sealed it, back to its text."""
    bad = InvalidRequest("encrypted_content was not produced by this server (tandem returns reasoning as "
                         "reasoning_text content; send that, or the encrypted_content it gave)", param=param)
    if not blob.startswith(SEALED_PREFIX):
        raise bad
    try:
        d = zlib.decompressobj()
        raw = d.decompress(base64.urlsafe_b64decode(blob[len(SEALED_PREFIX):]), MAX_REASONING_BYTES)
        if d.unconsumed_tail or d.unused_data or not d.eof:
            raise bad
        return raw.decode()
    except (binascii.Error, ValueError, zlib.error, UnicodeDecodeError):
        raise bad from None

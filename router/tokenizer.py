"""o200k_harmony text tokenizer for the router (no torch).

Role: text encode/decode for `/v1/completions` (text prompts in, text out) and the named special
token ids the rest of the router uses. The BPE itself is openai-harmony's (Rust); this module adds
the offline vocabulary (router.vocab), an explicit policy for ids outside the vocabulary, and an
incremental detokenizer for streaming.

Lifecycle: `load_encoding()` loads the harmony encoding once per process (≈0.4 s) and is shared by
`Tokenizer` and `router.harmony`. One `IncrementalDetokenizer` per streamed request: `feed(ids)`
returns only text whose UTF-8 bytes are complete (a character split across tokens, e.g. an emoji as
three byte tokens, is held back until its last byte arrives); `flush()` at the end releases any
incomplete tail as U+FFFD.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Sequence
from pathlib import Path

from openai_harmony import HarmonyEncoding, HarmonyEncodingName, load_harmony_encoding

from router.vocab import ensure_vocab

# o200k_harmony special tokens (MODEL_SPEC §3).
STARTOFTEXT = 199998
ENDOFTEXT = 199999
RETURN = 200002
CONSTRAIN = 200003
CHANNEL = 200005
START = 200006
END = 200007
MESSAGE = 200008
CALL = 200012

# Every id >= FIRST_SPECIAL_ID is a special (or reserved) token; every id below is plain BPE.
FIRST_SPECIAL_ID = 199998
VOCAB_SIZE = 201088  # o200k_harmony, = gpt-oss vocab_size
# What the engine stops on for an assistant turn: harmony's stop_tokens_for_assistant_actions().
ASSISTANT_STOP_TOKEN_IDS: tuple[int, ...] = (RETURN, CALL)


@functools.lru_cache(maxsize=1)
def load_encoding(cache_dir: Path | None = None) -> HarmonyEncoding:
    """The gpt-oss harmony encoding, loaded once per process from the offline vocabulary."""
    ensure_vocab(cache_dir)
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def in_vocab(token_id: int) -> bool:
    return 0 <= token_id < VOCAB_SIZE


class Tokenizer:
    """Text <-> token ids in o200k_harmony.

    Ids outside [0, VOCAB_SIZE) cannot come from gpt-oss (its head has exactly VOCAB_SIZE rows);
    decoding skips them rather than failing, so model output can never turn into a 5xx.
    """

    def __init__(self, encoding: HarmonyEncoding | None = None) -> None:
        self.encoding = encoding if encoding is not None else load_encoding()

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Encode text. With allow_special (the default, for raw Harmony prompts sent to
        /v1/completions) strings like "<|start|>" become their special token; without it they
        are encoded as the literal characters."""
        if allow_special:
            return self.encoding.encode(text, allowed_special="all")
        return self.encoding.encode(text, disallowed_special=())

    def is_special(self, token_id: int) -> bool:
        return token_id >= FIRST_SPECIAL_ID

    def _keep(self, ids: Sequence[int], skip_special: bool) -> list[int]:
        return [t for t in ids if in_vocab(t) and not (skip_special and t >= FIRST_SPECIAL_ID)]

    def token_bytes(self, ids: Sequence[int], *, skip_special: bool = False) -> bytes:
        """The exact bytes of `ids` (specials as their "<|...|>" text unless skipped)."""
        kept = self._keep(ids, skip_special)
        if not kept:
            return b""
        # surrogateescape round-trips every byte exactly through harmony's public str decode.
        text = self.encoding.decode(kept, errors="surrogateescape")
        return text.encode("utf-8", errors="surrogateescape")

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Decode to text; invalid UTF-8 becomes U+FFFD."""
        kept = self._keep(ids, skip_special)
        return self.encoding.decode(kept, errors="replace") if kept else ""

    def new_detokenizer(self, *, skip_special: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special=skip_special)


class IncrementalDetokenizer:
    """Streaming decode: concatenating every `feed()` result and `flush()` equals
    `tokenizer.decode(all_ids)` exactly, however the ids were chunked."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        # The stdlib incremental decoder keeps an incomplete trailing sequence buffered and emits
        # U+FFFD for bytes that can never become valid: the same result as one-shot decoding.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Sequence[int]) -> str:
        data = self._tokenizer.token_bytes(ids, skip_special=self._skip_special)
        return self._decoder.decode(data) if data else ""

    def flush(self) -> str:
        """End of stream: release a held incomplete character (as U+FFFD) and reset."""
        return self._decoder.decode(b"", final=True)

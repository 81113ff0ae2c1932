"""Bounds on client text before it reaches the tokenizer, so no input can crash or stall the router.

Role: openai-harmony's BPE (Rust, fancy-regex, holding the GIL) splits text into pieces with the
o200k pattern and merges each piece in time quadratic in its length; a piece of ~1M characters
(one run of letters, of symbols or of whitespace) overflows the regex engine's stack and panics
(pyo3 PanicException, a BaseException: it escaped every handler and became an HTTP 500). 100k
letters already take ~4 s, CJK ~20x more, all of it blocking the event loop.

Checked here, in linear time, before rendering or tokenising (InvalidRequest, HTTP 400):
- total characters: no o200k token decodes to more than MAX_CHARS_PER_TOKEN characters, so text
  longer than max_model_len x that can only exceed the context;
- runs: no maximal run of letters/marks, of symbols or of whitespace (what one tokenizer piece is
  made of) longer than MAX_RUN_CHARS. Real text breaks far sooner (base64 and hex carry digits;
  prose, code and CJK carry punctuation); at this bound 4 MiB of worst-case text tokenises in ~3 s.
  The check itself takes ~0.1 s per MB of prose.
`guarded(fn, ...)` turns a panic that still happens into a 400 as well.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import re

import regex

from common.errors import InvalidRequest

MAX_CHARS_PER_TOKEN = 128  # the longest o200k_harmony token (a run of spaces); tests/unit/test_textguard.py checks it
MAX_RUN_CHARS = 1024

_WHITESPACE = re.compile(r"\s+")
_RUNS = regex.compile(r"[\p{L}\p{M}]+|[^\s\p{L}\p{N}]+")  # letters/marks, symbols: the long-piece makers


def longest_run(text: str) -> int:
    """The longest maximal run of whitespace, of letters/marks or of symbols in `text`. Linear, and
    C-speed for ordinary text: str.split finds the non-whitespace stretches; only a stretch longer
    than the bound is split further into letter and symbol runs."""
    if len(text) <= MAX_RUN_CHARS:
        return len(text)
    stretches = text.split()
    longest = max(map(len, _WHITESPACE.findall(text)), default=0)
    for st in stretches:
        if len(st) > MAX_RUN_CHARS:
            longest = max(longest, max(map(len, _RUNS.findall(st)), default=0))
    return longest


T = TypeVar("T")


def check_texts(texts: Iterable[tuple[str, str]], max_model_len: int) -> None:
    """`texts`: (param, text) pairs of one request. Raises InvalidRequest (400) past a bound."""
    total = 0
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    for param, text in texts:
        total += len(text)
        if total > limit:
            raise InvalidRequest(f"the request has more than {limit} characters, which is more than the maximum "
                                 f"context length of {max_model_len} tokens can hold", param=param)
        run = longest_run(text) if len(text) > MAX_RUN_CHARS else 0
        if run > MAX_RUN_CHARS:
            raise InvalidRequest(f"{param} has a run of {run} letters, symbols or whitespace without a break; "
                                 f"the tokenizer takes at most {MAX_RUN_CHARS}", param=param)


def guarded(fn: Callable[..., T], *args, param: str, **kw) -> T:
    """Call the tokenizer; a Rust panic (pyo3 PanicException) becomes a 400 instead of a 500."""
    try:
        return fn(*args, **kw)
    except BaseException as e:  # noqa: BLE001 - PanicException derives from BaseException
        if type(e).__name__ != "PanicException":
            raise
        raise InvalidRequest(f"the tokenizer could not process this text ({str(e)[:120]})", param=param) from None

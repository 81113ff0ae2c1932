"""The typed msgpack codec shared by every wire format in the project (router <-> workers, the
ranks of one worker): dataclass messages go out as nested field-value lists; coming back, every
field is checked against the class annotations (int, float, str, bytes, bool, None, unions, lists,
nested dataclasses), so a malformed frame raises ProtocolError instead of reaching worker logic.

Bounds on untrusted bytes: `unpack` caps every length a frame may declare (msgpack also caps each at
the frame's own size, so a huge declared length fails before anything is allocated); no message
carries a map or an ext type, so none may be declared; nesting is bounded by msgpack's fixed
unpack stack (deeper raises StackError), and `build`/`check` walk only as deep as the message
class, never the data, and never repr a value (a deeply nested value is rejected at the first
level that does not match, without recursing into it)."""

from __future__ import annotations

import dataclasses
import types
import typing

import msgpack

from common.errors import ProtocolError

_HINTS: dict[type, dict[str, typing.Any]] = {}


def to_wire(obj: typing.Any) -> typing.Any:
    if dataclasses.is_dataclass(obj):
        return [to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, list | tuple):
        return [to_wire(x) for x in obj]
    return obj


def check(value: typing.Any, tp: typing.Any, where: str) -> typing.Any:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        for alt in typing.get_args(tp):
            try:
                return check(value, alt, where)
            except ProtocolError:
                continue
        raise ProtocolError(f"{where}: {type(value).__name__} matches none of {tp}")
    if tp is type(None):
        if value is not None:
            raise ProtocolError(f"{where}: expected None")
        return None
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        (inner,) = typing.get_args(tp)
        return [check(v, inner, f"{where}[]") for v in value]
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if (tp is int and isinstance(value, bool)) or not isinstance(value, tp):
        raise ProtocolError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
    return value


def build(cls: type, values: typing.Any, where: str) -> typing.Any:
    """A dataclass from its field-value list, every field checked."""
    fields = dataclasses.fields(cls)
    if not isinstance(values, list) or len(values) != len(fields):
        raise ProtocolError(f"{where}: {cls.__name__} needs {len(fields)} fields")
    hints = _HINTS.get(cls) or _HINTS.setdefault(cls, typing.get_type_hints(cls))
    return cls(**{f.name: check(v, hints[f.name], f"{cls.__name__}.{f.name}") for f, v in zip(fields, values)})


def brief(value: typing.Any) -> str:
    """A value for an error message, bounded whatever the value (never recurses into it)."""
    if value is None or isinstance(value, bool | int | float):
        return repr(value)[:40]
    if isinstance(value, str | bytes):
        return repr(value[:40])
    return f"a {type(value).__name__}"


def pack(frame: list) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


MAX_STR_LEN = 1 << 20  # ids, reasons, error texts: bytes to KBs
MAX_ARRAY_LEN = 1 << 22  # token ids of the longest prompt, page ids of a step: < 1M
MAX_BIN_LEN = 64 << 20  # opaque payloads (KV targets, NIXL metadata); callers pass their frame bound


def unpack(data: bytes, what: str, max_bin_len: int = MAX_BIN_LEN) -> typing.Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=MAX_STR_LEN,
                               max_bin_len=max_bin_len, max_array_len=MAX_ARRAY_LEN, max_map_len=0, max_ext_len=0)
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:  # StackError, FormatError,
        raise ProtocolError(f"{what}: not a msgpack frame: {str(e)[:200]}") from None  # ExtraData included

"""The typed msgpack codec shared by every wire format in the project (router <-> workers, the
ranks of one worker): dataclass messages go out as nested field-value lists; coming back, every
field is checked against the class annotations (int, float, str, bytes, bool, None, unions, lists,
nested dataclasses), so a malformed frame raises ProtocolError instead of reaching worker logic."""

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


def pack(frame: list) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


def unpack(data: bytes, what: str) -> typing.Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as e:
        raise ProtocolError(f"{what}: not a msgpack frame: {e}") from None

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

_FIELDS: dict[type, tuple[str, ...]] = {}
_ENCODERS: dict[type, tuple[tuple[str, bool], ...]] = {}
_PLANS: dict[type, typing.Callable[[typing.Any, str], typing.Any]] = {}
_CHECKERS: dict[typing.Any, typing.Callable[[typing.Any, str], typing.Any]] = {}
_SCALARS = (int, str, bytes, bool, float)

# Speed: a prompt crosses the wire several times per request (GenerateRequest, AdmitRequest,
# PrefillRequest, StartDecode), every decode step sends a TokenBatch, and the router decodes them all
# on its event loop. Walking a 4k-token list[int] element by element through typing introspection
# took ~5 ms to encode and ~10 ms to decode on the dev machine; so each class and type is compiled
# once into a plan, and a list of scalars is checked in one pass over its element types (the
# element-by-element walk remains, for the conversions and error messages of anything else).


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _plain(tp: typing.Any) -> bool:
    """Values of this annotation go to msgpack as they are: scalars, None, lists of those."""
    if tp in _SCALARS or tp is type(None):
        return True
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union, list):
        return all(_plain(a) for a in typing.get_args(tp))
    return False


def _encoder(cls: type) -> tuple[tuple[str, bool], ...]:
    plan = _ENCODERS.get(cls)
    if plan is None:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001 - an annotation we cannot resolve: walk every value
            hints = {}
        plan = _ENCODERS[cls] = tuple((n, n in hints and _plain(hints[n])) for n in _field_names(cls))
    return plan


def to_wire(obj: typing.Any) -> typing.Any:
    """A message as nested field-value lists. Lists are typed, hence homogeneous: one whose first
    element is a scalar goes out as it is (msgpack packs lists and tuples as arrays); fields whose
    annotation is plain (`_plain`) are not walked at all."""
    if dataclasses.is_dataclass(obj):
        return [getattr(obj, n) if plain else _wire_value(getattr(obj, n)) for n, plain in _encoder(type(obj))]
    return _wire_value(obj)


def _wire_value(v: typing.Any) -> typing.Any:
    if isinstance(v, list | tuple):
        if v and not isinstance(v[0], _SCALARS):
            return [to_wire(x) for x in v]
        return v
    if dataclasses.is_dataclass(v):
        return to_wire(v)
    return v


def check(value: typing.Any, tp: typing.Any, where: str) -> typing.Any:
    fn = _CHECKERS.get(tp)
    if fn is None:
        fn = _CHECKERS[tp] = _compile(tp)
    return fn(value, where)


def _compile(tp: typing.Any) -> typing.Callable[[typing.Any, str], typing.Any]:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        alts = typing.get_args(tp)

        def union(value: typing.Any, where: str) -> typing.Any:
            for alt in alts:
                try:
                    return check(value, alt, where)
                except ProtocolError:
                    continue
            raise ProtocolError(f"{where}: {type(value).__name__} matches none of {tp}")
        return union
    if tp is type(None):
        def none(value: typing.Any, where: str) -> None:
            if value is not None:
                raise ProtocolError(f"{where}: expected None")
        return none
    if origin is list:
        (inner,) = typing.get_args(tp)
        fast = {inner} if inner in _SCALARS else None  # exact types only: a bool is not an int here

        def list_of(value: typing.Any, where: str) -> list:
            if not isinstance(value, list):
                raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
            if fast is not None and set(map(type, value)) <= fast:
                return value
            return [check(v, inner, f"{where}[]") for v in value]
        return list_of
    if dataclasses.is_dataclass(tp):
        return lambda value, where: build(tp, value, where)
    if tp is float:
        def number(value: typing.Any, where: str) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ProtocolError(f"{where}: expected a number, got {type(value).__name__}")
            return float(value)
        return number

    def scalar(value: typing.Any, where: str) -> typing.Any:
        if (tp is int and isinstance(value, bool)) or not isinstance(value, tp):
            raise ProtocolError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    return scalar


def build(cls: type, values: typing.Any, where: str) -> typing.Any:
    """A dataclass from its field-value list, every field checked."""
    fn = _PLANS.get(cls)
    if fn is None:
        fn = _PLANS[cls] = _compile_builder(cls)
    return fn(values, where)


def _compile_builder(cls: type) -> typing.Callable[[typing.Any, str], typing.Any]:
    """Straight-line code per class (as dataclasses writes __init__): a field whose value has exactly
    its scalar annotation's type passes without a call (the router decodes ~60 TokenChunks of 10
    fields per decode step: the per-field `check` calls were ~10 % of its CPU); any other value goes
    through `check`, which converts (int -> float) or raises with the field's name."""
    hints = typing.get_type_hints(cls)
    names = _field_names(cls)
    if any(f.kw_only for f in dataclasses.fields(cls)):
        raise TypeError(f"{cls.__name__}: keyword-only fields are not supported on the wire")
    env: dict[str, typing.Any] = {"cls": cls, "check": check, "ProtocolError": ProtocolError, "list": list}
    args = ", ".join(f"v{i}" for i in range(len(names)))
    lines = [f"def build_{cls.__name__}(values, where):",
             f"    if type(values) is not list or len(values) != {len(names)}:",
             f"        raise ProtocolError(f'{{where}}: {cls.__name__} needs {len(names)} fields')"]
    if names:
        lines.append(f"    {args}, = values")
    for i, n in enumerate(names):
        env[f"T{i}"], env[f"L{i}"] = hints[n], f"{cls.__name__}.{n}"
        if hints[n] in _SCALARS:
            lines.append(f"    if type(v{i}) is not T{i}:")
            lines.append(f"        v{i} = check(v{i}, T{i}, L{i})")
        else:
            lines.append(f"    v{i} = check(v{i}, T{i}, L{i})")
    lines.append(f"    return cls({args})")
    exec("\n".join(lines), env)  # noqa: S102 - code built from our own class definitions only
    return env[f"build_{cls.__name__}"]


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

"""A config mapping (YAML, CLI flags, the offline API's options) -> a checked frozen config dataclass.

msgspec does the typing (``msgspec.convert(..., strict=True)``, the library the wire's messages use):
bool is not an int, an int is taken where a float is expected, None only where the type says ``| None``,
and it constructs the dataclass, so its ``__post_init__`` range and consistency checks run. What it
leaves to this module: unknown keys (msgspec refuses them on Structs only, and the configs stay
dataclasses: ``dataclasses.replace`` and ``repr=False`` serve the whole codebase) and infinite or NaN
floats. Every error is a ValueError naming the key's full path as the YAML spells it, e.g.
``engine.max_num_seqs must be int, got '64' (str)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from typing import Any, TypeVar, Union

import msgspec

T = TypeVar("T")

# msgspec's "<reason> - at `$.engine.max_num_seqs`" (or "- at `key` in `$.engine`": a mapping's key)
_AT = re.compile(r"(?s)(.*) - at (`key` in )?`\$([^`]*)`")
_SEGMENT = re.compile(r"\.([^.\[]+)|\[([^\]]*)\]")


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_keys(data: dict[str, Any], where: str, known: set[str]) -> None:
    unknown = sorted(set(data) - known, key=str)
    if unknown:
        raise ValueError(f"unknown {where} option(s) {unknown}; known: {sorted(known)}")


def from_dict(cls: type[T], data: Any, where: str = "") -> T:
    """Construct dataclass `cls` from a mapping. Unknown keys and values of the wrong type raise
    ValueError naming the key (``where``: the mapping's own path in the YAML, e.g. ``engine``). A field
    whose type is a config dataclass takes a mapping (checked the same way) or an instance of it."""
    if not _is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    _check_keys_and_floats(cls, data, where)
    return convert(data, cls, where)


def convert(data: Any, tp: Any, where: str) -> Any:
    """``data`` as type ``tp`` by msgspec, its error translated to the YAML's words (see the module)."""
    try:
        return msgspec.convert(data, tp, strict=True)
    except msgspec.ValidationError as error:
        raise ValueError(_message(error, tp, data, where)) from None


def _check_keys_and_floats(cls: type, data: Any, where: str) -> None:
    if not isinstance(data, dict):
        return  # msgspec names what it got
    hints = _hints(cls)
    check_keys(data, where or cls.__name__, set(hints))
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        tp = hints[key]
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(_wrong_type(path, tp, value))
        if _is_dataclass(tp):
            _check_keys_and_floats(tp, value, path)


def _message(error: msgspec.ValidationError, tp: Any, data: Any, where: str) -> str:
    at = _AT.fullmatch(str(error))
    is_key, path = (at.group(2) is not None, at.group(3)) if at else (False, "")
    shown, tp, value = _locate(tp, data, path, where)
    cause = error.__cause__
    if isinstance(cause, (ValueError, TypeError)):  # a __post_init__ check: it names the field
        names = set(_hints(tp)) if _is_dataclass(tp) else set()
        return _with_path(str(cause), shown, names)
    if is_key and isinstance(value, dict):
        key_tp = typing.get_args(tp)[0] if typing.get_args(tp) else str
        bad = next((k for k in value if not _fits(k, key_tp)), None)
        return f"{shown} keys must be {_type_name(key_tp)}, got {bad!r} ({type(bad).__name__})"[:300]
    if _is_dataclass(tp):
        return f"{shown or tp.__name__} must be a mapping, got {type(value).__name__}"
    return _wrong_type(shown, tp, value)


def _locate(tp: Any, value: Any, path: str, where: str) -> tuple[str, Any, Any]:
    """Walk msgspec's ``path`` (``.name``; ``[...]``: some value of a mapping) down from ``tp`` and
    ``value``: the key as the YAML spells it, its declared type and the value given there."""
    shown = where
    for name, index in _SEGMENT.findall(path):
        key: Any = name or f"[{index}]"
        if name and _is_dataclass(tp) and isinstance(value, dict):
            tp, value = _hints(tp).get(name, Any), value.get(name)
        elif index == "..." and isinstance(value, dict):  # msgspec does not say which key: find it
            value_tp = typing.get_args(tp)[1] if typing.get_args(tp) else Any
            key = next((k for k, v in value.items() if not _fits(v, value_tp)), key)
            tp, value = value_tp, value.get(key)
        else:
            tp, value = Any, None
        shown = f"{shown}.{key}" if shown else str(key)
    return shown, tp, value


def _fits(value: Any, tp: Any) -> bool:
    try:
        msgspec.convert(value, tp, strict=True)
    except msgspec.ValidationError:
        return False
    return True


def _wrong_type(key: str, tp: Any, value: Any) -> str:
    return f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})"[:300]


def _with_path(message: str, where: str, names: set[str]) -> str:
    """A constructor's check names its field first (``max_num_seqs must be >= 1``): prefix the mapping's
    path, so the message names the key as the YAML spells it (``pools.decode.engine.max_num_seqs``)."""
    first = message.split(" ", 1)[0]
    return f"{where}.{message}" if where and first in names else message


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _is_dataclass(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)

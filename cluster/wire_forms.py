"""The form a typed value takes on the wire: the msgspec type its frames are decoded into, and the
conversions between it and the value the rest of pdserve uses.

The wire's messages (cluster/wire.py) are frozen msgspec Structs that forbid unknown fields; the boundary
types they carry (cluster/protocol.py: ``SamplingParams``, ``TokenDelta``, ``WorkerStats`` and what they
nest) stay dataclasses, built and ``dataclasses.replace``-d all over the router, the edge and the workers.
msgspec checks a dataclass's field types, but it skips a map's unknown keys for one (only a Struct can
forbid them), and it fills a slots dataclass's left-out defaults through a failed attribute lookup each
(a plain delta, three fields of ten on the wire, decoded ~4x slower than a Struct). So each dataclass a
message carries has a *form*: a Struct made from its fields (same names, order and defaults), strict,
frozen, defaults left out when encoded, untracked by the collector (``gc=False``: a form lives for one
conversion and is in no reference cycle); a message holding one is decoded into its form and converted.

What a form changes of a field's type, so that the wire refuses what it always refused:
  - ``float`` must be finite (an int is taken as a float; a bool is neither);
  - ``dict[int, V]`` travels as ``[key, value]`` pairs (the frames' msgpack maps take str keys only),
    or as an empty map;
  - ``dict[str, V]`` holds at most ``MAX_MAP_ENTRIES`` entries (cluster/frames.py's cap on any map);
  - a dataclass becomes its form, inside lists and optionals too.
Types no form changes (a message of plain fields, ``WorkerInfo``) are their own form: no conversion.
This module imports only cluster/frames.py (its cap on a map).
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Union

import msgspec

from cluster.frames import MAX_MAP_ENTRIES

# NOTE: msgspec's bounds refuse nan (every comparison with it is false) as well as the infinities
FiniteFloat = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]

Convert = Callable[[Any], Any]
_PLAIN = (int, str, bool, bytes, type(None))


@dataclass(frozen=True)
class Form:
    """A type's wire form: ``wire_type`` is what msgspec decodes and encodes; ``to_wire`` and
    ``from_wire`` convert a value to and from it (None: the value is its own form); a record's form
    (a dataclass's) also converts a list of them in one pass (``*_each``)."""

    wire_type: Any
    to_wire: Convert | None = None
    from_wire: Convert | None = None
    to_wire_each: Convert | None = None
    from_wire_each: Convert | None = None


_forms: dict[Any, Form] = {}


def form_of(tp: Any) -> Form:
    """The wire form of type ``tp`` (a type hint), made once per type."""
    form = _forms.get(tp)
    if form is None:
        form = _forms[tp] = _make_form(tp)
    return form


def _make_form(tp: Any) -> Form:
    if tp is float:
        return Form(FiniteFloat)
    if tp in _PLAIN or typing.get_origin(tp) is Annotated:
        return Form(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return Form(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"no wire form for {tp!r}: only X | None unions")
        item = form_of(inner[0])
        return Form(item.wire_type | None, _or_none(item.to_wire), _or_none(item.from_wire))
    if origin is list:
        item = form_of(args[0])
        to_wire, from_wire = (
            item.to_wire_each or _each(item.to_wire),
            item.from_wire_each or _each(item.from_wire),
        )
        return Form(list[item.wire_type], to_wire, from_wire)  # type: ignore[name-defined]
    if origin is dict:
        return _dict_form(args[0], form_of(args[1]))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        if not all(f.init for f in dataclasses.fields(tp)):
            raise TypeError(f"no wire form for {tp!r}: a field it does not take in __init__")
        fields = [(f.name, hints[f.name], f.default, f.default_factory) for f in dataclasses.fields(tp)]
        return _record_form(tp, fields)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        fields = [(f.name, f.type, f.default, f.default_factory) for f in msgspec.structs.fields(tp)]
        return _record_form(tp, fields)
    raise TypeError(f"no wire form for {tp!r}")


def _dict_form(key: Any, value: Form) -> Form:
    if key is str:
        wire = Annotated[dict[str, value.wire_type], msgspec.Meta(max_length=MAX_MAP_ENTRIES)]  # type: ignore[name-defined]
        return Form(wire, _each_value(value.to_wire), _each_value(value.from_wire))
    if key is not int:
        raise TypeError(f"no wire form for dict[{key!r}, ...]: keys are str or int")
    # NOTE: [key, value] pairs; an empty map is taken as an empty dict too (as it was always sent)
    pairs = list[tuple[int, value.wire_type]]  # type: ignore[name-defined]
    empty = Annotated[dict[str, Any], msgspec.Meta(max_length=0)]
    to_v, from_v = value.to_wire, value.from_wire

    def to_wire(d: dict[int, Any]) -> list[tuple[int, Any]]:
        return [(k, v if to_v is None else to_v(v)) for k, v in d.items()]

    def from_wire(v: list[tuple[int, Any]] | dict[str, Any]) -> dict[int, Any]:
        if isinstance(v, dict):
            return {}
        return dict(v) if from_v is None else {k: from_v(x) for k, x in v}

    return Form(pairs | empty, to_wire, from_wire)


def _record_form(cls: type, fields: list[tuple[str, Any, Any, Any]]) -> Form:
    """A dataclass's or a Struct's form: the class itself when no field's form differs from its type (a
    Struct only), else a Struct of the field forms, with the conversions both ways."""
    forms = [form_of(tp) for _, tp, _, _ in fields]
    unchanged = all(f.wire_type == tp for f, (_, tp, _, _) in zip(forms, fields, strict=True))
    if unchanged and issubclass(cls, msgspec.Struct):
        return Form(cls)
    spec = [
        (name, form.wire_type, _wire_default(form, default, factory))
        for (name, _, default, factory), form in zip(fields, forms, strict=True)
    ]
    wire_cls = msgspec.defstruct(
        f"{cls.__name__}Form",
        spec,
        frozen=True,
        forbid_unknown_fields=True,
        omit_defaults=True,
        gc=False,
        module=__name__,
    )
    names = tuple(name for name, _, _, _ in fields)
    to_wire, to_wire_each = _rebuild(wire_cls, names, tuple(f.to_wire for f in forms))
    from_wire, from_wire_each = _rebuild(cls, names, tuple(f.from_wire for f in forms))
    return Form(wire_cls, to_wire, from_wire, to_wire_each, from_wire_each)


def _wire_default(form: Form, default: Any, factory: Any) -> Any:
    missing = (dataclasses.MISSING, msgspec.NODEFAULT)
    if default not in missing:
        return default if form.to_wire is None or default is None else form.to_wire(default)
    if factory in missing:
        return msgspec.NODEFAULT
    to_wire = form.to_wire
    if to_wire is None:
        return msgspec.field(default_factory=factory)
    empty = to_wire(factory())
    if type(empty) in (list, dict) and not empty:  # NOTE: so that omit_defaults leaves it out
        return msgspec.field(default_factory=type(empty))
    # NOTE: a nested dataclass's factory (``WorkerStats.engine``) gives its form's default
    return msgspec.field(default_factory=lambda: to_wire(factory()))


def _rebuild(
    target: type, names: tuple[str, ...], converts: tuple[Convert | None, ...]
) -> tuple[Convert, Convert]:
    """Converters of one object and of a list of them to ``target``, built from the object's ``names``
    attributes, positionally, each converted by its ``converts`` entry (None: as it is).

    NOTE: the hot case is a step's deltas (256 a frame, both ways): an object's attributes are read in
    one C call, one whose converted fields are all None (a plain delta: no logprobs, no timings) is built
    from them as they are, and a list is converted in one comprehension (no call per item but its
    constructor's)."""
    get_all = _getter(names)
    heavy = tuple((i, c) for i, c in enumerate(converts) if c is not None)
    if not heavy:
        return (lambda obj: target(*get_all(obj))), (lambda objs: [target(*get_all(o)) for o in objs])
    get_heavy = _getter(tuple(names[i] for i, _ in heavy))
    nones = (None,) * len(heavy)

    def rebuild(obj: Any) -> Any:
        out = list(get_all(obj))
        for i, convert in heavy:
            if out[i] is not None:
                out[i] = convert(out[i])
        return target(*out)

    def rebuild_each(objs: list[Any]) -> list[Any]:
        return [target(*get_all(o)) if get_heavy(o) == nones else rebuild(o) for o in objs]

    return rebuild, rebuild_each


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    if len(names) == 1:
        (name,) = names
        return lambda obj: (getattr(obj, name),)
    return operator.attrgetter(*names)


def _or_none(convert: Convert | None) -> Convert | None:
    if convert is None:
        return None
    return lambda v: None if v is None else convert(v)


def _each_value(convert: Convert | None) -> Convert | None:
    if convert is None:
        return None
    return lambda d: {k: convert(v) for k, v in d.items()}


def _each(convert: Convert | None) -> Convert | None:
    if convert is None:
        return None
    return lambda v: [convert(x) for x in v]

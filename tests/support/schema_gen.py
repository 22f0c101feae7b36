"""Seeded random JSON schemas for structured-output tests (not a test module).

``random_schema(seed)`` draws objects, arrays, enums, nested objects and required fields, with every
leaf bounded (string maxLength, integer range, array maxItems) so a sampled output always ends.
"""

from __future__ import annotations

import random
from typing import Any

MAX_DEPTH = 2


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "boolean", "enum_str", "enum_int"])
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 1), "maxLength": rng.randint(2, 8)}
    if kind == "integer":
        low = rng.randint(-50, 0)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 150)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum_str":
        return {
            "enum": rng.sample(
                ["red", "green", "blue", "cat", "dog", "yes", "no", "maybe"], rng.randint(2, 4)
            )
        }
    return {"enum": rng.sample(range(-9, 100), rng.randint(2, 4))}


def _node(rng: random.Random, depth: int) -> dict[str, Any]:
    if depth >= MAX_DEPTH:
        return _leaf(rng)
    kind = rng.choice(["leaf", "leaf", "object", "array"])
    if kind == "object":
        return _object(rng, depth)
    if kind == "array":
        items = _node(rng, depth + 1)
        low = rng.randint(0, 1)
        return {"type": "array", "items": items, "minItems": low, "maxItems": low + rng.randint(1, 3)}
    return _leaf(rng)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(
        ["id", "name", "age", "tags", "color", "ok", "score", "pet", "size", "info"], rng.randint(1, 4)
    )
    properties = {name: _node(rng, depth + 1) for name in names}
    required = sorted(rng.sample(names, rng.randint(1, len(names))), key=names.index)
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def random_schema(seed: int) -> dict[str, Any]:
    """A schema whose root is an object (or, for one seed in four, an array of objects)."""
    rng = random.Random(seed)
    if rng.random() < 0.25:
        return {"type": "array", "items": _object(rng, 1), "minItems": 1, "maxItems": 3}
    return _object(rng, 0)

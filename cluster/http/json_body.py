"""The request body: read under ``max_body_bytes`` (413 before anything is parsed), then parsed as
strict JSON (400 naming what is wrong)."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from cluster.http.errors import ApiError

MAX_JSON_DEPTH = 32
# NOTE: where a lone surrogate can come from: a \\uD800-\\uDFFF escape, or its UTF-8 bytes (json.loads
# decodes with surrogatepass); a NUL byte means a UTF-16/32 body, whose code units are not looked at here
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]|\x00")


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The raw body; 413 past max_body_bytes, checked before anything is parsed; 499 (quietly) when the
    client disconnects before the body is complete."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise ApiError(400, f"invalid Content-Length {length[:40]!r}")
        if int(length) > max_body_bytes:
            raise ApiError(413, f"request body ({length} bytes) exceeds max_body_bytes ({max_body_bytes})")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:  # NOTE: chunked bodies have no Content-Length to trust.
                raise ApiError(413, f"request body exceeds max_body_bytes ({max_body_bytes})")
    except ClientDisconnect:
        # NOTE: a client gone mid-body (or cut off by the body timeout) is routine, not a server fault:
        # a 499 nobody reads, counted in the error metrics, never an ERROR traceback.
        raise ApiError(
            499, "client disconnected before its request body was complete", code="client_disconnected"
        ) from None
    return bytes(body)


def _reject_constant(name: str) -> Any:
    raise ApiError(400, f"request body contains {name}, which is not a JSON number")


def parse_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, strictly: no NaN/Infinity, nesting at most MAX_JSON_DEPTH, no lone
    surrogate in any string (key or value). Raises ApiError 400 naming what is wrong."""
    try:
        raw = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ApiError(400, "request body must be a JSON object")
    if _may_break_rules(body):
        _check_tree(raw)
    return raw


def _may_break_rules(body: bytes) -> bool:
    """False when ``body`` cannot hold what ``_check_tree`` refuses: no lone surrogate can come from it,
    and it opens at most MAX_JSON_DEPTH arrays and objects in all (each level of nesting opens one). The
    walk costs ~0.25 us an item in Python (a 256-token prompt: 65 us); this costs ~1 us a KiB."""
    return (
        _MAY_HOLD_SURROGATE.search(body) is not None or body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH
    )


def _check_tree(root: dict[str, Any]) -> None:
    stack: list[tuple[Any, int, str]] = [(root, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels", path or None)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            # NOTE: the name may itself hold a lone surrogate; the error must still encode
            where = path or str(key).encode("utf-8", "backslashreplace").decode()
            if isinstance(key, str):
                _check_text(key, where)
            if isinstance(value, str):
                _check_text(value, where)
            elif isinstance(value, (dict, list)):
                stack.append((value, depth + 1, where))


def _check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} contains a lone surrogate (not valid UTF-8 text)", param) from None

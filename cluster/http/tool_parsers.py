"""Tool calls in a model's free text, as vLLM's ``--tool-call-parser`` finds them (``tool_choice`` "auto").

One parser per chat-template family, under vLLM's names:

- ``hermes`` (``qwen`` is the same parser): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks anywhere in the text (Hermes 2 Pro / 3, Qwen2.5, Qwen3). A block the output ends inside of
  still counts when its JSON is whole.
- ``llama3_json``: the output opens with JSON objects ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;`` (Llama 3.1-3.3).
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of calls (Mistral 7B Instruct v0.3, Mixtral 8x22B), or
  then ``name{...}`` / ``name[ARGS]{...}`` (the newer Mistral tokenizers), one call per marker.

``extract`` reads a whole output; ``feed`` reads a stream's text deltas. Both run one scanner, so the
deltas of a stream add up to exactly what ``extract`` returns for its text. A call is emitted once it is
complete and has the right shape (a non-empty string name, an object of arguments); anything else stays
content, character for character. Whitespace (and llama's ``;``) between, before or after calls is
dropped; any other text around calls is content, as it came. NOTE: a stream therefore holds a call back
until it is whole (a call arrives in one delta, name and arguments together) and holds whitespace that
may turn out to separate calls: what it sends is never taken back.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

IdFactory = Callable[[], str]

_ALNUM = string.ascii_letters + string.digits
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_-]+")


def vllm_tool_call_id() -> str:
    """vLLM's id for a tool call: ``chatcmpl-tool-`` and 32 random hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_tool_call_id() -> str:
    """Nine random letters and digits (vLLM's for Mistral): Mistral's templates refuse other ids."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the text of a JSON object


@dataclass(frozen=True)
class StreamDelta:
    """What one text delta adds: content text and OpenAI ``delta.tool_calls`` entries."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class _Found:
    """What the marker at ``start`` begins: ``calls`` up to ``end``; no calls: ``text[start:end]`` is text."""

    calls: list[ParsedCall]
    end: int


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return False, None


def _call(value: Any) -> ParsedCall | None:
    """A call object (name and ``arguments``, or llama's ``parameters``), else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value["arguments"] if "arguments" in value else value.get("parameters")
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _call_text(text: str) -> ParsedCall | None:
    ok, value = _loads(text)
    return _call(value) if ok else None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _find_marker(text: str, pos: int, marker: str) -> tuple[int | None, int]:
    """The marker's first index at or after ``pos``; else None and where a partial marker may end the text."""
    k = text.find(marker, pos)
    if k >= 0:
        return k, k
    for size in range(min(len(marker) - 1, len(text) - pos), 0, -1):
        if text.endswith(marker[:size]):
            return None, len(text) - size
    return None, len(text)


class ToolParser:
    """One choice's parser: ``extract(text)`` for a whole output, ``feed(delta, final)`` for a stream's
    text deltas in order (``final`` with the last). ``new_id`` names each call (tests inject a counter).

    Subclasses say where a call may start (``_find``) and what a start begins (``_parse``).
    ``skip_special_tokens`` False: the format's markers are special tokens in some models, so the text
    must keep special tokens (vLLM's ``adjust_request`` for these parsers).
    """

    skip_special_tokens = True

    def __init__(self, new_id: IdFactory | None = None) -> None:
        self.new_id: IdFactory = new_id if new_id is not None else self._default_id
        self.num_calls = 0
        self._pending = ""  # text not decided yet
        self._base = 0  # the output's index of _pending[0]
        self._run_is_blank = True  # the text since the last call (or the start) is all separators so far
        self._is_finished = False
        self._json_scan: tuple[int, int, int, bool, bool] | None = None

    def _default_id(self) -> str:
        return vllm_tool_call_id()

    def _find(self, text: str, pos: int) -> tuple[int | None, int]:
        """Where a call may start at or after ``pos``; else None and the index from which the text must
        wait for more (a partial marker)."""
        raise NotImplementedError

    def _parse(self, text: str, start: int, final: bool) -> _Found | None:
        """What ``start`` begins; None: it cannot be told yet (never with ``final``)."""
        raise NotImplementedError

    def _is_separator(self, run: str) -> bool:
        return not run.strip()

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole output's content (None when it is only calls) and its OpenAI ``tool_calls``."""
        parser = type(self)(self.new_id)
        parser._pending = text
        content, calls = parser._advance(final=True)
        tool_calls = [
            {"id": self.new_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
        return (content if content or not calls else None), tool_calls

    def feed(self, text: str, final: bool = False) -> StreamDelta:
        """What this text delta adds: content and ``delta.tool_calls`` entries (index, id, type, function)."""
        if self._is_finished:
            raise RuntimeError("a tool parser was fed after its final delta")
        self._pending += text
        first = self.num_calls
        content, calls = self._advance(final)
        self._is_finished = final
        entries = [
            {
                "index": first + k,
                "id": self.new_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for k, c in enumerate(calls)
        ]
        return StreamDelta(content, entries)

    def _advance(self, final: bool) -> tuple[str, list[ParsedCall]]:
        """Decide what of the pending text can be decided: content and complete calls. Text that may still
        begin, or separate, a call stays pending; with ``final`` nothing does."""
        text = self._pending
        content: list[str] = []
        calls: list[ParsedCall] = []
        consumed = pos = 0  # text[:consumed] is decided; text[consumed:pos] is a blank run, held
        while True:
            start, hold = self._find(text, pos)
            end = start if start is not None else (len(text) if final else hold)
            if self._run_is_blank and not self._is_separator(text[consumed:end]):
                self._run_is_blank = False
            if not self._run_is_blank:
                content.append(text[consumed:end])
                consumed = end
            pos = end
            if start is None:
                break
            found = self._parse(text, start, final)
            if found is None:
                break
            if found.calls:  # NOTE: a blank run before a call is dropped
                calls += found.calls
                self.num_calls += len(found.calls)
                self._run_is_blank = True
            else:
                content.append(text[consumed : found.end])
                self._run_is_blank = False
            consumed = pos = found.end
        if final:
            if self.num_calls == 0:  # separators alone, and no call: they are the content
                content.append(text[consumed:])
            consumed = len(text)
        self._pending = text[consumed:]
        self._base += consumed
        return "".join(content), calls

    def _json_end(self, text: str, start: int) -> int | None:
        """The end of the JSON object or list at ``start`` (brackets matched outside strings); None while
        it is open. NOTE: resumes where the last call for the same start stopped, so a stream scans each
        character once."""
        origin = self._base + start
        if self._json_scan is not None and self._json_scan[0] == origin:
            _, at, depth, in_string, escaped = self._json_scan
            i = at - self._base
        else:
            i, depth, in_string, escaped = start, 0, False, False
        while i < len(text):
            c = text[i]
            i += 1
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    self._json_scan = None
                    return i
        self._json_scan = (origin, self._base + i, depth, in_string, escaped)
        return None


class HermesParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks (vLLM's ``hermes``)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    skip_special_tokens = False

    def _find(self, text: str, pos: int) -> tuple[int | None, int]:
        return _find_marker(text, pos, self.OPEN)

    def _parse(self, text: str, start: int, final: bool) -> _Found | None:
        body = start + len(self.OPEN)
        close = text.find(self.CLOSE, body)
        if close < 0 and not final:
            return None
        stop, end = (close, close + len(self.CLOSE)) if close >= 0 else (len(text), len(text))
        call = _call_text(text[body:stop])
        return _Found([call], end) if call is not None else _Found([], body)


class Llama3JsonParser(ToolParser):
    """JSON call objects at the start of the output, after an optional ``<|python_tag|>``, separated by
    ``;`` (vLLM's ``llama3_json``). Once other text comes, the rest is content."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, new_id: IdFactory | None = None) -> None:
        super().__init__(new_id)
        self._is_closed = False  # text other than calls came: no more calls

    def _is_separator(self, run: str) -> bool:
        return not run.strip() or (self.num_calls > 0 and run.strip() == ";")

    def _find(self, text: str, pos: int) -> tuple[int | None, int]:
        if self._is_closed:
            return None, len(text)
        i = _skip_space(text, pos)
        if self.num_calls and text.startswith(";", i):
            i = _skip_space(text, i + 1)
        if text.startswith("{", i) or text.startswith(self.PYTHON_TAG, i):
            return i, i
        if self.PYTHON_TAG.startswith(text[i : i + len(self.PYTHON_TAG)]):  # nothing yet, or part of the tag
            return None, pos
        self._is_closed = True
        return None, len(text)

    def _parse(self, text: str, start: int, final: bool) -> _Found | None:
        i = start
        if text.startswith(self.PYTHON_TAG, i):
            i = _skip_space(text, i + len(self.PYTHON_TAG))
        end = self._json_end(text, i) if text.startswith("{", i) else i
        if end is None or i == len(text):
            if not final:
                return None
            end = len(text)
        call = _call_text(text[i:end]) if end > i else None
        if call is None:
            self._is_closed = True
            return _Found([], end)
        return _Found([call], end)


class MistralParser(ToolParser):
    """``[TOOL_CALLS]`` then a JSON list of calls, or then ``name{args}`` / ``name[ARGS]{args}`` (vLLM's
    ``mistral``). Call ids are nine letters and digits, as Mistral's templates require."""

    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
    skip_special_tokens = False

    def _default_id(self) -> str:
        return mistral_tool_call_id()

    def _find(self, text: str, pos: int) -> tuple[int | None, int]:
        return _find_marker(text, pos, self.MARKER)

    def _parse(self, text: str, start: int, final: bool) -> _Found | None:
        wait = None if not final else _Found([], start + len(self.MARKER))
        invalid = _Found([], start + len(self.MARKER))
        i = _skip_space(text, start + len(self.MARKER))
        if i == len(text):
            return wait
        if text[i] == "[":
            end = self._json_end(text, i)
            if end is None:
                return wait
            ok, value = _loads(text[i:end])
            calls = [_call(item) for item in value] if ok and isinstance(value, list) else []
            if not calls or any(c is None for c in calls):
                return invalid
            return _Found([c for c in calls if c is not None], end)
        name = _MISTRAL_NAME.match(text, i)
        if name is None:
            return invalid
        j = name.end()
        if text.startswith(self.ARGS, j):
            j += len(self.ARGS)
        elif self.ARGS.startswith(text[j:]) and not final:  # the name or the [ARGS] may go on
            return None
        if j == len(text):
            return wait
        if not text.startswith("{", j):
            return invalid
        end = self._json_end(text, j)
        if end is None:
            return wait
        ok, arguments = _loads(text[j:end])
        if not ok or not isinstance(arguments, dict):
            return invalid
        return _Found([ParsedCall(name.group(), json.dumps(arguments, ensure_ascii=False))], end)


# NOTE: vLLM has no "qwen" parser: its docs point Qwen2.5 and Qwen3 at "hermes", whose format they use.
PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "qwen": HermesParser,
}


def create_tool_parser(name: str, new_id: IdFactory | None = None) -> ToolParser:
    """A fresh parser (one per choice) for ``--tool-call-parser`` ``name``."""
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}, got {name!r}")
    return PARSERS[name](new_id)

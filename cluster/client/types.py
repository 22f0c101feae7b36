"""The SDK's result and error types, shaped like the ``openai`` package's (cluster/client/sdk.py uses them).

Plain dataclasses over the server's JSON: ``Result.choices[i].text`` / ``.message.content`` /
``.usage``; stream ``StreamDelta.choices[0].delta.content``; errors typed by HTTP status.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


class APIError(Exception):
    """The server answered with an error (``status`` None: an error event inside a 200 stream, or no
    answer at all). ``status_code`` is ``status`` under the ``openai`` package's name."""

    def __init__(
        self,
        status: int | None,
        message: str,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(f"{status}: {message}" if status is not None else message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    @property
    def status_code(self) -> int | None:
        return self.status


class APIStatusError(APIError):
    """An HTTP error status (the subclasses below name the common ones)."""


class BadRequestError(APIStatusError):
    """400: the request is invalid (``param`` names the field)."""


class AuthenticationError(APIStatusError):
    """401: missing or wrong API key."""


class NotFoundError(APIStatusError):
    """404: unknown model or route."""


class RateLimitError(APIStatusError):
    """429: the cluster's queue is full (retried ``max_retries`` times first)."""


class InternalServerError(APIStatusError):
    """5xx: the cluster failed the request, or has no healthy worker (503)."""


class APIConnectionError(APIError):
    def __init__(self, message: str) -> None:
        super().__init__(None, message, "connection_error", "connection_error")


class APITimeoutError(APIConnectionError):
    """No answer (or no next chunk) within the client's ``timeout``."""


def error_class(status: int) -> type[APIStatusError]:
    if status == 400:
        return BadRequestError
    if status == 401:
        return AuthenticationError
    if status == 404:
        return NotFoundError
    if status == 429:
        return RateLimitError
    return InternalServerError if status >= 500 else APIStatusError


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Usage:
        details = d.get("prompt_tokens_details") or {}
        return cls(
            d["prompt_tokens"], d["completion_tokens"], d["total_tokens"], details.get("cached_tokens") or 0
        )


@dataclass
class ServerRoute:
    """The router's routing decision for one request and why (``pdserve_timings.route``): mode
    ("colocated" | "disaggregated" | "conditional"), reason, the prefill and decode workers, the prefix
    hit (tokens) the router expected on each, the TTFT and decode step its cost model predicted (seconds,
    or None)."""

    mode: str = ""
    reason: str = ""
    prefill_worker: str | None = None
    decode_worker: str | None = None
    prefill_hit_tokens: int = 0
    decode_hit_tokens: int = 0
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None

    @classmethod
    def from_dict(cls, d: Any) -> ServerRoute | None:
        if not isinstance(d, dict):
            return None
        ttft, tbt = d.get("predicted_ttft_s"), d.get("predicted_tbt_s")
        return cls(
            str(d.get("mode", "")),
            str(d.get("reason", "")),
            d.get("prefill_worker"),
            d.get("decode_worker"),
            int(d.get("prefill_hit_tokens") or 0),
            int(d.get("decode_hit_tokens") or 0),
            float(ttft) if ttft is not None else None,
            float(tbt) if tbt is not None else None,
        )


@dataclass
class ServerTimings:
    """The router's split of one request (seconds), and its routing decision."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    num_migrations: int = 0
    route: ServerRoute | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ServerTimings | None:
        if d is None:
            return None
        seconds = {
            k: float(v)
            for k, v in d.items()
            if k in cls.__dataclass_fields__ and k not in ("num_migrations", "route")
        }
        return cls(
            **seconds,
            num_migrations=int(d.get("num_migrations", 0)),
            route=ServerRoute.from_dict(d.get("route")),
        )


@dataclass
class ToolCallFunction:
    name: str
    arguments: str  # JSON text


@dataclass
class ToolCall:
    id: str
    function: ToolCallFunction
    type: str = "function"


@dataclass
class Message:
    """A chat choice's message (``openai``'s shape): ``content`` None when it carries ``tool_calls``."""

    role: str
    content: str | None
    tool_calls: list[ToolCall] | None = None


@dataclass
class Choice:
    """One choice; ``text`` is the completion text or the chat message's content ("" for tool calls)."""

    index: int
    text: str
    token_ids: list[int] | None
    finish_reason: str | None
    timings: ServerTimings | None = None
    logprobs: dict[str, Any] | None = None
    message: Message | None = None  # chat only


@dataclass
class Result:
    """A finished (non-streaming) answer; ``text``/``token_ids``/``finish_reason``/``timings`` are choice 0's."""

    id: str
    model: str
    choices: list[Choice]
    usage: Usage | None
    latency_s: float
    raw: dict[str, Any]

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int] | None:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def timings(self) -> ServerTimings | None:
        return self.choices[0].timings


@dataclass
class ChunkDelta:
    content: str | None
    role: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


@dataclass
class ChunkChoice:
    """One choice of a stream chunk in ``openai``'s shape: ``.text`` (completions), ``.delta.content``."""

    index: int
    text: str
    delta: ChunkDelta
    finish_reason: str | None
    token_ids: list[int]


@dataclass
class StreamDelta:
    """One choice's new text and token ids from one chunk, with its arrival time (perf_counter)."""

    text: str
    token_ids: list[int]
    arrival_time: float
    index: int = 0
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @property
    def choices(self) -> list[ChunkChoice]:
        delta = ChunkDelta(self.text, tool_calls=self.tool_calls)
        return [ChunkChoice(self.index, self.text, delta, self.finish_reason, self.token_ids)]


@dataclass
class StreamResult:
    """One streamed choice, measured at the client: TTFT, the gaps between token deltas, e2e."""

    index: int
    start_time: float
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    timings: ServerTimings | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    tbt_s: list[float] = field(default_factory=list)
    end_time: float | None = None
    usage: Usage | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.start_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.start_time

"""Boundary messages: plain dataclasses that survive a msgpack round trip (see `to_dict`/`from_dict`).

This module imports nothing of the project and nothing heavy, so the router, server and client can use it.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

import msgpack

MAX_LOGPROBS = 20


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # failed inside the cluster (message carried separately)


@dataclass
class SamplingParams:
    """How to pick the next tokens for one request (the fields vLLM's offline API accepts).

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 and min_p 0 disable those filters.
    seed makes the request's random draws independent of whatever else shares the batch.
    logprobs None returns none; k >= 0 returns the chosen token's logprob plus the top k.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the offending field and its limit."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"stop_token_ids entries must be in [0, {vocab_size}), got {t}")


@dataclass
class TokenLogprobs:
    """Logprobs of one generated position: the chosen token's, then the top-n (raw model distribution)."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    """A finished (or, when streaming, in-progress) request as the offline API and router return it.

    Timestamps are time.time() seconds: arrival (engine accepted it), first token, finish.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None

    @classmethod
    def start(
        cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams, now: float
    ) -> RequestOutput:
        """An empty output that ``apply`` fills from the request's stream of deltas."""
        return cls(
            request_id,
            list(prompt_token_ids),
            arrival_time=now,
            logprobs=[] if params.logprobs is not None else None,
        )

    def apply(self, delta: TokenDelta, now: float) -> None:
        """Append one delta of this request's stream (``now``: when it arrived)."""
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.logprobs is not None and self.logprobs is not None:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.finish_time = now
            self.error = delta.error


def to_dict(obj: Any) -> Any:
    """Turn a protocol dataclass (nested) into msgpack-able builtins."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


@dataclass
class TokenDelta:
    """What one engine step produced for one request: new tokens, new text, and the end if it ended.

    Streaming consumers (router, offline LLM) concatenate deltas; ``num_cached_tokens`` is the prompt's
    prefix-cache hit, set on every delta.
    """

    request_id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    timings: RequestTimings | None = None  # set by the router on the final delta
    scheduled_time: float | None = None  # engine: when the request was first scheduled (first delta only)


@dataclass
class GenerateRequest:
    """What the HTTP server hands the router: already tokenized and validated at the edge.

    deadline: absolute time.time() after which the request fails with DeadlineExceeded (None: no bound
    beyond the router's default).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float | None = None


@dataclass
class RequestTimings:
    """Per-request split measured by the router (seconds); attached to the final TokenDelta."""

    queue_s: float = 0.0  # arrival at the router -> a worker started computing it
    prefill_s: float = 0.0  # prefill compute until the first token
    transfer_s: float = 0.0  # KV handoff (0 when colocated)
    decode_s: float = 0.0  # first token -> finish
    ttft_s: float = 0.0
    e2e_s: float = 0.0


@dataclass
class ModelInfo:
    """What the edge needs to validate and label requests."""

    name: str
    model_dir: str
    max_model_len: int
    vocab_size: int


class RouterError(Exception):
    """A request the cluster cannot serve; ``status`` is the HTTP status the server answers with."""

    status = 500
    code = "internal_error"


class InvalidRequestError(RouterError):
    status = 400
    code = "invalid_request"


class QueueFullError(RouterError):
    status = 429
    code = "queue_full"


class DeadlineExceededError(RouterError):
    status = 504
    code = "deadline_exceeded"


class ClusterUnavailableError(RouterError):
    status = 503
    code = "unavailable"


class RequestAbortedError(RouterError):
    status = 499  # nginx's "client closed request": nobody is left to read it
    code = "aborted"


class WorkerFailedError(RouterError):
    status = 500
    code = "worker_failed"


@dataclass
class WorkerStats:
    """One worker's gauges and cumulative counters (the router polls these; /metrics exports them)."""

    worker_id: str
    pool: str  # "prefill" | "decode" | "colocated"
    healthy: bool = True
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_kv: int = 0
    kv_usage: float = 0.0  # fraction of usable KV blocks with a user
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    num_transfers: int = 0
    num_failed_transfers: int = 0


def pack(message: dict[str, Any]) -> bytes:
    """msgpack a message of builtins (dataclasses go through ``to_dict`` first); never pickle."""
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    message = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(message, dict):
        raise ValueError(f"expected a msgpack map, got {type(message).__name__}")
    return message


def token_delta_from_dict(d: dict[str, Any]) -> TokenDelta:
    d = dict(d)
    if d.get("finish_reason") is not None:
        d["finish_reason"] = FinishReason(d["finish_reason"])
    if d.get("logprobs") is not None:
        d["logprobs"] = [TokenLogprobs(**x) for x in d["logprobs"]]
    if d.get("timings") is not None:
        d["timings"] = RequestTimings(**d["timings"])
    return TokenDelta(**d)

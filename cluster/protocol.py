"""Boundary messages: plain dataclasses that survive a msgpack round trip (see `to_dict`/`from_dict`).

This module imports nothing of the project and nothing heavy, so the router, server and client can use it.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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


def sampling_params_from_dict(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**d)


def request_output_from_dict(d: dict[str, Any]) -> RequestOutput:
    d = dict(d)
    if d.get("finish_reason") is not None:
        d["finish_reason"] = FinishReason(d["finish_reason"])
    if d.get("logprobs") is not None:
        d["logprobs"] = [TokenLogprobs(**x) for x in d["logprobs"]]
    return RequestOutput(**d)


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

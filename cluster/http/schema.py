"""OpenAI request bodies for pdserve's HTTP edge and the checks made on their fields (no FastAPI here, no
torch).

Pydantic models give the types only; ranges are checked by hand so a 400 names the field and its limit.
What a checked body becomes (the router's requests) is ``cluster/http/planning.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from cluster.http.errors import ApiError
from cluster.protocol import (
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_PENALTY,
    ModelInfo,
)

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


# ---- request schemas: types only; ranges are checked by hand for messages that name the limit ----


class CommonBody(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    timeout: float | None = None  # seconds; pdserve extension -> GenerateRequest.deadline
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # OpenAI's: token-id strings -> values
    # vLLM's sampling extensions
    min_tokens: int = 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class CompletionBody(CommonBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class _ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


class _FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str


class _ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: _FunctionCall


class ChatMessage(BaseModel):
    """One entry of ``messages`` (chat completions and /tokenize)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[_ContentPart] | None = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None


class ChatBody(CommonBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


# ---- the checks: each raises ApiError 400 (404 for an unknown model) naming the field ----


def check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise ApiError(400, message, param)


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """A pydantic error as the 400's message and the field it names."""
    err = e.errors()[0]
    param = str(err["loc"][0]) if err["loc"] else None
    if param == "prompt" and len(e.errors()) > 1:  # NOTE: one error per union member; say it once
        return (
            "prompt must be a string, a list of token ids, a list of strings or a list of token-id lists",
            param,
        )
    loc = ".".join(str(p) for p in err["loc"])
    return f"{loc}: {err['msg']} (got {str(err.get('input'))[:60]!r})", param


def check_model(model: str | None, names: Sequence[str]) -> None:
    if model is not None and model not in names:
        raise ApiError(404, f"model {model!r} does not exist; served: {names[0]!r}", "model")


def check_common(body: CommonBody, info: ModelInfo, names: Sequence[str]) -> None:
    check_model(body.model, names)
    check(1 <= body.n <= MAX_N, f"n must be in [1, {MAX_N}], got {body.n}", "n")
    check(body.temperature >= 0, f"temperature must be >= 0, got {body.temperature}", "temperature")
    check(0 < body.top_p <= 1, f"top_p must be in (0, 1], got {body.top_p}", "top_p")
    check(body.top_k >= -1, f"top_k must be -1, 0 (disabled) or >= 1, got {body.top_k}", "top_k")
    check(0 <= body.min_p <= 1, f"min_p must be in [0, 1], got {body.min_p}", "min_p")
    check_sampling_fields(body, info)
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    check(all(stops), "stop strings must be non-empty", "stop")
    check(
        len(stops) <= MAX_STOP_STRINGS,
        f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}",
        "stop",
    )
    longest = max((len(x) for x in stops), default=0)
    check(
        longest <= MAX_STOP_STRING_CHARS,
        f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters, got {longest}",
        "stop",
    )
    num_stop_ids = len(body.stop_token_ids or [])
    check(
        num_stop_ids <= MAX_STOP_TOKEN_IDS,
        f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {num_stop_ids}",
        "stop_token_ids",
    )
    for t in body.stop_token_ids or []:
        check(
            0 <= t < info.vocab_size,
            f"stop_token_ids entry {t} is outside the vocabulary [0, {info.vocab_size})",
            "stop_token_ids",
        )
    check(body.seed is None or 0 <= body.seed < 2**63, f"seed must be in [0, 2**63), got {body.seed}", "seed")
    check(
        body.timeout is None or body.timeout > 0,
        f"timeout must be > 0 seconds, got {body.timeout}",
        "timeout",
    )
    check(
        body.stream or body.stream_options is None,
        "stream_options is only allowed when stream is true",
        "stream_options",
    )


def check_sampling_fields(body: CommonBody, info: ModelInfo) -> None:
    """vLLM's sampling fields, each against its own limit. What needs more than the body is checked where
    it resolves: min_tokens against the resolved max_tokens and bad_words against the tokenizer
    (``cluster/http/planning.py``), logit_bias's keys against the vocabulary (:func:`logit_bias_ids`)."""
    for name, value in (
        ("presence_penalty", body.presence_penalty),
        ("frequency_penalty", body.frequency_penalty),
    ):
        check(
            -MAX_PENALTY <= value <= MAX_PENALTY,
            f"{name} must be in [{-MAX_PENALTY}, {MAX_PENALTY}], got {value}",
            name,
        )
    check(
        body.repetition_penalty > 0,
        f"repetition_penalty must be > 0, got {body.repetition_penalty}",
        "repetition_penalty",
    )
    check(body.min_tokens >= 0, f"min_tokens must be >= 0, got {body.min_tokens}", "min_tokens")
    words = body.bad_words or []
    check(
        len(words) <= MAX_BAD_WORDS,
        f"bad_words may hold at most {MAX_BAD_WORDS} words, got {len(words)}",
        "bad_words",
    )
    check(all(w.strip() for w in words), "bad_words entries must be non-empty (not only spaces)", "bad_words")
    allowed = body.allowed_token_ids
    if allowed is not None:
        check(len(allowed) > 0, "allowed_token_ids must hold at least one token id", "allowed_token_ids")
        check(
            len(allowed) <= info.vocab_size,
            f"allowed_token_ids may hold at most {info.vocab_size} ids (the vocabulary), got {len(allowed)}",
            "allowed_token_ids",
        )
        if min(allowed) < 0 or max(allowed) >= info.vocab_size:
            t = next(t for t in allowed if not 0 <= t < info.vocab_size)
            raise ApiError(
                400,
                f"allowed_token_ids entry {t} is outside the vocabulary [0, {info.vocab_size})",
                "allowed_token_ids",
            )
    k = body.prompt_logprobs
    check(
        k is None or 0 <= k <= MAX_LOGPROBS,
        f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {k}",
        "prompt_logprobs",
    )
    # NOTE: vLLM's rule: a stream's chunks have no place for them
    check(
        not (body.stream and k is not None and k > 0),
        "prompt_logprobs are not available when stream is true",
        "prompt_logprobs",
    )


def logit_bias_ids(body: CommonBody, info: ModelInfo) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token-id strings -> values in [-100, 100]) keyed by token id; 400 naming
    logit_bias for a key that is not a token id of the vocabulary or a value out of range."""
    bias = body.logit_bias or {}
    check(
        len(bias) <= MAX_LOGIT_BIAS_ENTRIES,
        f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}",
        "logit_bias",
    )
    ids: dict[int, float] = {}
    for key, value in bias.items():
        token_id = int(key) if key.isascii() and key.isdigit() else -1
        check(
            0 <= token_id < info.vocab_size,
            f"logit_bias keys must be token ids in [0, {info.vocab_size}), got {key[:40]!r}",
            "logit_bias",
        )
        check(
            -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS,
            f"logit_bias values must be in [{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {value} for {key!r}",
            "logit_bias",
        )
        ids[token_id] = value
    return ids


def check_prompt_chars(num_chars: int, max_chars: int, reason: str, param: str, what: str) -> None:
    """400 when a prompt's text is too long to fit the context in any tokenization (checked before
    tokenizing it: the refusal costs nothing however big the text)."""
    if num_chars > max_chars:
        raise ApiError(
            400,
            f"{param}: {what} is {num_chars:,} characters, over the limit of {max_chars:,} ({reason}): "
            "it cannot fit the context",
            param,
            "context_length_exceeded",
        )


def check_prompt_ids(ids: list[int], info: ModelInfo, param: str) -> None:
    check(len(ids) > 0, f"{param} must not be empty", param)
    # NOTE: min/max run in C; a Python loop over a long prompt's ids holds the GIL in 5 ms slices that
    # every other request's thread hops then queue behind.
    if min(ids) < 0 or max(ids) >= info.vocab_size:
        t = next(t for t in ids if not 0 <= t < info.vocab_size)
        raise ApiError(400, f"{param} token id {t} is outside the vocabulary [0, {info.vocab_size})", param)

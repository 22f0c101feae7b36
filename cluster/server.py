"""OpenAI-compatible HTTP front of pdserve: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics.

Hosting choice: the router process hosts this ASGI app itself (FastAPI + uvicorn), not Ray Serve. The
router already owns the sockets to every worker and the per-request streams; serving HTTP from the same
process and event loop means one hop from worker to client and no extra replica, actor call or
object-store copy per token. Ray stays the lifecycle plane only (DESIGN.md: never per token).

The edge validates everything itself (400 naming the field and its limit, never FastAPI's 422; 413 for
an oversized body before it is parsed; 401 for a bad key) before any router call, so a rejected request
queues nothing. This module never imports torch.

pdserve extensions to OpenAI's shapes (OpenAI clients ignore unknown fields): every choice carries
``token_ids`` (the ids of that chunk, or of the whole output), and the chunk or choice that finishes a
choice carries ``pdserve_timings`` (the router's queue/prefill/transfer/decode split, in seconds).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, cast

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.metrics import CONTENT_TYPE, Metrics
from cluster.protocol import (
    MAX_LOGPROBS,
    FinishReason,
    GenerateRequest,
    ModelInfo,
    RequestTimings,
    RouterError,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
    WorkerStats,
)
from workers.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MAX_N = 16
KEEPALIVE_S = 15.0  # an SSE comment while idle, so a vanished client is noticed on the next send


class RouterLike(Protocol):
    """The slice of ``cluster.router.Router`` the server uses (tests pass a stub)."""

    model_info: ModelInfo
    mode: str

    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]: ...
    async def abort(self, request_id: str) -> None: ...
    def is_healthy(self) -> bool: ...
    def worker_stats(self) -> list[WorkerStats]: ...


class ApiError(Exception):
    """A request answered with an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or {
            400: "invalid_request",
            401: "invalid_api_key",
            404: "model_not_found",
            413: "request_too_large",
        }.get(status, "error")

    @classmethod
    def from_router(cls, e: RouterError) -> ApiError:
        return cls(e.status, str(e) or type(e).__name__, code=e.code)


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    return "invalid_request_error" if status < 500 else "server_error"


def _error_body(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": _error_type(e.status), "param": e.param, "code": e.code}}


# ---- request schemas: types only; ranges are checked by hand for messages that name the limit ----


class _Body(BaseModel):
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
    logit_bias: dict[str, float] | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class _ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[_ContentPart] | None = None


class ChatBody(_Body):
    messages: list[_Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


@dataclass
class Plan:
    """A validated request: what to send to the router and how to shape the answer."""

    kind: Literal["completion", "chat"]
    id: str
    model: str
    stream: bool
    include_usage: bool
    logprobs: bool
    prompts: list[list[int]]
    jobs: list[tuple[int, GenerateRequest]]  # (choice index, router request)
    created: int = field(default_factory=lambda: int(time.time()))


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise ApiError(400, message, param)


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    param = str(err["loc"][0]) if err["loc"] else None
    if param == "prompt" and len(e.errors()) > 1:  # NOTE: one error per union member; say it once
        return (
            "prompt must be a string, a list of token ids, a list of strings or a list of token-id lists",
            param,
        )
    loc = ".".join(str(p) for p in err["loc"])
    return f"{loc}: {err['msg']} (got {str(err.get('input'))[:60]!r})", param


def _check_common(body: _Body, info: ModelInfo, names: Sequence[str]) -> None:
    if body.model is not None and body.model not in names:
        raise ApiError(404, f"model {body.model!r} does not exist; served: {names[0]!r}", "model")
    _check(1 <= body.n <= MAX_N, f"n must be in [1, {MAX_N}], got {body.n}", "n")
    _check(body.temperature >= 0, f"temperature must be >= 0, got {body.temperature}", "temperature")
    _check(0 < body.top_p <= 1, f"top_p must be in (0, 1], got {body.top_p}", "top_p")
    _check(body.top_k >= -1, f"top_k must be -1, 0 (disabled) or >= 1, got {body.top_k}", "top_k")
    _check(0 <= body.min_p <= 1, f"min_p must be in [0, 1], got {body.min_p}", "min_p")
    for name, value, neutral in (
        ("presence_penalty", body.presence_penalty, 0.0),
        ("frequency_penalty", body.frequency_penalty, 0.0),
        ("repetition_penalty", body.repetition_penalty, 1.0),
    ):
        _check(value == neutral, f"{name} is not supported (must be {neutral}), got {value}", name)
    _check(not body.logit_bias, "logit_bias is not supported", "logit_bias")
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    _check(all(stops), "stop strings must be non-empty", "stop")
    for t in body.stop_token_ids or []:
        _check(
            0 <= t < info.vocab_size,
            f"stop_token_ids entry {t} is outside the vocabulary [0, {info.vocab_size})",
            "stop_token_ids",
        )
    _check(
        body.seed is None or 0 <= body.seed < 2**63, f"seed must be in [0, 2**63), got {body.seed}", "seed"
    )
    _check(
        body.timeout is None or body.timeout > 0,
        f"timeout must be > 0 seconds, got {body.timeout}",
        "timeout",
    )
    _check(
        body.stream or body.stream_options is None,
        "stream_options is only allowed when stream is true",
        "stream_options",
    )


def _check_prompt_ids(ids: list[int], info: ModelInfo, param: str) -> None:
    _check(len(ids) > 0, f"{param} must not be empty", param)
    for t in ids:
        _check(
            0 <= t < info.vocab_size,
            f"{param} token id {t} is outside the vocabulary [0, {info.vocab_size})",
            param,
        )


def _resolve_max_tokens(
    requested: int | None, default: int | None, prompt_len: int, info: ModelInfo, param: str
) -> int:
    room = info.max_model_len - prompt_len
    _check(
        room >= 1,
        f"prompt ({prompt_len} tokens) leaves no room to generate within max_model_len "
        f"({info.max_model_len})",
        "prompt" if param == "max_tokens" else "messages",
    )
    max_tokens = requested if requested is not None else min(default or room, room)
    _check(max_tokens >= 1, f"{param} must be >= 1, got {max_tokens}", param)
    _check(
        prompt_len + max_tokens <= info.max_model_len,
        f"prompt ({prompt_len} tokens) + {param} ({max_tokens}) exceeds max_model_len ({info.max_model_len})",
        param,
    )
    return max_tokens


def _build_plan(
    kind: Literal["completion", "chat"],
    body: _Body,
    prompts: list[list[int]],
    max_tokens: list[int],
    num_logprobs: int | None,
    model: str,
    deadline: float | None,
) -> Plan:
    plan_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    jobs: list[tuple[int, GenerateRequest]] = []
    for p, ids in enumerate(prompts):
        for j in range(body.n):
            params = SamplingParams(
                max_tokens=max_tokens[p],
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                min_p=body.min_p,
                seed=None if body.seed is None else body.seed + j,
                stop=stop,
                stop_token_ids=list(body.stop_token_ids or []),
                ignore_eos=body.ignore_eos,
                logprobs=num_logprobs,
            )
            jobs.append((p * body.n + j, GenerateRequest(f"{plan_id}-{p}-{j}", ids, params, deadline)))
    include_usage = bool((body.stream_options or {}).get("include_usage", False))
    return Plan(kind, plan_id, model, body.stream, include_usage, num_logprobs is not None, prompts, jobs)


def plan_completion(
    raw: dict[str, Any],
    info: ModelInfo,
    tokenizer: Tokenizer | None,
    names: Sequence[str],
    default_timeout_s: float | None,
) -> Plan:
    """Validate a /v1/completions body; raises ApiError (400/404) before anything is queued."""
    try:
        body = CompletionBody.model_validate(raw)
    except ValidationError as e:
        raise ApiError(400, *_validation_message(e)) from None
    _check_common(body, info, names)
    _check(not body.echo, "echo is not supported", "echo")
    _check(body.suffix is None, "suffix is not supported", "suffix")
    _check(body.best_of in (None, body.n), f"best_of must equal n ({body.n}), got {body.best_of}", "best_of")
    _check(
        body.logprobs is None or 0 <= body.logprobs <= MAX_LOGPROBS,
        f"logprobs must be in [0, {MAX_LOGPROBS}], got {body.logprobs}",
        "logprobs",
    )
    single = isinstance(body.prompt, str) or (bool(body.prompt) and isinstance(body.prompt[0], int))
    items = cast("list[str | list[int]]", [body.prompt] if single else list(body.prompt))
    _check(len(items) > 0, "prompt must not be empty", "prompt")
    _check(
        len(items) * body.n <= MAX_N, f"prompts x n must be <= {MAX_N}, got {len(items) * body.n}", "prompt"
    )
    prompts: list[list[int]] = []
    for item in items:
        if isinstance(item, str):
            _check(
                tokenizer is not None,
                "text prompts need a tokenizer; this model has none: send token ids",
                "prompt",
            )
            _check(item != "", "prompt must not be empty", "prompt")
            ids = tokenizer.encode(item) if tokenizer is not None else []
        else:
            ids = list(item)
        _check_prompt_ids(ids, info, "prompt")
        prompts.append(ids)
    max_tokens = [_resolve_max_tokens(body.max_tokens, 16, len(ids), info, "max_tokens") for ids in prompts]
    deadline = _deadline(body.timeout, default_timeout_s)
    return _build_plan("completion", body, prompts, max_tokens, body.logprobs, names[0], deadline)


def plan_chat(
    raw: dict[str, Any],
    info: ModelInfo,
    tokenizer: Tokenizer | None,
    names: Sequence[str],
    default_timeout_s: float | None,
) -> Plan:
    """Validate a /v1/chat/completions body and render its chat template; raises ApiError."""
    try:
        body = ChatBody.model_validate(raw)
    except ValidationError as e:
        raise ApiError(400, *_validation_message(e)) from None
    _check_common(body, info, names)
    _check(len(body.messages) > 0, "messages must not be empty", "messages")
    _check(
        body.top_logprobs is None or body.logprobs,
        "top_logprobs requires logprobs to be true",
        "top_logprobs",
    )
    _check(
        body.top_logprobs is None or 0 <= body.top_logprobs <= MAX_LOGPROBS,
        f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
        "top_logprobs",
    )
    _check(
        tokenizer is not None, "chat needs a tokenizer with a chat template; this model has none", "messages"
    )
    messages: list[dict[str, str]] = []
    for i, m in enumerate(body.messages):
        if isinstance(m.content, list):
            _check(
                all(p.type == "text" and p.text is not None for p in m.content),
                f"messages[{i}].content: only text parts are supported",
                "messages",
            )
            text = "".join(p.text or "" for p in m.content)
        else:
            text = m.content or ""
        messages.append({"role": m.role, "content": text})
    try:
        ids = tokenizer.encode_chat(messages, body.add_generation_prompt) if tokenizer is not None else []
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from None
    _check_prompt_ids(ids, info, "messages")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = [_resolve_max_tokens(requested, None, len(ids), info, param)]
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    deadline = _deadline(body.timeout, default_timeout_s)
    return _build_plan("chat", body, [ids], max_tokens, num_logprobs, names[0], deadline)


def _deadline(timeout: float | None, default_timeout_s: float | None) -> float | None:
    t = timeout if timeout is not None else default_timeout_s
    return None if t is None else time.time() + t


# ---- response shapes ----


class _Choice:
    """One choice's output so far, and its OpenAI shapes (stream chunk choice or full choice)."""

    def __init__(self, kind: str, tokenizer: Tokenizer | None, want_logprobs: bool) -> None:
        self.kind, self.tokenizer, self.want_logprobs = kind, tokenizer, want_logprobs
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: FinishReason | None = None
        self.timings: RequestTimings | None = None
        self.num_cached_tokens = 0
        self._text_offset = 0

    def add(self, delta: TokenDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finish_reason is not None:
            self.finish_reason, self.timings = delta.finish_reason, delta.timings

    def _token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _format_logprobs(self, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        if self.kind == "chat":
            content = []
            for e in entries:
                tok = self._token(e.token_id)
                tops = [(self._token(t), lp) for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=True)]
                content.append(
                    {
                        "token": tok,
                        "logprob": e.logprob,
                        "bytes": list(tok.encode()),
                        "top_logprobs": [
                            {"token": s, "logprob": lp, "bytes": list(s.encode())} for s, lp in tops
                        ],
                    }
                )
            return {"content": content}
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for e in entries:
            tok = self._token(e.token_id)
            out["tokens"].append(tok)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(
                {self._token(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=True)}
            )
            out["text_offset"].append(self._text_offset)
            self._text_offset += len(tok)
        return out

    def _tail(
        self, choice: dict[str, Any], finish: FinishReason | None, timings: RequestTimings | None
    ) -> None:
        choice["finish_reason"] = finish.value if finish is not None else None
        if timings is not None:
            choice["pdserve_timings"] = asdict(timings)

    def stream_choice(self, index: int, delta: TokenDelta) -> dict[str, Any]:
        self.add(delta)
        body: dict[str, Any]
        if self.kind == "chat":
            body = {"index": index, "delta": {"content": delta.text}}
        else:
            body = {"index": index, "text": delta.text}
        body["logprobs"] = self._format_logprobs(delta.logprobs or [])
        body["token_ids"] = list(delta.token_ids)
        self._tail(body, delta.finish_reason, delta.timings)
        return body

    def full_choice(self, index: int) -> dict[str, Any]:
        body: dict[str, Any]
        if self.kind == "chat":
            body = {"index": index, "message": {"role": "assistant", "content": self.text}}
        else:
            body = {"index": index, "text": self.text}
        body["logprobs"] = self._format_logprobs(self.logprobs)
        body["token_ids"] = self.token_ids
        self._tail(body, self.finish_reason, self.timings)
        return body


def _usage(plan: Plan, choices: dict[int, _Choice]) -> dict[str, Any]:
    n = len(plan.jobs) // len(plan.prompts)
    completion = sum(len(c.token_ids) for c in choices.values())
    prompt = sum(len(p) for p in plan.prompts)
    cached = sum(
        max(choices[p * n + j].num_cached_tokens for j in range(n)) for p in range(len(plan.prompts))
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _envelope(plan: Plan, *, chunk: bool) -> dict[str, Any]:
    obj = (
        ("chat.completion.chunk" if chunk else "chat.completion")
        if plan.kind == "chat"
        else "text_completion"
    )
    return {"id": plan.id, "object": obj, "created": plan.created, "model": plan.model}


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _as_api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RouterError):
        return ApiError.from_router(e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")


# ---- running a plan against the router ----


class _Fanout:
    """Runs a plan's router requests (n x prompts) as tasks and merges their deltas into one queue.

    Lifecycle: ``close()`` must run once the answer is done or abandoned (it is idempotent and must be
    shielded from cancellation): it cancels the consumer tasks, which closes each router stream, then
    awaits ``router.abort`` for every request that did not finish, so a disconnect, an error or a sibling
    choice's failure frees KV blocks everywhere.
    """

    def __init__(self, router: RouterLike, metrics: Metrics, plan: Plan, arrival: float) -> None:
        self.router, self.metrics, self.arrival, self.mode = router, metrics, arrival, router.mode
        self.queue: asyncio.Queue[tuple[int, TokenDelta | BaseException]] = asyncio.Queue()
        self.unfinished = {req.request_id for _, req in plan.jobs}
        self.failed: set[str] = set()
        self.closed = False
        self.tasks = [asyncio.create_task(self._consume(i, req)) for i, req in plan.jobs]

    async def _consume(self, index: int, req: GenerateRequest) -> None:
        stream = self.router.generate(req)
        last: float | None = None
        num_tokens = 0
        try:
            async for delta in stream:
                now = time.perf_counter()
                if delta.token_ids:
                    if last is None:
                        self.metrics.observe_first_token(now - self.arrival, self.mode)
                    else:
                        self.metrics.observe_token_gap(now - last, self.mode)
                    last, num_tokens = now, num_tokens + len(delta.token_ids)
                if delta.finish_reason == FinishReason.ERROR:
                    raise ApiError(
                        500, f"worker failed: {delta.error or 'unknown error'}", code="worker_failed"
                    )
                if delta.finish_reason is not None:
                    self.unfinished.discard(req.request_id)
                    self.metrics.observe_finished(
                        delta.timings,
                        delta.finish_reason.value,
                        self.mode,
                        e2e_s=now - self.arrival,
                        num_prompt_tokens=len(req.prompt_token_ids),
                        num_generation_tokens=num_tokens,
                        num_cached_tokens=delta.num_cached_tokens,
                    )
                await self.queue.put((index, delta))
                if delta.finish_reason is not None:
                    return
            raise ApiError(500, "router stream ended without a finish_reason", code="internal_error")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not isinstance(e, (RouterError, ApiError)):
                logger.exception("request %s failed", req.request_id)
            self.failed.add(req.request_id)
            await self.queue.put((index, e))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def next(self, timeout: float | None = None) -> tuple[int, TokenDelta | BaseException] | None:
        if not self.queue.empty():  # NOTE: the common case; skips wait_for's extra task per delta
            return self.queue.get_nowait()
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for request_id in sorted(self.unfinished):
            if request_id not in self.failed:
                self.metrics.requests.labels("abort", self.mode).inc()
            try:
                await self.router.abort(request_id)
            except Exception:
                logger.exception("router.abort(%s) failed", request_id)


async def _until_disconnected(request: Request, work: asyncio.Future[Any] | asyncio.Task[Any]) -> Any:
    """Await ``work`` unless the client goes away first (then ApiError 499 and ``work`` is cancelled)."""

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise ApiError(499, "client disconnected", code="client_disconnected")
    finally:
        watcher.cancel()
        work.cancel()


async def _collect(fanout: _Fanout, plan: Plan, tokenizer: Tokenizer | None) -> dict[int, _Choice]:
    choices = {i: _Choice(plan.kind, tokenizer, plan.logprobs) for i, _ in plan.jobs}
    remaining = len(choices)
    while remaining:
        index, event = await fanout.queue.get()
        if isinstance(event, BaseException):
            raise _as_api_error(event)
        choices[index].add(event)
        remaining -= event.finish_reason is not None
    return choices


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs ``on_close`` however the response ends (done, client gone, error).

    NOTE: a generator's own ``finally`` never runs if the response fails before its first iteration.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: _Fanout) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.fanout = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.move_on_after(30, shield=True):
                await self.fanout.close()


async def _stream(
    plan: Plan,
    fanout: _Fanout,
    first: tuple[int, TokenDelta | BaseException],
    tokenizer: Tokenizer | None,
    metrics: Metrics,
) -> AsyncIterator[bytes]:
    choices = {i: _Choice(plan.kind, tokenizer, plan.logprobs) for i, _ in plan.jobs}
    usage_field = {"usage": None} if plan.include_usage else {}
    if plan.kind == "chat":
        for i in choices:
            role = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield _sse({**_envelope(plan, chunk=True), "choices": [role], **usage_field})
    remaining = len(choices)
    item: tuple[int, TokenDelta | BaseException] | None = first
    while remaining:
        if item is None:
            yield b": keep-alive\n\n"
        else:
            index, event = item
            if isinstance(event, BaseException):
                error = _as_api_error(event)
                metrics.observe_error(error.status, error.code)
                yield _sse(_error_body(error))
                break
            choice = choices[index].stream_choice(index, event)
            yield _sse({**_envelope(plan, chunk=True), "choices": [choice], **usage_field})
            remaining -= event.finish_reason is not None
        if remaining:
            item = await fanout.next(KEEPALIVE_S)
    if remaining == 0 and plan.include_usage:
        yield _sse({**_envelope(plan, chunk=True), "choices": [], "usage": _usage(plan, choices)})
    yield b"data: [DONE]\n\n"


# ---- the app ----


def create_app(
    router: RouterLike,
    tokenizer: Tokenizer | None,
    *,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    served_model_name: str | None = None,
    default_timeout_s: float | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over ``router``; ``app.state.metrics`` holds its :class:`Metrics`.

    tokenizer None serves token-id prompts only (text prompts and chat answer 400). default_timeout_s
    bounds requests without a ``timeout`` field (GenerateRequest.deadline); None leaves it to the router.
    """
    info = router.model_info
    names = list(dict.fromkeys([served_model_name or info.name, info.name]))
    metrics = Metrics(router.worker_stats)
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics, app.state.router = metrics, router
    expected_auth = f"Bearer {api_key}".encode() if api_key is not None else None

    def error_response(e: ApiError) -> JSONResponse:
        metrics.observe_error(e.status, e.code)
        return JSONResponse(_error_body(e), status_code=e.status)

    @app.exception_handler(ApiError)
    async def _on_api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(ApiError(400, f"invalid request: {e.errors()[:1]}"))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(ApiError(e.status_code, str(e.detail), code="http_error"))

    def authorize(request: Request) -> None:
        if expected_auth is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected_auth):
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer <key>)")

    async def read_json(request: Request) -> dict[str, Any]:
        """The body as a JSON object; 413 past max_body_bytes, checked before parsing anything."""
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise ApiError(400, f"invalid Content-Length {length!r}")
            if int(length) > max_body_bytes:
                raise ApiError(
                    413, f"request body ({length} bytes) exceeds max_body_bytes ({max_body_bytes})"
                )
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:  # NOTE: chunked bodies have no Content-Length to trust.
                raise ApiError(413, f"request body exceeds max_body_bytes ({max_body_bytes})")
        try:
            raw = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ApiError(400, "request body must be a JSON object")
        return raw

    async def run(plan: Plan, request: Request, arrival: float) -> Response:
        fanout = _Fanout(router, metrics, plan, arrival)
        handed_off = False
        try:
            if plan.stream:
                # NOTE: wait for the first event before sending headers, so 429/503/504 raised before the
                # first token still get their HTTP status (and clients may retry them).
                first = await _until_disconnected(request, asyncio.ensure_future(fanout.queue.get()))
                if isinstance(first[1], BaseException):
                    raise _as_api_error(first[1])
                handed_off = True
                return _ClosingStreamingResponse(_stream(plan, fanout, first, tokenizer, metrics), fanout)
            work = asyncio.ensure_future(_collect(fanout, plan, tokenizer))
            choices = await _until_disconnected(request, work)
            response = {
                **_envelope(plan, chunk=False),
                "choices": [c.full_choice(i) for i, c in choices.items()],
            }
            return JSONResponse({**response, "usage": _usage(plan, choices)})
        finally:
            if not handed_off:
                with anyio.move_on_after(30, shield=True):
                    await fanout.close()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        authorize(request)
        plan = plan_completion(await read_json(request), info, tokenizer, names, default_timeout_s)
        return await run(plan, request, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        authorize(request)
        plan = plan_chat(await read_json(request), info, tokenizer, names, default_timeout_s)
        return await run(plan, request, arrival)

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "root": info.model_dir,
            "max_model_len": info.max_model_len,
            "vocab_size": info.vocab_size,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [model_card(names[0])]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        authorize(request)
        if model_id not in names:
            raise ApiError(404, f"model {model_id!r} does not exist; served: {names[0]!r}", "model")
        return model_card(names[0])

    @app.get("/health")
    async def health() -> Response:
        healthy = router.is_healthy()
        return JSONResponse({"status": "ok" if healthy else "unhealthy"}, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        authorize(request)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def create_server(
    app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> uvicorn.Server:
    """A uvicorn server for ``app``; ``await server.serve()`` runs it inside an existing event loop."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve ``app`` until interrupted (blocks; uvicorn owns the event loop)."""
    create_server(app, host, port).run()

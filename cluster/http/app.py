"""OpenAI-compatible HTTP front of pdserve: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics.

Hosting choice: the router process hosts this ASGI app itself (FastAPI + uvicorn), not Ray Serve. The
router already owns the sockets to every worker and the per-request streams; serving HTTP from the same
process and event loop means one hop from worker to client and no extra replica, actor call or
object-store copy per token. Ray stays the lifecycle plane only (DESIGN.md: never per token).

The edge validates everything itself (400 naming the field and its limit, never FastAPI's 422; 413 for
an oversized body before it is parsed; 401 for a bad key) before any router call, so a rejected request
queues nothing (request schemas and validation: ``cluster/http/openai_schema.py``). This module never imports
torch or ray.

Routes are module-level functions over the :class:`ServerState` that ``create_app`` builds; any exception
no handler knows becomes a JSON 500 in OpenAI's shape (logged with its traceback). Hosting on a running
cluster is the composition root's business: ``deploy/http_host.py``.

pdserve extensions to OpenAI's shapes (OpenAI clients ignore unknown fields): every choice carries
``token_ids`` (the ids of that chunk, or of the whole output), and the chunk or choice that finishes a
choice carries ``pdserve_timings`` (the router's queue/prefill/transfer/decode split, in seconds, and
``route``: its routing decision and why). A request may carry ``x-pdserve-ttft-slo-ms`` (its TTFT SLO for
SLO-aware admission: a request predicted to miss it is a 429 with Retry-After). ``GET
/v1/pdserve/advice`` is the planner's live advice (see :class:`AdvisorLike`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import __version__
from cluster.http.metrics import CONTENT_TYPE, Metrics
from cluster.http.openai_schema import (
    ApiError,
    Edge,
    Plan,
    as_api_error,
    detokenize_body,
    error_body,
    parse_body,
    plan_chat,
    plan_completion,
    tokenize_body,
)
from cluster.http.responses import ChoiceBuilder, envelope, sse_event, usage
from cluster.protocol import FinishReason, GenerateRequest, ModelInfo, RouterError, TokenDelta, WorkerStats
from cluster.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")
KEEPALIVE_S = 15.0  # an SSE comment while idle, so a vanished client is noticed on the next send
TTFT_SLO_HEADER = "x-pdserve-ttft-slo-ms"
MAX_TTFT_SLO_MS = 3_600_000.0


class RouterLike(Protocol):
    """The slice of ``cluster.router.router.Router`` the server uses (tests pass a stub)."""

    @property
    def model_info(self) -> ModelInfo: ...
    @property
    def mode(self) -> str: ...

    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]: ...
    async def abort(self, request_id: str) -> None: ...
    def is_healthy(self) -> bool: ...
    def worker_stats(self) -> list[WorkerStats]: ...


class AdvisorLike(Protocol):
    """Live advice (deploy/planner/advice.py ``Advisor``): the planner's recommended split for the recent
    traffic, computed off the event loop and cached. ``advice`` raises TimeoutError when a fresh answer
    is not ready within its bound (the computation goes on; a later call gets it)."""

    max_window_s: float

    async def advice(self, window_s: float | None = None) -> dict[str, Any]: ...
    def latest(self) -> dict[str, Any] | None: ...
    def refresh_soon(self) -> None: ...


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
        self.generated: list[int] = []  # tokens of each finished choice (vllm:request_max_num_...)
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
                    self.generated.append(num_tokens)
                    if not self.unfinished:
                        self.metrics.observe_group(self.generated)
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
        if not self.queue.empty():  # NOTE: the common case; skips the timeout's timer per delta
            return self.queue.get_nowait()
        try:
            async with asyncio.timeout(timeout):  # NOTE: not wait_for, which can swallow a cancel (3.11)
                return await self.queue.get()
        except TimeoutError:
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
                self.metrics.observe_abort(self.mode)
            try:
                await self.router.abort(request_id)
            except Exception:
                logger.exception("router.abort(%s) failed", request_id)


async def _until_disconnected(request: Request, work: asyncio.Future[Any] | asyncio.Task[Any]) -> Any:
    """Await ``work`` unless the client goes away first (then ApiError 499 and ``work`` is cancelled)."""

    async def watch() -> None:
        # NOTE: the body is read by now, so the next ASGI message is the disconnect, which the server
        # sends the moment the connection drops (a poll of is_disconnected() would notice a poll late).
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(watch())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise ApiError(499, "client disconnected", code="client_disconnected")
    finally:
        watcher.cancel()
        work.cancel()


async def _collect(fanout: _Fanout, plan: Plan, tokenizer: Tokenizer | None) -> dict[int, ChoiceBuilder]:
    choices = {i: ChoiceBuilder(plan.kind, tokenizer, plan.logprobs, plan.tool_calls) for i, _ in plan.jobs}
    remaining = len(choices)
    while remaining:
        index, event = await fanout.queue.get()
        if isinstance(event, BaseException):
            raise as_api_error(event)
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
    choices = {i: ChoiceBuilder(plan.kind, tokenizer, plan.logprobs, plan.tool_calls) for i, _ in plan.jobs}
    usage_field = {"usage": None} if plan.include_usage else {}
    if plan.kind == "chat":
        for i in choices:
            role = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield sse_event({**envelope(plan, chunk=True), "choices": [role], **usage_field})
    remaining = len(choices)
    item: tuple[int, TokenDelta | BaseException] | None = first
    while remaining:
        if item is None:
            yield b": keep-alive\n\n"
        else:
            index, event = item
            if isinstance(event, BaseException):
                error = as_api_error(event)
                metrics.observe_error(error.status, error.code)
                yield sse_event(error_body(error))
                break
            choice = choices[index].stream_choice(index, event)
            yield sse_event({**envelope(plan, chunk=True), "choices": [choice], **usage_field})
            remaining -= event.finish_reason is not None
        if remaining:
            item = await fanout.next(KEEPALIVE_S)
    if remaining == 0 and plan.include_usage:
        yield sse_event({**envelope(plan, chunk=True), "choices": [], "usage": usage(plan, choices)})
    yield b"data: [DONE]\n\n"


# ---- the app ----


@dataclass
class ServerState:
    """What the routes share (``app.state.pdserve``); built once by :func:`create_app`."""

    router: RouterLike
    edge: Edge
    metrics: Metrics
    expected_auth: bytes | None
    max_body_bytes: int
    # NOTE: validation, tokenization and chat templates run here, off the event loop, so a huge prompt
    # does not stall every other stream's tokens (the tokenizer releases the GIL while it works).
    pool: concurrent.futures.ThreadPoolExecutor
    scaler: Scaler | None = None
    # NOTE: one scale operation at a time; a second one while it runs is a 409, never queued.
    scaling: asyncio.Lock = field(default_factory=asyncio.Lock)
    advisor: AdvisorLike | None = None  # live advice (/v1/pdserve/advice, the advice gauges)

    def authorize(self, request: Request) -> None:
        if self.expected_auth is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, self.expected_auth):
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer <key>)")

    async def plan(self, request: Request, planner: Callable[[dict[str, Any], Edge], Plan]) -> Plan:
        return await self.run_on_pool(request, planner)

    async def run_on_pool(self, request: Request, handler: Callable[[dict[str, Any], Edge], T]) -> T:
        """Read the body (413 past the limit) and run ``handler(json, edge)`` on the edge's pool."""
        body = await read_body(request, self.max_body_bytes)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, lambda: handler(parse_body(body), self.edge))


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.pdserve
    return state


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The raw body; 413 past max_body_bytes, checked before anything is parsed."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise ApiError(400, f"invalid Content-Length {length[:40]!r}")
        if int(length) > max_body_bytes:
            raise ApiError(413, f"request body ({length} bytes) exceeds max_body_bytes ({max_body_bytes})")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body_bytes:  # NOTE: chunked bodies have no Content-Length to trust.
            raise ApiError(413, f"request body exceeds max_body_bytes ({max_body_bytes})")
    return bytes(body)


async def _run(state: ServerState, plan: Plan, request: Request, arrival: float) -> Response:
    fanout = _Fanout(state.router, state.metrics, plan, arrival)
    handed_off = False
    try:
        if plan.stream:
            # NOTE: wait for the first event before sending headers, so 429/503/504 raised before the
            # first token still get their HTTP status (and clients may retry them).
            first = await _until_disconnected(request, asyncio.ensure_future(fanout.queue.get()))
            if isinstance(first[1], BaseException):
                raise as_api_error(first[1])
            handed_off = True
            stream = _stream(plan, fanout, first, state.edge.tokenizer, state.metrics)
            return _ClosingStreamingResponse(stream, fanout)
        work = asyncio.ensure_future(_collect(fanout, plan, state.edge.tokenizer))
        choices = await _until_disconnected(request, work)
        response = {**envelope(plan, chunk=False), "choices": [c.full_choice(i) for i, c in choices.items()]}
        return JSONResponse({**response, "usage": usage(plan, choices)})
    finally:
        if not handed_off:
            with anyio.move_on_after(30, shield=True):
                await fanout.close()


routes = APIRouter()


def _ttft_slo_s(request: Request) -> float | None:
    """The request's TTFT SLO header in seconds (None when absent); 400 naming it when malformed."""
    raw = request.headers.get(TTFT_SLO_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_TTFT_SLO_MS:  # NOTE: also false for nan
        raise ApiError(
            400,
            f"{TTFT_SLO_HEADER} must be a number of milliseconds in (0, {MAX_TTFT_SLO_MS:.0f}], got {raw[:40]!r}",
            TTFT_SLO_HEADER,
        )
    return value / 1e3


async def _planned(
    state: ServerState, request: Request, planner: Callable[[dict[str, Any], Edge], Plan]
) -> Plan:
    slo_s = _ttft_slo_s(request)
    plan = await state.plan(request, planner)
    if slo_s is not None:
        for _, req in plan.jobs:
            req.ttft_slo_s = slo_s
    return plan


@routes.post("/v1/completions")
async def completions(request: Request) -> Response:
    arrival, state = time.perf_counter(), _state(request)
    state.authorize(request)
    return await _run(state, await _planned(state, request, plan_completion), request, arrival)


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    arrival, state = time.perf_counter(), _state(request)
    state.authorize(request)
    return await _run(state, await _planned(state, request, plan_chat), request, arrival)


def _model_card(edge: Edge) -> dict[str, Any]:
    info = edge.info
    return {
        "id": edge.names[0],
        "object": "model",
        "created": 0,
        "owned_by": "pdserve",
        "root": info.model_dir,
        "max_model_len": info.max_model_len,
        "vocab_size": info.vocab_size,
    }


@routes.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = _state(request)
    state.authorize(request)
    return {"object": "list", "data": [_model_card(state.edge)]}


@routes.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.authorize(request)
    if model_id not in state.edge.names:
        raise ApiError(404, f"model {model_id!r} does not exist; served: {state.edge.names[0]!r}", "model")
    return _model_card(state.edge)


@routes.get("/health")
async def health(request: Request) -> Response:
    healthy = _state(request).router.is_healthy()
    if healthy:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unhealthy"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


@routes.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@routes.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    """vLLM's /tokenize: ``prompt`` text, or chat ``messages`` rendered through the template."""
    state = _state(request)
    state.authorize(request)
    return await state.run_on_pool(request, tokenize_body)


@routes.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    """vLLM's /detokenize: token ids -> ``prompt`` text."""
    state = _state(request)
    state.authorize(request)
    return await state.run_on_pool(request, detokenize_body)


@routes.get("/metrics")
async def metrics_endpoint(request: Request) -> Response:
    state = _state(request)
    state.authorize(request)
    if state.advisor is not None:
        state.advisor.refresh_soon()  # NOTE: never waits; the advice gauges show the latest finished run
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


MAX_POOL_WORKERS = 256  # NOTE: an upper bound for one pool asked of the admin route (a typo guard)


class Scaler(Protocol):
    """Grows or shrinks a pool of a running cluster (``deploy.launch.ClusterHandle``); blocking."""

    @property
    def pools(self) -> list[str]: ...

    def scale(self, pool: str, num_workers: int) -> list[str]: ...


def parse_scale(body: dict[str, Any], pools: list[str]) -> tuple[str, int]:
    """``{"pool": ..., "num_workers": N}`` of the admin scale route; 400 naming the field otherwise."""
    unknown = sorted(set(body) - {"pool", "num_workers"})
    if unknown:
        raise ApiError(
            400, f"unknown field {unknown[0]!r}; the fields are 'pool' and 'num_workers'", unknown[0]
        )
    pool, num = body.get("pool"), body.get("num_workers")
    if pool not in pools:
        raise ApiError(400, f"pool must be one of {pools}, got {pool!r}", "pool")
    if type(num) is not int or not 0 <= num <= MAX_POOL_WORKERS:
        raise ApiError(
            400, f"num_workers must be an integer in [0, {MAX_POOL_WORKERS}], got {num!r}", "num_workers"
        )
    return pool, num


@routes.post("/v1/pdserve/scale")
async def scale(request: Request) -> dict[str, Any]:
    """Admin: grow or shrink a pool (``pdserve scale``); answers once the pool has its new size. Needs
    the API key when one is set; 409 while another scale runs."""
    state = _state(request)
    state.authorize(request)
    scaler = state.scaler
    if scaler is None:
        raise ApiError(
            404, "this server cannot scale its cluster (not started by pdserve serve)", code="not_found"
        )
    pool, num = parse_scale(parse_body(await read_body(request, state.max_body_bytes)), scaler.pools)
    if state.scaling.locked():
        raise ApiError(409, "another scale operation is running; retry when it is done", code="conflict")
    async with state.scaling:
        # NOTE: scale() blocks (it waits for admission and drains); the router's loop must stay free.
        workers = await asyncio.get_running_loop().run_in_executor(None, scaler.scale, pool, num)
    return {"pool": pool, "num_workers": len(workers), "workers": workers}


@routes.get("/v1/pdserve/advice")
async def advice(request: Request) -> Response:
    """The planner's recommended split for the traffic of the last ``window_s`` seconds (query
    parameter; default and limit: the router's ``advice_window_s``) and the SLO attainment it predicts."""
    state = _state(request)
    state.authorize(request)
    advisor = state.advisor
    if advisor is None:
        raise ApiError(
            404,
            "live advice needs a cost profile (router.cost_profile, or run `pdserve plan calibrate`)",
            code="advice_unavailable",
        )
    raw = request.query_params.get("window_s")
    window_s: float | None = None
    if raw is not None:
        try:
            window_s = float(raw)
        except ValueError:
            window_s = math.nan
        if not 0 < window_s <= advisor.max_window_s:
            raise ApiError(
                400,
                f"window_s must be in (0, {advisor.max_window_s:g}] seconds, got {raw[:40]!r}",
                "window_s",
            )
    try:
        return JSONResponse(await advisor.advice(window_s))
    except TimeoutError:
        raise ApiError(
            503, "the planner is still computing advice; retry shortly", code="advice_not_ready"
        ) from None


RETRY_AFTER_S = 1  # NOTE: 429 (queue full) and 503 (no healthy worker) are worth retrying soon


def _error_response(request: Request, e: ApiError) -> JSONResponse:
    _state(request).metrics.observe_error(e.status, e.code)
    retry_after = e.retry_after_s if e.retry_after_s is not None else RETRY_AFTER_S
    headers = {"Retry-After": str(retry_after)} if e.status in (429, 503) else None
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


async def _on_api_error(request: Request, e: Exception) -> JSONResponse:
    return _error_response(request, e if isinstance(e, ApiError) else as_api_error(e))


async def _on_validation_error(request: Request, e: Exception) -> JSONResponse:
    errors = e.errors()[:1] if isinstance(e, RequestValidationError) else str(e)
    return _error_response(request, ApiError(400, f"invalid request: {errors}"))


async def _on_http_error(request: Request, e: Exception) -> JSONResponse:
    status = e.status_code if isinstance(e, StarletteHTTPException) else 500
    detail = e.detail if isinstance(e, StarletteHTTPException) else str(e)
    return _error_response(request, ApiError(status, str(detail), code="http_error"))


async def _on_unexpected(request: Request, e: Exception) -> JSONResponse:
    """Any exception nothing else handled: a JSON 500 in OpenAI's shape, logged with its traceback."""
    logger.error("unhandled %s on %s %s", type(e).__name__, request.method, request.url.path, exc_info=e)
    return _error_response(
        request, ApiError(500, f"internal error: {type(e).__name__}", code="internal_error")
    )


def create_app(
    router: RouterLike,
    tokenizer: Tokenizer | None,
    *,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    served_model_name: str | None = None,
    default_timeout_s: float | None = None,
    max_timeout_s: float | None = None,
    num_tokenizer_threads: int = 2,
    structured_outputs: bool = False,
    metrics_compat: str = "none",
    scaler: Scaler | None = None,
    advisor: AdvisorLike | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over ``router``; ``app.state.pdserve`` is its :class:`ServerState`.

    tokenizer None serves token-id prompts only (text prompts and chat answer 400). default_timeout_s
    bounds requests without a ``timeout`` field (None leaves it to the router); max_timeout_s caps any.
    structured_outputs: the workers apply structured-output masks (else such requests are a 400).
    metrics_compat "vllm" also exports the ``vllm:*`` metric names. scaler: enables the admin route
    ``POST /v1/pdserve/scale`` (a cluster's handle). advisor: serves /v1/pdserve/advice and the advice
    gauges (None: that route answers 404).
    """
    info = router.model_info
    names = list(dict.fromkeys([served_model_name or info.name, info.name]))
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(
        router.worker_stats,
        getattr(router, "rejected_frames", None),
        model_name=names[0],
        mode=router.mode,
        compat=metrics_compat,
        route_decisions=getattr(router, "route_decisions", None),
        advice=advisor.latest if advisor is not None else None,
    )
    app.state.pdserve = ServerState(
        router=router,
        edge=Edge(info, tokenizer, names, default_timeout_s, max_timeout_s, structured_outputs),
        metrics=metrics,
        expected_auth=f"Bearer {api_key}".encode() if api_key is not None else None,
        max_body_bytes=max_body_bytes,
        pool=concurrent.futures.ThreadPoolExecutor(num_tokenizer_threads, thread_name_prefix="pdserve-edge"),
        scaler=scaler,
        advisor=advisor,
    )
    app.include_router(routes)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RouterError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
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

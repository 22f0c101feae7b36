"""OpenAI-compatible HTTP front of pdserve: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics.

Hosting choice: the router process hosts this ASGI app itself (FastAPI + uvicorn), not Ray Serve. The
router already owns the sockets to every worker and the per-request streams; serving HTTP from the same
process and event loop means one hop from worker to client and no extra replica, actor call or
object-store copy per token. Ray stays the lifecycle plane only (DESIGN.md: never per token).

The edge validates everything itself (400 naming the field and its limit, never FastAPI's 422; 413 for
an oversized body before it is parsed; 401 for a bad key) before any router call, so a rejected request
queues nothing (request bodies and their checks: ``cluster/http/schema.py``; planning:
``cluster/http/planning.py``). This package never imports torch or ray.

Routes are module-level functions over the ``ServerState`` that ``create_app`` builds
(``cluster/http/server_state.py``), one module per kind: ``completion_routes.py`` (generation, JSON or
SSE), ``model_routes.py`` (models, tokenize), ``admin_routes.py`` (health, version, metrics, scale,
advice). Any exception no handler knows becomes a JSON 500 in OpenAI's shape (logged with its
traceback). Hosting on a running cluster is the composition root's business: ``deploy/http_host.py``.

pdserve extensions to OpenAI's shapes (OpenAI clients ignore unknown fields): every choice carries
``token_ids`` (the ids of that chunk, or of the whole output), and the chunk or choice that finishes a
choice carries ``pdserve_timings`` (the router's queue/prefill/transfer/decode split, in seconds, and
``route``: its routing decision and why). A request may carry ``x-pdserve-ttft-slo-ms`` (its TTFT SLO for
SLO-aware admission: a request predicted to miss it is a 429 with Retry-After). ``GET
/v1/pdserve/advice`` is the planner's live advice (see ``AdvisorLike``).
"""

from __future__ import annotations

import concurrent.futures
import logging

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from cluster.config import ServerConfig
from cluster.http import admin_routes, completion_routes, model_routes
from cluster.http.auth import KeyRing
from cluster.http.connections import ConnectionLimits, bounded_protocol
from cluster.http.errors import RETRY_AFTER_S, ApiError, as_api_error, error_body
from cluster.http.metrics import Metrics
from cluster.http.planning import Edge
from cluster.http.quotas import TenantLimits, TenantQuotas
from cluster.http.server_state import AdvisorLike, RouterLike, Scaler, ServerState, StreamLimits, state_of
from cluster.http.tool_parsers import create_tool_parser
from cluster.protocol import RouterError
from cluster.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def _error_response(request: Request, e: ApiError) -> JSONResponse:
    state_of(request).metrics.observe_error(e.status, e.code)
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


class EdgeApp(FastAPI):
    """The edge's FastAPI app, with its generation routes (``POST /v1/completions`` and
    ``/v1/chat/completions``) dispatched here, ahead of Starlette's middleware stack and FastAPI's routing:
    the same handler and the same error answers (``_on_api_error``, ``_on_unexpected``), ~0.2 ms less of
    the loop per request. Every other request goes the framework's way."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = _FAST_ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except (ApiError, RouterError) as e:
            response = await _on_api_error(request, e)
        except Exception as e:  # noqa: BLE001 - logged with its traceback there, answered as a JSON 500
            response = await _on_unexpected(request, e)
        await response(scope, receive, send)


# NOTE: the generation routes as completion_routes declares them (path -> handler), POST only
_FAST_ROUTES = {
    route.path: route.endpoint
    for route in completion_routes.routes.routes
    if isinstance(route, APIRoute) and route.methods == {"POST"}
}


def create_app(
    router: RouterLike,
    tokenizer: Tokenizer | None,
    server: ServerConfig | None = None,
    *,
    max_timeout_s: float | None = None,
    default_timeout_s: float | None = None,
    structured_outputs: bool = False,
    num_tokenizer_threads: int = 2,
    scaler: Scaler | None = None,
    advisor: AdvisorLike | None = None,
    replica: int | None = None,
) -> EdgeApp:
    """The OpenAI-compatible app over ``router``, as ``server`` (the ``server:`` config; default
    ``ServerConfig()``) sets it up: its keys (``KeyRing.from_config``: ``api_key``, ``api_keys_file``, the
    admin key), tenant limits, body limit, served model name, metrics names, tool-call parser and stream
    bounds. ``app.state.pdserve`` is its :class:`ServerState`.

    tokenizer None serves token-id prompts only (text prompts and chat answer 400). default_timeout_s
    bounds requests without a ``timeout`` field (None leaves it to the router); max_timeout_s caps any (the
    router's ``request_timeout_s``). structured_outputs: the workers apply structured-output masks (else
    such requests are a 400). scaler: enables the admin route ``POST /v1/pdserve/scale`` (a cluster).
    advisor: serves /v1/pdserve/advice and the advice gauges (None: that route answers 404). ``replica``:
    this front-end replica's index, sent back on completions as the ``x-pdserve-replica`` header.
    """
    server = server or ServerConfig()
    parser = server.tool_call_parser if server.enable_auto_tool_choice else None
    if parser is not None:
        create_tool_parser(parser)  # NOTE: an unknown name fails here, not in every request
    info = router.model_info
    names = list(dict.fromkeys([server.served_model_name or info.name, info.name]))
    app = EdgeApp(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(
        router.worker_stats,
        router.rejected_frames,
        model_name=names[0],
        mode=router.mode,
        compat=server.metrics_compat,
        route_decisions=router.route_decisions,
        advice=advisor.latest if advisor is not None else None,
    )
    app.state.pdserve = ServerState(
        router=router,
        edge=Edge(info, tokenizer, names, default_timeout_s, max_timeout_s, structured_outputs, parser),
        metrics=metrics,
        keys=KeyRing.from_config(server),
        quotas=TenantQuotas(TenantLimits(server.max_requests_per_key, server.max_tokens_per_key)),
        max_body_bytes=server.max_body_bytes,
        pool=concurrent.futures.ThreadPoolExecutor(num_tokenizer_threads, thread_name_prefix="pdserve-edge"),
        scaler=scaler,
        advisor=advisor,
        stream_limits=StreamLimits(server.stream_buffer_bytes, server.stream_stall_timeout_s),
        replica=replica,
    )
    app.include_router(completion_routes.routes)
    app.include_router(model_routes.routes)
    app.include_router(admin_routes.routes)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RouterError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
    return app


def create_server(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    limits: ConnectionLimits | None = None,
    access_log: bool | None = None,
) -> uvicorn.Server:
    """A uvicorn server for ``app``; ``await server.serve()`` runs it inside an existing event loop.
    ``limits``: head / body / keep-alive timeouts and the connection cap (``cluster/http/connections.py``;
    default :class:`ConnectionLimits`). ``access_log``: uvicorn's line per request (None: only while the
    root logger takes DEBUG, as ``deploy/logs.py`` configures it; a line costs ~40 us of the loop)."""
    if access_log is None:
        access_log = logging.getLogger().isEnabledFor(logging.DEBUG)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=5,
        http=bounded_protocol(limits or ConnectionLimits()),
    )
    return uvicorn.Server(config)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve ``app`` until interrupted (blocks; uvicorn owns the event loop)."""
    create_server(app, host, port).run()

"""The routes for whoever runs the server: GET /health, /version and /metrics, and pdserve's admin routes
POST /v1/pdserve/scale (grow or shrink a pool) and GET /v1/pdserve/advice (the planner's live advice).

The admin routes take the admin key only (``server.admin_key``), never an inference key; a server
without one answers them 404 (they are off). /metrics takes the inference key, like the API."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cluster import __version__
from cluster.http.errors import RETRY_AFTER_S, ApiError
from cluster.http.json_body import parse_body, read_body
from cluster.http.metrics import CONTENT_TYPE
from cluster.http.server_state import state_of

MAX_POOL_WORKERS = 256  # NOTE: an upper bound for one pool asked of the admin route (a typo guard)

routes = APIRouter()


@routes.get("/health")
async def health(request: Request) -> Response:
    healthy = state_of(request).router.is_healthy()
    if healthy:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unhealthy"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


@routes.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@routes.get("/metrics")
async def metrics_endpoint(request: Request) -> Response:
    state = state_of(request)
    state.authorize(request)
    if state.advisor is not None:
        state.advisor.refresh_soon()  # NOTE: never waits; the advice gauges show the latest finished run
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


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
    the admin key (404 when the server has none); 409 while another scale runs."""
    state = state_of(request)
    state.authorize_admin(request)
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
    parameter; default and limit: the router's ``advice_window_s``) and the SLO attainment it predicts.
    Needs the admin key (it describes every tenant's traffic); 404 when the server has none."""
    state = state_of(request)
    state.authorize_admin(request)
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

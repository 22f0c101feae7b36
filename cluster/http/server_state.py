"""What the HTTP edge's routes share: :class:`ServerState` (``app.state.pdserve``) and the protocols of
what it holds: the router (:class:`RouterLike`), the live advisor (:class:`AdvisorLike`) and the cluster's
scaler (:class:`Scaler`). Tests pass stubs for all three."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import Request

from cluster.http.errors import ApiError
from cluster.http.json_body import parse_body, read_body
from cluster.http.metrics import Metrics
from cluster.http.planning import Edge, Plan
from cluster.protocol import GenerateRequest, ModelInfo, TokenDelta, WorkerStats

T = TypeVar("T")


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


class Scaler(Protocol):
    """Grows or shrinks a pool of a running cluster (``deploy.launch.ClusterHandle``); blocking."""

    @property
    def pools(self) -> list[str]: ...

    def scale(self, pool: str, num_workers: int) -> list[str]: ...


@dataclass
class ServerState:
    """What the routes share (``app.state.pdserve``); built once by ``cluster.http.app.create_app``."""

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


def state_of(request: Request) -> ServerState:
    """The :class:`ServerState` of the app serving ``request``."""
    state: ServerState = request.app.state.pdserve
    return state

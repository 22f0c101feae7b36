"""What the HTTP edge's routes share: :class:`ServerState` (``app.state.pdserve``) and the protocols of
what it holds: the router (:class:`RouterLike`), the live advisor (:class:`AdvisorLike`) and the cluster's
scaler (:class:`Scaler`). Tests pass stubs for all three. :class:`DueAnswers` batches the answers that got
output in one turn of the loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import Request

from cluster.http.auth import KeyRing
from cluster.http.json_body import parse_body, read_body
from cluster.http.metrics import Metrics
from cluster.http.planning import Edge, Plan
from cluster.http.quotas import Lease, TenantQuotas
from cluster.protocol import GenerateRequest, ModelInfo, WorkerStats
from cluster.router.stream import OutputListener, RequestStream

T = TypeVar("T")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamLimits:
    """How much of one answer the edge holds for its client and how long it waits on it (ServerConfig's
    ``stream_buffer_bytes`` and ``stream_stall_timeout_s``)."""

    buffer_bytes: int = 1 << 20
    stall_timeout_s: float = 30.0


class RouterLike(Protocol):
    """The edge's whole contract with the router (``cluster.router.router.Router``; tests pass stubs)."""

    @property
    def model_info(self) -> ModelInfo: ...
    @property
    def mode(self) -> str: ...

    def open(
        self,
        req: GenerateRequest,
        listener: OutputListener | None = None,
        *,
        max_unread_bytes: int | None = None,
        unread_elsewhere: Callable[[], int] | None = None,
    ) -> RequestStream:
        """Send ``req``; its output arrives in the returned stream, told to ``listener``; RouterError
        before anything is queued (``Router.open``)."""

    def is_healthy(self) -> bool: ...
    def worker_stats(self) -> list[WorkerStats]: ...
    def rejected_frames(self) -> dict[str, int]: ...
    def route_decisions(self) -> dict[tuple[str, str], int]: ...


class _Flushable(Protocol):
    def flush(self) -> None: ...


class DueAnswers:
    """The answers of one server (one event loop) that got output in this turn of the loop: one callback
    flushes them all once the turn's frames are handled, not one per answer per step
    (``cluster/http/answer.py``)."""

    def __init__(self) -> None:
        self._due: list[_Flushable] = []

    def add(self, answer: _Flushable) -> None:
        if not self._due:
            asyncio.get_running_loop().call_soon(self._flush)
        self._due.append(answer)

    def _flush(self) -> None:
        due, self._due = self._due, []
        for answer in due:
            try:
                answer.flush()
            except Exception:  # NOTE: one broken answer must not keep the others' output back
                logger.exception("writing an answer's output failed")


class AdvisorLike(Protocol):
    """Live advice (deploy/planner/advice.py ``Advisor``): the planner's recommended split for the recent
    traffic, computed off the event loop and cached. ``advice`` raises TimeoutError when a fresh answer
    is not ready within its bound (the computation goes on; a later call gets it)."""

    max_window_s: float

    async def advice(self, window_s: float | None = None) -> dict[str, Any]: ...
    def latest(self) -> dict[str, Any] | None: ...
    def refresh_soon(self) -> None: ...


class Scaler(Protocol):
    """Grows or shrinks a pool of a running cluster (``deploy.launch.Cluster``); blocking."""

    @property
    def pools(self) -> list[str]: ...

    def scale(self, pool: str, num_workers: int) -> list[str]: ...


REPLICA_HEADER = "x-pdserve-replica"


@dataclass
class ServerState:
    """What the routes share (``app.state.pdserve``); built once by ``cluster.http.app.create_app``."""

    router: RouterLike
    edge: Edge
    metrics: Metrics
    keys: KeyRing
    quotas: TenantQuotas  # NOTE: per tenant (API key, or client address without keys) fairness
    max_body_bytes: int
    # NOTE: validation, tokenization and chat templates run here, off the event loop, so a huge prompt
    # does not stall every other stream's tokens (the tokenizer releases the GIL while it works).
    pool: concurrent.futures.ThreadPoolExecutor
    scaler: Scaler | None = None
    # NOTE: one scale operation at a time; a second one while it runs is a 409, never queued.
    scaling: asyncio.Lock = field(default_factory=asyncio.Lock)
    advisor: AdvisorLike | None = None  # live advice (/v1/pdserve/advice, the advice gauges)
    stream_limits: StreamLimits = field(default_factory=StreamLimits)  # a stream's buffer and stall bounds
    due_answers: DueAnswers = field(default_factory=DueAnswers)  # the answers with output this turn
    # NOTE: a body past large_body_bytes is parsed and tokenized on its own one-thread lane, so huge
    # prompts queue behind each other, never in front of a small request (issue 31 row 8).
    large_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pdserve-edge-large"
        )
    )
    large_body_bytes: int = 16 << 10
    # front-end replicas: this one's index, sent back as the x-pdserve-replica header (None: no header)
    replica: int | None = None

    @property
    def replica_headers(self) -> dict[str, str]:
        return {} if self.replica is None else {REPLICA_HEADER: str(self.replica)}

    def authorize(self, request: Request) -> str:
        """The tenant the request counts against (its key's name, or its client address when the server
        has no keys); ApiError 401 for a missing or unknown key."""
        client = request.client.host if request.client is not None else None
        return self.keys.tenant(request.headers.get("authorization", ""), client)

    def authorize_admin(self, request: Request) -> None:
        """The admin routes (/v1/pdserve/*): 404 when off (no admin key), 401 / 403 otherwise."""
        self.keys.check_admin(request.headers.get("authorization", ""))

    def admit(self, tenant: str, plan: Plan) -> Lease:
        """Count ``plan`` against ``tenant``'s limits (429 / 400 when over); the caller must release the
        lease once the answer is done or abandoned."""
        tokens = sum(len(req.prompt_token_ids) + req.params.max_tokens for _, req in plan.jobs)
        return self.quotas.acquire(tenant, len(plan.jobs), tokens)

    async def plan(
        self,
        request: Request,
        planner: Callable[[dict[str, Any], Edge], Plan],
        on_loop: Callable[[dict[str, Any]], bool] | None = None,
    ) -> Plan:
        """Read the body and plan it (``run_on_pool``); a body of at most large_body_bytes for which
        ``on_loop(json)`` says planning needs no tokenizer is planned here on the loop (cheaper than the
        hop to the pool, and nothing in it can take long)."""
        if on_loop is None:
            return await self.run_on_pool(request, planner)
        body = await read_body(request, self.max_body_bytes)
        if len(body) > self.large_body_bytes:
            return await self._on_pool(self.large_pool, lambda: planner(parse_body(body), self.edge))
        raw = parse_body(body)
        if on_loop(raw):
            return planner(raw, self.edge)
        return await self._on_pool(self.pool, lambda: planner(raw, self.edge))

    async def run_on_pool(self, request: Request, handler: Callable[[dict[str, Any], Edge], T]) -> T:
        """Read the body (413 past the limit) and run ``handler(json, edge)`` on the edge's pool (a body
        past large_body_bytes: on the large lane)."""
        body = await read_body(request, self.max_body_bytes)
        pool = self.pool if len(body) <= self.large_body_bytes else self.large_pool
        return await self._on_pool(pool, lambda: handler(parse_body(body), self.edge))

    async def _on_pool(self, pool: concurrent.futures.ThreadPoolExecutor, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, work)


def state_of(request: Request) -> ServerState:
    """The :class:`ServerState` of the app serving ``request``."""
    state: ServerState = request.app.state.pdserve
    return state

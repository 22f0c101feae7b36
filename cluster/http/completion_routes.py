"""The generation routes: POST /v1/completions and /v1/chat/completions.

Each validates and plans its body (``ServerState.plan``), counts it against its tenant's limits
(``cluster/http/quotas.py``: 429 naming the limit), runs the plan as an :class:`Answer`
(``cluster/http/answer.py``) and answers one JSON body or an SSE stream (``cluster/http/streaming.py``). A request may
carry ``x-pdserve-ttft-slo-ms`` (its TTFT SLO for SLO-aware admission: a request predicted to miss it is a
429 with Retry-After).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from cluster.http.answer import Answer
from cluster.http.connections import ConnectionLost, writer_for
from cluster.http.errors import ApiError
from cluster.http.planning import Edge, Plan, completion_plans_on_loop, plan_chat, plan_completion
from cluster.http.quotas import Lease
from cluster.http.responses import envelope, response_prompt_logprobs, usage
from cluster.http.server_state import ServerState, state_of
from cluster.http.streaming import SseResponse

TTFT_SLO_HEADER = "x-pdserve-ttft-slo-ms"
MAX_TTFT_SLO_MS = 3_600_000.0

T = TypeVar("T")

routes = APIRouter()


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client goes away first (then ApiError 499 and ``work`` is cancelled)."""
    try:
        return await writer_for(request.scope, request.receive).run(work)
    except ConnectionLost:
        raise ApiError(499, "client disconnected", code="client_disconnected") from None


class _LeasedResponse(Response):
    """Delegates to ``inner`` (a streamed answer) and releases the tenant's ``lease`` once it has ended,
    however it ends (the inner response closes its answer, aborting what did not finish, first). A
    stream written whole gave it back already, before its end reached the client (``on_complete``).

    NOTE: not ``background=``: Starlette skips a response's background task when the stream fails.
    """

    def __init__(self, inner: Response, lease: Lease) -> None:
        # NOTE: no super().__init__: this response renders nothing itself; ``inner`` does.
        self.inner, self.lease = inner, lease
        self.status_code, self.background = inner.status_code, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self.lease.release()


async def _run(state: ServerState, plan: Plan, request: Request, arrival: float, lease: Lease) -> Response:
    """Run ``plan`` and answer it; ``lease`` (the tenant's quota) is released once the answer ends."""
    handed_off = False
    answer: Answer | None = None
    try:
        answer = Answer(
            state.router,
            state.metrics,
            plan,
            arrival,
            due=state.due_answers,
            limits=state.stream_limits,
            tokenizer=state.edge.tokenizer,
        )
        if plan.stream:
            # NOTE: wait for the first output before sending headers, so 429/503/504 raised before the
            # first token still get their HTTP status (and clients may retry them).
            await _until_disconnected(request, answer.first_output())
            handed_off = True
            return _LeasedResponse(
                SseResponse(answer, state.replica_headers, on_complete=lease.release), lease
            )
        choices = await _until_disconnected(request, answer.collect())
        response = {**envelope(plan, chunk=False), "choices": [c.full_choice(i) for i, c in choices.items()]}
        return JSONResponse(
            {**response, "usage": usage(plan, choices), **response_prompt_logprobs(plan, choices)},
            headers=state.replica_headers,
        )
    finally:
        if not handed_off:
            if answer is not None:
                answer.close()
            lease.release()


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


async def _serve(
    request: Request,
    planner: Callable[[dict[str, Any], Edge], Plan],
    on_loop: Callable[[dict[str, Any]], bool] | None = None,
) -> Response:
    arrival, state = time.perf_counter(), state_of(request)
    tenant = state.authorize(request)
    slo_s = _ttft_slo_s(request)
    state.quotas.check_room(tenant)  # NOTE: a tenant already at its limit is refused before planning
    plan = await state.plan(request, planner, on_loop)
    if slo_s is not None:
        for _, req in plan.jobs:
            req.ttft_slo_s = slo_s
    return await _run(state, plan, request, arrival, state.admit(tenant, plan))


@routes.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, plan_completion, completion_plans_on_loop)


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, plan_chat)

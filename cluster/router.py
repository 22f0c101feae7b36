"""Router: picks workers, drives prefill -> handoff -> decode, re-yields tokens, aborts, deadlines.

Runs on one asyncio loop in the router process (which also hosts the HTTP server). Hot messages go over
ZMQ with msgpack: one PUSH socket per worker for requests, one PULL socket for everything coming back.
Ray is used only for lifecycle: the health task polls each actor's ``stats()`` (a snapshot, cheap) and
treats an actor that errors or stays silent past ``health_timeout_s`` as dead: its requests fail with
WorkerFailedError at once and nothing new is routed to it.

Modes: ``disaggregated`` (prefill pool, then a decode pool), ``colocated`` (one pool does both),
``conditional`` (prompts up to ``conditional_max_prompt_tokens`` go straight to a decode worker, the rest
are disaggregated).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from cluster.config import RouterConfig
from cluster.protocol import (
    ClusterUnavailableError,
    DeadlineExceededError,
    GenerateRequest,
    InvalidRequestError,
    ModelInfo,
    QueueFullError,
    RequestAbortedError,
    RequestTimings,
    RouterError,
    TokenDelta,
    WorkerFailedError,
    WorkerStats,
    pack,
    to_dict,
    token_delta_from_dict,
    unpack,
)
from workers.prefix_cache import hash_block

logger = logging.getLogger(__name__)


@dataclass
class WorkerRef:
    """The router's view of one worker."""

    worker_id: str
    pool: str
    actor: Any  # Ray actor handle (anything with .stats.remote())
    request_endpoint: str
    block_size: int
    rank: int | None = None  # torch.distributed rank (None: not in the KV-transfer world)
    socket: zmq.asyncio.Socket | None = None
    healthy: bool = True
    stats: WorkerStats | None = None
    last_seen: float = field(default_factory=time.monotonic)
    num_assigned: int = 0  # requests the router routed here that are not over
    num_prompt_tokens: int = 0  # outstanding prompt tokens routed here (prefill load)


@dataclass
class _Flight:
    """One request in flight through the router."""

    req: GenerateRequest
    arrival: float
    events: asyncio.Queue[tuple[str, dict[str, Any]]] = field(default_factory=asyncio.Queue)
    prefill: WorkerRef | None = None
    decode: WorkerRef | None = None
    scheduled_time: float | None = None
    first_token_time: float | None = None
    transfer_s: float = 0.0
    done: bool = False


class Router:
    def __init__(self, config: RouterConfig, workers: list[WorkerRef], model_info: ModelInfo) -> None:
        self.config = config
        self.mode = config.mode
        self.model_info = model_info
        self.workers = workers
        self._flights: dict[str, _Flight] = {}
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind("tcp://127.0.0.1:*")
        self.endpoint: str = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        for w in workers:
            w.socket = self._ctx.socket(zmq.PUSH)
            w.socket.setsockopt(zmq.LINGER, 0)
            w.socket.connect(w.request_endpoint)
        self._tasks: list[asyncio.Task[None]] = []

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._health_loop())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for w in self.workers:
            if w.socket is not None:
                w.socket.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()

    def is_healthy(self) -> bool:
        pools = {w.pool for w in self.workers if w.healthy}
        if self.mode == "colocated":
            return "colocated" in pools
        return {"prefill", "decode"} <= pools

    def placement(self, request_id: str) -> tuple[str | None, str | None]:
        """(prefill worker id, decode worker id) of a request in flight; (None, None) if unknown."""
        f = self._flights.get(request_id)
        if f is None:
            return None, None
        return (f.prefill.worker_id if f.prefill else None, f.decode.worker_id if f.decode else None)

    def worker_stats(self) -> list[WorkerStats]:
        return [
            w.stats if w.stats is not None else WorkerStats(w.worker_id, w.pool, healthy=w.healthy)
            for w in self.workers
        ]

    # ---- the request path -----------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Yield the request's token deltas; the last has finish_reason and timings. Raises RouterError.
        If the caller stops iterating early (disconnect), the request is aborted everywhere."""
        if len(self._flights) >= self.config.max_pending_requests:
            raise QueueFullError(f"{len(self._flights)} requests in flight (max_pending_requests)")
        if req.request_id in self._flights:
            raise InvalidRequestError(f"request_id {req.request_id!r} is already in flight")
        flight = _Flight(req, time.time())
        deadline = (
            req.deadline if req.deadline is not None else flight.arrival + self.config.request_timeout_s
        )
        self._flights[req.request_id] = flight
        try:
            self._dispatch(flight, deadline)
            while True:
                kind, msg = await self._next_event(flight, deadline)
                if kind == "error":
                    raise _error_for(msg)
                if kind == "transferred":
                    flight.transfer_s = float(msg["seconds"])
                    continue
                delta = token_delta_from_dict(msg["delta"])
                if flight.first_token_time is None:
                    flight.first_token_time = time.time()
                    flight.scheduled_time = delta.scheduled_time
                if kind == "prefilled":
                    self._hand_off(flight, msg, delta, deadline)
                if delta.finish_reason is not None:
                    flight.done = True
                    delta.timings = self._timings(flight)
                    yield delta
                    return
                yield delta
        finally:
            self._settle(flight)

    def _dispatch(self, flight: _Flight, deadline: float) -> None:
        req = flight.req
        base = {
            "rid": req.request_id,
            "prompt": req.prompt_token_ids,
            "params": to_dict(req.params),
            "deadline": deadline,
        }
        if self.mode == "colocated":
            w = self._pick_least_loaded("colocated")
            self._assign(flight, w, "decode", len(req.prompt_token_ids))
            self._send(w, {"op": "generate", **base, "hold": False})
        elif (
            self.mode == "conditional"
            and len(req.prompt_token_ids) <= self.config.conditional_max_prompt_tokens
        ):
            w = self._pick_decode()
            self._assign(flight, w, "decode", len(req.prompt_token_ids))
            self._send(w, {"op": "generate", **base, "hold": False})
        else:
            w = self._pick_prefill(req.prompt_token_ids)
            self._assign(flight, w, "prefill", len(req.prompt_token_ids))
            self._send(w, {"op": "generate", **base, "hold": True})

    def _hand_off(self, flight: _Flight, msg: dict[str, Any], delta: TokenDelta, deadline: float) -> None:
        """Prefill sampled the first token (already on its way to the caller): start the decode side."""
        req = flight.req
        if flight.prefill is not None:
            flight.prefill.num_prompt_tokens -= len(req.prompt_token_ids)
        try:
            w = self._pick_decode()
        except ClusterUnavailableError:
            self._send_abort(flight)
            raise
        self._assign(flight, w, "decode", 0)
        self._send(
            w,
            {
                "op": "decode",
                "rid": req.request_id,
                "prompt": req.prompt_token_ids,
                "first_token": delta.token_ids[0],
                "params": to_dict(req.params),
                "handoff": msg["handoff"],
                "deadline": deadline,
            },
        )

    async def _next_event(self, flight: _Flight, deadline: float) -> tuple[str, dict[str, Any]]:
        left = deadline - time.time()
        if left <= 0:
            raise DeadlineExceededError(f"request {flight.req.request_id!r} passed its deadline")
        try:
            return await asyncio.wait_for(flight.events.get(), timeout=left)
        except asyncio.TimeoutError:
            raise DeadlineExceededError(f"request {flight.req.request_id!r} passed its deadline") from None

    def _settle(self, flight: _Flight) -> None:
        """Request over (finished, failed, cancelled): release router counters; abort if unfinished."""
        if not flight.done:
            self._send_abort(flight)
        for w in (flight.prefill, flight.decode):
            if w is not None:
                w.num_assigned -= 1
        if flight.prefill is not None and flight.first_token_time is None:
            flight.prefill.num_prompt_tokens -= len(flight.req.prompt_token_ids)
        self._flights.pop(flight.req.request_id, None)

    async def abort(self, request_id: str) -> None:
        """Idempotent: every worker holding the request frees it; a generate() still being iterated
        for it raises RequestAbortedError."""
        flight = self._flights.get(request_id)
        if flight is not None:
            self._send_abort(flight)
            flight.events.put_nowait(("error", {"status": 499, "message": "aborted", "aborted": True}))

    def _send_abort(self, flight: _Flight) -> None:
        for w in (flight.prefill, flight.decode):
            if w is not None and w.healthy:
                self._send(w, {"op": "abort", "rid": flight.req.request_id})

    def _timings(self, f: _Flight) -> RequestTimings:
        now = time.time()
        first = f.first_token_time or now
        sched = f.scheduled_time or f.arrival
        return RequestTimings(
            queue_s=max(0.0, sched - f.arrival),
            prefill_s=max(0.0, first - sched),
            transfer_s=f.transfer_s,
            decode_s=now - first,
            ttft_s=first - f.arrival,
            e2e_s=now - f.arrival,
        )

    # ---- choosing workers -----------------------------------------------------------------------------
    def _healthy(self, pool: str) -> list[WorkerRef]:
        ws = [w for w in self.workers if w.pool == pool and w.healthy]
        if not ws:
            raise ClusterUnavailableError(f"no healthy {pool} worker")
        return ws

    def _pick_least_loaded(self, pool: str) -> WorkerRef:
        return min(self._healthy(pool), key=lambda w: (w.num_assigned, w.worker_id))

    def _pick_prefill(self, prompt: list[int]) -> WorkerRef:
        """Prefix affinity on the prompt's first block (rendezvous hashing), unless that worker has
        ``affinity_slack_tokens`` more outstanding prompt tokens than the least loaded one."""
        ws = self._healthy("prefill")
        least = min(ws, key=lambda w: (w.num_prompt_tokens, w.num_assigned, w.worker_id))
        bs = ws[0].block_size
        if len(prompt) < bs:
            return least
        key = hash_block(b"", prompt[:bs])
        preferred = max(ws, key=lambda w: hashlib.blake2b(key + w.worker_id.encode(), digest_size=8).digest())
        if preferred.num_prompt_tokens - least.num_prompt_tokens > self.config.affinity_slack_tokens:
            return least
        return preferred

    def _pick_decode(self) -> WorkerRef:
        """Fewest requests routed there, then the most free KV blocks in its last stats."""

        def score(w: WorkerRef) -> tuple[int, int, str]:
            free = w.stats.num_free_blocks if w.stats is not None else 0
            return (w.num_assigned, -free, w.worker_id)

        return min(self._healthy("decode"), key=score)

    def _assign(self, flight: _Flight, w: WorkerRef, role: str, prompt_tokens: int) -> None:
        if role == "prefill":
            flight.prefill = w
        else:
            flight.decode = w
        w.num_assigned += 1
        w.num_prompt_tokens += prompt_tokens if role == "prefill" else 0

    def _send(self, w: WorkerRef, message: dict[str, Any]) -> None:
        assert w.socket is not None
        # NOTE: PUSH with a connected peer queues without blocking (up to the HWM); never awaits here.
        w.socket.send(pack(message), flags=zmq.NOBLOCK)

    # ---- background tasks -----------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        while True:
            try:
                msg = unpack(await self._pull.recv())
            except ValueError:
                logger.exception("router: dropped a malformed message")
                continue
            kind = msg.get("kind", "")
            rid = msg["delta"]["request_id"] if "delta" in msg else msg.get("rid")
            flight = self._flights.get(rid) if rid is not None else None
            if flight is None:
                if kind == "prefilled":
                    # NOTE: the caller went away while prefill ran; make the prefill side let go.
                    self._abort_at(msg.get("worker"), rid)
                continue
            flight.events.put_nowait((kind, msg))

    def _abort_at(self, worker_id: str | None, rid: str | None) -> None:
        for w in self.workers:
            if w.worker_id == worker_id and w.healthy and rid is not None:
                self._send(w, {"op": "abort", "rid": rid})

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(w) for w in self.workers if w.healthy))
            await asyncio.sleep(self.config.health_interval_s)

    async def _poll(self, w: WorkerRef) -> None:
        try:
            stats = await asyncio.wait_for(w.actor.stats.remote(), self.config.health_timeout_s)
            w.stats = WorkerStats(**stats)
            w.last_seen = time.monotonic()
            if not w.stats.healthy:
                self._mark_dead(w, "its step loop died")
        except asyncio.TimeoutError:
            if time.monotonic() - w.last_seen > self.config.health_timeout_s:
                self._mark_dead(w, f"no stats within {self.config.health_timeout_s} s")
        except Exception as e:  # noqa: BLE001 - RayActorError and friends: the actor is gone
            self._mark_dead(w, f"{type(e).__name__}: {e}")

    def _mark_dead(self, w: WorkerRef, why: str) -> None:
        if not w.healthy:
            return
        logger.error("router: worker %s is dead (%s)", w.worker_id, why)
        w.healthy = False
        if w.rank is not None:
            # NOTE: peers stop waiting on the dead rank at once instead of sitting out transfer timeouts
            # with other workers' transfers queued behind.
            for peer in self.workers:
                if peer.healthy and peer.rank is not None:
                    self._send(peer, {"op": "peer_dead", "rank": w.rank})
        for flight in list(self._flights.values()):
            # NOTE: a request already handed to a decode worker no longer needs its prefill worker once
            # the KV landed; a transfer still in flight fails on the decode side (policy fail/recompute).
            depends = flight.decode is w or (flight.prefill is w and flight.decode is None)
            if depends and not flight.done:
                flight.events.put_nowait(
                    (
                        "error",
                        {
                            "status": 500,
                            "message": f"worker {w.worker_id} failed: {why}",
                            "worker_failed": True,
                        },
                    )
                )


def _error_for(msg: dict[str, Any]) -> RouterError:
    status = int(msg.get("status", 500))
    text = str(msg.get("message", "error"))
    if msg.get("aborted"):
        return RequestAbortedError(text)
    if status == 400:
        return InvalidRequestError(text)
    if status == 504:
        return DeadlineExceededError(text)
    return WorkerFailedError(text)

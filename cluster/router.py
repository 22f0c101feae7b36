"""Router: picks workers, drives prefill -> handoff -> decode, re-yields tokens, aborts, deadlines, health.

Runs on one asyncio loop in the router process (which also hosts the HTTP server). Hot messages are the
typed, authenticated frames of cluster/wire.py over ZMQ: one PUSH socket per worker for ops, one PULL
socket for every event coming back. A bad frame is counted and dropped; no frame can end a task.

Worker states (``WorkerRef.state``):
  healthy    its step thread's heartbeat is fresh and says every thread is alive: routable;
  unhealthy  its heartbeat is stale (stopped, stuck) or it reported a dead thread: not routed to; its
             requests keep waiting (bounded by their deadlines) and a fresh heartbeat makes it healthy;
  dead       it said so (``WorkerFailed``) or Ray says the actor is gone: its requests fail at once with
             WorkerFailedError and its transfer peers stop waiting on it.
Ray is the lifecycle plane only: one watcher per worker pings the actor to learn that it died.

Modes: ``disaggregated`` (prefill pool, then a decode pool), ``colocated`` (one pool does both),
``conditional`` (prompts up to ``conditional_max_prompt_tokens`` go straight to a decode worker, the rest
are disaggregated). Placement policy: cluster/placement.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import zmq
import zmq.asyncio

from cluster.config import RouterConfig
from cluster.placement import pick_decode, pick_least_loaded, pick_prefill
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
    router_error,
)
from cluster.wire import (
    EVENTS,
    ROUTER_ID,
    Abort,
    DecodeHandoff,
    Delta,
    Generate,
    Heartbeat,
    PeerDead,
    Prefilled,
    RequestFailed,
    Transferred,
    WireDecoder,
    WireEncoder,
    WorkerFailed,
)

logger = logging.getLogger(__name__)


class WorkerState(str, enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DEAD = "dead"


@dataclass
class WorkerRef:
    """The router's view of one worker."""

    worker_id: str
    pool: str
    actor: Any  # Ray actor handle (anything with .ping.remote()); None: no lifecycle watch
    request_endpoint: str
    block_size: int
    rank: int | None = None  # torch.distributed rank (None: not in the KV-transfer world)
    socket: zmq.asyncio.Socket | None = None
    state: WorkerState = WorkerState.HEALTHY
    why: str = ""  # why it is not healthy
    stats: WorkerStats | None = None
    last_beat: float = field(default_factory=time.monotonic)
    num_assigned: int = 0  # requests the router routed here that are not over
    num_prompt_tokens: int = 0  # outstanding prompt tokens routed here (prefill load)

    @property
    def healthy(self) -> bool:
        return self.state == WorkerState.HEALTHY


FlightEvent = Delta | Prefilled | Transferred | RouterError


@dataclass
class _Flight:
    """One request in flight through the router."""

    req: GenerateRequest
    arrival: float
    events: asyncio.Queue[FlightEvent] = field(default_factory=asyncio.Queue)
    prefill: WorkerRef | None = None
    decode: WorkerRef | None = None
    scheduled_time: float | None = None
    first_token_time: float | None = None
    transfer_s: float = 0.0
    done: bool = False


class Router:
    """See the module docstring. ``secret`` authenticates every control frame (cluster/frames.py)."""

    def __init__(
        self,
        config: RouterConfig,
        workers: list[WorkerRef],
        model_info: ModelInfo,
        secret: bytes,
        *,
        bind_host: str = "127.0.0.1",
    ) -> None:
        self.config = config
        self.mode = config.mode
        self.model_info = model_info
        self.workers = workers
        self._by_id = {w.worker_id: w for w in workers}
        self._flights: dict[str, _Flight] = {}
        self._encoder = WireEncoder(secret)
        self.decoder = WireDecoder(secret, ROUTER_ID, EVENTS)
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(f"tcp://{bind_host}:*")
        self.endpoint: str = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        for w in workers:
            w.socket = self._ctx.socket(zmq.PUSH)
            w.socket.setsockopt(zmq.LINGER, 0)
            w.socket.connect(w.request_endpoint)
        self._loops: list[asyncio.Task[None]] = []
        self._tasks: list[asyncio.Task[None]] = []

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            w.last_beat = now
        # NOTE: these two run until close(); a lifecycle watch ends when its worker is dead.
        self._loops = [
            asyncio.create_task(self._receive_loop(), name="router-receive"),
            asyncio.create_task(self._heartbeat_monitor(), name="router-heartbeats"),
        ]
        self._tasks = [
            *self._loops,
            *(
                asyncio.create_task(self._lifecycle_watch(w), name=f"router-watch-{w.worker_id}")
                for w in self.workers
                if w.actor is not None
            ),
        ]

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

    def dead_tasks(self) -> list[str]:
        """The router's own loops that ended (each should run until close)."""
        return [t.get_name() for t in self._loops if t.done()]

    def is_healthy(self) -> bool:
        """The router's tasks all run and a full path is healthy (prefill + decode, or colocated)."""
        if not self._loops or self.dead_tasks():
            return False
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
        """Latest stats of every worker; ``healthy`` is the router's verdict."""
        return [
            replace(w.stats, healthy=w.healthy)
            if w.stats is not None
            else WorkerStats(w.worker_id, w.pool, healthy=w.healthy)
            for w in self.workers
        ]

    def rejected_frames(self) -> dict[str, int]:
        """Control frames the router itself dropped, by reason."""
        return self.decoder.rejected()

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
                event = await self._next_event(flight, deadline)
                if isinstance(event, RouterError):
                    raise event
                if isinstance(event, Transferred):
                    flight.transfer_s = event.seconds
                    continue
                delta = event.delta
                if flight.first_token_time is None:
                    flight.first_token_time = time.time()
                    flight.scheduled_time = delta.scheduled_time
                if isinstance(event, Prefilled):
                    self._hand_off(flight, event, deadline)
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
        conditional = (
            self.mode == "conditional"
            and len(req.prompt_token_ids) <= self.config.conditional_max_prompt_tokens
        )
        if self.mode == "colocated" or conditional:
            pool = "colocated" if self.mode == "colocated" else "decode"
            w = (
                pick_least_loaded(self._healthy(pool), pool)
                if pool == "colocated"
                else pick_decode(self._healthy(pool))
            )
            hold = False
        else:
            w = pick_prefill(
                self._healthy("prefill"), req.prompt_token_ids, self.config.affinity_slack_tokens
            )
            hold = True
        self._assign(flight, w, "prefill" if hold else "decode", len(req.prompt_token_ids))
        self._send(w, Generate(req.request_id, req.prompt_token_ids, req.params, deadline, hold))

    def _hand_off(self, flight: _Flight, event: Prefilled, deadline: float) -> None:
        """Prefill sampled the first token (already on its way to the caller): start the decode side."""
        req = flight.req
        if flight.prefill is not None:
            flight.prefill.num_prompt_tokens -= len(req.prompt_token_ids)
        try:
            w = pick_decode(self._healthy("decode"))
        except ClusterUnavailableError:
            self._send_abort(flight)
            raise
        self._assign(flight, w, "decode", 0)
        first = event.delta.token_ids[0]
        self._send(
            w, DecodeHandoff(req.request_id, req.prompt_token_ids, first, req.params, event.handoff, deadline)
        )

    async def _next_event(self, flight: _Flight, deadline: float) -> FlightEvent:
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
            flight.events.put_nowait(RequestAbortedError("aborted"))

    def _send_abort(self, flight: _Flight) -> None:
        for w in (flight.prefill, flight.decode):
            if w is not None and w.state != WorkerState.DEAD:
                self._send(w, Abort(flight.req.request_id))

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

    # ---- workers --------------------------------------------------------------------------------------
    def _healthy(self, pool: str) -> list[WorkerRef]:
        return [w for w in self.workers if w.pool == pool and w.healthy]

    def _assign(self, flight: _Flight, w: WorkerRef, role: str, prompt_tokens: int) -> None:
        if role == "prefill":
            flight.prefill = w
            w.num_prompt_tokens += prompt_tokens
        else:
            flight.decode = w
        w.num_assigned += 1

    def _send(self, w: WorkerRef, op: Any) -> None:
        if w.socket is None:
            raise RuntimeError(f"worker {w.worker_id} has no socket")
        try:
            # NOTE: PUSH queues without blocking up to its high-water mark; never awaits here.
            w.socket.send(self._encoder.encode(w.worker_id, op), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.error("router: %s's queue is full; dropped %s", w.worker_id, type(op).__name__)
            if not isinstance(op, Abort):
                raise ClusterUnavailableError(f"worker {w.worker_id} is not taking work") from None

    # ---- background tasks -----------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        while True:
            frame = await self._pull.recv()
            event = self.decoder.decode(frame)
            if event is None:
                continue
            try:
                self._on_event(event)
            except Exception:
                logger.exception("router: failed to handle %s", type(event).__name__)

    def _on_event(self, event: Any) -> None:
        worker_id = event.stats.worker_id if isinstance(event, Heartbeat) else event.worker_id
        w = self._by_id.get(worker_id)
        if w is None:
            self.decoder.verifier.reject("unknown_worker")
            return
        if isinstance(event, Heartbeat):
            self._on_heartbeat(w, event.stats)
        elif isinstance(event, WorkerFailed):
            self._mark_dead(w, f"it reported: {event.reason}")
        elif isinstance(event, RequestFailed):
            self._to_flight(w, event.request_id, router_error(event.code, event.message))
        elif isinstance(event, (Delta, Prefilled)):
            if not self._to_flight(w, event.delta.request_id, event) and isinstance(event, Prefilled):
                # NOTE: the caller went away while prefill ran; make the prefill side let go.
                self._send(w, Abort(event.delta.request_id))
        elif isinstance(event, Transferred):
            self._to_flight(w, event.request_id, event)

    def _to_flight(self, w: WorkerRef, request_id: str, event: FlightEvent) -> bool:
        flight = self._flights.get(request_id)
        if flight is None or (flight.prefill is not w and flight.decode is not w):
            return False
        flight.events.put_nowait(event)
        return True

    def _on_heartbeat(self, w: WorkerRef, stats: WorkerStats) -> None:
        if w.state == WorkerState.DEAD:
            return
        w.stats, w.last_beat = stats, time.monotonic()
        if not stats.healthy:
            self._set_state(w, WorkerState.UNHEALTHY, "it reports a dead thread")
        elif w.state == WorkerState.UNHEALTHY:
            self._set_state(w, WorkerState.HEALTHY, "")

    async def _heartbeat_monitor(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            now = time.monotonic()
            for w in self.workers:
                silent = now - w.last_beat
                if w.healthy and silent > self.config.health_timeout_s:
                    self._set_state(w, WorkerState.UNHEALTHY, f"no heartbeat for {silent:.1f} s")

    async def _lifecycle_watch(self, w: WorkerRef) -> None:
        """Learn from Ray that the actor died (a stopped or busy actor only times out: not dead)."""
        while w.state != WorkerState.DEAD:
            try:
                await asyncio.wait_for(w.actor.ping.remote(), self.config.health_timeout_s)
            except asyncio.TimeoutError:
                pass
            except Exception as e:  # noqa: BLE001 - RayActorError and friends: the actor is gone
                self._mark_dead(w, f"{type(e).__name__}: {e}")
                return
            await asyncio.sleep(self.config.health_interval_s)

    def _set_state(self, w: WorkerRef, state: WorkerState, why: str) -> None:
        if w.state == state:
            return
        log = logger.info if state == WorkerState.HEALTHY else logger.error
        log("router: worker %s is %s%s", w.worker_id, state.value, f" ({why})" if why else "")
        w.state, w.why = state, why

    def _mark_dead(self, w: WorkerRef, why: str) -> None:
        if w.state == WorkerState.DEAD:
            return
        self._set_state(w, WorkerState.DEAD, why)
        if w.rank is not None:
            # NOTE: peers stop waiting on the dead rank at once instead of sitting out transfer timeouts
            # with other workers' transfers queued behind.
            for peer in self._live_peers(w):
                self._send(peer, PeerDead(w.worker_id, w.rank))
        for flight in list(self._flights.values()):
            # NOTE: a request already handed to a decode worker no longer needs its prefill worker once
            # the KV landed; a transfer still in flight fails on the decode side (policy fail/recompute).
            depends = flight.decode is w or (flight.prefill is w and flight.decode is None)
            if depends and not flight.done:
                flight.events.put_nowait(WorkerFailedError(f"worker {w.worker_id} failed: {why}"))

    def _live_peers(self, w: WorkerRef) -> Sequence[WorkerRef]:
        return [p for p in self.workers if p is not w and p.rank is not None and p.state != WorkerState.DEAD]

"""Router: admits workers, picks them, drives prefill -> handoff -> decode, re-yields tokens, migrates
requests off dead workers, drains workers for scale-down, aborts, deadlines, health.

Runs on one asyncio loop in the router process (which also hosts the HTTP server). Hot messages are the
typed, authenticated frames of cluster/wire.py over ZMQ: one PUSH socket per worker for ops, one PULL
socket for every event coming back. A bad frame is counted and dropped; no frame can end a task.

Membership: a worker registers with its first Heartbeat (which carries its WorkerInfo); a heartbeat
from a new incarnation of a known worker (Ray restarted it) re-admits it. States (``WorkerRef.state``):
  healthy    its heartbeat is fresh and says every thread is alive: routable;
  unhealthy  its heartbeat is stale (stopped, stuck) or it reported a dead thread: not routed to; its
             requests keep waiting (bounded by their deadlines) and a fresh heartbeat makes it healthy;
  draining   being removed (scale-down): not routed to; its requests finish or migrate;
  dead       it said so (``WorkerFailed``) or Ray says the actor is gone: its requests migrate.
Ray is the lifecycle plane only: one watcher per actor pings it to learn that it died.

Migration: a request whose worker died is dispatched again, as prompt + the tokens already streamed, to
a surviving path (``Generate.output_token_ids``: computed, not re-sampled, so greedy continues token for
token and a seeded request continues its random stream); at most ``max_migrations`` times. Each attempt
has its own wire id (``<request id>~<attempt>``), so late events of an abandoned attempt are dropped.
With ``colocated_fallback``, workers of either pool serve whole requests when the other pool is empty.

Modes: ``disaggregated`` (prefill pool, then a decode pool), ``colocated`` (one pool does both),
``conditional`` (a decode worker prefills the request itself when the cost model predicts that cheaper;
without a cost profile, when the prompt has at most ``conditional_max_prompt_tokens``).
Placement policy: cluster/router/placement.py; route decisions and their reasons: cluster/router/routing.py;
SLO-aware admission: cluster/router/admission.py.

Early decode admission (``early_decode_admission``): the decode worker is picked when the prefill is
dispatched and told at once (``PrepareDecode``), so it reserves blocks and posts its KV fetch while the
prefill runs; the ``DecodeHandoff`` after the prefill then only brings the first token. Until then the
flight's decode worker is a reservation: the request still depends on its prefill worker alone (that one
dying migrates it, and the reservation is aborted with the attempt), and a reserving worker that dies is
just replaced at the handoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import zmq
import zmq.asyncio

from cluster.config import RouterConfig
from cluster.protocol import (
    ClusterUnavailableError,
    DeadlineExceededError,
    ErrorCode,
    GenerateRequest,
    InvalidRequestError,
    ModelInfo,
    QueueFullError,
    RequestAbortedError,
    RequestTimings,
    RouteInfo,
    RouterError,
    SloUnattainableError,
    TokenDelta,
    WorkerFailedError,
    WorkerStats,
    peer_name,
    router_error,
)
from cluster.router.admission import SloAdmission, build_admission
from cluster.router.placement import pick_decode
from cluster.router.predict import Predictor, TrafficLog
from cluster.router.routing import Pools, PrefixView, Route, decide
from cluster.wire import (
    EVENTS,
    ROUTER_ID,
    Abort,
    DecodeHandoff,
    Deltas,
    ExtendLease,
    Generate,
    Heartbeat,
    KeepAlive,
    Message,
    PeerDead,
    Prefilled,
    PrepareDecode,
    RequestFailed,
    Transferred,
    WireDecoder,
    WireEncoder,
    WorkerFailed,
    WorkerInfo,
)

logger = logging.getLogger(__name__)

# NOTE: bounds how long a death Ray reported waits for frames already here (a busy socket never empties).
_SETTLE_S = 0.5


class WorkerState(str, enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    DEAD = "dead"


@dataclass
class WorkerRef:
    """The router's view of one admitted worker (one incarnation of it)."""

    info: WorkerInfo
    socket: zmq.asyncio.Socket
    state: WorkerState = WorkerState.HEALTHY
    why: str = ""  # why it is not healthy
    stats: WorkerStats | None = None
    last_beat: float = field(default_factory=time.monotonic)
    num_assigned: int = 0  # requests the router routed here that are not over
    num_prompt_tokens: int = 0  # prompt tokens routed here whose first token has not come back
    num_queued_prompts: int = 0  # the requests those tokens belong to
    admitted_at: float = field(default_factory=time.monotonic)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def pool(self) -> str:
        return self.info.pool

    @property
    def block_size(self) -> int:
        return self.info.block_size

    @property
    def healthy(self) -> bool:
        return self.state == WorkerState.HEALTHY

    @property
    def peer_name(self) -> str:
        return peer_name(self.info.worker_id, self.info.incarnation)

    def has_broken_pair_with(self, other: WorkerRef) -> bool:
        """Its last stats say its KV-transfer pair with ``other`` is broken."""
        return self.stats is not None and other.peer_name in self.stats.broken_peers


@dataclass(frozen=True)
class Delta:
    """One request's delta from ``worker_id``, as the router hands it to that request's stream (the
    wire carries a step's deltas together, in ``Deltas``)."""

    worker_id: str
    delta: TokenDelta


FlightEvent = Delta | Prefilled | Transferred | RouterError


@dataclass
class _Flight:
    """One request in flight through the router (across its migrations)."""

    req: GenerateRequest
    arrival: float
    deadline: float
    events: asyncio.Queue[tuple[int, FlightEvent]] = field(default_factory=asyncio.Queue)  # (attempt, event)
    attempt: int = 0
    prefill: WorkerRef | None = None
    decode: WorkerRef | None = None
    is_early_decode: bool = False  # `decode` holds an early reservation; the handoff has not happened
    # NOTE: counted when a delta arrives, not when the caller consumes it: every received token will reach
    # the caller, so a migration continues after all of them (none twice, none lost).
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False  # its final delta arrived (it must not migrate any more)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    transfer_s: float = 0.0
    done: bool = False
    route: RouteInfo | None = None  # the current attempt's routing decision
    queued_on: WorkerRef | None = None  # the worker whose prefill queue holds the current attempt
    queued_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # of the tokens the current attempt prefills

    @property
    def wire_id(self) -> str:
        rid = self.req.request_id
        return rid if self.attempt == 0 else f"{rid}~{self.attempt}"

    def put(self, event: FlightEvent) -> None:
        """Queue an event of the current attempt for generate()."""
        if isinstance(event, (Delta, Prefilled)):
            self.token_ids += event.delta.token_ids
            self.finished = self.finished or event.delta.finish_reason is not None
        self.events.put_nowait((self.attempt, event))

    @property
    def is_handed_off(self) -> bool:
        """A decode worker has taken the request over (an early reservation does not count)."""
        return self.decode is not None and not self.is_early_decode

    def depends_on(self, w: WorkerRef) -> bool:
        """Its progress needs ``w``: w decodes it, or w prefills it and no decode worker took over yet."""
        if self.decode is w and not self.is_early_decode:
            return True
        return self.prefill is w and not self.is_handed_off


class Router:
    """See the module docstring. ``secret`` authenticates every control frame (cluster/frames.py)."""

    def __init__(
        self,
        config: RouterConfig,
        secret: bytes,
        *,
        served_model_name: str | None = None,
        bind_host: str = "127.0.0.1",
        predictor: Predictor | None = None,
    ) -> None:
        """``predictor``: the cost model behind conditional routing and admission (None: the prompt-length
        rule; ``admission: slo`` needs one)."""
        self.config = config
        self.mode = config.mode
        self.predictor = predictor
        self.admission: SloAdmission | None = build_admission(config)
        if self.admission is not None and predictor is None:
            raise ValueError("router admission 'slo' needs a cost profile to predict TTFT with (predictor)")
        self.prefix_view = PrefixView()
        self.traffic = TrafficLog(config.advice_window_s)
        self._route_counts: dict[tuple[str, str], int] = {}
        self.served_model_name = served_model_name
        self._workers: dict[str, WorkerRef] = {}
        self._first_info: WorkerInfo | None = None
        self._retired: set[str] = set()  # incarnations drained by scale-down: never re-admitted
        self._actors: dict[str, Any] = {}
        self._flights: dict[str, _Flight] = {}  # by the caller's request id
        self._by_wire: dict[str, _Flight] = {}  # by the current attempt's wire id
        self._encoder = WireEncoder(secret)
        self.decoder = WireDecoder(secret, ROUTER_ID, EVENTS)
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(f"tcp://{bind_host}:*")
        self.endpoint: str = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._loops: list[asyncio.Task[None]] = []
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._admitted = asyncio.Event()

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        # NOTE: these two run until close(); a lifecycle watch ends when its actor is unwatched.
        self._loops = [
            asyncio.create_task(self._receive_loop(), name="router-receive"),
            asyncio.create_task(self._heartbeat_monitor(), name="router-heartbeats"),
        ]

    async def close(self) -> None:
        tasks = [*self._loops, *self._watches.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for w in self._workers.values():
            w.socket.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()

    def watch(self, worker_id: str, actor: Any) -> None:
        """Watch an actor's lifecycle through Ray (anything with ``.ping.remote()``); call on the loop."""
        self._actors[worker_id] = actor
        if worker_id not in self._watches:
            self._watches[worker_id] = asyncio.create_task(
                self._lifecycle_watch(worker_id), name=f"router-watch-{worker_id}"
            )

    async def wait_admitted(self, worker_ids: Sequence[str], timeout_s: float) -> None:
        """Until every worker in ``worker_ids`` has registered and is healthy (bounded)."""
        deadline = time.monotonic() + timeout_s
        while not all(wid in self._workers and self._workers[wid].healthy for wid in worker_ids):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [wid for wid in worker_ids if wid not in self._workers]
                raise TimeoutError(f"workers not admitted within {timeout_s:.0f} s: {missing}")
            self._admitted.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.5)):
                    await self._admitted.wait()

    @property
    def workers(self) -> list[WorkerRef]:
        return list(self._workers.values())

    @property
    def model_info(self) -> ModelInfo:
        """What the edge validates against: the served model, the smallest max_model_len of the
        admitted workers."""
        first = self._first_info
        if first is None:
            raise ClusterUnavailableError("no worker has registered yet")
        lens = [w.info.max_model_len for w in self._workers.values() if w.state != WorkerState.DEAD]
        return ModelInfo(
            name=self.served_model_name or os.path.basename(first.model_dir.rstrip("/")),
            model_dir=first.model_dir,
            max_model_len=min(lens or [first.max_model_len]),
            vocab_size=first.vocab_size,
        )

    def dead_tasks(self) -> list[str]:
        """The router's own loops that ended (each should run until close)."""
        return [t.get_name() for t in self._loops if t.done()]

    def is_healthy(self) -> bool:
        """The router's loops all run and some path serves a request end to end."""
        if not self._loops or self.dead_tasks():
            return False
        pools = {w.pool for w in self._workers.values() if w.healthy}
        if self.mode == "colocated":
            return "colocated" in pools
        if self.config.colocated_fallback:
            return bool(pools)
        return {"prefill", "decode"} <= pools

    def placement(self, request_id: str) -> tuple[str | None, str | None]:
        """(prefill worker id, decode worker id) of a request in flight; (None, None) if unknown."""
        f = self._flights.get(request_id)
        if f is None:
            return None, None
        decode = f.decode.worker_id if f.decode is not None and f.is_handed_off else None
        return (f.prefill.worker_id if f.prefill else None, decode)

    def worker_stats(self) -> list[WorkerStats]:
        """Latest stats of every admitted worker; ``healthy`` is the router's verdict."""
        return [
            replace(w.stats, healthy=w.healthy)
            if w.stats is not None
            else WorkerStats(w.worker_id, w.pool, healthy=w.healthy)
            for w in self._workers.values()
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
        arrival = time.time()
        deadline = req.deadline if req.deadline is not None else arrival + self.config.request_timeout_s
        flight = _Flight(req, arrival, deadline)
        route = self._route(flight)
        self._admit_or_refuse(flight, route)
        self._flights[req.request_id] = flight
        self._by_wire[flight.wire_id] = flight
        try:
            self._commit(flight, route)
            while True:
                attempt, event = await self._next_event(flight)
                if isinstance(event, RouterError):
                    raise event
                if isinstance(event, Transferred):
                    flight.transfer_s = event.seconds
                    continue
                delta = event.delta
                delta.request_id = req.request_id
                if flight.first_token_time is None:
                    flight.first_token_time = time.time()
                    flight.scheduled_time = delta.scheduled_time
                    if self.admission is not None and flight.attempt == 0 and flight.route is not None:
                        measured = flight.first_token_time - flight.arrival
                        self.admission.observe(flight.route.predicted_ttft_s, measured)
                if isinstance(event, Prefilled) and attempt == flight.attempt:
                    self._hand_off(flight, event)
                if delta.finish_reason is not None:
                    flight.done = True
                    delta.timings = self._timings(flight)
                    yield delta
                    return
                yield delta
        finally:
            self._settle(flight)

    def _dispatch(self, flight: _Flight) -> None:
        """Send the flight's current attempt to a worker; raises ClusterUnavailableError if none can."""
        self._commit(flight, self._route(flight))

    def _route(self, flight: _Flight) -> Route[WorkerRef]:
        """Where the flight's current attempt goes and why (cluster/router/routing.py); changes nothing.
        NOTE: a migrated request already streaming is finished whole somewhere (prompt + its tokens)."""
        pools = Pools(self._healthy("prefill"), self._healthy("decode"), self._healthy("colocated"))
        tokens = (
            flight.req.prompt_token_ids + flight.token_ids
            if flight.token_ids
            else flight.req.prompt_token_ids
        )
        return decide(
            self.mode,
            tokens,
            pools,
            self.config,
            predictor=self.predictor,
            view=self.prefix_view,
            resume=bool(flight.token_ids),
        )

    def _admit_or_refuse(self, flight: _Flight, route: Route[WorkerRef]) -> None:
        """SLO-aware admission: raise SloUnattainableError (HTTP 429) when the route's predicted TTFT
        misses the request's SLO; nothing has been queued or counted yet."""
        if self.admission is None:
            return
        req = flight.req
        adm = self.admission
        verdict = adm.check(
            route.predicted_ttft_s,
            route.predicted_tbt_s,
            req.ttft_slo_s,
            decode_worker_id=route.tbt_worker_id,
        )
        if verdict.ok:
            return
        self.traffic.record(flight.arrival, len(req.prompt_token_ids), req.params.max_tokens)
        if verdict.missed == "ttft":
            slo, predicted, what = (
                adm.slo_s(req.ttft_slo_s) or 0.0,
                verdict.predicted_ttft_s,
                "time to first token",
            )
        else:
            slo, predicted, what = adm.tbt_slo_s or 0.0, verdict.predicted_tbt_s or 0.0, "time between tokens"
        raise SloUnattainableError(
            f"predicted {what} {predicted * 1e3:.0f} ms exceeds the {verdict.missed.upper()} SLO "
            f"{slo * 1e3:.0f} ms (on {route.worker.worker_id}); retry after {verdict.retry_after_s} s",
            verdict.retry_after_s,
        )

    def _commit(self, flight: _Flight, route: Route[WorkerRef]) -> None:
        """Carry out a route decision: count it, remember its blocks on the worker, send the request."""
        w = route.worker
        key = (route.mode, route.reason)
        self._route_counts[key] = self._route_counts.get(key, 0) + 1
        flight.route, flight.block_hashes = route.info(), route.block_hashes
        self.prefix_view.record(w.worker_id, route.block_hashes, w.info.num_blocks)
        num_tokens = len(flight.req.prompt_token_ids) + len(flight.token_ids)
        self._assign(flight, w, "prefill" if route.hold else "decode", num_tokens)
        self._send_generate(flight, w, hold=route.hold)
        if route.hold and self.config.early_decode_admission and flight.req.params.max_tokens > 1:
            self._admit_decode_early(flight, w)

    def route_decisions(self) -> dict[tuple[str, str], int]:
        """Routing decisions so far by (mode, reason): ``pdserve_route_decisions_total``."""
        return dict(self._route_counts)

    def _send_generate(self, flight: _Flight, w: WorkerRef, hold: bool) -> None:
        req = flight.req
        op = Generate(
            flight.wire_id, req.prompt_token_ids, req.params, flight.deadline, hold, list(flight.token_ids)
        )
        self._send(w, op)

    def _pick_decode_for(self, prefill: WorkerRef | None) -> WorkerRef | None:
        """A healthy decode worker for a handoff from ``prefill`` (None if there is none)."""
        decodes = self._healthy("decode")
        if not decodes:
            return None
        if prefill is not None:
            # NOTE: a broken pair is rebuilt on its next use; take another pair while one exists
            sound = [
                d for d in decodes if not (prefill.has_broken_pair_with(d) or d.has_broken_pair_with(prefill))
            ]
            decodes = sound or decodes
        return pick_decode(decodes)

    def _admit_decode_early(self, flight: _Flight, prefill: WorkerRef) -> None:
        """Pick the decode worker now and let it reserve blocks and post its fetch (best effort)."""
        w = self._pick_decode_for(prefill)
        if w is None or not prefill.info.kv_endpoint:
            return
        self._assign(flight, w, "decode", 0)
        flight.is_early_decode = True
        req, info = flight.req, prefill.info
        op = PrepareDecode(
            flight.wire_id,
            req.prompt_token_ids,
            req.params,
            flight.deadline,
            info.worker_id,
            info.incarnation,
            info.kv_endpoint,
        )
        try:
            self._send(w, op)
        except ClusterUnavailableError:
            self._drop_early_decode(flight)  # NOTE: its queue is full: the handoff picks one later

    def _drop_early_decode(self, flight: _Flight) -> None:
        """Forget the flight's early decode reservation (the worker is dead or never got it)."""
        if flight.is_early_decode and flight.decode is not None:
            flight.decode.num_assigned -= 1
            flight.decode = None
        flight.is_early_decode = False

    def _hand_off(self, flight: _Flight, event: Prefilled) -> None:
        """Prefill sampled the first token (already on its way to the caller): start the decode side."""
        req = flight.req
        w = flight.decode
        if w is None or not flight.is_early_decode or w.state == WorkerState.DEAD:
            self._drop_early_decode(flight)
            w = self._pick_decode_for(flight.prefill)
            if w is None:
                self._migrate(flight, "no healthy decode worker for the handoff")
                return
            self._assign(flight, w, "decode", 0)
        flight.is_early_decode = False
        self._note_decode_side(flight, w)
        first = event.delta.token_ids[0]
        op = DecodeHandoff(
            flight.wire_id, req.prompt_token_ids, first, req.params, event.handoff, flight.deadline
        )
        self._send(w, op)

    def _note_decode_side(self, flight: _Flight, w: WorkerRef) -> None:
        """The handoff's decode worker and its expected prefix hit join the flight's route; the prompt's
        blocks will be in that worker's prefix cache too."""
        if flight.route is None:
            return
        prompt = flight.req.prompt_token_ids
        hashes = flight.block_hashes
        hit = self.prefix_view.hit_tokens(w.worker_id, hashes, len(prompt), w.block_size)
        flight.route = replace(flight.route, decode_worker=w.worker_id, decode_hit_tokens=hit)
        self.prefix_view.record(w.worker_id, hashes, w.info.num_blocks)

    async def _next_event(self, flight: _Flight) -> tuple[int, FlightEvent]:
        left = flight.deadline - time.time()
        if left <= 0:
            raise DeadlineExceededError(f"request {flight.req.request_id!r} passed its deadline")
        # NOTE: not asyncio.wait_for: on Python 3.11 it returns an event that lands as the caller is
        # cancelled (a disconnect), swallowing the cancel, so the request would run on to its end.
        try:
            async with asyncio.timeout(left):
                return await flight.events.get()
        except TimeoutError:
            raise DeadlineExceededError(f"request {flight.req.request_id!r} passed its deadline") from None

    def _settle(self, flight: _Flight) -> None:
        """Request over (finished, failed, cancelled): release router counters; abort if unfinished."""
        self._release(flight, abort=not flight.done)
        self._flights.pop(flight.req.request_id, None)
        self._by_wire.pop(flight.wire_id, None)
        out = len(flight.token_ids) if flight.done else flight.req.params.max_tokens
        self.traffic.record(flight.arrival, len(flight.req.prompt_token_ids), out)

    def _release(self, flight: _Flight, abort: bool) -> None:
        """Drop the flight's worker assignments (telling live ones to abort its current attempt; an
        early decode reservation is aborted even when the request is done: it ended at its prefill)."""
        for w in {id(x): x for x in (flight.prefill, flight.decode) if x is not None}.values():
            is_reservation = w is flight.decode and flight.is_early_decode
            if (abort or is_reservation) and w.state != WorkerState.DEAD:
                self._send(w, Abort(flight.wire_id))
            w.num_assigned -= 1
        self._unqueue(flight)
        flight.prefill = flight.decode = None
        flight.is_early_decode = False

    def _unqueue(self, flight: _Flight) -> None:
        """The current attempt left its worker's prefill queue (first token back, or released)."""
        w = flight.queued_on
        if w is not None:
            w.num_prompt_tokens -= flight.queued_tokens
            w.num_queued_prompts -= 1
            flight.queued_on, flight.queued_tokens = None, 0

    def _migrate(self, flight: _Flight, why: str) -> None:
        """Dispatch the flight again (a new attempt) or, past max_migrations, fail it."""
        if flight.done or flight.finished:
            return
        if flight.attempt >= self.config.max_migrations:
            limit = self.config.max_migrations
            flight.put(WorkerFailedError(f"{why}; request not migrated again (max_migrations {limit})"))
            return
        self._release(flight, abort=True)
        self._by_wire.pop(flight.wire_id, None)
        flight.attempt += 1
        self._by_wire[flight.wire_id] = flight
        try:
            self._dispatch(flight)
        except ClusterUnavailableError as e:
            flight.put(ClusterUnavailableError(f"{why}; {e}"))
            return
        target = flight.prefill or flight.decode
        logger.warning(
            "router: migrated %s after %d tokens (%s) to %s",
            flight.req.request_id,
            len(flight.token_ids),
            why,
            target.worker_id if target is not None else "?",
        )

    async def abort(self, request_id: str) -> None:
        """Idempotent: every worker holding the request frees it; a generate() still being iterated
        for it raises RequestAbortedError."""
        flight = self._flights.get(request_id)
        if flight is not None:
            for w in (flight.prefill, flight.decode):
                if w is not None and w.state != WorkerState.DEAD:
                    self._send(w, Abort(flight.wire_id))
            flight.put(RequestAbortedError("aborted"))

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
            num_migrations=f.attempt,
            route=f.route,
        )

    # ---- workers --------------------------------------------------------------------------------------
    def _healthy(self, pool: str) -> list[WorkerRef]:
        return [w for w in self._workers.values() if w.pool == pool and w.healthy]

    def _assign(self, flight: _Flight, w: WorkerRef, role: str, prompt_tokens: int) -> None:
        """``prompt_tokens`` > 0: w must prefill them before the flight's first token (its queue)."""
        if role == "prefill":
            flight.prefill = w
        else:
            flight.decode = w
        w.num_assigned += 1
        if prompt_tokens > 0:
            self._unqueue(flight)
            flight.queued_on, flight.queued_tokens = w, prompt_tokens
            w.num_prompt_tokens += prompt_tokens
            w.num_queued_prompts += 1

    def _send(self, w: WorkerRef, op: Message) -> None:
        try:
            # NOTE: PUSH queues without blocking up to its high-water mark; never awaits here.
            w.socket.send(self._encoder.encode(w.worker_id, op), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.error("router: %s's queue is full; dropped %s", w.worker_id, type(op).__name__)
            if not isinstance(op, (Abort, PeerDead, ExtendLease)):
                raise ClusterUnavailableError(f"worker {w.worker_id} is not taking work") from None

    def _admit(self, info: WorkerInfo) -> WorkerRef | None:
        """Register a worker (or a new incarnation of one); None if it cannot join this cluster."""
        first = self._first_info
        if first is not None and _model_identity(info) != _model_identity(first):
            logger.error(
                "router: refused %s: it serves %s (vocab %d, fingerprint %r), the cluster serves %s "
                "(vocab %d, fingerprint %r)", info.worker_id, info.model_dir, info.vocab_size,
                info.model_fingerprint, first.model_dir, first.vocab_size, first.model_fingerprint,
            )  # fmt: skip
            self.decoder.verifier.reject("refused_worker")
            return None
        old = self._workers.get(info.worker_id)
        if old is not None:
            self._mark_dead(old, f"replaced by a new incarnation ({info.incarnation})")
            self._remove(old)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(info.request_endpoint)
        w = WorkerRef(info, sock)
        self._workers[info.worker_id] = w
        self._first_info = first or info
        logger.info(
            "router: admitted %s (%s, pid %d on %s, incarnation %s)",
            info.worker_id, info.pool, info.pid, info.node_ip, info.incarnation,
        )  # fmt: skip
        self._admitted.set()
        return w

    def _remove(self, w: WorkerRef) -> None:
        if self._workers.get(w.worker_id) is w:
            del self._workers[w.worker_id]
            self.prefix_view.forget(w.worker_id)
            if self.admission is not None:
                self.admission.forget(w.worker_id)
        w.socket.close(linger=0)

    async def drain(self, worker_id: str, timeout_s: float) -> None:
        """Scale-down: route nothing new to the worker; wait (bounded) for its requests to finish, migrate
        the rest, then forget it (the caller stops the actor)."""
        w = self._workers.get(worker_id)
        if w is None:
            raise ValueError(f"no worker {worker_id!r}")
        self._set_state(w, WorkerState.DRAINING, "scale-down")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(
            f.prefill is w or f.decode is w for f in self._flights.values()
        ):
            await asyncio.sleep(0.05)  # NOTE: a bounded poll of the router's own state
        for flight in [f for f in self._flights.values() if f.prefill is w or f.decode is w]:
            self._migrate(flight, f"worker {worker_id} drained")
        self.unwatch(worker_id)
        self._retired.add(w.info.incarnation)
        self._set_state(w, WorkerState.DEAD, "removed")
        self._tell_peers_dead(w)
        self._remove(w)

    def unwatch(self, worker_id: str) -> None:
        self._actors.pop(worker_id, None)
        task = self._watches.pop(worker_id, None)
        if task is not None:
            task.cancel()

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
        if isinstance(event, Heartbeat):
            self._on_heartbeat(event)
            return
        w = self._workers.get(event.worker_id)
        if w is None:
            self.decoder.verifier.reject("unknown_worker")
            return
        if isinstance(event, WorkerFailed):
            self._mark_dead(w, f"it reported: {event.reason}")
        elif isinstance(event, RequestFailed):
            self._on_request_failed(w, event)
        elif isinstance(event, Deltas):
            for delta in event.deltas:
                self._to_flight(w, delta.request_id, Delta(event.worker_id, delta))
        elif isinstance(event, Prefilled):
            if not self._to_flight(w, event.delta.request_id, event):
                # NOTE: the caller went away (or the request moved on) while prefill ran: let go of it.
                self._send(w, Abort(event.delta.request_id))
        elif isinstance(event, Transferred):
            self._to_flight(w, event.request_id, event)
        elif isinstance(event, KeepAlive):
            flight = self._by_wire.get(event.request_id)
            if flight is not None and flight.decode is w and flight.prefill is not None:
                self._send(flight.prefill, ExtendLease(event.request_id))

    def _flight_of(self, w: WorkerRef, wire_id: str) -> _Flight | None:
        flight = self._by_wire.get(wire_id)
        if flight is None or (flight.prefill is not w and flight.decode is not w):
            return None
        return flight

    def _to_flight(self, w: WorkerRef, wire_id: str, event: FlightEvent) -> bool:
        flight = self._flight_of(w, wire_id)
        if flight is None:
            return False
        if isinstance(event, (Delta, Prefilled)) and flight.queued_on is w:
            self._unqueue(flight)
        flight.put(event)
        return True

    def _on_request_failed(self, w: WorkerRef, event: RequestFailed) -> None:
        flight = self._flight_of(w, event.request_id)
        if flight is None:
            return
        prefill = flight.prefill
        if (
            event.code == ErrorCode.KV_TRANSFER_FAILED
            and prefill is not None
            and prefill.state == WorkerState.DEAD
        ):
            # NOTE: the KV's owner died mid-transfer: not the request's fault, so it moves on
            self._migrate(flight, f"KV source {prefill.worker_id} died mid-transfer")
            return
        flight.put(router_error(event.code, event.message))

    def _on_heartbeat(self, event: Heartbeat) -> None:
        info, stats = event.info, event.stats
        if stats.worker_id != info.worker_id:
            self.decoder.verifier.reject("bad_field")
            return
        w = self._workers.get(info.worker_id)
        if w is None or w.info.incarnation != info.incarnation:
            if (w is not None and w.state == WorkerState.DRAINING) or info.incarnation in self._retired:
                return  # NOTE: a drained process beats until its actor is stopped: never re-admitted
            w = self._admit(info)
            if w is None:
                return
        if w.state in (WorkerState.DEAD, WorkerState.DRAINING):
            return
        w.stats, w.last_beat = stats, time.monotonic()
        if self.admission is not None and self.predictor is not None and w.pool != "prefill":
            step = self.predictor.step_now_s(w)
            self.admission.observe_steps(w.worker_id, w.last_beat, stats.engine.num_steps, step)
        if not stats.healthy:
            self._set_state(w, WorkerState.UNHEALTHY, "it reports a dead thread")
        elif w.state == WorkerState.UNHEALTHY:
            self._set_state(w, WorkerState.HEALTHY, "")

    async def _heartbeat_monitor(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            now = time.monotonic()
            for w in list(self._workers.values()):
                silent = now - w.last_beat
                if w.healthy and silent > self.config.health_timeout_s:
                    self._set_state(w, WorkerState.UNHEALTHY, f"no heartbeat for {silent:.1f} s")

    async def _lifecycle_watch(self, worker_id: str) -> None:
        """Learn from Ray that the actor died (a stopped or busy actor only times out: not dead). Keeps
        watching after a death: a restarted actor registers again by itself."""
        while worker_id in self._actors:
            issued = time.monotonic()
            try:
                async with asyncio.timeout(self.config.health_timeout_s):
                    await self._actors[worker_id].ping.remote()
            except TimeoutError:
                pass
            except Exception as e:  # noqa: BLE001 - RayActorError and friends: the actor is gone
                w = self._workers.get(worker_id)
                # NOTE: a ping sent before a restart can fail after the new incarnation registered; the
                # failure is the old process's, so only an incarnation admitted before the ping dies here.
                if w is not None and w.admitted_at < issued:
                    await self._take_pending_events()
                    self._mark_dead(w, f"{type(e).__name__}: {str(e).splitlines()[0]}")
            await asyncio.sleep(self.config.health_interval_s)

    async def _take_pending_events(self) -> None:
        """Let the receive loop handle every frame already here before Ray's word on a death is acted
        on: what a dying worker sent last (its deltas, its own ``WorkerFailed`` reason) came first."""
        deadline = time.monotonic() + _SETTLE_S
        while self._readable() and time.monotonic() < deadline:
            await asyncio.sleep(0)
        # NOTE: the last frame read may still wait in the receive task's future: two turns of the loop.
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    def _readable(self) -> bool:
        # NOTE: ``get``, not ``getsockopt``: reading EVENTS clears the socket's edge-triggered fd, and
        # only the asyncio socket's ``get`` then re-arms the receive loop's reader.
        return bool(int(self._pull.get(zmq.EVENTS)) & zmq.POLLIN)

    def _set_state(self, w: WorkerRef, state: WorkerState, why: str) -> None:
        if w.state == state:
            return
        log = logger.info if state in (WorkerState.HEALTHY, WorkerState.DRAINING) else logger.error
        log("router: worker %s is %s%s", w.worker_id, state.value, f" ({why})" if why else "")
        w.state, w.why = state, why

    def _mark_dead(self, w: WorkerRef, why: str) -> None:
        if w.state == WorkerState.DEAD:
            return
        self._set_state(w, WorkerState.DEAD, why)
        self._tell_peers_dead(w)
        for flight in [f for f in self._flights.values() if f.decode is w and f.is_early_decode]:
            self._drop_early_decode(flight)  # NOTE: its prefill goes on; the handoff picks another worker
        for flight in [f for f in self._flights.values() if f.depends_on(w) and not f.done]:
            self._migrate(flight, f"worker {w.worker_id} failed: {why}")

    def _tell_peers_dead(self, w: WorkerRef) -> None:
        # NOTE: peers stop waiting on it at once instead of sitting out transfer timeouts with other
        # workers' transfers queued behind.
        for peer in self._live_peers(w):
            self._send(peer, PeerDead(w.worker_id, w.info.incarnation))

    def _live_peers(self, w: WorkerRef) -> Sequence[WorkerRef]:
        return [p for p in self._workers.values() if p is not w and p.state != WorkerState.DEAD]


def _model_identity(info: WorkerInfo) -> tuple[str, int]:
    """What workers of one cluster must agree on: the checkpoint (by fingerprint: its path differs
    between hosts, e.g. each node's copy of a Ray working_dir) and the vocabulary."""
    return (info.model_fingerprint or info.model_dir, info.vocab_size)

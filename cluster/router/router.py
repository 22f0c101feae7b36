"""Router: the request path. Picks workers, drives prefill -> handoff -> decode, re-yields tokens, migrates
requests off dead workers, drains workers for scale-down, aborts, deadlines, health.

Runs on one asyncio loop in the router process (which also hosts the HTTP server). Hot messages are the
typed, authenticated frames of cluster/wire.py over ZMQ: one PUSH socket per worker for ops, one PULL
socket for every event coming back (cluster/router/events.py, read from the loop's selector). A bad frame is counted and dropped; no frame can end a task.

The router composes: cluster/router/membership.py (which workers there are and their states: admit,
heartbeat, lifecycle, drain, death), cluster/router/flights.py (each request's state across its attempts),
cluster/router/handoff.py (the decode side: early decode admission, the handoff), route decisions and
their reasons (cluster/router/routing.py, over the placement policy of cluster/router/placement.py and
the workers' KV events in cluster/router/kv_index.py, fed by cluster/router/kv_feed.py), prefix pulls
between workers (cluster/router/pulls.py) and SLO-aware admission (cluster/router/admission.py).

Migration: a request whose worker died is dispatched again, as prompt + the tokens already streamed, to
a surviving path (``Generate.output_token_ids``: computed, not re-sampled, so greedy continues token for
token and a seeded request continues its random stream); at most ``max_migrations`` times. Each attempt
has its own wire id (``<request id>~<attempt>``), so late events of an abandoned attempt are dropped.
With ``colocated_fallback``, workers of either pool serve whole requests when the other pool is empty.

Modes: ``disaggregated`` (prefill pool, then a decode pool), ``colocated`` (one pool does both),
``conditional`` (a decode worker prefills the request itself when the cost model predicts that cheaper;
without a cost profile, when the prompt has at most ``conditional_max_prompt_tokens``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any, assert_never

import zmq

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
    RouterError,
    TokenDelta,
    WorkerFailedError,
    WorkerStats,
    router_error,
)
from cluster.router.admission import SloAdmission, build_admission
from cluster.router.events import EventSocket
from cluster.router.flights import Flight, Flights
from cluster.router.handoff import FailedTransfers, Handoffs
from cluster.router.kv_feed import KvFeed
from cluster.router.kv_index import KvIndex
from cluster.router.membership import Membership, WorkerRef
from cluster.router.predict import Predictor, TrafficLog
from cluster.router.pulls import Pulls
from cluster.router.routing import Pools, PrefixView, Route, decide
from cluster.router.stream import OutputListener, RequestStream
from cluster.wire import (
    Abort,
    Deltas,
    Event,
    ExtendLease,
    Generate,
    Heartbeat,
    KeepAlive,
    KvEvents,
    Op,
    Prefilled,
    PrefixFetched,
    PrefixOffered,
    RequestFailed,
    Transferred,
    WireEncoder,
    WorkerFailed,
    WorkerGone,
)

logger = logging.getLogger(__name__)


class Router:
    """See the module docstring. ``secret`` authenticates every control frame (cluster/frames.py).

    Lifecycle: ``start`` (on the loop that will run it) starts the receive loop and the heartbeat monitor;
    ``close`` ends them and every lifecycle watch and closes the sockets."""

    def __init__(
        self,
        config: RouterConfig,
        secret: bytes,
        *,
        served_model_name: str | None = None,
        bind_host: str = "127.0.0.1",
        predictor: Predictor | None = None,
        replica: int = 0,
        event_port: int = 0,
    ) -> None:
        """``predictor``: the cost model behind conditional routing and admission (None: the prompt-length
        rule; ``admission: slo`` needs one). ``replica``: this router's front-end replica index;
        ``event_port``: where its event socket listens (0: any free port; a restarted replica takes its
        predecessor's, which the workers' sockets reconnect to by themselves)."""
        self.config = config
        self.mode = config.mode
        self.predictor = predictor
        self.admission: SloAdmission | None = build_admission(config)
        if self.admission is not None and predictor is None:
            raise ValueError("router admission 'slo' needs a cost profile to predict TTFT with (predictor)")
        self.prefix_view = PrefixView()
        # NOTE: fed under both policies (a benchmark compares them); read only by "index"
        self.kv_index = KvIndex(config.kv_index_max_blocks_per_worker, config.kv_index_max_workers)
        self.kv_feed = KvFeed(self.kv_index, lambda wid: self.members.get(wid), self._send)
        self.traffic = TrafficLog(config.advice_window_s)
        self._route_counts: dict[tuple[str, str], int] = {}
        self.served_model_name = served_model_name
        self._flights = Flights()
        self.replica = replica
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.events = EventSocket(self._ctx, secret, replica, bind_host, event_port, self._on_event)
        self.endpoint = self.events.endpoint
        self._reject = self.events.decoder.verifier.reject
        self.members = Membership(
            config,
            self._ctx,
            WireEncoder(secret),
            reject=self._reject,
            on_death=self._on_worker_dead,
            on_removed=self._forget_worker,
            on_state=lambda w: self.kv_feed.on_state(w),
            replica=replica,
        )
        self._handoffs = Handoffs(self.members, self.prefix_view)
        self._failed_transfers = FailedTransfers(config.health_timeout_s, self._migrate, self._fail)
        self.pulls = Pulls(config, self.members, self.kv_index, predictor, self._send_generate, self._fail)
        self._loops: list[asyncio.Task[None]] = []

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        # NOTE: these two run until close(); a lifecycle watch ends when its actor is unwatched.
        self._loops = [
            asyncio.create_task(self.events.run(), name="router-receive"),
            asyncio.create_task(self.members.monitor(), name="router-heartbeats"),
        ]

    async def close(self) -> None:
        tasks = [*self._loops, *self.members.watch_tasks()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self.members.close()
        self.events.close()
        self._ctx.term()

    def watch(self, worker_id: str, actor: Any) -> None:
        """Watch an actor's lifecycle through Ray (anything with ``.ping.remote()``); call on the loop."""
        self.members.watch(worker_id, actor)

    def unwatch(self, worker_id: str) -> None:
        self.members.unwatch(worker_id)

    async def wait_admitted(self, worker_ids: Sequence[str], timeout_s: float) -> None:
        """Until every worker in ``worker_ids`` has registered and is healthy (bounded)."""
        await self.members.wait_admitted(worker_ids, timeout_s)

    async def wait_healthy(self, timeout_s: float) -> None:
        """Until ``is_healthy()`` (a worker of every pool the mode needs is admitted and healthy),
        bounded: TimeoutError naming what is missing."""
        try:
            await self.members.wait_until(self.is_healthy, timeout_s)
        except TimeoutError:
            pools = sorted(self.members.healthy_pools())
            raise TimeoutError(
                f"router not healthy within {timeout_s:.0f} s (healthy pools: {pools})"
            ) from None

    @property
    def workers(self) -> list[WorkerRef]:
        return self.members.workers

    @property
    def model_info(self) -> ModelInfo:
        """What the edge validates against: the served model, the smallest max_model_len of the
        admitted workers."""
        return self.members.model_info(self.served_model_name)

    def dead_tasks(self) -> list[str]:
        """The router's own loops that ended (each should run until close)."""
        return [t.get_name() for t in self._loops if t.done()]

    def is_healthy(self) -> bool:
        """The router's loops all run and some path serves a request end to end."""
        if not self._loops or self.dead_tasks():
            return False
        pools = self.members.healthy_pools()
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
        return self.members.worker_stats()

    def rejected_frames(self) -> dict[str, int]:
        """Control frames the router itself dropped, by reason."""
        return self.events.decoder.rejected()

    def route_decisions(self) -> dict[tuple[str, str], int]:
        """Routing decisions so far by (mode, reason): ``pdserve_route_decisions_total``."""
        return dict(self._route_counts)

    # ---- the request path -----------------------------------------------------------------------------
    def open(
        self,
        req: GenerateRequest,
        listener: OutputListener | None = None,
        *,
        max_unread_bytes: int | None = None,
        unread_elsewhere: Callable[[], int] | None = None,
    ) -> RequestStream:
        """Route and send ``req``; its output arrives in the returned stream (cluster/router/stream.py),
        told to ``listener`` as it comes (None: the stream is an async iterator). Raises RouterError
        before anything is queued (queue full, a duplicate id, no healthy path, SLO refusal).

        The stream ends with the final delta (it carries finish_reason and timings) or with a RouterError
        (``stream.error``); ``stream.close()`` aborts the request everywhere if it has not ended. A
        consumer that leaves more than ``max_unread_bytes`` untaken (with what ``unread_elsewhere()``
        says it holds itself) has its request aborted on its workers and its stream ended with
        RequestAbortedError ``stream_stalled``."""
        if len(self._flights) >= self.config.max_pending_requests:
            raise QueueFullError(f"{len(self._flights)} requests in flight (max_pending_requests)")
        if req.request_id in self._flights:
            raise InvalidRequestError(f"request_id {req.request_id!r} is already in flight")
        arrival = time.time()
        deadline = req.deadline if req.deadline is not None else arrival + self.config.request_timeout_s
        stream = RequestStream(
            req.request_id, listener, max_unread_bytes=max_unread_bytes, unread_elsewhere=unread_elsewhere
        )
        flight = Flight(req, arrival, deadline, stream)
        route = self._route(flight)
        self._admit_or_refuse(flight, route)
        self._flights.add(flight)
        self._arm_deadline(flight)
        try:
            self._commit(flight, route)
        except BaseException:
            flight.is_ended = True
            self._settle(flight, finished=False)
            raise
        stream.on_close(lambda: self._on_stream_closed(flight))
        return stream

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """``open`` for an in-process caller: the request's deltas (merged while the caller falls behind);
        the last has finish_reason and timings. Raises RouterError. If the caller stops iterating early,
        the request is aborted everywhere."""
        stream = self.open(req)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def _dispatch(self, flight: Flight) -> None:
        """Send the flight's current attempt to a worker; raises ClusterUnavailableError if none can."""
        self._commit(flight, self._route(flight))

    def _route(self, flight: Flight) -> Route[WorkerRef]:
        """Where the flight's current attempt goes and why (cluster/router/routing.py); changes nothing.
        NOTE: a migrated request already streaming is finished whole somewhere (prompt + its tokens)."""
        healthy = self.members.healthy
        pools = Pools(healthy("prefill"), healthy("decode"), healthy("colocated"))
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
            index=self.kv_index if self.config.prefix_routing == "index" else None,
            resume=bool(flight.token_ids),
        )

    def _admit_or_refuse(self, flight: Flight, route: Route[WorkerRef]) -> None:
        """SLO-aware admission: raise SloUnattainableError (HTTP 429) when the route's predicted TTFT or
        TBT misses the request's SLO; nothing has been queued or counted yet."""
        if self.admission is None:
            return
        req = flight.req
        refusal = self.admission.refusal(
            route.predicted_ttft_s,
            route.predicted_tbt_s,
            req.ttft_slo_s,
            route.worker.worker_id,
            route.tbt_worker_id,
        )
        if refusal is not None:
            self.traffic.record(flight.arrival, len(req.prompt_token_ids), req.params.max_tokens)
            raise refusal

    def _commit(self, flight: Flight, route: Route[WorkerRef]) -> None:
        """Carry out a route decision: count it, remember its blocks on the worker, send the request."""
        w = route.worker
        key = (route.mode, route.reason)
        self._route_counts[key] = self._route_counts.get(key, 0) + 1
        flight.route, flight.block_hashes = route.info(), route.block_hashes
        self.prefix_view.record(w.worker_id, route.block_hashes, w.info.num_blocks)
        num_tokens = len(flight.req.prompt_token_ids) + len(flight.token_ids)
        queued = num_tokens if route.queued_tokens is None else route.queued_tokens
        flight.assign(w, "prefill" if route.hold else "decode", queued)
        if not self.pulls.start(flight, route, flight.req.prompt_token_ids + flight.token_ids):
            self._send_generate(flight, w, hold=route.hold)  # NOTE: else once the prefix pull ends
        if route.hold and self.config.early_decode_admission and flight.req.params.max_tokens > 1:
            self._handoffs.admit_early(flight, w)

    def _send_generate(self, flight: Flight, w: WorkerRef, hold: bool) -> None:
        req = flight.req
        op = Generate(
            flight.wire_id,
            req.prompt_token_ids,
            req.params,
            flight.deadline,
            hold,
            list(flight.token_ids),
            owner=self.members.owner,
        )
        self._send(w, op)

    def _arm_deadline(self, flight: Flight) -> None:
        """One timer per flight (``flight.deadline_timer``, cancelled when it ends) ends it with
        DeadlineExceededError at its deadline."""
        loop = asyncio.get_running_loop()

        def check() -> None:
            if flight.is_ended:
                return
            left = flight.deadline - time.time()
            if left <= 0:
                self._fail(
                    flight, DeadlineExceededError(f"request {flight.req.request_id!r} passed its deadline")
                )
            else:  # NOTE: the loop's clock and the wall clock may drift apart: wait the rest
                flight.deadline_timer = loop.call_later(left, check)

        flight.deadline_timer = loop.call_later(max(0.0, flight.deadline - time.time()), check)

    def _deliver(self, flight: Flight, delta: TokenDelta) -> None:
        """A delta of the flight's current attempt arrived: into its stream, as it came (a decode step's) or
        rewritten (``_deliver_rewritten``)."""
        flight.token_ids += delta.token_ids
        if flight.first_token_time is None:
            self._first_token(flight, delta.scheduled_time)
        if delta.finish_reason is not None or delta.request_id != flight.req.request_id:
            self._deliver_rewritten(flight, delta)
        elif flight.stream.put(delta):
            self._abort_overflowed(flight)

    def _deliver_rewritten(self, flight: Flight, delta: TokenDelta) -> None:
        """A migrated attempt's delta under the request's own id; the final one with the flight's timings
        (and the flight then ends). NOTE: copies: a delta is a wire message's payload, never changed."""
        if delta.request_id != flight.req.request_id:
            delta = replace(delta, request_id=flight.req.request_id)
        if delta.finish_reason is None:
            if flight.stream.put(delta):
                self._abort_overflowed(flight)
            return
        flight.is_ended = True
        self._settle(flight, finished=True)
        flight.stream.put(replace(delta, timings=flight.timings()))

    def _first_token(self, flight: Flight, scheduled_time: float | None) -> None:
        flight.first_token_time = time.time()
        flight.scheduled_time = scheduled_time
        if self.admission is not None and flight.attempt == 0 and flight.route is not None:
            measured = flight.first_token_time - flight.arrival
            self.admission.observe(flight.route.predicted_ttft_s, measured)

    def _fail(self, flight: Flight, error: RouterError) -> None:
        """End the flight with ``error`` (after the output its stream holds), aborting it everywhere."""
        if flight.is_ended:
            return
        flight.is_ended = True
        self._settle(flight, finished=False)
        flight.stream.fail(error)

    def _on_stream_closed(self, flight: Flight) -> None:
        """Its consumer left: abort it everywhere unless it has ended."""
        if not flight.is_ended:
            flight.is_ended = True
            self._settle(flight, finished=False)

    def _settle(self, flight: Flight, finished: bool) -> None:
        """The flight ended (``finished``, or failed, or abandoned): release router counters, abort it on
        its workers unless it finished (``Flight.release`` says which), forget it."""
        if flight.deadline_timer is not None:
            flight.deadline_timer.cancel()
            flight.deadline_timer = None
        self._release(flight, abort=not finished)
        self._flights.remove(flight)
        out = len(flight.token_ids) if finished else flight.req.params.max_tokens
        self.traffic.record(flight.arrival, len(flight.req.prompt_token_ids), out)

    def _release(self, flight: Flight, abort: bool) -> None:
        """Drop the flight's worker assignments, telling live ones to abort its current attempt
        (``Flight.release`` says which)."""
        for w in flight.release(abort):
            self._send(w, Abort(flight.wire_id))

    def _migrate(self, flight: Flight, why: str) -> None:
        """Dispatch the flight again (a new attempt) or, past max_migrations, fail it."""
        if flight.is_ended:
            return
        if flight.attempt >= self.config.max_migrations:
            limit = self.config.max_migrations
            self._fail(
                flight, WorkerFailedError(f"{why}; request not migrated again (max_migrations {limit})")
            )
            return
        self._release(flight, abort=True)
        self._flights.next_attempt(flight)
        try:
            self._dispatch(flight)
        except ClusterUnavailableError as e:
            self._fail(flight, ClusterUnavailableError(f"{why}; {e}"))
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
        """Idempotent: every worker holding the request frees it; its stream ends with
        RequestAbortedError."""
        flight = self._flights.get(request_id)
        if flight is not None:
            self._fail(flight, RequestAbortedError("aborted"))

    def _send(self, w: WorkerRef, op: Op) -> None:
        self.members.send(w, op)

    # ---- what membership tells the request path -------------------------------------------------------
    def _on_worker_dead(self, w: WorkerRef, why: str) -> None:
        """``w`` died (its peers were told): its requests move on."""
        self._failed_transfers.on_dead(w)
        for flight in [f for f in self._flights if f.decode is w and f.is_early_decode]:
            flight.drop_early_decode()  # NOTE: its prefill goes on; the handoff picks another worker
        for flight in [f for f in self._flights if f.depends_on(w)]:
            self._migrate(flight, f"worker {w.worker_id} failed: {why}")
        self.pulls.on_dead(w)  # NOTE: after the migrations: a moved flight gets nothing from its old pull

    def _forget_worker(self, worker_id: str) -> None:
        """The worker is gone for good: the routing views forget it."""
        self.prefix_view.forget(worker_id)
        self.kv_index.forget(worker_id)
        if self.admission is not None:
            self.admission.forget(worker_id)

    async def drain(self, worker_id: str, timeout_s: float) -> None:
        """Scale-down: route nothing new to the worker; wait (bounded) for its requests to finish, migrate
        the rest, then forget it (the caller stops the actor)."""
        w = self.members.start_drain(worker_id)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._flights.held_by(w):
            await asyncio.sleep(0.05)  # NOTE: a bounded poll of the router's own state
        for flight in self._flights.held_by(w):
            self._migrate(flight, f"worker {worker_id} drained")
        self.members.retire(w)

    # ---- events from the workers ----------------------------------------------------------------------
    def _on_event(self, event: Event) -> None:
        if isinstance(event, Heartbeat):
            self._on_heartbeat(event)
            return
        if isinstance(event, KvEvents):
            self.kv_feed.on_events(event)
            return
        w = self.members.get(event.worker_id)
        if w is None:
            self._reject("unknown_worker")
            return
        match event:
            case WorkerFailed():
                self.members.mark_dead(w, f"it reported: {event.reason}")
            case RequestFailed():
                self._on_request_failed(w, event)
            case Deltas():
                for delta in event.deltas:
                    self._on_delta(w, delta)
            case Prefilled():
                if not self._on_prefilled(w, event):
                    # NOTE: the caller went away (or the request moved on) while prefill ran: let go of it.
                    self._send(w, Abort(event.delta.request_id))
            case Transferred():
                flight = self._flights.of(w, event.request_id)
                if flight is not None:
                    flight.transfer_s = event.seconds
            case WorkerGone():
                self.members.on_gone(event)
            case PrefixOffered() | PrefixFetched():
                self.pulls.on_answer(w, event)
            case KeepAlive():
                flight = self._flights.current(event.request_id)
                if flight is not None and flight.decode is w and flight.prefill is not None:
                    self._send(flight.prefill, ExtendLease(event.request_id))
            case _:
                assert_never(event)

    def _on_heartbeat(self, event: Heartbeat) -> None:
        w = self.members.on_heartbeat(event)
        if w is not None:
            self.kv_feed.check(w)
        if w is not None and len(self._failed_transfers):
            self._failed_transfers.on_heartbeat(w)
        if w is None or self.admission is None or self.predictor is None or w.pool == "prefill":
            return
        step = self.predictor.step_now_s(w)
        self.admission.observe_steps(w.worker_id, w.last_beat, event.stats.engine.num_steps, step)

    def _on_delta(self, w: WorkerRef, delta: TokenDelta) -> None:
        """A decode step's delta (the token path: one per running request per step)."""
        flight = self._flights.of(w, delta.request_id)
        if flight is None:
            return
        if flight.queued_on is w:
            flight.unqueue()
        self._deliver(flight, delta)

    def _on_prefilled(self, w: WorkerRef, event: Prefilled) -> bool:
        """A held request's first token: to its stream, then its KV handed to a decode worker (or the
        flight migrates when none can take it). False: the flight is gone (its caller left, or it moved
        on)."""
        flight = self._flights.of(w, event.delta.request_id)
        if flight is None:
            return False
        if flight.queued_on is w:
            flight.unqueue()
        self._deliver(flight, event.delta)
        if not flight.is_ended and not self._handoffs.hand_off(flight, event):
            self._migrate(flight, "no healthy decode worker for the handoff")
        return True

    def _abort_overflowed(self, flight: Flight) -> None:
        """The flight's consumer has left more than its bound of output untaken (a stalled stream): a
        worker cannot pause one request, so it is aborted on its workers now (its KV freed, nothing more
        taken) and the consumer finds the error after the output its stream holds."""
        stream = flight.stream
        num_bytes, limit = stream.num_unread_bytes, stream.max_unread_bytes
        what = "router: aborted %s: its consumer left %d bytes untaken (stream_buffer_bytes %s)"
        logger.warning(what, flight.req.request_id, num_bytes, limit)
        why = f"stream_stalled: the caller left {num_bytes} bytes of this request's output untaken "
        self._fail(flight, RequestAbortedError(why + f"(stream_buffer_bytes {limit}); generation aborted"))

    def _on_request_failed(self, w: WorkerRef, event: RequestFailed) -> None:
        flight = self._flights.of(w, event.request_id)
        if flight is None:
            return
        error = router_error(event.code, event.message)
        if event.code == ErrorCode.KV_TRANSFER_FAILED and flight.prefill is not None:
            self._failed_transfers.on_failed(flight, flight.prefill, error)  # NOTE: its source may be dead
            return
        self._fail(flight, error)

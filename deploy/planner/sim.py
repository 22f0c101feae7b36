"""Discrete-event simulation of a whole pdserve cluster: client, HTTP edge, router, workers, KV handoffs.

What runs for real: every worker's ``Scheduler`` / ``KVCacheManager`` / prefix cache (deploy/planner/
twin.py) and the router's placement policy (``cluster.router.placement``: pick_prefill, pick_decode,
pick_least_loaded). What is modelled: time. A step lasts ``CostProfile.step_s(shape)`` at its pool's
tensor-parallel size (``with_tensor_parallel``; stretched
while more CPU workers are busy than the host has cores; a prefill step more, by the profile's
``prefill_weight``; longer by ``handoff_receive_step_s`` / ``handoff_send_step_s`` for each handoff that
its worker received / sent beside the step before it), a KV handoff ``handoff_s``, a control message
``hop_s``, the front end ``frontend_s_per_request`` per new request (shared between the requests it
holds; ``frontend_fifo``: one at a time, on the same server as the tokens) and
``frontend_cpu_per_token_s`` per streamed token (one at a time), the HTTP edge ``http_s`` each way, and an exponential delivery delay per streamed token, of the mean ``delivery_jitter_at``
gives for the number of tokens its step streams, plus ``delivery_jitter_contended_s`` while another
worker is busy too (seeded; each stream's tokens in order). No forward pass, no Ray, no sockets.

The event order mirrors the real paths (cluster/router/router.py, workers/worker.py, workers/decode_role.py):

* client send -> (http) front end: each request's own work, the front end shared between the requests
  it holds (processor sharing: one event loop interleaving their handlers) -> router: the route
  decision (cluster/router/routing.py: mode, worker and reason, as the router decides), SLO-aware admission
  when the router config asks for it (cluster/router/admission.py), count it -> (hop) worker's command queue;
* with early decode admission (the router's default), the decode worker is told at dispatch too
  (hop): it reserves blocks for the prompt while the prefill runs (or once blocks free, while no
  handoff waits) and the KV moves as soon as the prefill offers it;
* a worker's loop turn: read every queued command, retry waiting handoffs, start one step;
* step end: tokens go (hop) to the router, through the front end, (http) to the client; a held
  prefill's first token makes the router pick a decode worker and send it the handoff (hop); the
  decode worker reserves blocks (or waits for them), the transfer runs on both sides' transfer threads
  (one at a time per worker), then the decode side commits (next loop turn) and the prefill side
  releases its blocks;
* the last token settles the router's counters (hop) and frees the client's concurrency slot (http).
"""

from __future__ import annotations

import heapq
import math
import random
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from cluster.block_hash import hash_full_blocks
from cluster.cost_model import CostProfile
from cluster.protocol import SamplingParams
from cluster.router.admission import build_admission
from cluster.router.placement import pick_decode
from cluster.router.predict import Predictor
from cluster.router.routing import Pools, PrefixView, decide
from deploy.planner.twin import Flight, SimConfig, SimWorker
from deploy.planner.workload import Workload
from workers.request import RequestStatus

# event kinds
_SEND, _ROUTE, _DELIVER, _STEP_END, _PREFILLED, _SETTLE, _CLIENT_DONE, _EDGE, _EDGE_DONE = range(9)
_RUNNING = RequestStatus.RUNNING
_RATE_WINDOW_S = 0.25  # time constant of the streamed-token rate
# worker commands
GENERATE, GENERATE_HELD, HANDOFF, KV_DONE, KV_SENT, PREPARE = range(6)


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it (seconds since the start)."""

    prompt_len: int
    output_len: int
    send_s: float = math.nan
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_s: float | None = None
    num_tokens: int = 0
    gaps_s: array = field(default_factory=lambda: array("d"))  # type: ignore[type-arg]
    rejected: str | None = None  # why the cluster refused it (a miss in goodput)
    route: str = ""  # the route's mode (cluster/router/routing.py)
    route_reason: str = ""
    transfer_s: float = 0.0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.send_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.send_s

    @property
    def mean_tbt_s(self) -> float:
        return sum(self.gaps_s) / len(self.gaps_s) if self.gaps_s else 0.0


@dataclass
class SimResult:
    config: SimConfig
    workload_name: str
    records: list[RequestRecord]
    duration_s: float
    num_steps: int
    num_preemptions: int
    worker_busy_s: dict[str, float]
    worker_steps: dict[str, int]
    worker_tokens: dict[str, int]  # tokens sampled there
    prefix_hit_tokens: int
    # handoffs (received or sent) that finished beside a step and were charged to the next one
    worker_charged_handoffs: dict[str, int] = field(default_factory=dict)


class Simulation:
    """Run ``workload`` through ``config`` under ``profile``; ``run()`` returns every request's record.

    ``on_step`` (optional) sees each worker step as it starts (worker, start time, shape, duration):
    tests use it to pin schedules. ``seed``: the random stream of the profile's delivery jitter (the only
    randomness; a run is a function of its inputs)."""

    def __init__(
        self,
        config: SimConfig,
        profile: CostProfile,
        workload: Workload,
        *,
        on_step: Callable[[SimWorker, float, Any, float], None] | None = None,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.profile = profile
        self.workload = workload
        self.on_step = on_step
        if config.mode == "colocated":
            pools = {"colocated": config.num_colocated}
        else:
            pools = {"prefill": config.num_prefill, "decode": config.num_decode}
        self.pools = {
            pool: [SimWorker(f"{pool}-{i}", pool, config) for i in range(n)] for pool, n in pools.items()
        }
        self.workers = [w for ws in self.pools.values() for w in ws]
        router = config.router
        self.admission = build_admission(router)
        # NOTE: predictions cost time per request; only the decisions that read them get a predictor
        predicts = self.admission is not None or (config.mode == "conditional" and config.cost_routing)
        tbt = router.tbt_slo_ms / 1e3 if router.tbt_slo_ms is not None else None
        prefills_on = "colocated" if config.mode == "colocated" else "prefill"
        budget = config.engine_of(prefills_on).max_num_batched_tokens
        # each pool's steps at its own tensor-parallel size (ValueError when the profile cannot say)
        self.step_profiles = {pool: profile.with_tensor_parallel(config.tp_of(pool)) for pool in pools}
        # NOTE: the router predicts with one profile: the pool that prefills (its TTFT is what it judges)
        step_profile = self.step_profiles[prefills_on]
        self.predictor = Predictor(step_profile, budget, tbt) if predicts else None
        self.view = PrefixView() if predicts else None
        self._pools = Pools(
            self.pools.get("prefill", []), self.pools.get("decode", []), self.pools.get("colocated", [])
        )
        self.records = [RequestRecord(r.prompt_len, r.output_len) for r in workload.requests]
        self.flights: dict[str, Flight] = {}  # by request id
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = count()
        self._num_busy = 0  # workers in a step or polling for work they cannot schedule yet
        self._token_rate = 0.0  # tokens/s streamed through the front end (exponential moving average)
        self._token_rate_t = 0.0
        self._frontend_free = 0.0  # the front end is busy with earlier tokens until then
        self.transfer_busy_s = 0.0  # the KV handoffs' own seconds (their links' queueing aside)
        self.spinning_transfer_s = 0.0  # of those, the ones beside a spinning worker
        # new requests in the front end, shared between them (processor sharing, in virtual time: each
        # has received `_edge_v` seconds of work, the min-heap holds the virtual time each one is done)
        self._edge: list[tuple[float, int]] = []
        self._edge_v = 0.0
        self._edge_t = 0.0
        self._edge_gen = 0  # of the one pending _EDGE_DONE event that counts
        self._edge_fifo_free = 0.0  # a front end taking new requests in order is busy until then
        self._rng = random.Random(seed)
        self._slots = workload.max_concurrency or 0
        self._backlog: deque[int] = deque()
        self.now = 0.0

    # ---- the loop -------------------------------------------------------------------------------------
    def _at(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self) -> SimResult:
        for w in self.workers:
            w.beat(0.0, self.config.heartbeat_interval_s)
        for i, r in enumerate(self.workload.requests):
            self._at(0.0 if self.workload.max_concurrency else r.arrival_s, _SEND, i)
        handlers: dict[int, Callable[[float, Any], None]] = {
            _SEND: self._on_send,
            _ROUTE: self._on_route,
            _DELIVER: self._on_deliver,
            _STEP_END: self._on_step_end,
            _PREFILLED: self._on_prefilled,
            _SETTLE: self._on_settle,
            _CLIENT_DONE: self._on_client_done,
            _EDGE: self._on_edge,
            _EDGE_DONE: self._on_edge_done,
        }
        events = self._events
        while events:
            t, _, kind, payload = heapq.heappop(events)
            self.now = t
            handlers[kind](t, payload)
        return SimResult(
            self.config,
            self.workload.name,
            self.records,
            max((r.finish_s or r.send_s for r in self.records), default=0.0),
            sum(w.num_steps for w in self.workers),
            sum(w.scheduler.num_preemptions for w in self.workers),
            {w.worker_id: w.busy_s for w in self.workers},
            {w.worker_id: w.num_steps for w in self.workers},
            {w.worker_id: w.num_tokens for w in self.workers},
            sum(
                w.scheduler.kv.prefix_cache.num_hit_tokens
                for w in self.workers
                if w.scheduler.kv.prefix_cache is not None
            ),
            {w.worker_id: w.num_charged_handoffs for w in self.workers},
        )

    # ---- client ---------------------------------------------------------------------------------------
    def _on_send(self, t: float, index: int) -> None:
        if self.workload.max_concurrency:
            if self._slots == 0:
                self._backlog.append(index)
                return
            self._slots -= 1
        self.records[index].send_s = t
        per_request = self.profile.frontend_s_per_request
        if per_request and self.profile.frontend_fifo:
            # NOTE: one at a time, in arrival order (CostProfile.frontend_fifo), on the event loop that
            # streams the tokens too: the front end is busy for both
            start = max(t + self.profile.http_s, self._frontend_free)
            self._frontend_free = self._edge_fifo_free = start + per_request
            self._at(self._frontend_free, _ROUTE, index)
            return
        self._at(t + self.profile.http_s, _EDGE if per_request else _ROUTE, index)

    def _on_client_done(self, t: float, index: int) -> None:
        if not self.workload.max_concurrency:
            return
        self._slots += 1
        if self._backlog:
            self._on_send(t, self._backlog.popleft())

    # ---- front end: new requests -----------------------------------------------------------------------
    def _on_edge(self, t: float, index: int) -> None:
        """A request reaches the front end: it shares the front end with the others there."""
        self._edge_advance(t)
        heapq.heappush(self._edge, (self._edge_v + self.profile.frontend_s_per_request, index))
        self._edge_next(t)

    def _on_edge_done(self, t: float, gen: int) -> None:
        if gen != self._edge_gen:
            return  # NOTE: a request came in since, and moved the next completion
        self._edge_advance(t)
        edge, done = self._edge, []
        while edge and edge[0][0] <= self._edge_v + 1e-12:
            done.append(heapq.heappop(edge)[1])
        self._edge_next(t)
        for index in done:
            self._on_route(t, index)

    def _edge_advance(self, t: float) -> None:
        if self._edge:
            self._edge_v += (t - self._edge_t) / len(self._edge)
        self._edge_t = t

    def _edge_next(self, t: float) -> None:
        self._edge_gen += 1
        if self._edge:
            left = max(0.0, self._edge[0][0] - self._edge_v)
            self._at(t + left * len(self._edge), _EDGE_DONE, self._edge_gen)

    # ---- router ---------------------------------------------------------------------------------------
    def _on_route(self, t: float, index: int) -> None:
        router = self.config.router
        rec = self.records[index]
        if len(self.flights) >= router.max_pending_requests:
            rec.rejected = "queue_full"
            self._client_done(index, t + self.profile.http_s)
            return
        req = self.workload.requests[index]
        prompt = self.workload.prompt_tokens(index)
        if len(prompt) + req.output_len > self.config.max_model_len:
            rec.rejected = "too_long"
            self._client_done(index, t + self.profile.http_s)
            return
        params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
        route = decide(
            self.config.mode, prompt, self._pools, router, predictor=self.predictor, view=self.view
        )
        admission = self.admission
        tbt_worker = route.tbt_worker_id
        if (
            admission is not None
            and not admission.check(
                route.predicted_ttft_s, route.predicted_tbt_s, decode_worker_id=tbt_worker
            ).ok
        ):
            rec.rejected = "slo_unattainable"
            self._client_done(index, t + self.profile.http_s)
            return
        flight = Flight(
            index,
            str(index),
            prompt,
            params,
            predicted_ttft_s=route.predicted_ttft_s,
            predicted_tbt_s=route.predicted_tbt_s,
        )
        self.flights[flight.request_id] = flight
        w = route.worker
        rec.route, rec.route_reason = route.mode, route.reason
        if route.hold:
            flight.prefill, cmd = w, GENERATE_HELD
        else:
            flight.decode, cmd = w, GENERATE
        if self.view is not None:
            self.view.record(w.worker_id, route.block_hashes, w.num_kv_blocks - 1)
        w.queue(flight)
        w.num_assigned += 1
        self._at(t + self.profile.hop_s, _DELIVER, (w, cmd, flight))
        if route.hold and router.early_decode_admission and params.max_tokens > 1:
            # early decode admission (cluster/router/handoff.py): the decode worker is picked now and
            # reserves blocks while the prefill runs
            d = pick_decode(self.pools["decode"])
            flight.decode, flight.is_early = d, True
            d.num_assigned += 1
            self._at(t + self.profile.hop_s, _DELIVER, (d, PREPARE, flight))

    def _on_prefilled(self, t: float, flight: Flight) -> None:
        if flight.prefill is not None:
            flight.prefill.unqueue(flight)
        w = flight.decode
        if w is None:
            w = flight.decode = pick_decode(self.pools["decode"])
            w.num_assigned += 1
        if self.view is not None:
            hashes = hash_full_blocks(flight.prompt, w.block_size)
            self.view.record(w.worker_id, hashes, w.num_kv_blocks - 1)
        self._at(t + self.profile.hop_s, _DELIVER, (w, HANDOFF, flight))

    def _on_settle(self, t: float, flight: Flight) -> None:
        for w in (flight.prefill, flight.decode):
            if w is not None:
                w.num_assigned -= 1
        self.records[flight.index].transfer_s = flight.transfer_s
        del self.flights[flight.request_id]

    def _client_done(self, index: int, t: float) -> None:
        self.records[index].finish_s = t
        self._at(t, _CLIENT_DONE, index)

    # ---- workers --------------------------------------------------------------------------------------
    def _on_deliver(self, t: float, payload: tuple[SimWorker, int, Flight]) -> None:
        w, cmd = payload[0], payload[1]
        if w.in_step and cmd in (KV_DONE, KV_SENT):  # a handoff finished on a transfer thread, beside a step
            if cmd == KV_DONE:
                w.received_beside += 1
                w.received_tokens_beside += payload[2].num_kv_tokens
            else:
                w.sent_beside += 1
        w.inbox.append((cmd, payload[2]))
        if not w.in_step:
            self._turn(w, t)

    def _turn(self, w: SimWorker, t: float) -> None:
        """One pass of the worker's step loop: commands, waiting handoffs, then one step (if any)."""
        was_busy = w.spinning  # a turn never runs during a step
        received, sent, received_tokens = w.received_beside, w.sent_beside, w.received_tokens_beside
        w.received_beside = w.sent_beside = w.received_tokens_beside = 0
        while w.inbox:
            cmd, flight = w.inbox.popleft()
            if cmd in (GENERATE, GENERATE_HELD):
                w.add(flight, hold=cmd == GENERATE_HELD)
            elif cmd == HANDOFF:
                self._on_handoff(w, flight, t)
            elif cmd == KV_DONE:
                flight.is_kv_here = True
                if not flight.is_early or flight.is_first_here:
                    w.commit(flight)
            elif cmd == PREPARE:
                w.early[flight.request_id] = flight
                if not w.pending:
                    self._reserve_early(w, flight, t)
            else:  # KV_SENT
                w.scheduler.release(flight.request_id)
        # NOTE: the decode role's poll: early admissions (while no handoff waits), then waiting handoffs
        if w.early and not w.pending:
            for flight in list(w.early.values()):
                if not self._reserve_early(w, flight, t):
                    break
        while w.pending and self._start_transfer(w, w.pending[0], t):
            w.pending.popleft()
        beat = w.beat(t, self.config.heartbeat_interval_s)
        if beat and self.admission is not None and self.predictor is not None and w.pool != "prefill":
            self.admission.observe_steps(w.worker_id, t, w.num_steps, self.predictor.step_now_s(w))
        shape = w.begin_step() if w.scheduler.waiting or w.scheduler.running else None
        busy = shape is not None or w.has_work
        if busy != was_busy:
            self._num_busy += 1 if busy else -1
        w.spinning = shape is None and w.has_work
        if shape is None:
            return
        step_s = self.step_profiles[w.pool].step_s(shape) * self._slowdown(t, w.pool == "prefill")
        if w.link_free_s > t:  # its transfer thread moves KV meanwhile
            step_s += self.profile.host_transfer_s
        if received or sent:
            # NOTE: what the handoffs that finished beside the last step cost it; the twin fixed that
            # step's end when it began, so the step after it (if one follows at once) takes it instead
            prof = self.profile
            step_s += received * prof.handoff_receive_step_s + sent * prof.handoff_send_step_s
            step_s += received_tokens * prof.handoff_receive_token_s
            w.num_charged_handoffs += received + sent
        w.busy_s += step_s
        if self.on_step is not None:
            self.on_step(w, t, shape, step_s)
        self._at(t + step_s, _STEP_END, w)

    def _slowdown(self, t: float, prefill: bool = False) -> float:
        """CPU workers sharing ``host_cpus`` cores (with the front end: one core while it holds new
        requests, else its CPU per streamed token): a step stretches by demand / cores while the demand
        exceeds the cores; a prefill step by (1 + prefill_weight x (demand - 1)) / cores."""
        cpus = self.profile.host_cpus
        if not cpus:
            return 1.0
        demand = float(self._num_busy)
        if self._edge or self._edge_fifo_free > t:
            demand += 1.0
        elif self.profile.frontend_cpu_per_token_s:
            rate = self._token_rate * math.exp((self._token_rate_t - t) / _RATE_WINDOW_S)
            demand += min(1.0, rate * self.profile.frontend_cpu_per_token_s)
        if prefill and demand > 1.0:
            demand = 1.0 + self.profile.prefill_weight * (demand - 1.0)
        return max(1.0, demand / cpus)

    def _on_handoff(self, w: SimWorker, flight: Flight, t: float) -> None:
        """A DecodeHandoff (the first token): an early reservation commits once its KV is here too; any
        other request reserves blocks now (or waits for them) and fetches its KV."""
        if flight.is_reserved:
            flight.is_first_here = True
            if flight.is_kv_here:
                w.commit(flight)
            return
        if w.early.pop(flight.request_id, None) is not None:
            flight.is_early = False  # NOTE: never reserved early: the usual path
        if not self._start_transfer(w, flight, t):
            w.pending.append(flight)

    def _reserve_early(self, w: SimWorker, flight: Flight, t: float) -> bool:
        """An early admission reserves blocks and posts its fetch (False: blocks or seats are short); the
        KV moves as soon as the prefill offers it."""
        num_tokens = w.reserve(flight, None)
        if num_tokens is None:
            return False
        del w.early[flight.request_id]
        flight.is_reserved, flight.num_kv_tokens = True, num_tokens
        if flight.is_offered:
            self._transfer(w, flight, t, num_tokens)
        return True

    def _start_transfer(self, w: SimWorker, flight: Flight, t: float) -> bool:
        num_tokens = w.reserve(flight, 0)
        if num_tokens is None:
            return False
        self._transfer(w, flight, t, num_tokens)
        return True

    def _transfer(self, w: SimWorker, flight: Flight, t: float, num_tokens: int) -> None:
        """The KV moves on both sides' transfer threads (one transfer at a time on each), slower while
        either side spins (``CostProfile.spinning_transfer_scale``)."""
        sender = flight.prefill
        start = max(t, w.link_free_s, sender.link_free_s if sender is not None else 0.0)
        seconds = self.profile.handoff_s(num_tokens)
        # NOTE: a sender blocked on blocks spins as soon as its step ends (the held KV this transfer
        # frees is what it waits for), so it counts as spinning from the start of the transfer on
        if w.spinning or (sender is not None and (sender.spinning or sender.is_blocked)):
            seconds *= self.profile.spinning_transfer_scale
            self.spinning_transfer_s += seconds
        end = start + seconds
        self.transfer_busy_s += seconds
        flight.num_kv_tokens = num_tokens
        w.link_free_s = end
        if sender is not None:
            sender.link_free_s = end
            self._at(end, _DELIVER, (sender, KV_SENT, flight))
        flight.transfer_s = end - t
        self._at(end, _DELIVER, (w, KV_DONE, flight))

    def _on_step_end(self, t: float, w: SimWorker) -> None:
        """Tokens go to the router (hop); the front end (router, HTTP edge, client) handles one token at
        a time, ``frontend_cpu_per_token_s`` each, first come first served; then HTTP to the client."""
        at_router = t + self.profile.hop_s
        http, cost = self.profile.http_s, self.profile.frontend_cpu_per_token_s
        delay = self._rng.expovariate
        free = self._frontend_free
        flights, records = self.flights, self.records
        updated = w.end_step()
        jitter = self.profile.delivery_jitter_at(len(updated))
        if self._num_busy > 1:  # another worker is in a step too (or polling)
            jitter += self.profile.delivery_jitter_contended_s
        if updated and cost and self.profile.host_cpus:
            decay = math.exp((self._token_rate_t - t) / _RATE_WINDOW_S)
            self._token_rate = self._token_rate * decay + len(updated) / _RATE_WINDOW_S
            self._token_rate_t = t
        for request in updated:
            # NOTE: the hot path of a big simulation (once per generated token): kept inline.
            if cost:
                free = (at_router if at_router > free else free) + cost
                done = free
            else:
                done = at_router
            flight = flights[request.request_id]
            rec = records[flight.index]
            arrive = done + http
            if jitter:
                arrive += delay(1.0 / jitter)
                last = rec.last_token_s
                if last is not None and arrive < last:
                    arrive = last  # NOTE: one stream's tokens reach its client in order
            if rec.last_token_s is None:
                rec.first_token_s = arrive
                if flight.prefill is None:
                    w.unqueue(flight)  # NOTE: a held prefill leaves its queue at the handoff (_PREFILLED)
                if self.admission is not None:
                    self.admission.observe(flight.predicted_ttft_s, arrive - rec.send_s)
            else:
                rec.gaps_s.append(arrive - rec.last_token_s)
            rec.last_token_s = arrive
            rec.num_tokens += 1
            status = request.status
            if status is _RUNNING:
                continue
            if status is RequestStatus.SENDING_KV:
                flight.is_offered = True
                if flight.is_reserved and flight.decode is not None:
                    # NOTE: its fetch waited for the offer (transfer/parking.py)
                    self._transfer(flight.decode, flight, t, flight.num_kv_tokens)
                self._at(done, _PREFILLED, flight)
            elif status.is_finished:
                self._at(done, _SETTLE, flight)
                self._client_done(flight.index, arrive)

        self._frontend_free = free
        self._num_busy -= 1
        self._turn(w, t)

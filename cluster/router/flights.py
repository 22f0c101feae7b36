"""Flights: the router's state of each request it carries (across its migrations): which workers hold it,
the stream its output goes to (cluster/router/stream.py), the tokens it streamed so far (a migration goes
on after them), its timings and deadline, and the worker counters it adds to while it is on them.

Each attempt of a request has its own wire id (``<request id>~<attempt>``), so late events of an
abandoned attempt are dropped: ``Flights`` finds a flight by the caller's request id and by its current
attempt's wire id, and keeps the two maps in step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from cluster.protocol import GenerateRequest, RequestTimings, RouteInfo
from cluster.router.membership import WorkerRef, WorkerState
from cluster.router.stream import RequestStream


@dataclass
class Flight:
    """One request in flight through the router (across its migrations)."""

    req: GenerateRequest
    arrival: float
    deadline: float
    stream: RequestStream  # where its output goes
    attempt: int = 0
    prefill: WorkerRef | None = None
    decode: WorkerRef | None = None
    is_early_decode: bool = False  # `decode` holds an early reservation; the handoff has not happened
    # NOTE: counted when a delta arrives (it is in the stream from then on): a migration continues after
    # all of them (none twice, none lost)
    token_ids: list[int] = field(default_factory=list)
    is_ended: bool = False  # finished or failed: the router let go of it (its stream ended)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    transfer_s: float = 0.0
    route: RouteInfo | None = None  # the current attempt's routing decision
    queued_on: WorkerRef | None = None  # the worker whose prefill queue holds the current attempt
    queued_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # of the tokens the current attempt prefills
    deadline_timer: asyncio.TimerHandle | None = None  # ends it at the deadline (Router)

    @property
    def wire_id(self) -> str:
        rid = self.req.request_id
        return rid if self.attempt == 0 else f"{rid}~{self.attempt}"

    @property
    def is_handed_off(self) -> bool:
        """A decode worker has taken the request over (an early reservation does not count)."""
        return self.decode is not None and not self.is_early_decode

    def depends_on(self, w: WorkerRef) -> bool:
        """Its progress needs ``w``: w decodes it, or w prefills it and no decode worker took over yet."""
        if self.decode is w and not self.is_early_decode:
            return True
        return self.prefill is w and not self.is_handed_off

    def holds(self, w: WorkerRef) -> bool:
        """``w`` prefills or decodes it (or reserved blocks for it)."""
        return self.prefill is w or self.decode is w

    # ---- the worker counters it adds to ---------------------------------------------------------------
    def assign(self, w: WorkerRef, role: str, prompt_tokens: int) -> None:
        """``prompt_tokens`` > 0: w must prefill them before the flight's first token (its queue)."""
        if role == "prefill":
            self.prefill = w
        else:
            self.decode = w
        w.num_assigned += 1
        if prompt_tokens > 0:
            self.unqueue()
            self.queued_on, self.queued_tokens = w, prompt_tokens
            w.num_prompt_tokens += prompt_tokens
            w.num_queued_prompts += 1

    def unqueue(self) -> None:
        """The current attempt left its worker's prefill queue (first token back, or released)."""
        w = self.queued_on
        if w is not None:
            w.num_prompt_tokens -= self.queued_tokens
            w.num_queued_prompts -= 1
            self.queued_on, self.queued_tokens = None, 0

    def drop_early_decode(self) -> None:
        """Forget the flight's early decode reservation (the worker is dead or never got it)."""
        if self.is_early_decode and self.decode is not None:
            self.decode.num_assigned -= 1
            self.decode = None
        self.is_early_decode = False

    def release(self, abort: bool) -> list[WorkerRef]:
        """Drop the flight's worker assignments; returns the live workers to tell to abort its current
        attempt (an early decode reservation is aborted even when the request is done: it ended at its
        prefill)."""
        to_abort = []
        for w in {id(x): x for x in (self.prefill, self.decode) if x is not None}.values():
            is_reservation = w is self.decode and self.is_early_decode
            if (abort or is_reservation) and w.state != WorkerState.DEAD:
                to_abort.append(w)
            w.num_assigned -= 1
        self.unqueue()
        self.prefill = self.decode = None
        self.is_early_decode = False
        return to_abort

    def timings(self) -> RequestTimings:
        """Its timings so far (the final delta carries them)."""
        now = time.time()
        first = self.first_token_time or now
        sched = self.scheduled_time or self.arrival
        return RequestTimings(
            queue_s=max(0.0, sched - self.arrival),
            prefill_s=max(0.0, first - sched),
            transfer_s=self.transfer_s,
            decode_s=now - first,
            ttft_s=first - self.arrival,
            e2e_s=now - self.arrival,
            num_migrations=self.attempt,
            route=self.route,
        )


class Flights:
    """The requests in flight: by the caller's request id (``by_request``) and by their current attempt's
    wire id (``by_wire``)."""

    def __init__(self) -> None:
        self.by_request: dict[str, Flight] = {}
        self.by_wire: dict[str, Flight] = {}

    def __len__(self) -> int:
        return len(self.by_request)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_request

    def __iter__(self) -> Iterator[Flight]:
        return iter(self.by_request.values())

    def get(self, request_id: str) -> Flight | None:
        return self.by_request.get(request_id)

    def add(self, flight: Flight) -> None:
        self.by_request[flight.req.request_id] = flight
        self.by_wire[flight.wire_id] = flight

    def next_attempt(self, flight: Flight) -> None:
        """The flight starts a new attempt: events of the old one no longer find it."""
        self.by_wire.pop(flight.wire_id, None)
        flight.attempt += 1
        self.by_wire[flight.wire_id] = flight

    def remove(self, flight: Flight) -> None:
        self.by_request.pop(flight.req.request_id, None)
        self.by_wire.pop(flight.wire_id, None)

    def current(self, wire_id: str) -> Flight | None:
        """The flight whose current attempt has ``wire_id``."""
        return self.by_wire.get(wire_id)

    def of(self, w: WorkerRef, wire_id: str) -> Flight | None:
        """The flight whose current attempt has ``wire_id``, if ``w`` holds it (else its event is late)."""
        flight = self.by_wire.get(wire_id)
        if flight is None or (flight.prefill is not w and flight.decode is not w):
            return None
        return flight

    def held_by(self, w: WorkerRef) -> list[Flight]:
        return [f for f in self.by_request.values() if f.holds(w)]

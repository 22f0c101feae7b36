"""The decode side of a disaggregated request: which decode worker takes it over from its prefill worker,
told early (``PrepareDecode``) and at the handoff (``DecodeHandoff``).

Early decode admission (``early_decode_admission``): the decode worker is picked when the prefill is
dispatched and told at once (``PrepareDecode``), so it reserves blocks and posts its KV fetch while the
prefill runs; the ``DecodeHandoff`` after the prefill then only brings the first token. Until then the
flight's decode worker is a reservation: the request still depends on its prefill worker alone (that one
dying migrates it, and the reservation is aborted with the attempt), and a reserving worker that dies is
just replaced at the handoff.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace

from cluster.protocol import ClusterUnavailableError, RouterError
from cluster.router.flights import Flight
from cluster.router.membership import Membership, WorkerRef, WorkerState
from cluster.router.placement import pick_decode
from cluster.router.routing import PrefixView
from cluster.wire import DecodeHandoff, Prefilled, PrepareDecode


class Handoffs:
    """Picks and tells a flight's decode worker (see the module docstring); the router calls
    ``admit_early`` when it dispatches a prefill and ``hand_off`` when the first token is back."""

    def __init__(self, members: Membership, prefix_view: PrefixView) -> None:
        self.members = members
        self.prefix_view = prefix_view

    def pick_decode_for(self, prefill: WorkerRef | None) -> WorkerRef | None:
        """A healthy decode worker for a handoff from ``prefill`` (None if there is none)."""
        decodes = self.members.healthy("decode")
        if not decodes:
            return None
        if prefill is not None:
            # NOTE: a broken pair is rebuilt on its next use; take another pair while one exists
            sound = [
                d for d in decodes if not (prefill.has_broken_pair_with(d) or d.has_broken_pair_with(prefill))
            ]
            decodes = sound or decodes
        return pick_decode(decodes)

    def admit_early(self, flight: Flight, prefill: WorkerRef) -> None:
        """Pick the decode worker now and let it reserve blocks and post its fetch (best effort)."""
        w = self.pick_decode_for(prefill)
        if w is None or not prefill.info.kv_endpoint:
            return
        flight.assign(w, "decode", 0)
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
            owner=self.members.owner,
        )
        try:
            self.members.send(w, op)
        except ClusterUnavailableError:
            flight.drop_early_decode()  # NOTE: its queue is full: the handoff picks one later

    def hand_off(self, flight: Flight, event: Prefilled) -> bool:
        """Prefill sampled the first token (already on its way to the caller): start the decode side.
        False: no healthy decode worker (nothing was sent; the caller migrates the flight)."""
        req = flight.req
        w = flight.decode
        if w is None or not flight.is_early_decode or w.state == WorkerState.DEAD:
            flight.drop_early_decode()
            w = self.pick_decode_for(flight.prefill)
            if w is None:
                return False
            flight.assign(w, "decode", 0)
        flight.is_early_decode = False
        self._note_decode_side(flight, w)
        first = event.delta.token_ids[0]
        op = DecodeHandoff(
            flight.wire_id,
            req.prompt_token_ids,
            first,
            req.params,
            event.handoff,
            flight.deadline,
            owner=self.members.owner,
        )
        self.members.send(w, op)
        return True

    def _note_decode_side(self, flight: Flight, w: WorkerRef) -> None:
        """The handoff's decode worker and its expected prefix hit join the flight's route; the prompt's
        blocks will be in that worker's prefix cache too."""
        if flight.route is None:
            return
        prompt = flight.req.prompt_token_ids
        hashes = flight.block_hashes
        hit = self.prefix_view.hit_tokens(w.worker_id, hashes, len(prompt), w.block_size)
        flight.route = replace(flight.route, decode_worker=w.worker_id, decode_hit_tokens=hit)
        self.prefix_view.record(w.worker_id, hashes, w.info.num_blocks)


class FailedTransfers:
    """A decode worker's word that a handoff's KV transfer failed (``KV_TRANSFER_FAILED``) may reach the
    router before the news that the KV's source (the prefill worker) died: the source's death breaks the
    transfer at once, while Ray's word (or the heartbeat timeout) takes longer. A request whose source
    died is not at fault and migrates; one whose source is alive fails (``failure_policy: fail``). So a
    failure whose source is not known dead waits for the first of:

    - the source's death (``on_dead``): it migrates;
    - two heartbeats of the source after the failure (``on_heartbeat``; the first may have left before a
      death): the source is alive, it fails;
    - the bound (``bound_s``, the heartbeat timeout): it migrates if the source is no longer healthy, else
      it fails.

    A flight that ended (an abort) or moved on to a new attempt meanwhile is left alone."""

    BEATS_ALIVE = 2

    def __init__(
        self,
        bound_s: float,
        migrate: Callable[[Flight, str], None],
        fail: Callable[[Flight, RouterError], None],
    ) -> None:
        self.bound_s = bound_s
        self._migrate, self._fail = migrate, fail
        # by the failed attempt's wire id: (the flight, its source, the error, the source's beats since)
        self._waiting: dict[str, _Waiting] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def on_failed(self, flight: Flight, source: WorkerRef, error: RouterError) -> None:
        """On the router's loop: the decode side failed ``flight``'s transfer from ``source``."""
        if source.state == WorkerState.DEAD:
            self._migrate(flight, f"KV source {source.worker_id} died mid-transfer")
            return
        wire_id = flight.wire_id
        timer = asyncio.get_running_loop().call_later(self.bound_s, self._settle, wire_id, None)
        self._waiting[wire_id] = _Waiting(flight, source, error, timer)

    def on_dead(self, w: WorkerRef) -> None:
        """``w`` died: the failed transfers it was the source of migrate now."""
        for wire_id in [k for k, v in self._waiting.items() if v.source is w]:
            self._settle(wire_id, True)

    def on_heartbeat(self, w: WorkerRef) -> None:
        """A heartbeat of ``w``: the failed transfers it is the source of fail once it beat twice."""
        for wire_id, waiting in list(self._waiting.items()):
            if waiting.source is w:
                waiting.num_beats += 1
                if waiting.num_beats >= self.BEATS_ALIVE:
                    self._settle(wire_id, False)

    def _settle(self, wire_id: str, is_dead: bool | None) -> None:
        """Migrate or fail the waiting failure ``wire_id`` (``is_dead`` None: the bound passed, the
        source's state decides)."""
        waiting = self._waiting.pop(wire_id, None)
        if waiting is None:
            return
        waiting.timer.cancel()
        flight, source = waiting.flight, waiting.source
        if flight.is_ended or flight.wire_id != wire_id:
            return  # NOTE: aborted, or moved on (a new attempt) meanwhile
        if is_dead is None:
            is_dead = source.state != WorkerState.HEALTHY
        if is_dead:
            self._migrate(flight, f"KV source {source.worker_id} died mid-transfer")
        else:
            self._fail(flight, waiting.error)


@dataclass
class _Waiting:
    flight: Flight
    source: WorkerRef
    error: RouterError
    timer: asyncio.TimerHandle
    num_beats: int = 0

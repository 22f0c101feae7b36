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

from dataclasses import replace

from cluster.protocol import ClusterUnavailableError
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

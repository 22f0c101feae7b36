"""Prefix pulls, the router's half (issue 44 item 3): before a prompt goes to the prefill worker the
index picked (the puller), the device blocks of its prefix that another worker holds and the puller
lacks may be pulled over the KV transfer instead of recomputed (workers/prefix_pulls.py: the workers'
half).

When: ``router.prefix_routing: index``, a route that holds (a prefill worker, disaggregated or
conditional mode), and a holder (another prefill or a decode worker with a pull sender) whose index
entries show at least ``router.pull_min_blocks`` more device blocks of the prompt's prefix than the
puller's (0: pulls off); with a cost profile also only when the profile's transfer of those blocks is
faster than their prefill on the puller (its queue as the router sees it). Host-tier blocks of a
holder are not offered (the holder would have to load them first).

How: ``OfferPrefix`` to the holder (it holds the blocks and offers them; ``PrefixOffered``), then
``FetchPrefix`` to the puller (it fetches and caches them; ``PrefixFetched``); the flight's Generate
waits for the pull, bounded by ``router.pull_timeout_s`` and the request's deadline. On success,
failure, timeout or the death of either worker the Generate goes to the puller as usual (the pulled
blocks are then a prefix hit, or the prompt is recomputed), and an Abort of the pull id lets go of
whatever the holder and the puller still hold of it (a hold not fetched, a fetch still queued). A
flight that moved on meanwhile (migrated, failed, aborted) gets nothing from here.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from cluster.config import RouterConfig
from cluster.protocol import ClusterUnavailableError, RouterError
from cluster.router.flights import Flight
from cluster.router.kv_index import KvIndex
from cluster.router.membership import Membership, WorkerRef
from cluster.router.predict import Predictor, WorkerQueue, prefill_time_s
from cluster.router.routing import Route
from cluster.wire import Abort, FetchPrefix, OfferPrefix, PrefixFetched, PrefixOffered


@dataclass
class _Pull:
    pull_id: str
    flight: Flight
    attempt: int
    puller: WorkerRef
    holder: WorkerRef
    token_ids: list[int]  # the holder's blocks' tokens
    deadline: float  # time.time() seconds
    timer: asyncio.TimerHandle | None = None
    is_fetching: bool = False


class Pulls:
    """See the module docstring. ``send_generate(flight, worker, hold)``: the flight's Generate,
    sent when its pull ends; ``fail``: ends a flight whose Generate cannot be sent."""

    def __init__(
        self,
        config: RouterConfig,
        members: Membership,
        kv_index: KvIndex,
        predictor: Predictor | None,
        send_generate: Callable[[Flight, WorkerRef, bool], None],
        fail: Callable[[Flight, RouterError], None],
    ) -> None:
        self.config = config
        self._members = members
        self._index = kv_index
        self._predictor = predictor
        self._send_generate = send_generate
        self._fail = fail
        self._pulls: dict[str, _Pull] = {}
        self.counts = {"started": 0, "pulled": 0, "failed": 0, "timed_out": 0, "worker_died": 0}

    def __len__(self) -> int:
        return len(self._pulls)

    def start(self, flight: Flight, route: Route[WorkerRef], token_ids: list[int]) -> bool:
        """Start a pull for the flight's route if one pays; True: its Generate is sent when it ends."""
        cfg, puller = self.config, route.worker
        if cfg.pull_min_blocks <= 0 or not route.hold or cfg.prefix_routing != "index":
            return False
        if puller.pool != "prefill" or not puller.info.pull_endpoint or not route.block_hashes:
            return False
        bs, hashes, wid = puller.info.block_size, route.block_hashes, puller.worker_id
        num_held = self._index.hit(wid, hashes, len(token_ids), bs).device_blocks
        best: tuple[int, str, WorkerRef] | None = None
        for w in (*self._members.healthy("prefill"), *self._members.healthy("decode")):
            if w is puller or not w.info.pull_endpoint or w.info.block_size != bs:
                continue
            num = self._index.hit(w.worker_id, hashes, len(token_ids), bs).device_blocks
            if best is None or (num, w.worker_id) > best[:2]:
                best = (num, w.worker_id, w)
        if best is None or best[0] - num_held < cfg.pull_min_blocks:
            return False
        num_blocks, _, holder = best
        if not self._pays(puller, (num_blocks - num_held) * bs):
            return False
        deadline = min(flight.deadline, time.time() + cfg.pull_timeout_s)
        pull = _Pull(
            f"pull:{secrets.token_hex(8)}", flight, flight.attempt, puller, holder,
            token_ids[: num_blocks * bs], deadline,
        )  # fmt: skip
        try:
            self._members.send(holder, OfferPrefix(pull.pull_id, pull.token_ids, deadline))
        except ClusterUnavailableError:
            return False
        self._pulls[pull.pull_id] = pull
        self.counts["started"] += 1
        loop = asyncio.get_running_loop()
        pull.timer = loop.call_later(max(0.0, deadline - time.time()), self._expire, pull.pull_id)
        return True

    def _pays(self, puller: WorkerRef, num_tokens: int) -> bool:
        """The profile's transfer of ``num_tokens`` positions beats their prefill on the puller (no
        profile: the block rule alone)."""
        p = self._predictor
        if p is None:
            return True
        compute_s = prefill_time_s(p.profile, p.budget, WorkerQueue.of(puller), num_tokens)
        return p.profile.handoff_s(num_tokens) < compute_s

    # ---- answers ----------------------------------------------------------------------------------------
    def on_answer(self, w: WorkerRef, event: PrefixOffered | PrefixFetched) -> None:
        if isinstance(event, PrefixOffered):
            self.on_offered(w, event)
        else:
            self.on_fetched(w, event)

    def on_offered(self, w: WorkerRef, event: PrefixOffered) -> None:
        pull = self._pulls.get(event.pull_id)
        if pull is None or w is not pull.holder or pull.is_fetching:
            return
        if event.error or not event.num_blocks:
            self._finish(pull, "failed")
            return
        pull.is_fetching = True
        op = FetchPrefix(pull.pull_id, pull.token_ids, event.handoff, pull.deadline)
        try:
            self._members.send(pull.puller, op)
        except ClusterUnavailableError:
            self._finish(pull, "failed")

    def on_fetched(self, w: WorkerRef, event: PrefixFetched) -> None:
        pull = self._pulls.get(event.pull_id)
        if pull is not None and w is pull.puller:
            self._finish(pull, "failed" if event.error else "pulled")

    def _expire(self, pull_id: str) -> None:
        pull = self._pulls.get(pull_id)
        if pull is not None:
            pull.timer = None
            self._finish(pull, "timed_out")

    def on_dead(self, w: WorkerRef) -> None:
        """``w`` died: its pulls end now (the puller's Generate goes out, or its flight moved on)."""
        for pull in [p for p in self._pulls.values() if w in (p.holder, p.puller)]:
            self._finish(pull, "worker_died")

    def _finish(self, pull: _Pull, outcome: str) -> None:
        del self._pulls[pull.pull_id]
        self.counts[outcome] += 1
        if pull.timer is not None:
            pull.timer.cancel()
        if outcome != "pulled":  # NOTE: frees what either side still holds of it (a no-op where none)
            for w in (pull.holder, pull.puller):
                if not w.died.is_set():
                    self._members.send(w, Abort(pull.pull_id))
        flight = pull.flight
        if not flight.is_ended and flight.attempt == pull.attempt and flight.prefill is pull.puller:
            try:
                self._send_generate(flight, pull.puller, True)
            except ClusterUnavailableError as e:
                self._fail(flight, e)

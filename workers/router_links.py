"""A worker's links to its routers: one PUSH socket per router endpoint (front-end replicas, by replica
index), which router owns each request, and the routers' leases.

Routing events: a request's events (its deltas, ``Prefilled``, ``Transferred``, ``RequestFailed``,
``KeepAlive``) go to the router that owns it, named by the op that brought it (``owner``, a router
process's incarnation); a ``Heartbeat``, ``KvEvents`` and ``WorkerFailed`` go to every router. A request of no known
owner (an op with ``owner`` "", as a single router's tests send) goes to the first router.

Leases: a router renews its ``RouterLease`` every health interval. ``expired`` names the owners not
heard from for their lease, and ``on_lease`` the owner a new incarnation replaces in its replica slot;
the worker frees their requests (and tells the owner, in case it is only slow). An op from an owner
this worker holds no lease of (a replaced incarnation's op that arrived late) is refused (``admit``).

Sending never blocks: each socket queues up to ``_SEND_HWM`` frames for its router (one that is down or
not reading included: a restarted replica binds its predecessor's endpoint, the socket reconnects by
itself and the queue goes out, last words included); past that a frame is dropped and counted, and
``send`` returns the requests it carried, which the worker aborts (their router cannot hear them). A
dead replica's requests are freed by its lease long before its queue fills.

Threads: ``send`` runs under the worker's push lock (any thread); the rest runs on the step thread. The
request -> owner map is read by the sending threads and written by the step thread, under ``_lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from cluster.wire import (
    Deltas,
    Event,
    Heartbeat,
    KeepAlive,
    KvEvents,
    Prefilled,
    PrefixFetched,
    PrefixOffered,
    RequestFailed,
    RouterLease,
    Transferred,
    WireEncoder,
    WorkerFailed,
    WorkerGone,
    router_recipient,
)

logger = logging.getLogger(__name__)

# NOTE: frames a socket queues for a router that is down or slow to read them (a step's Deltas frame is
# one); past it frames are dropped (and their requests aborted) rather than the sender blocked
_SEND_HWM = 10_000
_SWEEP_S = 2.0  # how often the request -> owner map forgets requests that left this worker


@dataclass
class _Owner:
    """A router holding a lease on this worker."""

    incarnation: str
    replica: int
    lease_s: float
    expires: float  # time.monotonic()


class RouterLinks:
    """See the module docstring. Built by the worker with the context its sockets live in."""

    def __init__(self, endpoints: Sequence[str], encoder: WireEncoder, ctx: zmq.Context[Any]) -> None:
        if not endpoints:
            raise ValueError("a worker needs at least one router endpoint")
        self._encoder = encoder
        self.sockets: list[zmq.Socket[Any]] = []
        for endpoint in endpoints:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
            sock.connect(endpoint)
            self.sockets.append(sock)
        self._recipients = [router_recipient(i) for i in range(len(endpoints))]
        self._owners: dict[str, _Owner] = {}  # by incarnation
        self._slots: dict[int, str] = {}  # replica index -> its current incarnation
        self._owner_of: dict[str, _Owner] = {}  # request id -> its owner
        self._lock = threading.Lock()
        self._not_seen: set[str] = set()  # requests not live at the last sweep
        self._next_sweep = 0.0
        self.num_dropped = 0  # frames dropped because their router could not take them

    # ---- sending (under the worker's push lock) --------------------------------------------------------
    def send(self, message: Event) -> list[str]:
        """Send ``message`` to the router(s) it is for; returns the ids of the requests whose events were
        dropped (their router is down or not reading)."""
        # NOTE: a worker sends no WorkerGone; a KvEvents frame one router could not take is a gap in its
        # sequence there, which that router's index sees and recovers from (cluster/router/kv_index.py)
        # (a prefix pull's answer, PrefixOffered / PrefixFetched, has no owner here: every router gets it,
        # and those that did not start the pull ignore it)
        if isinstance(message, (Heartbeat, KvEvents, WorkerFailed, WorkerGone, PrefixOffered, PrefixFetched)):
            for i in range(len(self.sockets)):
                self.send_to(i, message)
            return []
        if isinstance(message, Deltas) and message.deltas:
            groups = self._group(message)
            if groups is None:
                return (
                    []
                    if self.send_to(self._replica_of(message.deltas[0].request_id), message)
                    else [d.request_id for d in message.deltas]
                )
            dropped: list[str] = []
            for i, deltas in groups.items():
                if not self.send_to(i, Deltas(message.worker_id, deltas)):
                    dropped += [d.request_id for d in deltas]
            return dropped
        if isinstance(message, Deltas):  # NOTE: no deltas: no request to route it by
            self.send_to(0, message)
            return []
        rid = _request_of(message)
        return [] if self.send_to(self._replica_of(rid), message) else [rid]

    def _group(self, message: Deltas) -> dict[int, list[Any]] | None:
        """The frame's deltas by router, or None when they all go to one (the usual case: no copy)."""
        if len(self.sockets) == 1:
            return None
        replicas = [self._replica_of(d.request_id) for d in message.deltas]
        if all(r == replicas[0] for r in replicas):
            return None
        groups: dict[int, list[Any]] = {}
        for r, d in zip(replicas, message.deltas, strict=True):
            groups.setdefault(r, []).append(d)
        return groups

    def _replica_of(self, request_id: str) -> int:
        owner = self._owner_of.get(request_id)  # NOTE: one dict read; the step thread writes under _lock
        return 0 if owner is None else owner.replica

    def send_to(self, replica: int, message: Event) -> bool:
        """Send ``message`` to router ``replica`` (under the worker's push lock); False: dropped."""
        try:
            self.sockets[replica].send(self._encoder.encode(self._recipients[replica], message), zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.num_dropped += 1
            if self.num_dropped <= 10 or self.num_dropped % 1000 == 0:
                logger.warning(
                    "router %d is not taking frames (down, or not reading): dropped %s (#%d)",
                    replica,
                    type(message).__name__,
                    self.num_dropped,
                )
            return False

    def close(self, linger_ms: int = 0) -> None:
        for sock in self.sockets:
            sock.close(linger=linger_ms)

    # ---- owners and leases (step thread) ---------------------------------------------------------------
    def on_lease(self, op: RouterLease, now: float | None = None) -> list[str] | None:
        """Take a lease; returns the requests of the incarnation it replaces in its slot (to free), or
        None for a lease this worker cannot take (no such replica endpoint, a bad lease)."""
        if not (0 <= op.replica < len(self.sockets)) or not (0 < op.lease_s <= 3600) or not op.incarnation:
            return None
        now = time.monotonic() if now is None else now
        owner = self._owners.get(op.incarnation)
        if owner is not None:
            if owner.replica != op.replica:
                return None
            owner.expires, owner.lease_s = now + op.lease_s, op.lease_s
            return []
        freed: list[str] = []
        old = self._slots.get(op.replica)
        if old is not None:
            logger.warning("router replica %d restarted (%s -> %s)", op.replica, old, op.incarnation)
            freed = self._forget(old)
        self._owners[op.incarnation] = _Owner(op.incarnation, op.replica, op.lease_s, now + op.lease_s)
        self._slots[op.replica] = op.incarnation
        return freed

    def admit(self, request_id: str, owner: str) -> bool:
        """A request arrives from ``owner``: note it (True), or refuse it: no lease of that owner."""
        if not owner:
            return True  # NOTE: an unleased op (a router that names no owner): its events go to router 0
        o = self._owners.get(owner)
        if o is None:
            return False
        with self._lock:
            self._owner_of[request_id] = o
        return True

    def expired(self, now: float | None = None) -> list[tuple[_Owner, list[str]]]:
        """The owners whose lease ran out, each with its requests (to free); they are forgotten."""
        now = time.monotonic() if now is None else now
        gone = [o for o in self._owners.values() if o.expires <= now]
        out = []
        for o in gone:
            logger.error(
                "router replica %d (%s) silent for over its %.1f s lease: freeing its requests",
                o.replica,
                o.incarnation,
                o.lease_s,
            )
            out.append((o, self._forget(o.incarnation)))
        return out

    def _forget(self, incarnation: str) -> list[str]:
        o = self._owners.pop(incarnation)
        if self._slots.get(o.replica) == incarnation:
            del self._slots[o.replica]
        with self._lock:
            mine = [rid for rid, owner in self._owner_of.items() if owner is o]
            for rid in mine:
                del self._owner_of[rid]
        return mine

    def sweep(self, is_live: Callable[[str], bool], now: float | None = None) -> None:
        """Forget the requests that left this worker (not live at two sweeps in a row: a request's last
        events may still be on their way out through the detokenizer thread after it ended)."""
        now = time.monotonic() if now is None else now
        if now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP_S
        with self._lock:
            ids = list(self._owner_of)
        gone = {rid for rid in ids if not is_live(rid)}
        with self._lock:
            for rid in gone & self._not_seen:
                self._owner_of.pop(rid, None)
        self._not_seen = gone

    @property
    def num_owned(self) -> int:
        return len(self._owner_of)

    def owners(self) -> dict[str, int]:
        """The routers holding a lease: incarnation -> replica index."""
        return {o.incarnation: o.replica for o in self._owners.values()}


def _request_of(message: Prefilled | Transferred | RequestFailed | KeepAlive) -> str:
    return message.delta.request_id if isinstance(message, Prefilled) else message.request_id

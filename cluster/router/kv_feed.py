"""The router's KV index fed (cluster/router/kv_index.py): the workers' ``KvEvents`` in, a worker's
entries out when it stops being healthy, and a snapshot asked for (``KvResync``) whenever the index lost
track of a healthy worker that publishes events (``WorkerInfo.kv_events``).

What loses track: a frame lost (a gap), frames left out while the worker was not healthy or before this
router admitted it (a router that starts, or restarts, beside workers whose caches are warm), the entries
dropped when it went unhealthy. Each is seen at the worker's next frame or heartbeat, whichever comes
first, and the worker answers with everything its tiers hold (a ``reset`` frame: workers/worker_vitals.py).
Until then the index only lacks entries (hits missed, never promised). Runs on the router's loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cluster.router.kv_index import KvIndex
from cluster.router.membership import WorkerRef, WorkerState
from cluster.wire import KvEvents, KvResync, Op

INDEXED_STATES = (WorkerState.HEALTHY, WorkerState.UNHEALTHY)  # whose KV events the index takes


class KvFeed:
    """See the module docstring. ``lookup``: the admitted worker of an id; ``send``: an op to a worker."""

    def __init__(
        self,
        index: KvIndex,
        lookup: Callable[[str], WorkerRef | None],
        send: Callable[[WorkerRef, Op], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self._lookup = lookup
        self._send = send
        self.clock = clock
        self.num_resyncs = 0  # KvResync ops sent

    def on_events(self, event: KvEvents) -> None:
        """Into the index, from a live process of an admitted worker only; a frame of one not admitted
        yet or of a dead or replaced process is no forgery (signed): left out quietly (only hits lost)."""
        w = self._lookup(event.worker_id)
        if w is None or w.info.incarnation != event.incarnation or w.state not in INDEXED_STATES:
            return
        self.index.apply(w.worker_id, w.info.incarnation, event.seq, event.stored, event.removed, event.reset)
        self.check(w)

    def on_state(self, w: WorkerRef) -> None:
        """A worker not healthy: its entries go (nothing vouches for them); healthy again: a snapshot."""
        if w.state != WorkerState.HEALTHY:
            self.index.forget(w.worker_id, w.info.incarnation)
        else:
            self.check(w)

    def check(self, w: WorkerRef) -> None:
        """Ask ``w`` for a snapshot if the index lost track of it (at most every RESYNC_INTERVAL_S)."""
        if not w.info.kv_events or w.state != WorkerState.HEALTHY:
            return
        if self.index.wants_snapshot(w.worker_id, w.info.incarnation, self.clock()):
            self.num_resyncs += 1
            self._send(w, KvResync())

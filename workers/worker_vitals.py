"""What a worker says of itself: its stats, its heartbeat, its leak report.

Stats: the step thread publishes a ``WorkerStats`` snapshot every loop turn (a new object each time, so
the actor's ``stats()`` reads it from any thread without a lock); it carries the step thread's split of
its steps (``StepSplit``) and the control and handshake frames this worker dropped, by reason.
Heartbeat: every ``heartbeat_interval_s``, busy or idle, the step thread sends a ``Heartbeat`` with the
latest snapshot; the router treats a worker whose beat is stale as unhealthy (SIGSTOP, a stuck step).
KV events: at most every ``KV_EVENTS_INTERVAL_S``, the net change of what the engine's KV tiers hold
(``Engine.take_kv_events``) goes to every router as ``KvEvents`` frames numbered from 0 for this process
(cluster/wire.py; the routers' exact prefix index, cluster/router/kv_index.py); nothing when nothing
changed, nothing at all without prefix caching. A router that lost track asks for a snapshot
(``KvResync``): the next turn sends everything the tiers hold, its first frame marked ``reset``, at most
one snapshot every ``KV_SNAPSHOT_INTERVAL_S`` (asks in between are met by the next one).
A dead transfer thread is found here, and raised (the step thread dies of it: workers/worker_threads.py).
Leaks: checked on the step thread (engine, role, the detokenizer stage drained first).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

from cluster.protocol import StepSplit, TransferStats, WorkerStats
from cluster.wire import Heartbeat, WorkerInfo, kv_event_frames
from workers.detokenizer import DetokenizerStage
from workers.engine import Engine
from workers.prefix_pulls import PrefixPulls
from workers.role import Role
from workers.worker_outbox import Outbox

STAGE_DRAIN_S = 10.0  # bound on the detokenizer stage's catching up (leak check, shutdown)
# NOTE: the index lags the tiers by up to this much (plus a loop turn); a frame per step instead would
# double the frames a router reads from a busy worker (a Deltas frame a step already)
KV_EVENTS_INTERVAL_S = 0.01
# NOTE: a snapshot costs a frame per 4,096 blocks held: asks more often than this wait for the next one
KV_SNAPSHOT_INTERVAL_S = 1.0


class Vitals:
    """See the module docstring. ``is_healthy``: every worker thread alive and nothing failed
    (workers/worker_threads.py's ``Guard``); ``rejected``: the control frames dropped, by reason;
    ``clock``: monotonic seconds (tests)."""

    def __init__(
        self,
        info: WorkerInfo,
        engine: Engine,
        role: Role | None,
        stage: DetokenizerStage | None,
        outbox: Outbox,
        heartbeat_interval_s: float,
        is_healthy: Callable[[], bool],
        rejected: Callable[[], dict[str, int]],
        pulls: PrefixPulls | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.info = info
        self._clock = clock
        self._pulls = pulls
        self._engine = engine
        self._role = role
        self._stage = stage
        self._outbox = outbox
        self._heartbeat_interval_s = heartbeat_interval_s
        self._is_healthy = is_healthy
        self._rejected = rejected
        self.steps = StepSplit()  # the step thread's own; published as a copy
        self.num_freed_for_router = 0  # requests freed because their router went (step thread)
        self._last_beat = 0.0
        self.stats = WorkerStats(info.worker_id, info.pool)
        self.num_kv_event_frames = 0  # KvEvents frames sent: the next one's seq
        self._publishes_kv_events = engine.config.enable_prefix_caching
        self._last_kv_events = 0.0
        self._last_kv_snapshot = -KV_SNAPSHOT_INTERVAL_S
        self._kv_snapshot_due = False
        self.num_kv_snapshots = 0

    def publish(self) -> None:
        """A fresh snapshot of the stats (step thread)."""
        role, pulls = self._role, self._pulls
        self.stats = WorkerStats(
            worker_id=self.info.worker_id,
            pool=self.info.pool,
            healthy=self._is_healthy(),
            num_waiting_for_kv=role.num_waiting_for_kv() if role is not None else 0,
            engine=self._engine.stats(),
            transfer=role.transfer_stats() if role is not None else TransferStats(),
            rejected_frames=self.rejected_frames(),
            broken_peers=role.broken_peers() if role is not None else [],
            steps=dataclasses.replace(self.steps),
            num_freed_for_router=self.num_freed_for_router,
            num_pulled_blocks=pulls.num_pulled_blocks if pulls is not None else 0,
            num_pulled_bytes=pulls.num_pulled_bytes if pulls is not None else 0,
            num_pull_failures=pulls.num_pull_failures if pulls is not None else 0,
        )

    def mark_unhealthy(self) -> None:
        """The worker failed (any thread): its published stats say so at once."""
        self.stats = dataclasses.replace(self.stats, healthy=False)

    def rejected_frames(self) -> dict[str, int]:
        """Control frames and KV handshake frames this worker dropped, by reason."""
        counts = collections.Counter(self._rejected())
        if self._role is not None:
            counts.update(self._role.rejected_frames())
        if self._pulls is not None:
            counts.update(self._pulls.rejected_frames())
        return dict(counts)

    def beat(self) -> None:
        """A heartbeat, if one is due (step thread); raises if a transfer thread died."""
        now = self._clock()
        if now - self._last_beat < self._heartbeat_interval_s:
            return
        self._last_beat = now
        dead = [t.name for t in self.role_threads() if not t.is_alive()]
        if dead:
            raise RuntimeError(f"transfer thread(s) {dead} died")
        self._outbox.send(Heartbeat(self.info, self.stats))

    def request_kv_snapshot(self) -> None:
        """A router asked for everything the KV tiers hold (``KvResync``): sent by ``send_kv_events``."""
        self._kv_snapshot_due = self._publishes_kv_events

    def send_kv_events(self) -> None:
        """What the KV tiers stored and removed since the last call, or a snapshot of them when one is
        asked for, if due (step thread: the engine's one user)."""
        if not self._publishes_kv_events:
            return
        now = self._clock()
        if now - self._last_kv_events < KV_EVENTS_INTERVAL_S:
            return
        self._last_kv_events = now
        reset = self._kv_snapshot_due and now - self._last_kv_snapshot >= KV_SNAPSHOT_INTERVAL_S
        if reset:
            self._kv_snapshot_due, self._last_kv_snapshot = False, now
            self.num_kv_snapshots += 1
            batch = self._engine.kv_snapshot()
        else:
            batch = self._engine.take_kv_events()
            if not len(batch):
                return
        seq = self.num_kv_event_frames
        frames = kv_event_frames(self.info.worker_id, self.info.incarnation, seq, batch, reset)
        self.num_kv_event_frames += len(frames)
        for frame in frames:
            self._outbox.send(frame)

    def role_threads(self) -> list[threading.Thread]:
        threads = self._role.threads() if self._role is not None else []
        return threads + (self._pulls.threads() if self._pulls is not None else [])

    def leak_report(self) -> str | None:
        """Leak invariant (step thread): None if clean, else what leaked."""
        try:
            self._engine.check_no_leaks()
            if self._role is not None:
                self._role.check_leaks()
            if self._pulls is not None:
                self._pulls.check_leaks()
            if self._stage is not None:
                try:  # NOTE: the final deltas it still holds free their state
                    self._stage.flush(STAGE_DRAIN_S)
                except (RuntimeError, TimeoutError) as e:  # failed or stuck: the step loop says so next
                    return f"the detokenizer stage did not drain: {e}"
                if self._stage.num_requests:
                    raise AssertionError(f"the detokenizer stage holds {self._stage.num_requests} requests")
        except AssertionError as e:
            return str(e)
        return None

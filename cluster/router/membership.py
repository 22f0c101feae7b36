"""Membership: the workers the router knows and the state of each (admit, heartbeat, re-admit, lifecycle
watch, drain, death), and the socket an op reaches each one by.

A worker registers with its first Heartbeat (which carries its WorkerInfo); a heartbeat from a new
incarnation of a known worker (Ray restarted it) re-admits it. States (``WorkerRef.state``):
  healthy    its heartbeat is fresh and says every thread is alive: routable;
  unhealthy  its heartbeat is stale (stopped, stuck) or it reported a dead thread: not routed to; its
             requests keep waiting (bounded by their deadlines) and a fresh heartbeat makes it healthy;
  draining   being removed (scale-down): not routed to; its requests finish or migrate;
  dead       it said so (``WorkerFailed``) or Ray says the actor is gone: its requests migrate.
Ray is the lifecycle plane only: one watcher per actor pings it to learn that it died. A worker's own
reason wins over Ray's whenever it sent one: Ray's word waits (bounded) for it (``_await_last_words``).

Leases: membership renews this router's ``RouterLease`` on every worker it knows (at admission, before
any request, then every health interval); a worker frees the requests this router owns when it stops
hearing it (front-end replicas: a replica that died or was cut off, cluster/wire.py).

What the request path (cluster/router/router.py) calls: ``get``, ``healthy``, ``send``; what membership
tells it back, through the hooks it was built with: a worker died (``on_death``: migrate its requests),
a worker is gone for good (``on_removed``: forget what the routing views hold of it), and a worker's
state changed (``on_state``: the KV index drops a worker that is no longer healthy).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import zmq

from cluster.config import RouterConfig
from cluster.protocol import ClusterUnavailableError, ModelInfo, WorkerStats, peer_name
from cluster.wire import (
    Abort,
    ExtendLease,
    Heartbeat,
    Op,
    PeerDead,
    RouterLease,
    WireEncoder,
    WorkerGone,
    WorkerInfo,
)

logger = logging.getLogger(__name__)

# NOTE: bounds how long Ray's word on a death waits for the worker's own. A worker flushes its last words
# (``WorkerFailed``) before it exits, so once Ray sees the process gone they are in the router's socket
# or on their way: milliseconds, even on a busy host. A worker killed without last words (kill -9, the OOM
# killer) costs this much before its requests migrate.
_LAST_WORDS_S = 1.0


class WorkerState(str, enum.Enum):
    """A worker's state in the router's eyes (see the module docstring)."""

    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    DEAD = "dead"


@dataclass
class WorkerRef:
    """The router's view of one admitted worker (one incarnation of it)."""

    info: WorkerInfo
    socket: zmq.Socket[bytes]
    state: WorkerState = WorkerState.HEALTHY
    why: str = ""  # why it is not healthy
    stats: WorkerStats | None = None
    last_beat: float = field(default_factory=time.monotonic)
    num_assigned: int = 0  # requests the router routed here that are not over
    num_prompt_tokens: int = (
        0  # prefill work routed here whose first token has not come back (Route.queued_tokens)
    )
    num_queued_prompts: int = 0  # the requests those tokens belong to
    died: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # set once its state is dead

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


class Membership:
    """The admitted workers, by id (see the module docstring). Runs on the router's loop.

    Lifecycle: built by the router; ``monitor`` runs as a task until the router closes; ``watch_tasks``
    are cancelled and ``close`` closes every worker's socket when it does (the router owns ``ctx``).
    """

    def __init__(
        self,
        config: RouterConfig,
        ctx: zmq.Context[zmq.Socket[bytes]],
        encoder: WireEncoder,
        *,
        reject: Callable[[str], None],
        on_death: Callable[[WorkerRef, str], None],
        on_removed: Callable[[str], None],
        on_state: Callable[[WorkerRef], None] | None = None,
        replica: int = 0,
    ) -> None:
        """``reject``: count a frame refused by reason (the router's ``rejected_frames``). ``replica``: this
        router's front-end replica index; ``owner`` (random per process) names it in every op that brings
        a request to a worker."""
        self.config = config
        self.replica = replica
        self.owner = secrets.token_hex(8)
        # NOTE: the ops' sockets are plain (blocking-API) sockets on the router's context: every op is sent
        # with NOBLOCK, so an asyncio socket's future per send buys nothing (`pdserve bench frontend`, 2
        # pairs: 77 vs 79 us per token at 32 streams, 45 vs 49 at 256: within this box's noise)
        self._ctx = ctx
        self._encoder = encoder
        self._reject = reject
        self._on_death = on_death
        self._on_removed = on_removed
        self._on_state = on_state
        self._workers: dict[str, WorkerRef] = {}
        self._first_info: WorkerInfo | None = None
        self._retired: set[str] = set()  # incarnations drained by scale-down: never re-admitted
        self._actors: dict[str, Any] = {}
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._gone: set[asyncio.Task[None]] = set()  # relayed news of deaths being taken (on_gone)
        self._admitted = asyncio.Event()

    # ---- what the request path reads and calls --------------------------------------------------------
    @property
    def workers(self) -> list[WorkerRef]:
        return list(self._workers.values())

    def get(self, worker_id: str) -> WorkerRef | None:
        return self._workers.get(worker_id)

    def healthy(self, pool: str) -> list[WorkerRef]:
        return [w for w in self._workers.values() if w.pool == pool and w.healthy]

    def healthy_pools(self) -> set[str]:
        return {w.pool for w in self._workers.values() if w.healthy}

    def send(self, w: WorkerRef, op: Op) -> None:
        """Queue ``op`` for ``w`` without waiting; raises ClusterUnavailableError when its queue is full
        (dropped quietly for the ops that only free or keep state: Abort, PeerDead, ExtendLease)."""
        try:
            # NOTE: PUSH queues without blocking up to its high-water mark; never awaits here. Addressed to
            # the incarnation: no other process of the worker acts on it (workers/worker.py).
            w.socket.send(self._encoder.encode(w.peer_name, op), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.error("router: %s's queue is full; dropped %s", w.worker_id, type(op).__name__)
            if not isinstance(op, (Abort, PeerDead, ExtendLease, RouterLease)):
                raise ClusterUnavailableError(f"worker {w.worker_id} is not taking work") from None

    def model_info(self, served_model_name: str | None) -> ModelInfo:
        """What the edge validates against: the served model, the smallest max_model_len of the
        admitted workers."""
        first = self._first_info
        if first is None:
            raise ClusterUnavailableError("no worker has registered yet")
        lens = [w.info.max_model_len for w in self._workers.values() if w.state != WorkerState.DEAD]
        return ModelInfo(
            name=served_model_name or os.path.basename(first.model_dir.rstrip("/")),
            model_dir=first.model_dir,
            max_model_len=min(lens or [first.max_model_len]),
            vocab_size=first.vocab_size,
        )

    def worker_stats(self) -> list[WorkerStats]:
        """Latest stats of every admitted worker; ``healthy`` is the router's verdict."""
        return [
            replace(w.stats, healthy=w.healthy)
            if w.stats is not None
            else WorkerStats(w.worker_id, w.pool, healthy=w.healthy)
            for w in self._workers.values()
        ]

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

    async def wait_until(self, ready: Callable[[], bool], timeout_s: float) -> None:
        """Until ``ready()`` holds, checked at each admission (and every 0.5 s); TimeoutError past
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"not ready within {timeout_s:.0f} s")
            self._admitted.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.5)):
                    await self._admitted.wait()

    # ---- admission and heartbeats ---------------------------------------------------------------------
    def on_heartbeat(self, event: Heartbeat) -> WorkerRef | None:
        """Take a heartbeat (admitting its sender if new); returns the worker whose beat was taken, None
        when it was refused or its worker is dead or draining."""
        info, stats = event.info, event.stats
        if stats.worker_id != info.worker_id:
            self._reject("bad_field")
            return None
        w = self._workers.get(info.worker_id)
        if w is None or w.info.incarnation != info.incarnation:
            if (w is not None and w.state == WorkerState.DRAINING) or info.incarnation in self._retired:
                return None  # NOTE: a drained process beats until its actor is stopped: never re-admitted
            w = self._admit(info)
            if w is None:
                return None
        if w.state in (WorkerState.DEAD, WorkerState.DRAINING):
            return None
        w.stats, w.last_beat = stats, time.monotonic()
        if not stats.healthy:
            self.set_state(w, WorkerState.UNHEALTHY, "it reports a dead thread")
        elif w.state == WorkerState.UNHEALTHY:
            self.set_state(w, WorkerState.HEALTHY, "")
        return w

    def _admit(self, info: WorkerInfo) -> WorkerRef | None:
        """Register a worker (or a new incarnation of one); None if it cannot join this cluster."""
        first = self._first_info
        if first is not None and _model_identity(info) != _model_identity(first):
            logger.error(
                "router: refused %s: it serves %s (vocab %d, fingerprint %r), the cluster serves %s "
                "(vocab %d, fingerprint %r)", info.worker_id, info.model_dir, info.vocab_size,
                info.model_fingerprint, first.model_dir, first.vocab_size, first.model_fingerprint,
            )  # fmt: skip
            self._reject("refused_worker")
            return None
        old = self._workers.get(info.worker_id)
        if old is not None:
            self.mark_dead(old, f"replaced by a new incarnation ({info.incarnation})")
            self._remove(old)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(info.request_endpoint)
        w = WorkerRef(info, sock)
        self._renew_lease(w)  # NOTE: first on the socket: the worker knows its owner before any request
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
            self._on_removed(w.worker_id)
        w.socket.close(linger=0)

    def _renew_lease(self, w: WorkerRef) -> None:
        self.send(w, RouterLease(self.owner, self.replica, self.config.router_lease_s))

    async def monitor(self) -> None:
        """Renew this router's lease on every worker; mark a worker whose heartbeat went stale unhealthy
        (runs until cancelled)."""
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            now = time.monotonic()
            for w in list(self._workers.values()):
                if w.state != WorkerState.DEAD:
                    self._renew_lease(w)
                silent = now - w.last_beat
                if w.healthy and silent > self.config.health_timeout_s:
                    self.set_state(w, WorkerState.UNHEALTHY, f"no heartbeat for {silent:.1f} s")

    # ---- the lifecycle plane (Ray) --------------------------------------------------------------------
    def watch(self, worker_id: str, actor: Any) -> None:
        """Watch an actor's lifecycle through Ray (anything with ``.ping.remote()``); call on the loop."""
        self._actors[worker_id] = actor
        if worker_id not in self._watches:
            self._watches[worker_id] = asyncio.create_task(
                self._lifecycle_watch(worker_id), name=f"router-watch-{worker_id}"
            )

    def unwatch(self, worker_id: str) -> None:
        self._actors.pop(worker_id, None)
        task = self._watches.pop(worker_id, None)
        if task is not None:
            task.cancel()

    def watch_tasks(self) -> list[asyncio.Task[None]]:
        return [*self._watches.values(), *self._gone]

    async def _lifecycle_watch(self, worker_id: str) -> None:
        """Learn from Ray that the actor died (a stopped or busy actor only times out: not dead). Keeps
        watching after a death: a restarted actor registers again by itself."""
        answered_pid: int | None = None  # the process that answered the last ping (``ping`` gives its pid)
        while worker_id in self._actors:
            try:
                async with asyncio.timeout(self.config.health_timeout_s):
                    answered_pid = await self._actors[worker_id].ping.remote()
            except TimeoutError:
                pass
            except Exception as e:  # noqa: BLE001 - RayActorError and friends: the actor is gone
                await self._ray_says_gone(
                    worker_id, answered_pid, f"{type(e).__name__}: {str(e).splitlines()[0]}"
                )
            await asyncio.sleep(self.config.health_interval_s)

    def on_gone(self, event: WorkerGone) -> None:
        """The lifecycle plane's word relayed (front-end replicas: their supervisor watches Ray): as a
        failed ping of this router's own watch."""
        task = asyncio.create_task(
            self._ray_says_gone(event.worker_id, event.pid or None, event.why),
            name=f"router-gone-{event.worker_id}",
        )
        self._gone.add(task)
        task.add_done_callback(self._gone.discard)

    async def _ray_says_gone(self, worker_id: str, answered_pid: int | None, why: str) -> None:
        w = self._workers.get(worker_id)
        if w is not None and self._is_news_of(w, answered_pid):
            await self._await_last_words(w, why)
            self.mark_dead(w, why)  # NOTE: nothing more when its own word came first

    def _is_news_of(self, w: WorkerRef, answered_pid: int | None) -> bool:
        """Whether a failed ping tells of ``w``'s process: the one that answered the last ping, or one that
        never answered any but has gone silent too (it died before Ray ever reached it).

        NOTE: a restarted worker's new process registers by its first heartbeat, before Ray counts the
        actor as restarted; until then Ray fails pings ("the actor is restarting"), and so does a ping
        sent before the restart that fails late. Both are news of the old process: taken for the new
        one, they killed it for good the moment it joined (its heartbeats are then ignored)."""
        silent_s = time.monotonic() - w.last_beat
        return w.info.pid == answered_pid or silent_s > self.config.health_timeout_s

    async def _await_last_words(self, w: WorkerRef, why: str) -> None:
        """Ray says ``w``'s process is gone: route nothing new to it and give its own ``WorkerFailed`` (and
        the deltas before it) up to ``_LAST_WORDS_S`` to be handled first.

        NOTE: the two words race through different sockets (Ray's RPC, the worker's ZMQ frame), and on a
        busy host Ray's often comes first while the worker's, already sent, waits in the router's socket
        or in ZMQ's I/O thread, where no poll of the socket can see it."""
        if w.state == WorkerState.DEAD:
            return
        self.set_state(w, WorkerState.UNHEALTHY, f"Ray reports it gone ({why}); waiting for its last words")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_LAST_WORDS_S):
                await w.died.wait()

    # ---- drain and death ------------------------------------------------------------------------------
    def start_drain(self, worker_id: str) -> WorkerRef:
        """Scale-down begins: route nothing new to the worker (raises ValueError for an unknown one)."""
        w = self._workers.get(worker_id)
        if w is None:
            raise ValueError(f"no worker {worker_id!r}")
        self.set_state(w, WorkerState.DRAINING, "scale-down")
        return w

    def retire(self, w: WorkerRef) -> None:
        """Scale-down ends (its requests are over or moved): forget the worker; its incarnation is never
        re-admitted (the caller stops the actor)."""
        self.unwatch(w.worker_id)
        self._retired.add(w.info.incarnation)
        self.set_state(w, WorkerState.DEAD, "removed")
        self._tell_peers_dead(w)
        self._remove(w)

    def set_state(self, w: WorkerRef, state: WorkerState, why: str) -> None:
        if w.state == state:
            return
        log = logger.info if state in (WorkerState.HEALTHY, WorkerState.DRAINING) else logger.error
        log("router: worker %s is %s%s", w.worker_id, state.value, f" ({why})" if why else "")
        w.state, w.why = state, why
        if state == WorkerState.DEAD:
            w.died.set()
        if self._on_state is not None:
            self._on_state(w)

    def mark_dead(self, w: WorkerRef, why: str) -> None:
        """The worker is dead: its peers are told, then the request path moves its requests (on_death)."""
        if w.state == WorkerState.DEAD:
            return
        self.set_state(w, WorkerState.DEAD, why)
        self._tell_peers_dead(w)
        self._on_death(w, why)

    def _tell_peers_dead(self, w: WorkerRef) -> None:
        # NOTE: peers stop waiting on it at once instead of sitting out transfer timeouts with other
        # workers' transfers queued behind.
        for peer in self._live_peers(w):
            self.send(peer, PeerDead(w.worker_id, w.info.incarnation))

    def _live_peers(self, w: WorkerRef) -> Sequence[WorkerRef]:
        return [p for p in self._workers.values() if p is not w and p.state != WorkerState.DEAD]

    def close(self) -> None:
        """Close every worker's socket (the watch tasks are cancelled first, by the router)."""
        for w in self._workers.values():
            w.socket.close(linger=0)


def _model_identity(info: WorkerInfo) -> tuple[str, int]:
    """What workers of one cluster must agree on: the checkpoint (by fingerprint: its path differs
    between hosts, e.g. each node's copy of a Ray working_dir) and the vocabulary."""
    return (info.model_fingerprint or info.model_dir, info.vocab_size)

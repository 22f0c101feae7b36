"""Front-end replicas (``server.replicas: N``, ``pdserve serve --api-server-count N`` as vLLM names it): the
supervisor's side, ``ReplicatedFrontEnd``, the front end ``build_cluster`` (deploy/launch.py) builds for N.

N processes, each an HTTP edge + router (``python -m deploy.replicas``, fed a :class:`ReplicaSpec` on its
stdin) over the same worker pools, all listening on one port of the head node (``SO_REUSEPORT``: the
kernel spreads new connections over the replicas that listen). The cluster's process supervises: it runs
Ray and the worker actors (as with one front end), and restarts a replica that dies (:class:`ReplicaSet`).

What the replicas share is the workers, nothing else. Each replica admits the workers by their
heartbeats (a worker beats to every replica's event socket: ``WorkerControl.router_endpoints``), routes
by the load they report and its own requests, and owns the requests it took: a worker sends each
request's events to its owner only (workers/router_links.py). A replica that dies: the kernel stops
giving it connections; its clients' streams end with a connection error (they may retry); every worker
frees its requests once its lease runs out (``router.router_lease_s``) or at once when the restarted
replica (same slot, same event port, a new incarnation) renews its lease; the other replicas never
notice.

Metrics: each replica has its own registry. Prometheus scrapes each replica on its own port
(``server.metrics_port`` + its index; the shared port reaches whichever replica the kernel picks); the
dashboard sums the request series over ``instance``. Every replica also exports the workers' gauges
(from the heartbeats): the dashboard takes their ``max`` per worker.

Ray's word on a worker reaches the replicas (which run no Ray) through :class:`LifecycleRelay`. Not
served with replicas (yet): ``POST /v1/pdserve/scale`` and ``Cluster.scale`` (the launcher is in the
supervisor: scale with one replica).
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from cluster.config import ClusterConfig
from cluster.protocol import WorkerStats
from cluster.wire import WireEncoder, WorkerGone, router_recipient
from deploy.front_end import check_exposure

logger = logging.getLogger(__name__)

REPLICA_MARK = "PDSERVE-REPLICA"  # a replica's stdout lines for its supervisor start with it
START_TIMEOUT_S = 600.0  # a replica's start: its router binds at once; serving waits for healthy workers
EVENTS_TIMEOUT_S = 120.0  # a replica process's imports and its router's bind
_STOP_S = 10.0  # a replica's graceful stop (uvicorn's 5 s window for in-flight responses, then its router)
_RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # after quick deaths in a row
_STABLE_S = 30.0  # a replica that served this long starts its backoff over
_STATS_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica process is told on its stdin (one JSON line; it carries the cluster secret, so it
    never goes on a command line)."""

    index: int
    config: dict[str, Any]  # ClusterConfig.to_dict()
    secret_hex: str
    bind_host: str  # the router's event socket's address
    event_port: int  # 0: any free port (the first start); a restart takes its predecessor's
    http_port: int  # the shared port (already chosen: never 0 here)


class ReplicaProcess:
    """One replica slot: its process (restarted as a new one in the same slot), its event endpoint."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.endpoint = ""
        self.proc: subprocess.Popen[str] | None = None
        self.num_restarts = 0
        self.started_at = 0.0
        self._events = threading.Event()  # the current process printed its event endpoint
        self.serving = threading.Event()  # ... and serves HTTP

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def spawn(self) -> None:
        self._events.clear()
        self.serving.clear()
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.replicas"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            # NOTE: a terminal's Ctrl-C reaches the supervisor only, which stops the replicas itself
            # (they also die with it: _die_with_parent)
            start_new_session=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(asdict(self.spec)) + "\n")
        proc.stdin.close()
        self.proc, self.started_at = proc, time.monotonic()
        threading.Thread(
            target=self._read, args=(proc,), name=f"replica-{self.spec.index}-stdout", daemon=True
        ).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        """Echo the replica's stdout; take its marks (bounded: ends with the process's stdout)."""
        assert proc.stdout is not None
        for line in proc.stdout:
            parts = line.split()
            if parts[:2] == [REPLICA_MARK, str(self.spec.index)] and proc is self.proc:
                if parts[2] == "EVENTS":
                    self.endpoint = parts[3]
                    port = int(self.endpoint.rsplit(":", 1)[1])
                    self.spec = replace(self.spec, event_port=port)  # NOTE: a restart binds it again
                    self._events.set()
                elif parts[2] == "SERVING":
                    self.serving.set()
                continue
            sys.stdout.write(line)
            sys.stdout.flush()

    def wait_events(self, timeout_s: float) -> str:
        if not self._events.wait(timeout_s):
            raise TimeoutError(
                f"replica {self.spec.index} did not bind its event socket in {timeout_s:.0f} s"
            )
        return self.endpoint

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=_STOP_S)


class ReplicaSet:
    """N replica slots on one port: started together, each restarted when its process dies (``supervise``
    on a thread of its own until ``stop``)."""

    def __init__(self, cfg: ClusterConfig, secret: bytes, bind_host: str) -> None:
        server = cfg.server
        # NOTE: the port is held here (bound with SO_REUSEPORT, never listening) for the cluster's life:
        # port 0 gets a concrete one the replicas share, and no other program takes it while one restarts
        self._port_sock = socket.socket(
            socket.AF_INET6 if ":" in server.host else socket.AF_INET, socket.SOCK_STREAM
        )
        self._port_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._port_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self._port_sock.bind((server.host, server.port))
        self.port = int(self._port_sock.getsockname()[1])
        self.slots = [
            ReplicaProcess(ReplicaSpec(i, cfg.to_dict(), secret.hex(), bind_host, 0, self.port))
            for i in range(server.replicas)
        ]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> list[str]:
        """Spawn every replica; returns their event endpoints (by index) once each has bound its own."""
        for slot in self.slots:
            slot.spawn()
        return [slot.wait_events(EVENTS_TIMEOUT_S) for slot in self.slots]

    def wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for slot in self.slots:
            while not slot.serving.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
                proc = slot.proc
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(
                        f"replica {slot.spec.index} exited with {proc.returncode} while starting"
                    )
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"replica {slot.spec.index} not serving within {timeout_s:.0f} s")

    def start_supervising(self) -> None:
        self._thread = threading.Thread(target=self._supervise, name="replica-supervisor", daemon=True)
        self._thread.start()

    def _supervise(self) -> None:
        quick_deaths = [0] * len(self.slots)
        restart_at: dict[int, float] = {}
        while not self._stop.wait(0.2):
            try:
                self._supervise_once(quick_deaths, restart_at)
            except Exception:  # NOTE: said, then the next turn tries again: restarts must not stop for good
                logger.exception("front-end replica supervisor: a turn failed")

    def _supervise_once(self, quick_deaths: list[int], restart_at: dict[int, float]) -> None:
        now = time.monotonic()
        for slot in self.slots:
            i = slot.spec.index
            proc = slot.proc
            if proc is None or proc.poll() is None:
                continue
            if i not in restart_at:
                quick = now - slot.started_at < _STABLE_S
                quick_deaths[i] = quick_deaths[i] + 1 if quick else 0
                delay = _RESTART_BACKOFF_S[min(quick_deaths[i], len(_RESTART_BACKOFF_S) - 1)]
                logger.error(
                    "front-end replica %d (pid %d) exited with %s; restarting it in %.1f s",
                    i, proc.pid, proc.returncode, delay,
                )  # fmt: skip
                restart_at[i] = now + delay
            elif now >= restart_at[i]:
                del restart_at[i]
                slot.num_restarts += 1
                try:
                    slot.spawn()
                except OSError:
                    logger.exception("front-end replica %d: restart failed", i)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for slot in self.slots:
            slot.stop()
        self._port_sock.close()


class LifecycleRelay:
    """Ray's word on the workers, for the replicas (which run no Ray): the supervisor pings every actor
    each health interval, as a single router's lifecycle watch does, and when Ray cannot reach one it
    sends each replica ``WorkerGone`` (signed, with the pid that answered last), which the replica takes
    as its own failed ping would be (cluster/router/membership.py): its requests migrate. A ping that
    only times out (a stopped or busy actor) says nothing."""

    def __init__(
        self,
        actors: Callable[[], dict[str, Any]],
        endpoints: Sequence[str],
        secret: bytes,
        cfg: ClusterConfig,
    ) -> None:
        import zmq

        self._actors = actors
        self._interval_s = cfg.router.health_interval_s
        self._timeout_s = cfg.router.health_timeout_s
        self._encoder = WireEncoder(secret)
        self._ctx: Any = zmq.Context()
        self._sockets = []
        for endpoint in endpoints:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._sockets.append(sock)
        self._answered: dict[str, int] = {}  # worker id -> the pid that answered its last ping
        self._told: set[tuple[str, int]] = set()  # (worker id, pid) whose death the replicas were told
        self.gone: set[str] = set()  # workers whose last ping Ray answered with their death
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-lifecycle-relay", daemon=True)
        self.num_told = 0

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        import ray

        while not self._stop.wait(self._interval_s):
            try:
                self._turn(ray)
            except Exception:  # NOTE: said, then the next turn tries again
                logger.exception("lifecycle relay: a turn failed")

    def _turn(self, ray: Any) -> None:
        refs = {wid: actor.ping.remote() for wid, actor in self._actors().items()}
        if not refs:
            return
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self._timeout_s)
        done = set(ready)
        for wid, ref in refs.items():
            if ref not in done:
                continue  # NOTE: stopped or busy: not dead
            try:
                self._answered[wid] = int(ray.get(ref))
                self.gone.discard(wid)
            except Exception as e:  # noqa: BLE001 - RayActorError and friends: the actor is gone
                self.gone.add(wid)
                pid = self._answered.get(wid, 0)
                if (wid, pid) not in self._told:  # NOTE: each process's death is told once
                    self._told.add((wid, pid))
                    self._tell(WorkerGone(wid, pid, f"{type(e).__name__}: {str(e).splitlines()[0]}"))

    def _tell(self, event: WorkerGone) -> None:
        import zmq

        self.num_told += 1
        for i, sock in enumerate(self._sockets):
            with contextlib.suppress(zmq.Again):
                sock.send(self._encoder.encode(router_recipient(i), event), zmq.NOBLOCK)

    def stop(self) -> None:
        """Idempotent, bounded (a turn's pings take at most ``health_timeout_s``)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._timeout_s + 5)
        for sock in self._sockets:
            sock.close(linger=0)
        self._ctx.term()


class ReplicatedFrontEnd:
    """N front-end replica processes on one port (``server.replicas`` >= 2), supervised from this process;
    the front end ``build_cluster`` builds for them (deploy/front_end.py ``FrontEnd``). Built before Ray
    starts: a public bind without an API key fails here, before anything runs.

    No router runs in this process: requests go over HTTP to ``url``. Ray's word on each watched worker
    reaches the replicas through the relay, once they serve (``wait_serving``)."""

    def __init__(self, cfg: ClusterConfig) -> None:
        if cfg.server.replicas < 2:
            raise ValueError(f"a replicated front end needs server.replicas >= 2, got {cfg.server.replicas}")
        check_exposure(cfg.server, cfg.server.host)
        self.config = cfg
        self._replicas: ReplicaSet | None = None
        self._relay: LifecycleRelay | None = None
        self._secret = b""
        self._endpoints: tuple[str, ...] = ()
        self._actors: dict[str, Any] = {}
        self._is_stopped = False

    @property
    def replicas(self) -> ReplicaSet:
        if self._replicas is None:
            raise RuntimeError("the front-end replicas have not started")
        return self._replicas

    @property
    def relay(self) -> LifecycleRelay:
        if self._relay is None:
            raise RuntimeError("the lifecycle relay starts once the replicas serve (wait_serving)")
        return self._relay

    @property
    def url(self) -> str:
        """Where the replicas serve HTTP (their shared port; loopback for a wildcard host)."""
        host = self.config.server.host
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.replicas.port}"

    def start(self, secret: bytes, bind_host: str) -> tuple[str, ...]:
        self._secret = secret
        self._replicas = ReplicaSet(self.config, secret, bind_host)
        self._endpoints = tuple(self._replicas.start())
        return self._endpoints

    def watch(self, worker_id: str, actor: Any) -> None:
        self._actors[worker_id] = actor

    def wait_serving(self, worker_ids: Sequence[str], timeout_s: float) -> None:
        """Until every replica serves (each one's router has a healthy worker of every pool it needs);
        then the supervisor restarts a replica that dies and the relay tells them of the workers."""
        self.replicas.wait_serving(timeout_s)
        self.replicas.start_supervising()
        if self._relay is None:
            self._relay = LifecycleRelay(
                lambda: dict(self._actors), self._endpoints, self._secret, self.config
            )
            self._relay.start()

    def live_worker_ids(self) -> list[str]:
        gone = set(self._relay.gone) if self._relay is not None else set()
        return [wid for wid in self._actors if wid not in gone]

    def worker_stats(self) -> list[WorkerStats]:
        """Asked of the live actors (the heartbeats go to the replicas, not here)."""
        import ray

        actors = [self._actors[wid] for wid in self.live_worker_ids()]
        return list(ray.get([a.stats.remote() for a in actors], timeout=_STATS_TIMEOUT_S))

    def stop(self) -> None:
        if self._is_stopped:
            return
        self._is_stopped = True
        if self._relay is not None:
            self._relay.stop()
        if self._replicas is not None:
            self._replicas.stop()

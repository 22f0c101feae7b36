"""Front-end replicas (``server.replicas: N``, ``pdserve serve --api-server-count N`` as vLLM names it).

N processes, each an HTTP edge + router (``python -m deploy.replicas``, fed a :class:`ReplicaSpec` on its
stdin) over the same worker pools, all listening on one port of the head node (``SO_REUSEPORT``: the
kernel spreads new connections over the replicas that listen). The launching process supervises: it
runs Ray, the KV-transfer store and the worker actors (:class:`ReplicatedCluster`), and restarts a
replica that dies (:class:`ReplicaSet`).

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
served with replicas (yet): ``POST /v1/pdserve/scale`` (the launcher is in the supervisor: scale with one
replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
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
from cluster.frames import new_secret
from cluster.wire import WireEncoder, WorkerControl, WorkerGone, router_recipient

logger = logging.getLogger(__name__)

_MARK = "PDSERVE-REPLICA"
_START_TIMEOUT_S = 600.0  # a replica's start: its router binds at once; serving waits for healthy workers
_EVENTS_TIMEOUT_S = 120.0  # a replica process's imports and its router's bind
_STOP_S = 10.0  # a replica's graceful stop (uvicorn's 5 s window for in-flight responses, then its router)
_RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # after quick deaths in a row
_STABLE_S = 30.0  # a replica that served this long starts its backoff over


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


# ---- the replica process ---------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its supervisor dies (the thread that spawned it ends: the
    supervisor's main thread, or its supervising thread for a restarted replica, both of which live
    until the cluster stops), so no replica outlives its cluster."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


async def _serve_replica(spec: ReplicaSpec) -> None:
    from cluster.heap import freeze_startup_heap
    from cluster.http.app import create_server
    from cluster.router.admission import load_predictor
    from cluster.router.router import Router
    from deploy.http_host import connection_limits, create_router_app, listen

    cfg = ClusterConfig.from_dict(spec.config)
    router = Router(
        cfg.router,
        bytes.fromhex(spec.secret_hex),
        served_model_name=cfg.server.served_model_name,
        bind_host=spec.bind_host,
        predictor=load_predictor(cfg.router, cfg.engine_config(cfg.prefill_pool)),
        replica=spec.index,
        event_port=spec.event_port,
    )
    await router.start()
    socks: list[socket.socket] = []
    try:
        print(f"{_MARK} {spec.index} EVENTS {router.endpoint}", flush=True)
        await router.wait_healthy(_START_TIMEOUT_S)
        server = cfg.server
        socks.append(listen(server.host, spec.http_port, reuse_port=True))
        if server.metrics_port:
            socks.append(listen(server.host, server.metrics_port + spec.index))
        http = create_server(
            create_router_app(router, cfg, replica=spec.index),
            server.host,
            spec.http_port,
            limits=connection_limits(server),
        )
        serving = asyncio.create_task(http.serve(sockets=socks))
        async with asyncio.timeout(_EVENTS_TIMEOUT_S):
            while not http.started and not serving.done():
                await asyncio.sleep(0.05)  # NOTE: uvicorn's own flag (it has no event to wait on)
        if serving.done():
            serving.result()
            raise RuntimeError(f"replica {spec.index}: the HTTP server stopped during startup")
        print(f"{_MARK} {spec.index} SERVING pid {os.getpid()}", flush=True)
        freeze_startup_heap()
        await serving
    finally:
        await router.close()
        for sock in socks:
            sock.close()


def replica_main() -> int:
    """``python -m deploy.replicas``: one replica, its spec on stdin, until SIGTERM / SIGINT."""
    from deploy.logs import configure_logging

    _die_with_parent()
    raw = json.loads(sys.stdin.readline())
    spec = ReplicaSpec(**raw)
    configure_logging(ClusterConfig.from_dict(spec.config).log)
    asyncio.run(_serve_replica(spec))
    return 0


# ---- the supervisor's side -------------------------------------------------------------------------------
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
            if parts[:2] == [_MARK, str(self.spec.index)] and proc is self.proc:
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
        return [slot.wait_events(_EVENTS_TIMEOUT_S) for slot in self.slots]

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
            except Exception as e:  # noqa: BLE001 - RayActorError and friends: the actor is gone
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
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._timeout_s + 5)
        for sock in self._sockets:
            sock.close(linger=0)
        self._ctx.term()


class ReplicatedCluster:
    """Ray, the KV-transfer store, the worker actors and N front-end replicas (see the module docstring).
    Built complete by :meth:`start`; ``shutdown()`` leaves no process, actor or thread behind."""

    def __init__(
        self,
        cfg: ClusterConfig,
        replicas: ReplicaSet,
        launcher: Any,
        kv_store: Any,
        started_ray: bool,
        relay: LifecycleRelay,
    ):
        self.config = cfg
        self.replicas = replicas
        self.relay = relay
        self._launcher = launcher
        self._kv_store = kv_store
        self._started_ray = started_ray
        self.url = (
            f"http://{'127.0.0.1' if cfg.server.host in ('0.0.0.0', '') else cfg.server.host}:{replicas.port}"
        )

    @property
    def actors(self) -> dict[str, Any]:
        return dict(self._launcher.actors)

    @classmethod
    def start(cls, config: ClusterConfig, *, fault_injection: bool = False) -> ReplicatedCluster:
        import ray

        from cluster.hub import resolve_cluster_model
        from deploy import device_check
        from deploy.http_host import check_exposure
        from deploy.launch import KVStore, WorkerLauncher, _bind_host, _init_ray, _pools, _resolved_transfer

        cfg = resolve_cluster_model(config)
        if cfg.server.replicas < 2:
            raise ValueError(f"a replicated front end needs server.replicas >= 2, got {cfg.server.replicas}")
        check_exposure(cfg.server, cfg.server.host)
        joining = bool(cfg.ray_address or os.environ.get("RAY_ADDRESS"))
        if not joining:
            device_check.check_local(cfg)
        started_ray = _init_ray(cfg)
        worker_bind, router_host = _bind_host(cfg)
        secret = new_secret()
        replicas = ReplicaSet(cfg, secret, router_host)
        kv_store: Any = None
        launcher: Any = None
        relay: LifecycleRelay | None = None
        try:
            endpoints = replicas.start()
            kv_store = KVStore(router_host) if cfg.router.mode != "colocated" else None
            store = kv_store.address if kv_store is not None else None
            control = WorkerControl(tuple(endpoints), cfg.router.health_interval_s, worker_bind, store)
            launcher = WorkerLauncher(
                replace(cfg, transfer=_resolved_transfer(cfg)), secret, control, fault_injection
            )
            if joining:
                device_check.check_remote(cfg)
            for pool, pc in _pools(cfg):
                for _ in range(pc.num_workers):
                    launcher.create(pool)
            replicas.wait_serving(_START_TIMEOUT_S)
            replicas.start_supervising()
            relay = LifecycleRelay(lambda: dict(launcher.actors), endpoints, secret, cfg)
            relay.start()
        except BaseException:
            if relay is not None:
                relay.stop()
            replicas.stop()
            if launcher is not None:
                launcher.stop_all()
            if kv_store is not None:
                kv_store.close()
            if started_ray:
                ray.shutdown()
            raise
        return cls(cfg, replicas, launcher, kv_store, started_ray, relay)

    def check_leaks(self, timeout_s: float = 30.0) -> dict[str, str | None]:
        """Every worker's leak report (None: clean), as ``ClusterHandle.check_leaks``."""
        import ray

        ids = list(self._launcher.actors)
        reports = ray.get(
            [self._launcher.actors[w].check_leaks.remote(timeout_s) for w in ids], timeout=timeout_s + 10
        )
        return dict(zip(ids, reports, strict=True))

    def kill_worker(self, worker_id: str) -> None:
        """kill -9 a worker's process, with no restart (tests): Ray's word reaches the replicas through
        the relay."""
        import ray

        ray.kill(self._launcher.actors[worker_id], no_restart=True)

    def shutdown(self) -> None:
        import ray

        self.relay.stop()
        self.replicas.stop()
        self._launcher.stop_all()
        if self._kv_store is not None:
            self._kv_store.close()
        if self._started_ray:
            ray.shutdown()


def serve_replicated(cfg: ClusterConfig) -> None:
    """``pdserve serve`` with ``server.replicas`` > 1: start everything, serve until Ctrl-C / SIGTERM."""
    stop = threading.Event()

    def on_signal(sig: int, frame: Any) -> None:
        stop.set()

    cluster = ReplicatedCluster.start(cfg)
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        pids = [slot.pid for slot in cluster.replicas.slots]
        print(
            f"pdserve: serving ({cfg.router.mode}) on {cluster.url} with {len(pids)} front-end replicas "
            f"(pids {pids})",
            flush=True,
        )
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        cluster.shutdown()


if __name__ == "__main__":
    raise SystemExit(replica_main())

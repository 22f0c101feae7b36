"""The composition root: ``build_cluster`` turns a ``ClusterConfig`` into the running actor graph, and
:class:`Cluster` owns its lifecycle. The only place that creates actors (:class:`WorkerLauncher`).

    ray job submit --working-dir . -- python -m deploy.launch --config deploy/cpu-disagg.yaml \
        --prompt "Once upon a time"                                    # one request, then exit
    python -m deploy.launch --config ... --prompt "..." --prompt "..." # local Ray cluster

Serving the HTTP API is the CLI's (``pdserve serve``, ``python -m deploy.cli serve --config ...``, also
under ``ray job submit``), through ``deploy/http_host.py``, which sits above this module.

Python API (tests, benchmarks, the CLI):

    cluster = build_cluster("deploy/cpu-disagg.yaml")   # or a ClusterConfig / dict
    out = cluster.generate(prompt_token_ids, SamplingParams(max_tokens=16))
    async for delta in cluster.agenerate(prompt_token_ids, params): ...
    cluster.scale("decode", 2)                           # grow / shrink a pool (drains, migrates)
    cluster.shutdown()                                   # no process, actor or thread left

One graph, one swapped part, the front end (deploy/front_end.py): with ``server.replicas: 1`` a
``RouterFrontEnd``, the router on an event loop owned by the cluster (its own thread; the HTTP server,
when asked for, is served on that same loop so handlers and router share it); with N, a
``ReplicatedFrontEnd`` (deploy/replica_set.py), N HTTP edge + router processes on one port, supervised
here. What needs the router in this process (``generate``, ``agenerate``, ``scale``, ``router``) refuses
the second with :class:`NoLocalRouterError`. Each prefill/decode pair builds its own KV-transfer group
on first use (transfer/pairs.py), rendezvousing over the pair's own signed handshake link: there is no
launch-time world and no torch.distributed store (the cluster opens no port for one), so workers added
by ``scale`` or restarted by Ray move KV like the first ones. A worker moves KV if its control says so
(``WorkerControl.moves_kv``: any non-colocated cluster). Each worker gets its own pool's engine settings
(``ClusterConfig.engine_config(pool)``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any, TypeVar

# NOTE: ray is imported in the functions that use it: a bare GPU machine (no Ray) imports this module too
# (the tests of what it builds, the GPU first-contact script).
from cluster.config import ClusterConfig, PoolConfig, TransferConfig
from cluster.frames import new_secret
from cluster.hub import resolve_cluster_model
from cluster.protocol import (
    ModelInfo,
    RequestOutput,
    SamplingParams,
    TokenDelta,
    WorkerStats,
)
from cluster.router.router import Router
from cluster.wire import WorkerControl
from deploy import device_check, logs
from deploy.front_end import FrontEnd, RouterFrontEnd
from deploy.replica_set import ReplicatedFrontEnd

logger = logging.getLogger(__name__)
T = TypeVar("T")

_START_TIMEOUT_S = 600.0
_LOCAL_RAY_CPUS = 16
_STOP_TIMEOUT_S = 10.0  # a worker's graceful shutdown, before it is killed
# NOTE: Ray's worker_niceness is added to the niceness its workers inherit (the process that started
# Ray's): 0 runs a local cluster's workers at the front end's own priority (Ray's default is 15)
WORKER_NICENESS = 0


def _pools(cfg: ClusterConfig) -> list[tuple[str, PoolConfig]]:
    return [(pool, cfg.pool(pool)) for pool in cfg.pool_names]


class WorkerLauncher:
    """Creates and stops the worker actors of one cluster (at start and when scaling): the only place that
    creates actors. Each worker asks Ray for its own resources, so a worker can be added or removed alone
    and its resources go back to Ray with it. ``actors`` maps each worker id to its face: the actor the
    router talks to and Ray's lifecycle watch pings."""

    def __init__(
        self, cfg: ClusterConfig, secret: bytes, control: WorkerControl, fault_injection: bool
    ) -> None:
        self.cfg = cfg
        self.secret = secret
        self.control = control
        self.fault_injection = fault_injection
        self.actors: dict[str, Any] = {}
        self._next_index: dict[str, int] = {}
        self._cores = sorted(os.sched_getaffinity(0))
        self._num_created = 0

    def create(self, pool: str) -> tuple[str, Any]:
        """A new worker of ``pool``, named ``<pool>-<index>``; returns (worker id, its actor)."""
        index = self._next_index.get(pool, 0)
        self._next_index[pool] = index + 1
        worker_id = f"{pool}-{index}"
        core = self._cores[self._num_created % len(self._cores)] if self.cfg.pin_cpu_cores else None
        self._num_created += 1
        self.actors[worker_id] = self._create_actor(worker_id, pool, core)
        return worker_id, self.actors[worker_id]

    def _create_actor(self, worker_id: str, pool: str, core: int | None) -> Any:
        """One worker, one actor with its pool's resources times its ranks.

        A tensor-parallel worker (``tensor_parallel_size`` N) is this one actor, rank 0, asking Ray for
        N ranks' devices and cores at once, which Ray grants on one node; it starts ranks 1..N-1 as its
        own child processes (workers/rank_process.py), one device each, so the worker lives, dies and
        is restarted as one unit and its resources go back to Ray with it."""
        import ray

        from workers.worker import EngineWorker

        pc = self.cfg.pool(pool)
        ranks = pc.tensor_parallel_size
        actor_cls: Any = ray.remote(EngineWorker)
        return actor_cls.options(
            num_cpus=max(pc.num_cpus * ranks, 0.001),
            num_gpus=pc.num_gpus * ranks,
            resources=dict(pc.resources) or None,
            max_restarts=pc.max_restarts,
            scheduling_strategy="SPREAD" if self.cfg.placement_strategy == "SPREAD" else "DEFAULT",
        ).remote(
            worker_id,
            pool,
            self.cfg.engine_config(pool),
            self.cfg.transfer,
            self.secret,
            self.control,
            torch_threads=pc.torch_threads if not pc.num_gpus else None,
            cpu_core=core,
            allow_fault_injection=self.fault_injection,
            stats_interval_s=self.cfg.log.stats_interval_s,
            freeze_heap=True,  # NOTE: each actor is a process of its own
        )

    def kill(self, worker_id: str, *, no_restart: bool) -> None:
        """kill -9 a worker (failure injection): Ray restarts it if its pool allows and ``no_restart`` is
        False. It stays in ``actors`` (dead or restarted)."""
        import ray

        ray.kill(self.actors[worker_id], no_restart=no_restart)

    def stop(self, worker_id: str) -> None:
        """Stop one worker (scale-down): a graceful shutdown (bounded), then killed; its resources go back
        to Ray."""
        self._release([self.actors.pop(worker_id)])

    def stop_all(self) -> None:
        """Stop every worker at once (each gets the same bounded graceful shutdown)."""
        actors = list(self.actors.values())
        self.actors.clear()
        self._release(actors)

    def _release(self, actors: list[Any]) -> None:
        import ray

        if not actors:
            return
        refs = []
        for actor in actors:
            # NOTE: a dead actor cannot shut down; it is killed regardless
            with contextlib.suppress(Exception):
                refs.append(actor.shutdown.remote())
        with contextlib.suppress(Exception):
            ray.wait(refs, num_returns=len(refs), timeout=_STOP_TIMEOUT_S)
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)


class NoLocalRouterError(RuntimeError):
    """What needs the router in this process, asked of a cluster whose routers run in its front-end
    replica processes."""


class Cluster:
    """A running cluster: Ray (when it started it), the worker actors and its front end (see the module
    docstring). Built complete by :func:`build_cluster`.

    Lifecycle: ``shutdown()`` (idempotent, bounded; also ``with cluster:``) stops the front end first (no
    new request, no replica left), then the workers and a Ray it started: no process, actor or thread of
    the cluster is left behind.
    """

    def __init__(
        self,
        config: ClusterConfig,
        secret: bytes,
        front_end: FrontEnd,
        launcher: WorkerLauncher | None,
        started_ray: bool,
    ) -> None:
        self.config = config
        self.secret = secret  # the control plane's key (cluster/frames.py); tests sign with it
        self.front_end = front_end
        self._launcher = launcher
        self._started_ray = started_ray
        self._is_shut_down = False

    @property
    def actors(self) -> dict[str, Any]:
        """Each worker's actor, by worker id (a dead one too, until it is stopped)."""
        return self._launcher.actors if self._launcher is not None else {}

    # ---- the router in this process ------------------------------------------------------------------
    def _local(self, what: str) -> RouterFrontEnd:
        if isinstance(self.front_end, RouterFrontEnd):
            return self.front_end
        n = self.config.server.replicas
        where = self.front_end.url if isinstance(self.front_end, ReplicatedFrontEnd) else "its front end"
        raise NoLocalRouterError(
            f"{what} needs the router in this process; this cluster's routers run in its {n} front-end "
            f"replica processes (server.replicas {n}): send requests over HTTP to {where}"
        )

    @property
    def router(self) -> Router:
        return self._local("router").router

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The router's event loop (its own thread)."""
        return self._local("loop").loop

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the router's loop from any other thread."""
        return self._local("run").run(coro, timeout)

    @property
    def model_info(self) -> ModelInfo:
        return self.router.model_info

    # ---- requests (through the router in this process) ------------------------------------------------
    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        timeout_s: float | None = None,
    ) -> RequestOutput:
        """Blocking: the whole request. Router errors (RouterError subclasses) propagate."""
        return self._local("generate").generate(prompt_token_ids, params, timeout_s=timeout_s)

    def agenerate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Async streaming from any event loop: yields the router's TokenDeltas as they arrive."""
        return self._local("agenerate").agenerate(prompt_token_ids, params, request_id=request_id)

    # ---- elasticity -----------------------------------------------------------------------------------
    @property
    def pools(self) -> list[str]:
        """The pools ``scale`` accepts."""
        return [p for p, _ in _pools(self.config)]

    def scale(self, pool: str, num_workers: int, *, timeout_s: float = _START_TIMEOUT_S) -> list[str]:
        """Grow or shrink ``pool`` to ``num_workers`` live workers; returns the pool's worker ids.

        Growing waits (bounded) until the new workers are admitted. Shrinking drains the newest workers
        (nothing new is routed to them; their requests finish or migrate within ``drain_timeout_s``),
        then stops them, which returns their resources to Ray. Never call it on the router's loop.
        """
        front = self._local("scale")
        if pool not in self.pools:
            raise ValueError(f"pool must be one of {self.pools}, got {pool!r}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        launcher = self._running_launcher()
        live = self._live(front, pool)
        if num_workers > len(live):
            new = [launcher.create(pool) for _ in range(num_workers - len(live))]
            for worker_id, actor in new:
                front.watch(worker_id, actor)
            front.wait_serving([wid for wid, _ in new], timeout_s)
        for worker_id in sorted(live, key=_index)[num_workers:][::-1]:
            front.drain(worker_id, self.config.router.drain_timeout_s)
            launcher.stop(worker_id)
        return self._live(front, pool)

    @staticmethod
    def _live(front: RouterFrontEnd, pool: str) -> list[str]:
        return sorted(
            (w.worker_id for w in front.router.workers if w.pool == pool and w.state != "dead"), key=_index
        )

    def _running_launcher(self) -> WorkerLauncher:
        if self._launcher is None or self._is_shut_down:
            raise RuntimeError("the cluster is not running")
        return self._launcher

    # ---- observability & tests ------------------------------------------------------------------------
    def worker_stats(self) -> list[WorkerStats]:
        """The latest stats of every live worker (with one front end: the router's, from heartbeats)."""
        return self.front_end.worker_stats()

    def _live_actors(self) -> dict[str, Any]:
        actors = self.actors
        return {wid: actors[wid] for wid in self.front_end.live_worker_ids() if wid in actors}

    def check_leaks(self, timeout_s: float = 30.0) -> dict[str, str | None]:
        """Leak invariant on every worker the front end does not know dead: None where clean. Each
        worker's check and the wait for all of them are bounded by ``timeout_s``."""
        import ray

        live = self._live_actors()
        reports = ray.get([a.check_leaks.remote(timeout_s) for a in live.values()], timeout=timeout_s + 10)
        return dict(zip(live, reports, strict=True))

    def wait_until_quiet(self, timeout_s: float = 30.0) -> None:
        """Wait (bounded) until no live worker runs, waits, or waits for KV (e.g. after aborts)."""
        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            actors = list(self._live_actors().values())
            stats: list[WorkerStats] = ray.get([a.stats.remote() for a in actors], timeout=timeout_s)
            idle = all(
                s.engine.num_running == 0 and s.engine.num_waiting == 0 and s.num_waiting_for_kv == 0
                for s in stats
            )
            if idle and all(v is None for v in self.check_leaks(timeout_s).values()):
                return
            time.sleep(0.05)  # NOTE: polling a condition with a bound, not waiting for readiness
        raise TimeoutError(f"workers still busy after {timeout_s} s: {self.check_leaks(timeout_s)}")

    def kill_worker(self, worker_id: str, *, no_restart: bool = True) -> None:
        """Failure injection: kill -9 one worker (Ray restarts it if its pool allows and no_restart is
        False). Ray's word reaches every router (with replicas, through the supervisor's relay)."""
        self._running_launcher().kill(worker_id, no_restart=no_restart)

    def inject_fault(self, worker_id: str, kind: str) -> None:
        """Failure injection (``build_cluster(..., fault_injection=True)``): a worker thread dies."""
        import ray

        try:
            ray.get(self.actors[worker_id].inject_fault.remote(kind), timeout=30)
        except ray.exceptions.RayActorError:
            # NOTE: the call only queues the fault, and the process it kills can end before Ray's reply
            # to the call leaves it (a busy host: the step thread acts first): the fault took effect.
            logger.info("%s ended before answering the injected %s fault", worker_id, kind)

    def shutdown(self) -> None:
        """See the class docstring. A step that fails is logged and the next one still runs."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        _teardown(self.front_end, self._launcher, self._started_ray)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()


def _teardown(front_end: FrontEnd, launcher: WorkerLauncher | None, started_ray: bool) -> None:
    """The one teardown, of a running cluster and of one that failed to start: front end, workers, then
    a Ray this process started."""
    steps: list[tuple[str, Callable[[], None]]] = [("front end", front_end.stop)]
    if launcher is not None:
        steps.append(("workers", launcher.stop_all))
    if started_ray:
        import ray

        steps.append(("Ray", ray.shutdown))
    for name, stop in steps:
        try:
            stop()
        except Exception:
            logger.exception("cluster shutdown: stopping the %s failed", name)


def _index(worker_id: str) -> int:
    return int(worker_id.rsplit("-", 1)[1])


def _init_ray(cfg: ClusterConfig) -> bool:
    """Join the given / RAY_ADDRESS cluster, else start a local one. True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    handlers = list(logging.getLogger().handlers)
    if address:
        ray.init(address=address, log_to_driver=True, logging_config=logs.ray_logging_config(cfg.log))
        logs.after_ray_init(handlers)
        return False
    needed = sum(p.num_cpus * p.num_workers * p.tensor_parallel_size for _, p in _pools(cfg))
    # NOTE: a local cluster's CPUs are admission tokens (workers set their own torch threads), so leave
    # room for more than one cluster in the same driver (tests, benchmarks comparing two configs).
    num_cpus = max(int(needed) + 1, os.cpu_count() or 1, _LOCAL_RAY_CPUS)
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=True,
        logging_config=logs.ray_logging_config(cfg.log),
        # NOTE: at Ray's default (15 steps down) an engine's step and heartbeat threads get a sliver of
        # a node that also runs anything at normal priority, the front end included. A cluster joined at
        # ray_address keeps its operator's setting (RAY_worker_niceness=0 for `ray start`: the README).
        _system_config={"worker_niceness": WORKER_NICENESS},
    )
    logs.after_ray_init(handlers)
    return True


def _bind_host(cfg: ClusterConfig) -> tuple[str, str]:
    """(worker bind mode, the router's own bind address): loopback on one host, else the node's."""
    import ray

    network = cfg.network
    if network == "auto":
        network = "node" if sum(1 for n in ray.nodes() if n.get("Alive")) > 1 else "loopback"
    if network == "loopback":
        return "loopback", "127.0.0.1"
    return "node", str(ray.util.get_node_ip_address())


def _front_end(cfg: ClusterConfig) -> FrontEnd:
    """The swapped part: one router here, or N front-end replica processes. Built before Ray starts, so
    what it checks (a cost profile; a public bind without a key) fails before anything runs."""
    if cfg.server.replicas > 1:
        return ReplicatedFrontEnd(cfg)
    return RouterFrontEnd(cfg)


def build_cluster(config: ClusterConfig | dict[str, Any] | str, *, fault_injection: bool = False) -> Cluster:
    """Ray, the front end (binds the event sockets the workers report to), the worker actors, then wait
    (bounded) until the front end serves with every worker admitted. See the module docstring.
    ``fault_injection``: workers accept ``Cluster.inject_fault`` (tests only). On any failure
    everything started so far is stopped before the error propagates."""
    import ray

    if isinstance(config, str):
        cfg = ClusterConfig.from_yaml(config)
    elif isinstance(config, dict):
        cfg = ClusterConfig.from_dict(config)
    else:
        cfg = config
    cfg = resolve_cluster_model(cfg)
    front_end = _front_end(cfg)
    joining = bool(cfg.ray_address or os.environ.get("RAY_ADDRESS"))
    if not joining:
        device_check.check_local(cfg)
    started_ray = _init_ray(cfg)
    launcher: WorkerLauncher | None = None
    try:
        worker_bind, router_host = _bind_host(cfg)
        secret = new_secret()
        endpoints = front_end.start(secret, router_host)
        moves_kv = cfg.router.mode != "colocated"
        control = WorkerControl(endpoints, cfg.router.health_interval_s, worker_bind, moves_kv)
        launcher = WorkerLauncher(
            replace(cfg, transfer=_resolved_transfer(cfg)), secret, control, fault_injection
        )
        if joining:
            device_check.check_remote(cfg)
        for pool, pc in _pools(cfg):
            for _ in range(pc.num_workers):
                front_end.watch(*launcher.create(pool))
        try:
            front_end.wait_serving(list(launcher.actors), _START_TIMEOUT_S)
        except TimeoutError as e:
            raise RuntimeError(f"{e}; Ray resources available: {ray.available_resources()}") from None
    except BaseException:
        _teardown(front_end, launcher, started_ray)
        raise
    return Cluster(cfg, secret, front_end, launcher, started_ray)


def _resolved_transfer(cfg: ClusterConfig) -> TransferConfig:
    """The transfer config every worker gets: backend ``auto`` becomes nccl when every KV pool has GPUs
    (both ends of a pair must build the same kind of group), else gloo."""
    backend = cfg.transfer.backend
    if backend == "auto":
        backend = "nccl" if all(pc.num_gpus for _, pc in _pools(cfg)) else "gloo"
    return replace(cfg.transfer, backend=backend)


def main(argv: Sequence[str] | None = None) -> int:
    """Start the cluster of ``--config``, send each ``--prompt`` (greedy), print its output, shut down."""
    ap = argparse.ArgumentParser(
        prog="python -m deploy.launch",
        description="Start a cluster, send prompts, print the outputs, exit (serving: `pdserve serve`).",
    )
    ap.add_argument("--config", required=True, help="ClusterConfig YAML (deploy/*.yaml)")
    ap.add_argument("--prompt", action="append", required=True, help="send this prompt (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    cfg = ClusterConfig.from_yaml(args.config)
    if cfg.server.replicas > 1:
        raise SystemExit(
            "python -m deploy.launch sends prompts through a router in this process: the config's "
            f"server.replicas must be 1, got {cfg.server.replicas} (serve replicas with `pdserve serve`)"
        )
    logs.configure_logging(cfg.log)
    with build_cluster(cfg) as cluster:
        from cluster.tokenizer import Tokenizer

        tok = Tokenizer.from_pretrained(cluster.model_info.model_dir)
        if tok is None:
            raise SystemExit("the model has no tokenizer.json; --prompt needs one")
        for prompt in args.prompt:
            out = cluster.generate(
                tok.encode(prompt), SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
            )
            print(
                f"PROMPT {prompt!r}\nOUTPUT {out.text!r}\nTOKENS {len(out.token_ids)} "
                f"finish={out.finish_reason.value if out.finish_reason else None}",
                flush=True,
            )
        return 0


if __name__ == "__main__":
    raise SystemExit(main())

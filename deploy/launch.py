"""The only place that creates worker actors (WorkerLauncher); start_cluster() and ClusterHandle.

    ray job submit --working-dir . -- python -m deploy.launch --config deploy/cpu-disagg.yaml \
        --prompt "Once upon a time"                                    # one request, then exit
    python -m deploy.launch --config ... --prompt "..." --prompt "..." # local Ray cluster

Serving the HTTP API is the CLI's (``pdserve serve``, ``python -m deploy.cli serve --config ...``, also
under ``ray job submit``), through ``deploy/http_host.py``, which sits above this module.

Python API (tests, benchmarks):

    handle = start_cluster("deploy/cpu-disagg.yaml")   # or a ClusterConfig / dict
    out = handle.generate(prompt_token_ids, SamplingParams(max_tokens=16))
    async for delta in handle.agenerate(prompt_token_ids, params): ...
    handle.scale("decode", 2)                           # grow / shrink a pool (drains, migrates)
    handle.shutdown()                                   # no actor or thread left

The router runs on an event loop owned by the handle (its own thread); the HTTP server, when asked
for (deploy/http_host.py), is served on that same loop so handlers and router share it. The router
process also hosts the torch.distributed store (``KVStore``) on which each prefill/decode pair builds its
own KV-transfer group on first use (transfer/pairs.py): there is no launch-time world, so workers added
by ``scale`` or restarted by Ray move KV like the first ones. Each worker gets its own pool's engine
settings (``ClusterConfig.engine_config(pool)``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import replace
from typing import Any, TypeVar

# NOTE: ray is imported in the functions that use it: a bare GPU machine (no Ray) imports this module too
# (the tests of what it builds, the GPU first-contact script).
from cluster.config import ClusterConfig, PoolConfig, TransferConfig
from cluster.frames import new_secret
from cluster.hub import resolve_cluster_model
from cluster.protocol import (
    GenerateRequest,
    ModelInfo,
    RequestOutput,
    SamplingParams,
    TokenDelta,
    WorkerStats,
)
from cluster.router.admission import load_predictor
from cluster.router.router import Router
from cluster.wire import WorkerControl
from deploy import device_check, logs

logger = logging.getLogger(__name__)
T = TypeVar("T")

_START_TIMEOUT_S = 600.0
_LOCAL_RAY_CPUS = 16
# NOTE: Ray's worker_niceness is added to the niceness its workers inherit (the process that started
# Ray's): 0 runs a local cluster's workers at the front end's own priority (Ray's default is 15)
WORKER_NICENESS = 0
_ids = itertools.count()


def _pools(cfg: ClusterConfig) -> list[tuple[str, PoolConfig]]:
    return [(pool, cfg.pool(pool)) for pool in cfg.pool_names]


class RouterLoop:
    """The router's event loop, run by its own thread (the HTTP server, when hosted, shares it)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pdserve-router", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop from any other thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class KVStore:
    """The torch.distributed TCPStore KV-transfer pairs rendezvous on, served by the router process.

    NOTE: bound to ``host`` only (the router's own address): given no socket, torch's store server
    listens on every interface, so it gets one already bound and listening (``master_listen_fd``, which
    the store owns and closes). torch's store cannot authenticate its clients: every value a pair's
    rendezvous sets is signed with a key derived from the cluster secret and checked by the other end,
    which ignores (and counts) a stranger's (transfer/rendezvous.py). What a stranger that reaches this
    port can still do: read key names and values (worker names, gloo addresses), delete or overwrite a
    key (that pair's build times out; it is rebuilt at its next generation), and fill this process's
    memory: the store has no size or count cap (issue 31 measured 128 x 8 MiB sets: +1 GiB RSS). Bind it
    to an address only the cluster reaches (the README's trust boundary).
    """

    def __init__(self, host: str) -> None:
        import datetime

        import torch.distributed as dist

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(1024)
            self.address: tuple[str, int] = (host, int(listener.getsockname()[1]))
            self._store: Any = dist.TCPStore(
                host,
                self.address[1],
                None,
                True,
                datetime.timedelta(seconds=60),
                wait_for_workers=False,
                master_listen_fd=listener.fileno(),
            )
        except BaseException:
            listener.close()
            raise
        listener.detach()  # NOTE: the store owns the descriptor now

    def close(self) -> None:
        self._store = None


class WorkerLauncher:
    """Creates and stops worker actors of one cluster (at start and when scaling): the only place that
    creates actors. Each worker asks Ray for its own resources (no placement group), so a worker can be
    added or removed alone and its resources go back to Ray with it."""

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
        import ray

        from workers.worker import EngineWorker

        pc = self.cfg.pool(pool)
        index = self._next_index.get(pool, 0)
        self._next_index[pool] = index + 1
        worker_id = f"{pool}-{index}"
        core = self._cores[self._num_created % len(self._cores)] if self.cfg.pin_cpu_cores else None
        self._num_created += 1
        actor_cls: Any = ray.remote(EngineWorker)
        actor = actor_cls.options(
            num_cpus=max(pc.num_cpus, 0.001),
            num_gpus=pc.num_gpus,
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
        self.actors[worker_id] = actor
        return worker_id, actor

    def stop(self, worker_id: str) -> None:
        import ray

        actor = self.actors.pop(worker_id)
        # NOTE: a dead actor cannot shut down; it is killed regardless
        with contextlib.suppress(Exception):
            ray.get(actor.shutdown.remote(), timeout=10)
        ray.kill(actor, no_restart=True)

    def stop_all(self) -> None:
        for worker_id in list(self.actors):
            self.stop(worker_id)


class ClusterHandle:
    """A running cluster: worker actors and the router on its own loop.

    Built complete by :func:`start_cluster`; ``shutdown()`` leaves no actor or thread behind.
    """

    def __init__(
        self,
        config: ClusterConfig,
        router: Router,
        router_loop: RouterLoop,
        launcher: WorkerLauncher,
        started_ray: bool,
        kv_store: KVStore | None,
    ) -> None:
        self.config = config
        self.router = router
        self._kv_store = kv_store
        self._router_loop = router_loop
        self.loop = router_loop.loop
        self._launcher = launcher
        self.secret = launcher.secret  # the control plane's key (cluster/frames.py); tests sign with it
        self._started_ray = started_ray

    @property
    def actors(self) -> dict[str, Any]:
        return self._launcher.actors

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the router's loop from any other thread."""
        return self._router_loop.run(coro, timeout)

    @property
    def model_info(self) -> ModelInfo:
        return self.router.model_info

    # ---- requests -------------------------------------------------------------------------------------
    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        timeout_s: float | None = None,
    ) -> RequestOutput:
        """Blocking: the whole request. Router errors (RouterError subclasses) propagate."""
        return self.run(self._collect(prompt_token_ids, params or SamplingParams(), timeout_s))

    async def _collect(
        self, prompt: list[int], params: SamplingParams, timeout_s: float | None
    ) -> RequestOutput:
        rid = f"req-{next(_ids)}"
        out = RequestOutput.start(rid, prompt, params, time.time())
        deadline = None if timeout_s is None else time.time() + timeout_s
        async for d in self.router.generate(GenerateRequest(rid, list(prompt), params, deadline)):
            out.apply(d, time.time())
        return out

    async def agenerate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Async streaming from any event loop: yields the router's TokenDeltas as they arrive."""
        router = self.router
        rid = request_id or f"req-{next(_ids)}"
        req = GenerateRequest(rid, list(prompt_token_ids), params or SamplingParams())
        caller = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for d in router.generate(req):
                    caller.call_soon_threadsafe(inbox.put_nowait, ("delta", d))
                caller.call_soon_threadsafe(inbox.put_nowait, ("end", None))
            except Exception as e:  # noqa: BLE001 - handed to the caller's loop and re-raised there
                caller.call_soon_threadsafe(inbox.put_nowait, ("error", e))

        fut = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        try:
            while True:
                kind, item = await inbox.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise item
                yield item
        finally:
            if not fut.done():
                fut.cancel()
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(router.abort(rid), self.loop))

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
        if pool not in self.pools:
            raise ValueError(f"pool must be one of {self.pools}, got {pool!r}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        live = self._live(pool)
        if num_workers > len(live):
            new = [self._launcher.create(pool) for _ in range(num_workers - len(live))]
            for worker_id, actor in new:
                self.run(_call(self.router.watch, worker_id, actor))
            self.run(self.router.wait_admitted([wid for wid, _ in new], timeout_s), timeout_s + 10)
        for worker_id in sorted(live, key=_index)[num_workers:][::-1]:
            drain_s = self.config.router.drain_timeout_s
            self.run(self.router.drain(worker_id, drain_s), drain_s + 30)
            self._launcher.stop(worker_id)
        return self._live(pool)

    def _live(self, pool: str) -> list[str]:
        return sorted(
            (w.worker_id for w in self.router.workers if w.pool == pool and w.state != "dead"), key=_index
        )

    # ---- observability & tests ------------------------------------------------------------------------
    def worker_stats(self) -> list[WorkerStats]:
        return self.router.worker_stats()

    def check_leaks(self, timeout_s: float = 30.0) -> dict[str, str | None]:
        """Leak invariant on every worker that is not dead: None where clean."""
        import ray

        live = {w.worker_id: self.actors[w.worker_id] for w in self.router.workers if w.state != "dead"}
        refs = {wid: a.check_leaks.remote() for wid, a in live.items()}
        return {wid: ray.get(ref, timeout=timeout_s) for wid, ref in refs.items()}

    def wait_until_quiet(self, timeout_s: float = 30.0) -> None:
        """Wait (bounded) until no live worker runs, waits, or waits for KV (e.g. after aborts)."""
        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats: list[WorkerStats] = [
                ray.get(self.actors[w.worker_id].stats.remote(), timeout=timeout_s)
                for w in self.router.workers
                if w.state != "dead"
            ]
            idle = all(
                s.engine.num_running == 0 and s.engine.num_waiting == 0 and s.num_waiting_for_kv == 0
                for s in stats
            )
            if idle and all(v is None for v in self.check_leaks(timeout_s).values()):
                return
            time.sleep(0.05)  # NOTE: polling a condition with a bound, not waiting for readiness
        raise TimeoutError(f"workers still busy after {timeout_s} s: {self.check_leaks(timeout_s)}")

    def kill_worker(self, worker_id: str, *, no_restart: bool = True) -> None:
        """Failure injection: kill one worker actor (Ray restarts it if its pool allows and no_restart
        is False)."""
        import ray

        ray.kill(self.actors[worker_id], no_restart=no_restart)

    def inject_fault(self, worker_id: str, kind: str) -> None:
        """Failure injection (``start_cluster(..., fault_injection=True)``): a worker thread dies."""
        import ray

        try:
            ray.get(self.actors[worker_id].inject_fault.remote(kind), timeout=30)
        except ray.exceptions.RayActorError:
            # NOTE: the call only queues the fault, and the process it kills can end before Ray's reply
            # to the call leaves it (a busy host: the step thread acts first): the fault took effect.
            logger.info("%s ended before answering the injected %s fault", worker_id, kind)

    def shutdown(self) -> None:
        import ray

        try:
            self.run(self.router.close(), timeout=10)
        except Exception:
            logger.exception("router close failed")
        self._launcher.stop_all()
        self._router_loop.stop()
        if self._kv_store is not None:
            self._kv_store.close()
        if self._started_ray:
            ray.shutdown()


async def _call(fn: Any, *args: Any) -> None:
    """Run a plain function on the router's loop (router methods that create tasks)."""
    fn(*args)


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
    needed = sum(p.num_cpus * p.num_workers for _, p in _pools(cfg))
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


def start_cluster(
    config: ClusterConfig | dict[str, Any] | str, *, fault_injection: bool = False
) -> ClusterHandle:
    """KV store + router -> worker actors (each registers with the router). See the module docstring.
    fault_injection: workers accept ``ClusterHandle.inject_fault`` (tests only)."""
    import ray

    if isinstance(config, str):
        cfg = ClusterConfig.from_yaml(config)
    elif isinstance(config, dict):
        cfg = ClusterConfig.from_dict(config)
    else:
        cfg = config
    cfg = resolve_cluster_model(cfg)
    # NOTE: a bad profile fails before Ray starts
    predictor = load_predictor(cfg.router, cfg.engine_config(cfg.prefill_pool))
    joining = bool(cfg.ray_address or os.environ.get("RAY_ADDRESS"))
    if not joining:
        device_check.check_local(cfg)
    started_ray = _init_ray(cfg)
    worker_bind, router_host = _bind_host(cfg)
    secret = new_secret()
    router_loop = RouterLoop()

    async def make_router() -> Router:
        router = Router(
            cfg.router,
            secret,
            served_model_name=cfg.server.served_model_name,
            bind_host=router_host,
            predictor=predictor,
        )
        await router.start()
        return router

    router = router_loop.run(make_router(), timeout=60)
    kv_store = KVStore(router_host) if cfg.router.mode != "colocated" else None
    store = kv_store.address if kv_store is not None else None
    control = WorkerControl((router.endpoint,), cfg.router.health_interval_s, worker_bind, store)
    launcher = WorkerLauncher(
        replace(cfg, transfer=_resolved_transfer(cfg)), secret, control, fault_injection
    )
    try:
        if joining:
            device_check.check_remote(cfg)
        for pool, pc in _pools(cfg):
            for _ in range(pc.num_workers):
                worker_id, actor = launcher.create(pool)
                router_loop.run(_call(router.watch, worker_id, actor))
        try:
            router_loop.run(
                router.wait_admitted(list(launcher.actors), _START_TIMEOUT_S), _START_TIMEOUT_S + 10
            )
        except TimeoutError as e:
            raise RuntimeError(f"{e}; Ray resources available: {ray.available_resources()}") from None
    except BaseException:
        router_loop.run(router.close(), timeout=10)
        launcher.stop_all()
        router_loop.stop()
        if kv_store is not None:
            kv_store.close()
        if started_ray:
            ray.shutdown()
        raise
    return ClusterHandle(cfg, router, router_loop, launcher, started_ray, kv_store)


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
    logs.configure_logging(cfg.log)
    handle = start_cluster(cfg)
    try:
        from cluster.tokenizer import Tokenizer

        tok = Tokenizer.from_pretrained(handle.model_info.model_dir)
        if tok is None:
            raise SystemExit("the model has no tokenizer.json; --prompt needs one")
        for prompt in args.prompt:
            out = handle.generate(
                tok.encode(prompt), SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
            )
            print(
                f"PROMPT {prompt!r}\nOUTPUT {out.text!r}\nTOKENS {len(out.token_ids)} "
                f"finish={out.finish_reason.value if out.finish_reason else None}",
                flush=True,
            )
        return 0
    finally:
        handle.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())

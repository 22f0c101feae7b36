"""The only place that creates placement groups and actors.

    ray job submit --working-dir . -- python -m deploy.launch --config deploy/cpu-disagg.yaml
    python -m deploy.launch --config deploy/cpu-disagg.yaml            # local Ray cluster
    python -m deploy.launch --config ... --prompt "Once upon a time"   # one request, then exit

Python API (tests, benchmarks):

    handle = start_cluster("deploy/cpu-disagg.yaml")   # or a ClusterConfig / dict
    out = handle.generate(prompt_token_ids, SamplingParams(max_tokens=16))
    async for delta in handle.agenerate(prompt_token_ids, params): ...
    handle.shutdown()                                   # no actor, placement group or thread left

The router runs on an event loop owned by the handle (its own thread); the HTTP server, when asked
for, is served on that same loop so handlers and router share it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, TypeVar

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ClusterConfig, PoolConfig
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
from cluster.router import Router, WorkerRef
from deploy import device_check, logs

logger = logging.getLogger(__name__)
T = TypeVar("T")

_START_TIMEOUT_S = 600.0
_PLACEMENT_TIMEOUT_S = 120.0
_LOCAL_RAY_CPUS = 16
_ids = itertools.count()


def _pools(cfg: ClusterConfig) -> list[tuple[str, PoolConfig]]:
    if cfg.router.mode == "colocated":
        return [("colocated", cfg.colocated)]
    return [("prefill", cfg.prefill), ("decode", cfg.decode)]


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


class ClusterHandle:
    """A running cluster: worker actors, their placement group, the router on its own loop.

    Built complete by :func:`start_cluster`; ``shutdown()`` leaves no actor, placement group or thread.
    """

    def __init__(
        self,
        config: ClusterConfig,
        router: Router,
        router_loop: RouterLoop,
        actors: dict[str, Any],
        pg: Any,
        secret: bytes,
        started_ray: bool,
    ) -> None:
        self.config = config
        self.secret = secret  # the control plane's key (cluster/frames.py); tests sign frames with it
        self.router = router
        self._router_loop = router_loop
        self.loop = router_loop.loop
        self.actors = actors
        self.pg = pg
        self._started_ray = started_ray

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

    # ---- observability & tests ------------------------------------------------------------------------
    def worker_stats(self) -> list[WorkerStats]:
        return self.router.worker_stats()

    def check_leaks(self, timeout_s: float = 30.0) -> dict[str, str | None]:
        """Leak invariant on every worker that is not dead: None where clean."""
        live = {w.worker_id: self.actors[w.worker_id] for w in self.router.workers if w.state != "dead"}
        refs = {wid: a.check_leaks.remote() for wid, a in live.items()}
        return {wid: ray.get(ref, timeout=timeout_s) for wid, ref in refs.items()}

    def wait_until_quiet(self, timeout_s: float = 30.0) -> None:
        """Wait (bounded) until no live worker runs, waits, or waits for KV (e.g. after aborts)."""
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
        """Failure injection: kill one worker actor (restarted by Ray only if allowed and asked)."""
        ray.kill(self.actors[worker_id], no_restart=no_restart)

    def inject_fault(self, worker_id: str, kind: str) -> None:
        """Failure injection (``start_cluster(..., fault_injection=True)``): a worker thread dies."""
        ray.get(self.actors[worker_id].inject_fault.remote(kind), timeout=30)

    def shutdown(self) -> None:
        try:
            self.run(self.router.close(), timeout=10)
        except Exception:
            logger.exception("router close failed")
        _stop_actors(self.actors, self.pg)
        self._router_loop.stop()
        if self._started_ray:
            ray.shutdown()


def _stop_actors(actors: dict[str, Any], pg: Any) -> None:
    for actor in actors.values():
        # NOTE: a dead actor cannot shut down; it is killed regardless
        with contextlib.suppress(Exception):
            ray.get(actor.shutdown.remote(), timeout=10)
        ray.kill(actor, no_restart=True)
    actors.clear()
    if pg is not None:
        remove_placement_group(pg)


def _init_ray(cfg: ClusterConfig) -> bool:
    """Join the given / RAY_ADDRESS cluster, else start a local one. True if we started it."""
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
    )
    logs.after_ray_init(handlers)
    return True


def start_cluster(
    config: ClusterConfig | dict[str, Any] | str, *, fault_injection: bool = False
) -> ClusterHandle:
    """Placement group -> worker actors -> torch.distributed world -> router. See module docstring.

    fault_injection: workers accept ``ClusterHandle.inject_fault`` (tests only)."""
    if isinstance(config, str):
        cfg = ClusterConfig.from_yaml(config)
    elif isinstance(config, dict):
        cfg = ClusterConfig.from_dict(config)
    else:
        cfg = config
    cfg = resolve_cluster_model(cfg)
    joining = bool(cfg.ray_address or os.environ.get("RAY_ADDRESS"))
    if not joining:
        device_check.check_local(cfg)
    started_ray = _init_ray(cfg)
    router_loop = RouterLoop()
    actors: dict[str, Any] = {}
    pg: Any = None
    try:
        if joining:
            device_check.check_remote(cfg)
        pg = _placement_group(cfg)
        secret = new_secret()
        _start_workers(cfg, pg, secret, actors, fault_injection)
        router = _start_router(cfg, router_loop, secret, actors)
    except BaseException:
        _stop_actors(actors, pg)
        router_loop.stop()
        if started_ray:
            ray.shutdown()
        raise
    return ClusterHandle(cfg, router, router_loop, actors, pg, secret, started_ray)


def _specs(cfg: ClusterConfig) -> list[tuple[str, int, PoolConfig]]:
    return [(pool, i, pc) for pool, pc in _pools(cfg) for i in range(pc.num_workers)]


def _placement_group(cfg: ClusterConfig) -> Any:
    bundles = [
        {"CPU": max(pc.num_cpus, 0.001), **({"GPU": pc.num_gpus} if pc.num_gpus else {})}
        for _, _, pc in _specs(cfg)
    ]
    pg = placement_group(bundles, strategy=cfg.placement_strategy)
    try:
        ray.get(pg.ready(), timeout=_PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(
            f"placement group {bundles} ({cfg.placement_strategy}) did not fit within {_PLACEMENT_TIMEOUT_S:.0f} s; "
            f"available: {ray.available_resources()}"
        ) from None
    return pg


def _start_workers(
    cfg: ClusterConfig, pg: Any, secret: bytes, actors: dict[str, Any], fault_injection: bool
) -> None:
    """Create every worker actor (into ``actors`` as they are made, so a failure can clean up), then
    join the KV-transfer world (not in colocated mode)."""
    from workers.worker import EngineWorker

    engine_config = cfg.engine_config()
    actor_cls: Any = ray.remote(EngineWorker)
    specs = _specs(cfg)
    for index, (pool, i, pc) in enumerate(specs):
        worker_id = f"{pool}-{i}"
        actors[worker_id] = actor_cls.options(
            num_cpus=max(pc.num_cpus, 0.001),
            num_gpus=pc.num_gpus,
            max_restarts=pc.max_restarts,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
        ).remote(
            worker_id,
            pool,
            engine_config,
            cfg.transfer,
            secret,
            torch_threads=pc.torch_threads if not pc.num_gpus else None,
            allow_fault_injection=fault_injection,
            stats_interval_s=cfg.log.stats_interval_s,
        )
    if cfg.router.mode == "colocated":
        return
    handles = list(actors.values())
    all_gpu = all(pc.num_gpus for _, _, pc in specs)
    backend = cfg.transfer.backend if cfg.transfer.backend != "auto" else ("nccl" if all_gpu else "gloo")
    master = ray.get(handles[0].rendezvous_address.remote(), timeout=_START_TIMEOUT_S)
    ray.get(
        [a.init_process_group.remote(rank, len(handles), master, backend) for rank, a in enumerate(handles)],
        timeout=_START_TIMEOUT_S,
    )


def _start_router(
    cfg: ClusterConfig, router_loop: RouterLoop, secret: bytes, actors: dict[str, Any]
) -> Router:
    infos = dict(
        zip(
            actors, ray.get([a.info.remote() for a in actors.values()], timeout=_START_TIMEOUT_S), strict=True
        )
    )
    ranks = {} if cfg.router.mode == "colocated" else {wid: rank for rank, wid in enumerate(actors)}
    first = next(iter(infos.values()))
    model_info = ModelInfo(
        name=cfg.server.served_model_name or os.path.basename(first["model_dir"].rstrip("/")),
        model_dir=first["model_dir"],
        max_model_len=min(i["max_model_len"] for i in infos.values()),
        vocab_size=first["vocab_size"],
    )
    refs = [
        WorkerRef(
            wid, info["pool"], actors[wid], info["request_endpoint"], info["block_size"], ranks.get(wid)
        )
        for wid, info in infos.items()
    ]

    async def make_router() -> Router:
        router = Router(cfg.router, refs, model_info, secret)
        await router.start()
        return router

    router = router_loop.run(make_router(), timeout=60)
    try:
        ray.get(
            [a.start.remote(router.endpoint, cfg.router.health_interval_s) for a in actors.values()],
            timeout=60,
        )
    except BaseException:
        router_loop.run(router.close(), timeout=10)
        raise
    return router


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="ClusterConfig YAML (deploy/*.yaml)")
    ap.add_argument("--prompt", action="append", help="send this prompt, print the output, exit (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    cfg = ClusterConfig.from_yaml(args.config)
    logs.configure_logging(cfg.log)
    handle = start_cluster(cfg)
    try:
        if args.prompt:
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
        return serve_http(handle)
    finally:
        handle.shutdown()


def serve_http(handle: ClusterHandle) -> int:
    """Serve the OpenAI-compatible API on the router's loop until interrupted."""
    from deploy.http_host import serve_on_loop

    serve_on_loop(handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

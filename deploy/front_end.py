"""The front end of a cluster: the part ``build_cluster`` (deploy/launch.py) swaps, where requests enter and
the router runs. Every worker reports to its event socket(s); the rest of the cluster is the same.

* :class:`RouterFrontEnd` (``server.replicas: 1``): one router on an event loop of this process
  (:class:`RouterLoop`); the HTTP app, when asked for, is served on that same loop (deploy/http_host.py).
* ``ReplicatedFrontEnd`` (deploy/replica_set.py, ``server.replicas: N``): N processes, each an HTTP edge
  and a router, on one port, supervised from this process.

Both follow :class:`FrontEnd`: ``start`` binds the event socket(s) the workers report to, ``watch`` follows
a worker actor's lifecycle through Ray, ``wait_serving`` waits (bounded) until requests are served,
``stop`` ends everything it started (idempotent, bounded). Also here: the rule for binding a public
address (``check_exposure``), which every front end that opens an HTTP port keeps.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from cluster.config import ClusterConfig, ServerConfig
from cluster.protocol import GenerateRequest, RequestOutput, SamplingParams, TokenDelta, WorkerStats
from cluster.router.admission import load_predictor
from cluster.router.router import Router

logger = logging.getLogger(__name__)
T = TypeVar("T")

_CLOSE_TIMEOUT_S = 10.0
_ids = itertools.count()


class FrontEnd(Protocol):
    """What a cluster's front end does for the cluster that owns it (see the module docstring)."""

    def start(self, secret: bytes, bind_host: str) -> tuple[str, ...]:
        """Bind the event socket(s) every worker reports to, on ``bind_host``; return their endpoints (by
        router index: ``WorkerControl.router_endpoints``)."""
        ...

    def watch(self, worker_id: str, actor: Any) -> None:
        """Follow a new worker actor's lifecycle through Ray (its death reaches every router)."""
        ...

    def wait_serving(self, worker_ids: Sequence[str], timeout_s: float) -> None:
        """Until requests are served with ``worker_ids`` admitted (bounded: TimeoutError)."""
        ...

    def live_worker_ids(self) -> list[str]:
        """The watched workers not known to be dead."""
        ...

    def worker_stats(self) -> list[WorkerStats]:
        """The latest stats of the live workers."""
        ...

    def stop(self) -> None:
        """End everything ``start`` started (idempotent, bounded); the workers are the cluster's."""
        ...


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


class RouterFrontEnd:
    """One router on an event loop of this process (``server.replicas: 1``). Built before Ray starts: a
    bad cost profile fails here, before anything runs."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.config = cfg
        self._predictor = load_predictor(cfg.router, cfg.engine_config(cfg.prefill_pool))
        self._loop: RouterLoop | None = None
        self._router: Router | None = None
        self._is_stopped = False

    @property
    def router(self) -> Router:
        if self._router is None:
            raise RuntimeError("the front end's router has not started")
        return self._router

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("the front end's router has not started")
        return self._loop.loop

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the router's loop from any other thread."""
        if self._loop is None or self._is_stopped:
            coro.close()
            raise RuntimeError("the front end's router is not running")
        return self._loop.run(coro, timeout)

    # ---- requests --------------------------------------------------------------------------------------
    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        timeout_s: float | None = None,
    ) -> RequestOutput:
        """Blocking, from any thread but the router's: the whole request. Router errors (RouterError
        subclasses) propagate."""
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
        """Async streaming from any event loop: yields the router's TokenDeltas as they arrive. A caller
        that stops early aborts the request."""
        router, loop = self.router, self.loop
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

        fut = asyncio.run_coroutine_threadsafe(pump(), loop)
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
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(router.abort(rid), loop))

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start(self, secret: bytes, bind_host: str) -> tuple[str, ...]:
        cfg = self.config
        self._loop = RouterLoop()

        async def make_router() -> Router:
            router = Router(
                cfg.router,
                secret,
                served_model_name=cfg.server.served_model_name,
                bind_host=bind_host,
                predictor=self._predictor,
            )
            await router.start()
            return router

        self._router = self._loop.run(make_router(), timeout=60)
        return (self._router.endpoint,)

    def watch(self, worker_id: str, actor: Any) -> None:
        self.run(_call(self.router.watch, worker_id, actor))

    def wait_serving(self, worker_ids: Sequence[str], timeout_s: float) -> None:
        self.run(self.router.wait_admitted(list(worker_ids), timeout_s), timeout_s + 10)

    def drain(self, worker_id: str, timeout_s: float) -> None:
        """Scale-down: nothing new goes to the worker; its requests finish or migrate (bounded)."""
        self.run(self.router.drain(worker_id, timeout_s), timeout_s + 30)

    def live_worker_ids(self) -> list[str]:
        return [w.worker_id for w in self.router.workers if w.state != "dead"]

    def worker_stats(self) -> list[WorkerStats]:
        return self.router.worker_stats()

    def stop(self) -> None:
        if self._is_stopped:
            return
        self._is_stopped = True
        if self._router is not None and self._loop is not None:
            try:
                self._loop.run(self._router.close(), timeout=_CLOSE_TIMEOUT_S)
            except Exception:
                logger.exception("router close failed")
        if self._loop is not None:
            self._loop.stop()


async def _call(fn: Any, *args: Any) -> None:
    """Run a plain function on the router's loop (router methods that create tasks)."""
    fn(*args)


# ---- binding a public address ----------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    """Whether binding ``host`` reaches this machine only (``localhost`` or a loopback address)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # NOTE: any other name may resolve to a public address: treat it as public


def check_exposure(cfg: ServerConfig, host: str) -> None:
    """Refuse (ValueError) to serve a non-loopback ``host`` without an API key unless
    ``allow_unauthenticated``; when allowed, say so in the log. Never names a key."""
    if is_loopback(host) or cfg.api_key or cfg.api_keys_file:
        return
    if not cfg.allow_unauthenticated:
        raise ValueError(
            f"server.host {host!r} is not a loopback address and no API key is set: anyone who reaches "
            "it could use the model. Set --api-key / $PDSERVE_API_KEY or --api-keys-file, or pass "
            "--allow-unauthenticated (server.allow_unauthenticated) to serve it open"
        )
    logger.warning(
        "serving %s WITHOUT an API key (--allow-unauthenticated): anyone who can reach it can generate",
        host,
    )

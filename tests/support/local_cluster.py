"""Test utilities (not a test module): a whole cluster in this process, without Ray.

``LocalCluster`` runs the real Router on its own event loop thread and real
``EngineWorker``s (each one its step, inbound and transfer threads) in the test process: the same
frames, handshakes and gloo pairs as a Ray cluster, minus Ray's start-up (seconds) and its actors, so
tests read a worker's engine and role directly. Workers share the process's CPU; fine for tiny models.

NOTE: the model's forward context (workers/forward_context.py) is one per process, so two engines must
not run a forward at the same time here: every engine's ``step_output`` holds one lock (``_serial_engine``).
In a real cluster each worker is its own process.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from cluster.config import EngineConfig, RouterConfig, TransferConfig
from cluster.frames import new_secret
from cluster.protocol import GenerateRequest, SamplingParams, TokenDelta
from cluster.router.router import Router
from cluster.wire import WorkerControl
from deploy.front_end import RouterLoop
from workers.engine import Engine
from workers.step_output import StepOutput
from workers.worker import EngineWorker

ADMIT_TIMEOUT_S = 60.0
_STEP_LOCK = threading.Lock()


def _serial_engine(config: EngineConfig) -> Engine:
    """An Engine whose steps never overlap another engine's in this process (see the NOTE above):
    ``step_output`` (a worker's step, and inside ``step``) holds the lock."""
    engine = Engine(config)
    step_output = engine.step_output

    def locked_step_output() -> StepOutput:
        with _STEP_LOCK:
            return step_output()

    engine.step_output = locked_step_output  # type: ignore[method-assign]
    return engine


class LocalCluster:
    """Router + ``EngineWorker``s in one process. ``pools``: pool name -> number of workers
    (``prefill``/``decode`` or ``colocated``); workers are named ``<pool>-<i>``. A thread that dies is
    recorded in ``fatal`` (the worker stays, unhealthy) instead of ending the process. ``close()``
    stops everything it started."""

    def __init__(
        self,
        engine: EngineConfig,
        pools: dict[str, int],
        *,
        router: RouterConfig | None = None,
        transfer: TransferConfig | None = None,
        heartbeat_interval_s: float = 0.05,
    ) -> None:
        self.router_config = router or RouterConfig(health_interval_s=0.1, health_timeout_s=10.0)
        self.transfer_config = transfer or TransferConfig(backend="gloo", timeout_s=20.0)
        self.fatal: list[str] = []
        self.workers: dict[str, EngineWorker] = {}
        self._loop = RouterLoop()
        secret = new_secret()

        async def make_router() -> Router:
            r = Router(self.router_config, secret)
            await r.start()
            return r

        self.router = self._loop.run(make_router(), timeout=30)
        try:
            moves_kv = self.router_config.mode != "colocated"
            control = WorkerControl((self.router.endpoint,), heartbeat_interval_s, "loopback", moves_kv)
            for pool, num in pools.items():
                for i in range(num):
                    wid = f"{pool}-{i}"
                    self.workers[wid] = EngineWorker(
                        wid,
                        pool,
                        engine,
                        self.transfer_config,
                        secret,
                        control,
                        engine_factory=_serial_engine,
                        on_fatal=self.fatal.append,
                    )
            self._loop.run(
                self.router.wait_admitted(list(self.workers), ADMIT_TIMEOUT_S), ADMIT_TIMEOUT_S + 5
            )
        except BaseException:
            self.close()
            raise

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        return self._loop.run(coro, timeout)

    async def _collect(self, req: GenerateRequest) -> list[TokenDelta]:
        return [d async for d in self.router.generate(req)]

    def generate(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], timeout_s: float = 120.0
    ) -> list[list[TokenDelta]]:
        """Every prompt at once through the router; each request's deltas in order."""

        async def main() -> list[list[TokenDelta]]:
            reqs = [
                GenerateRequest(f"r{time.monotonic_ns()}-{i}", list(p), sp)
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            ]
            return list(await asyncio.gather(*(self._collect(r) for r in reqs)))

        result: list[list[TokenDelta]] = self.run(main(), timeout_s)
        return result

    def wait_until_quiet(self, timeout_s: float = 30.0) -> None:
        """Until no worker runs, waits or waits for KV, and every leak check is clean (bounded)."""
        deadline = time.monotonic() + timeout_s
        report: dict[str, str | None] = {}
        while time.monotonic() < deadline:
            busy = [
                wid
                for wid, w in self.workers.items()
                if (s := w.stats()).engine.num_running or s.engine.num_waiting or s.num_waiting_for_kv
            ]
            if not busy:
                report = {wid: w.check_leaks() for wid, w in self.workers.items()}
                if all(v is None for v in report.values()):
                    return
            time.sleep(0.02)  # NOTE: polling a condition with a bound, not waiting for readiness
        raise TimeoutError(f"workers still busy or leaking after {timeout_s} s: {report}")

    def close(self) -> None:
        for w in self.workers.values():
            w.shutdown()
        try:
            self._loop.run(self.router.close(), timeout=10)
        finally:
            self._loop.stop()


def engine_config(model_dir: str, **options: Any) -> EngineConfig:
    """A CPU engine (outputs are compared exactly with fp32 CPU transformers) with small test defaults."""
    base = EngineConfig.from_options(model_dir, device="cpu", block_size=4, num_kv_blocks=256)
    return replace(base, **options)

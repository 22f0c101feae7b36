"""Live advice: replay the router's recent traffic (``cluster.router.predict.TrafficLog``) through the
simulation of colocated and every P:D split of the current worker budget, and say which the planner
recommends and the SLO attainment it predicts for it and for the running configuration.

The HTTP edge cannot import this (cluster/ stays below deploy/): the composition root
(deploy/http_host.py) hands the server an :class:`Advisor`, which snapshots the traffic on the router's
loop, runs the planner on its own thread (bounded: at most ``max_requests`` of the most recent requests,
one run at a time, a bounded wait) and caches the answer for ``cache_s``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from cluster.config import ClusterConfig
from cluster.cost_model import CostProfile
from cluster.router.predict import TrafficEntry
from deploy.planner.report import Slo
from deploy.planner.search import recommend, search
from deploy.planner.twin import SimConfig
from deploy.planner.workload import SimRequest, Workload

if TYPE_CHECKING:
    from cluster.router.router import Router

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Advice:
    num_requests: int
    window_s: float  # first to last arrival in the replayed traffic
    rate_rps: float
    current: str  # the running configuration's label
    current_slo_attainment: float
    recommended: str
    recommended_slo_attainment: float
    recommended_goodput_rps: float
    recommended_meets_slo: bool
    recommended_prefill: int = 0  # the recommended configuration's workers per pool
    recommended_decode: int = 0
    recommended_colocated: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def traffic_workload(entries: Sequence[TrafficEntry], vocab_size: int, max_model_len: int) -> Workload:
    """The window as an open-loop workload: the same arrival gaps and lengths (fresh random prompts)."""
    if not entries:
        raise ValueError("no traffic to advise on")
    start = entries[0].arrival_s
    requests = []
    for e in entries:
        out = max(1, min(e.output_tokens, max_model_len - 1))
        requests.append(
            SimRequest(e.arrival_s - start, max(1, min(e.prompt_tokens, max_model_len - out)), out)
        )
    return Workload("recent traffic", requests, vocab_size)


def advise(
    entries: Sequence[TrafficEntry],
    current: SimConfig,
    profile: CostProfile,
    slo: Slo,
    *,
    vocab_size: int,
    worker_counts: Sequence[int] | None = None,
) -> Advice:
    """Simulate the recent traffic on ``current`` and its alternatives; the recommendation and both
    predicted attainments. Costs one simulation per configuration (seconds for thousands of requests)."""
    workload = traffic_workload(entries, vocab_size, current.max_model_len)
    split_mode = "conditional" if current.mode == "conditional" else "disaggregated"
    rows = search(
        current, worker_counts or [current.num_workers], profile, workload, slo, split_mode=split_mode
    )
    best = recommend(rows)
    by_label = {r.config.label: r for r in rows}
    running = by_label.get(current.label)
    window = entries[-1].arrival_s - entries[0].arrival_s
    return Advice(
        num_requests=len(entries),
        window_s=window,
        rate_rps=len(entries) / window if window > 0 else 0.0,
        current=current.label,
        current_slo_attainment=running.summary.slo_attainment if running is not None else float("nan"),
        recommended=best.config.label,
        recommended_slo_attainment=best.summary.slo_attainment,
        recommended_goodput_rps=best.summary.goodput_rps,
        recommended_meets_slo=best.summary.meets_slo,
        recommended_prefill=best.config.num_prefill,
        recommended_decode=best.config.num_decode,
        recommended_colocated=best.config.num_colocated,
    )


class Advisor:
    """Live advice for a running router (the server's ``AdvisorLike``).

    ``advice()`` runs on the router's loop: it snapshots the router's traffic log there (the log is the
    loop's), keeps the most recent ``max_requests`` of the window, and runs :func:`advise` on the
    advisor's single thread, awaiting it at most ``timeout_s`` (TimeoutError after that; the run goes on
    and its answer is cached). An answer younger than ``cache_s`` is returned as is. The planner is
    pure Python: while it runs it shares the router process's GIL, which bounds the run's size.
    Lifecycle: ``close()`` stops the thread (a run in progress finishes first).
    """

    def __init__(
        self,
        router: Router,
        config: ClusterConfig,
        profile: CostProfile,
        *,
        vocab_size: int,
        max_model_len: int,
        max_requests: int = 1000,
        cache_s: float = 60.0,
        timeout_s: float = 20.0,
    ) -> None:
        if max_requests < 1 or cache_s < 0 or timeout_s <= 0:
            raise ValueError(f"bad advisor bounds: {max_requests=}, {cache_s=}, {timeout_s=}")
        self.router, self.config, self.profile = router, config, profile
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.max_requests, self.cache_s, self.timeout_s = max_requests, cache_s, timeout_s
        self.max_window_s = router.traffic.window_s
        rc = config.router
        self.slo = Slo(
            rc.ttft_slo_ms if rc.ttft_slo_ms is not None else Slo.ttft_ms,
            rc.tbt_slo_ms if rc.tbt_slo_ms is not None else Slo.tbt_ms,
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pdserve-advice")
        self._latest: dict[str, Any] | None = None
        self._latest_at = -math.inf  # time.monotonic() of the latest answer
        self._latest_window: float | None = None
        self._running: asyncio.Future[dict[str, Any]] | None = None
        self._running_window: float | None = None

    def current_config(self) -> SimConfig:
        """The running deployment: the config's engine and router, the live workers per pool."""
        live = [w for w in self.router.workers if w.state.value != "dead"]
        counts = {p: sum(1 for w in live if w.pool == p) for p in ("prefill", "decode", "colocated")}
        default_blocks = min(e.num_kv_blocks or 2048 for e in self.config.engine_configs().values())
        blocks = min((w.info.num_blocks for w in live), default=default_blocks)
        base = SimConfig.from_cluster(self.config, num_kv_blocks=blocks, max_model_len=self.max_model_len)
        if base.mode == "colocated":
            return replace(base, num_colocated=max(1, counts["colocated"]))
        return replace(base, num_prefill=max(1, counts["prefill"]), num_decode=max(1, counts["decode"]))

    def latest(self) -> dict[str, Any] | None:
        """The latest finished answer's advice (the gauges), never computing."""
        return self._latest.get("advice") if self._latest is not None else None

    def refresh_soon(self) -> None:
        """Start a run of the default window when the latest answer is stale (never waits, never raises:
        a scrape must not fail for it)."""
        if self._running is None and time.monotonic() - self._latest_at > self.cache_s:
            try:
                self._running, self._running_window = self._start(None), None
            except Exception:
                logger.exception("live advice could not start")

    async def advice(self, window_s: float | None = None) -> dict[str, Any]:
        """The answer for the last ``window_s`` seconds (None: ``max_window_s``); see the class."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            fresh = time.monotonic() - self._latest_at <= self.cache_s
            if self._latest is not None and fresh and self._latest_window == window_s:
                return self._latest
            if self._running is None:
                self._running, self._running_window = self._start(window_s), window_s
            running, mine = self._running, self._running_window == window_s
            try:
                async with asyncio.timeout(deadline - time.monotonic()):
                    answer = await asyncio.shield(running)
            except TimeoutError:
                raise TimeoutError(f"advice not ready within {self.timeout_s:g} s") from None
            if mine:
                return answer
            # NOTE: that run was for another window (a scrape's): ours starts once it is done

    def _start(self, window_s: float | None) -> asyncio.Future[dict[str, Any]]:
        now = time.time()
        window = window_s if window_s is not None else self.max_window_s
        entries = [e for e in self.router.traffic.snapshot(now) if e.arrival_s >= now - window]
        entries = entries[-self.max_requests :]
        current = self.current_config()
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self._compute, entries, current, window, now)
        future.add_done_callback(lambda f: self._finished(f, window_s))
        return future

    def _compute(
        self, entries: Sequence[TrafficEntry], current: SimConfig, window: float, now: float
    ) -> dict[str, Any]:
        started = time.monotonic()
        answer: dict[str, Any] = {
            "object": "pdserve.advice",
            "window_s": window,
            "computed_at": now,
            "slo": asdict(self.slo),
            "profile": self.profile.name,
            "current": current.label,
            "advice": None,
        }
        if entries:
            advice = advise(entries, current, self.profile, self.slo, vocab_size=self.vocab_size)
            answer["advice"] = advice.to_dict()
        else:
            answer["note"] = f"no requests in the last {window:g} s"
        answer["planner_s"] = time.monotonic() - started
        return answer

    def _finished(self, future: asyncio.Future[dict[str, Any]], window_s: float | None) -> None:
        """On the loop: cache the answer (or log why there is none)."""
        self._running = None
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            logger.error("live advice failed", exc_info=error)
            return
        self._latest, self._latest_window, self._latest_at = future.result(), window_s, time.monotonic()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

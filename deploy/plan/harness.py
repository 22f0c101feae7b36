"""The running cluster the plan commands measure: served over HTTP on a free loopback port in this
process (``running_cluster``), and its pools' engine counters and step splits asked of the workers
fresh (``EngineTotals``, ``SplitWindows``): subtract two readings to see what ran in between."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from cluster.config import ClusterConfig
from cluster.protocol import StepSplit, TransferStats, WorkerStats

if TYPE_CHECKING:
    from deploy.launch import Cluster


@contextlib.contextmanager
def running_cluster(cfg: ClusterConfig) -> Iterator[tuple[str, Cluster]]:
    """The cluster of ``cfg`` served over HTTP on a free loopback port; yields its URL and handle. This
    process then hosts the router and the HTTP edge as a serving process does, and freezes its start-up
    heap as one does (``deploy.http_host.serve_on_loop``): a benchmark process and nothing else."""
    from cluster.heap import freeze_startup_heap
    from deploy.http_host import start_http
    from deploy.launch import build_cluster

    handle = build_cluster(cfg)
    try:
        with start_http(handle) as http:
            freeze_startup_heap()
            yield http.url, handle
    finally:
        handle.shutdown()


def pool_stats(handle: Cluster, pool: str) -> list[WorkerStats]:
    """Fresh stats of every worker of ``pool`` (asked of the actors, not the last heartbeat)."""
    import ray

    ids = [w.worker_id for w in handle.router.workers if w.pool == pool]
    return list(ray.get([handle.actors[i].stats.remote() for i in ids], timeout=60))


@dataclass(frozen=True)
class EngineTotals:
    """A pool's engine counters, summed: subtract two to see what ran in between."""

    num_steps: int
    seconds: float  # schedule + prepare + forward + detokenize
    num_generated: int

    @classmethod
    def of(cls, handle: Cluster, pool: str) -> EngineTotals:
        """Fresh totals of every worker of ``pool`` (``pool_stats``)."""
        engines = [st.engine for st in pool_stats(handle, pool)]
        seconds = sum(
            e.schedule_time_s + e.prepare_time_s + e.forward_time_s + e.detokenize_time_s for e in engines
        )
        return cls(sum(e.num_steps for e in engines), seconds, sum(e.num_generation_tokens for e in engines))

    def __sub__(self, other: EngineTotals) -> EngineTotals:
        return EngineTotals(
            self.num_steps - other.num_steps,
            self.seconds - other.seconds,
            self.num_generated - other.num_generated,
        )


def step_split_of(handle: Cluster, pool: str) -> StepSplit:
    """The step split of every worker of ``pool``, summed (fresh: ``pool_stats``)."""
    total = StepSplit()
    for st in pool_stats(handle, pool):
        for f in fields(StepSplit):
            setattr(total, f.name, getattr(total, f.name) + getattr(st.steps, f.name))
    return total


def received_of(handle: Cluster, pool: str) -> TransferStats:
    """The KV-transfer totals of every worker of ``pool``, summed (fresh: ``pool_stats``)."""
    total = TransferStats()
    for st in pool_stats(handle, pool):
        for f in fields(TransferStats):
            setattr(total, f.name, getattr(total, f.name) + getattr(st.transfer, f.name))
    return total


def transfer_delta(after: TransferStats, before: TransferStats) -> TransferStats:
    return TransferStats(
        **{f.name: getattr(after, f.name) - getattr(before, f.name) for f in fields(TransferStats)}
    )


def split_delta(after: StepSplit, before: StepSplit) -> StepSplit:
    return StepSplit(**{f.name: getattr(after, f.name) - getattr(before, f.name) for f in fields(StepSplit)})


class SplitWindows:
    """Pools' step splits over chosen phases of the probe, one window per phase."""

    def __init__(self, handle: Cluster, pools: Sequence[str]) -> None:
        self.handle = handle
        self.windows: dict[str, list[StepSplit]] = {pool: [] for pool in pools}
        self._at: dict[str, StepSplit] = {}

    def open(self) -> None:
        self._at = {pool: step_split_of(self.handle, pool) for pool in self.windows}

    def close(self) -> None:
        for pool, before in self._at.items():
            self.windows[pool].append(split_delta(step_split_of(self.handle, pool), before))

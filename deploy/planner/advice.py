"""Live advice: replay the router's recent traffic (``cluster.predict.TrafficLog``) through the
simulation of colocated and every P:D split of the current worker budget, and say which the planner
recommends and the SLO attainment it predicts for it and for the running configuration.

The HTTP edge cannot import this (cluster/ stays below deploy/): the composition root hands the server an
``Advisor`` (deploy/launch.py or deploy/http_host.py), which runs it off the event loop and caches it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cluster.cost_model import CostProfile
from cluster.predict import TrafficEntry
from deploy.planner.report import Slo
from deploy.planner.search import recommend, search
from deploy.planner.twin import SimConfig
from deploy.planner.workload import SimRequest, Workload


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
    )

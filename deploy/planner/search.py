"""Which deployment to run: colocated and every prefill:decode split of a worker budget, simulated on the
same workload, and the recommendation.

Recommendation: the configuration that meets the SLO (its percentile of TTFT and TBT within bounds,
nothing rejected) with the fewest workers, then the highest goodput; when none meets it, the highest
goodput (ties: SLO attainment, then the lower TTFT percentile). Large budgets (more than
``exhaustive_max`` workers) search a coarse grid of splits first and refine around the best one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cluster.cost_model import CostProfile
from deploy.planner.report import Slo, Summary, summarize_result
from deploy.planner.sim import SimResult, Simulation
from deploy.planner.twin import SimConfig
from deploy.planner.workload import Workload


@dataclass(frozen=True)
class PlanRow:
    config: SimConfig
    summary: Summary
    result: SimResult


def splits(num_workers: int, candidates: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """(prefill, decode) pairs with at least one of each."""
    prefills = candidates if candidates is not None else range(1, num_workers)
    return [(p, num_workers - p) for p in prefills if 1 <= p < num_workers]


def simulate(config: SimConfig, profile: CostProfile, workload: Workload, slo: Slo) -> PlanRow:
    result = Simulation(config, profile, workload).run()
    return PlanRow(config, summarize_result(result, slo), result)


def _rank(row: PlanRow) -> tuple[float, ...]:
    s = row.summary
    return (-s.goodput_rps, -s.slo_attainment, s.ttft_ms.p90)


def recommend(rows: Sequence[PlanRow]) -> PlanRow:
    meeting = [r for r in rows if r.summary.meets_slo]
    if meeting:
        return min(meeting, key=lambda r: (r.config.num_workers, *_rank(r)))
    return min(rows, key=_rank)


def search(
    base: SimConfig,
    worker_counts: Sequence[int],
    profile: CostProfile,
    workload: Workload,
    slo: Slo,
    *,
    split_mode: str = "disaggregated",
    include_colocated: bool = True,
    exhaustive_max: int = 16,
    progress: Callable[[str], None] | None = None,
) -> list[PlanRow]:
    """Simulate colocated and the P:D splits for each worker count; rows in evaluation order."""
    rows: list[PlanRow] = []

    def run(config: SimConfig) -> PlanRow:
        if progress is not None:
            progress(config.label)
        row = simulate(config, profile, workload, slo)
        rows.append(row)
        return row

    for n in worker_counts:
        if include_colocated:
            run(base.colocated(n))
        if n < 2:
            continue
        if n <= exhaustive_max:
            for p, d in splits(n):
                run(base.split(p, d, split_mode))
            continue
        step = max(1, n // 8)
        coarse = {p: run(base.split(p, n - p, split_mode)) for p, _ in splits(n, range(step, n, step))}
        best = min(coarse, key=lambda p: _rank(coarse[p]))
        fine = range(max(1, best - step + 1), min(n, best + step))
        for p, d in splits(n, [p for p in fine if p not in coarse]):
            run(base.split(p, d, split_mode))
    return rows

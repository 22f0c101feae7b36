"""Which deployment to run: colocated and every prefill:decode split of a worker budget, simulated on the
same workload, and the recommendation.

Recommendation: the configuration that meets the SLO (its percentile of TTFT and TBT within bounds,
nothing rejected) with the fewest GPUs (workers times their tensor-parallel size), then the highest
goodput; when none meets it, the highest goodput (ties: SLO attainment, then the lower TTFT
percentile). Large budgets (more than ``exhaustive_max`` splits) search a coarse grid of splits first
and refine around the best one.

With a :class:`~deploy.planner.parallel.Parallelism`, each budget is a number of GPUs and the search
covers (workers, TP) per pool, as DistServe does: colocated at every size that divides the budget, and
every prefill:decode split at every pair of sizes that uses the budget exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cluster.cost_model import CostProfile
from deploy.planner.parallel import (
    Parallelism,
    colocated_layout,
    no_layout_message,
    split_candidates,
    split_layout,
)
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
        return min(meeting, key=lambda r: (r.config.num_gpus, *_rank(r)))
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
    parallelism: Parallelism | None = None,
) -> list[PlanRow]:
    """Simulate colocated and the P:D splits for each worker count (with ``parallelism``: each GPU
    budget, every size per pool); rows in evaluation order. ValueError, naming the sizes that fit and
    those refused, when a budget has no layout."""
    rows: list[PlanRow] = []

    def run(config: SimConfig) -> PlanRow:
        if progress is not None:
            progress(config.label)
        row = simulate(config, profile, workload, slo)
        rows.append(row)
        return row

    if parallelism is not None:
        for n in worker_counts:
            _search_budget(base, n, parallelism, run, split_mode, include_colocated, exhaustive_max)
        return rows

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


def _search_budget(
    base: SimConfig,
    num_gpus: int,
    par: Parallelism,
    run: Callable[[SimConfig], PlanRow],
    split_mode: str,
    include_colocated: bool,
    exhaustive_max: int,
) -> None:
    layouts = 0
    if include_colocated:
        for tp in par.sizes("colocated"):
            if num_gpus % tp == 0:
                run(colocated_layout(base, par, num_gpus // tp, tp))
                layouts += 1
    for tp_p in par.sizes("prefill"):
        for tp_d in par.sizes("decode"):
            candidates = split_candidates(num_gpus, tp_p, tp_d)
            layouts += len(candidates)

            def split(
                i: int, tp_p: int = tp_p, tp_d: int = tp_d, c: list[tuple[int, int]] = candidates
            ) -> PlanRow:
                (p, d) = c[i]
                return run(split_layout(base, par, (p, tp_p), (d, tp_d), split_mode))

            if len(candidates) <= exhaustive_max:
                for i in range(len(candidates)):
                    split(i)
                continue
            step = max(1, len(candidates) // 8)
            coarse = {i: split(i) for i in range(step - 1, len(candidates), step)}
            best = min(coarse, key=lambda i: _rank(coarse[i]))
            for i in range(max(0, best - step + 1), min(len(candidates), best + step)):
                if i not in coarse:
                    split(i)
    if layouts == 0:
        raise ValueError(no_layout_message(num_gpus, par, include_colocated))


def why(best: PlanRow, rows: Sequence[PlanRow]) -> list[str]:
    """The reasons for the pick, from the simulated rows: the rule that chose it, the runner-up, the best
    colocated layout of its budget, and per pool the best layout with that pool at another size."""
    cfg, s = best.config, best.summary
    same = [r for r in rows if r.config.num_gpus == cfg.num_gpus]
    if s.meets_slo:
        k = sum(1 for r in same if r.summary.meets_slo)
        lines = [
            f"rule: the fewest GPUs that meet the SLO ({cfg.num_gpus}), then the most goodput: "
            f"{s.goodput_rps:.2f} req/s, the best of the {k} layout(s) of {cfg.num_gpus} GPUs that meet it"
        ]
    else:
        lines = [f"rule: no layout meets the SLO: the most goodput ({s.goodput_rps:.2f} req/s)"]
    others = sorted((r for r in same if r is not best), key=lambda r: -r.summary.goodput_rps)
    if others:
        r = others[0]
        lines.append(
            f"runner-up on {cfg.num_gpus} GPUs: {r.config.label} ({r.summary.goodput_rps:.2f} req/s)"
        )
    colocated = [r for r in same if r.config.mode == "colocated"]
    if colocated and cfg.mode != "colocated":
        c = max(colocated, key=lambda r: r.summary.goodput_rps)
        ratio = s.goodput_rps / c.summary.goodput_rps if c.summary.goodput_rps > 0 else float("inf")
        lines.append(
            f"best colocated on {cfg.num_gpus} GPUs: {c.config.label} ({c.summary.goodput_rps:.2f} req/s; "
            f"the pick {ratio:.2f}x)"
        )
    for pool in cfg.pools:
        tp = cfg.tp_of(pool)
        alternatives: dict[int, PlanRow] = {}
        for r in same:
            if r.config.mode == cfg.mode and r.config.tp_of(pool) != tp:
                other = r.config.tp_of(pool)
                if (
                    other not in alternatives
                    or r.summary.goodput_rps > alternatives[other].summary.goodput_rps
                ):
                    alternatives[other] = r
        if alternatives:
            listed = ", ".join(
                f"TP{t}: {alternatives[t].config.label} {alternatives[t].summary.goodput_rps:.2f}"
                for t in sorted(alternatives)
            )
            lines.append(f"{pool} at TP{tp}; the best with {pool} at another size (req/s): {listed}")
        else:
            lines.append(f"{pool} at TP{tp}: the only size simulated for it on {cfg.num_gpus} GPUs")
    return lines

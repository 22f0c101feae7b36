"""``pdserve plan spread``: how far the real cluster lands from itself, the floor under `plan validate`.

    pdserve plan spread plan_results/a/validate.json plan_results/b/validate.json [...] [--runs K]

`plan validate` runs the very same seeded workloads every time (its seeds depend on ``--seed`` and the
run only), so the real sides of two validations are two measurements of one thing. For every ordered pair
of files this holds one real side against the other with validate's own last-line figures (the first in
the sim's place) and prints their median over the pairs, how many pairs meet the goal, each workload's
median errors, and each file's own sim-vs-real figures beside the other files' real sides against the
same real side: a sim that lands as close to a real side as another real side does is as good as this
box can tell. ``--runs K`` pools only the first K runs of each workload on both sides (how the floor
moves with the number of runs). The figures are recomputed from each file's requests (``requests``),
the same records the validation summarized.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.plan.figures import Figures, figures
from deploy.planner.report import Slo, Summary, summarize
from deploy.planner.sim import RequestRecord


@dataclass(frozen=True)
class Validation:
    """One `plan validate` result: each workload's real and sim requests (validate.json's rows), in run
    order; the sim's are `num_profiles` blocks of `runs[name]` runs each."""

    name: str
    real: dict[str, list[list[Any]]]
    sim: dict[str, list[list[Any]]]
    runs: dict[str, int]
    num_profiles: int
    slo: Slo

    @classmethod
    def load(cls, path: Path, default_slo: Slo) -> Validation:
        data = json.loads(path.read_text())
        requests = data["requests"]
        runs = data.get("runs") or {n: len(v) for n, v in data["real_ttft_p90_ms_per_run"].items()}
        slo = Slo(**data["slo"]) if "slo" in data else default_slo
        num_profiles = len(data.get("profiles") or [data["profile"]])
        name = path.parent.name if path.name == "validate.json" else path.stem
        return cls(
            name,
            {n: v["real"] for n, v in requests.items()},
            {n: v["sim"] for n, v in requests.items()},
            {n: int(runs[n]) for n in requests},
            num_profiles,
            slo,
        )

    def real_summaries(self, num_runs: int | None) -> dict[str, Summary]:
        return {
            n: _summary(n, _first_runs(rows, self.runs[n], 1, num_runs), self.slo)
            for n, rows in self.real.items()
        }

    def sim_summaries(self, num_runs: int | None) -> dict[str, Summary]:
        return {
            n: _summary(n, _first_runs(rows, self.runs[n], self.num_profiles, num_runs), self.slo)
            for n, rows in self.sim.items()
        }


def records_from_rows(rows: Sequence[Sequence[Any]]) -> list[RequestRecord]:
    """The inverse of `validate.request_rows` as far as the summaries go: TTFT, the gaps, the token
    count and the end (the first token plus the gaps); a row without a TTFT is a refused request."""
    records = []
    for prompt_len, output_len, ttft_ms, _mean_tbt_ms, num_tokens, gaps_ms in rows:
        record = RequestRecord(int(prompt_len), int(output_len), send_s=0.0)
        if ttft_ms is None:
            record.rejected = "no token"
        else:
            record.first_token_s = ttft_ms / 1e3
            record.gaps_s.extend(g / 1e3 for g in gaps_ms)
            record.finish_s = record.first_token_s + sum(record.gaps_s)
            record.num_tokens = int(num_tokens)
        records.append(record)
    return records


def _first_runs(rows: list[list[Any]], num_runs: int, num_blocks: int, keep: int | None) -> list[list[Any]]:
    """The rows of the first `keep` runs (all: None) of each of `num_blocks` blocks of `num_runs` runs."""
    if keep is None or keep >= num_runs:
        return rows
    per_block, extra = divmod(len(rows), num_blocks)
    per_run, extra_run = divmod(per_block, num_runs)
    if extra or extra_run:
        raise ValueError(f"{len(rows)} requests do not split into {num_blocks} x {num_runs} equal runs")
    return [r for b in range(num_blocks) for r in rows[b * per_block : b * per_block + keep * per_run]]


def _summary(name: str, rows: list[list[Any]], slo: Slo) -> Summary:
    return summarize(name, records_from_rows(rows), 1.0, slo)


def _shape(rows: list[list[Any]]) -> list[tuple[int, int]]:
    return [(int(r[0]), int(r[1])) for r in rows]


def check_same_workloads(validations: Sequence[Validation], num_runs: int | None = None) -> list[str]:
    """The workloads every file has, each with the same requests (prompt and output lengths, in order)
    in its first `num_runs` runs (None: every run, as many in each file); raises ValueError naming the
    first that differs."""
    names = [n for n in validations[0].real if all(n in v.real for v in validations[1:])]
    if not names:
        raise ValueError("the files have no workload in common")
    first = validations[0]
    for v in validations[1:]:
        for n in names:
            if num_runs is None and v.runs[n] != first.runs[n]:
                raise ValueError(
                    f"workload {n!r}: {v.name} ran it {v.runs[n]} times, {first.name} {first.runs[n]} "
                    "(give --runs K to compare their first K runs)"
                )
            keep = num_runs
            if keep is not None and min(v.runs[n], first.runs[n]) < keep:
                raise ValueError(f"workload {n!r}: {v.name} or {first.name} ran it fewer than {keep} times")
            mine, theirs = (
                _first_runs(v.real[n], v.runs[n], 1, keep),
                _first_runs(first.real[n], first.runs[n], 1, keep),
            )
            if _shape(mine) != _shape(theirs):
                raise ValueError(
                    f"workload {n!r}: {v.name} ran other requests than {first.name} "
                    f"({len(mine)} against {len(theirs)}, or other lengths): not the same seeded workload"
                )
    return names


@dataclass(frozen=True)
class Spread:
    """Real against real over every ordered pair of files (`pairs`: (other, reference, figures)), each
    file's own sim against its real side (`sims`), and per workload the median of each error over the
    pairs and over the files (`by_workload`: name -> (real vs real, sim vs real))."""

    pairs: list[tuple[str, str, Figures]]
    sims: list[tuple[str, Figures]]
    by_workload: dict[str, tuple[Figures, Figures]]


def spread(validations: Sequence[Validation], num_runs: int | None = None) -> Spread:
    if len(validations) < 2:
        raise ValueError("give at least two validations of the same workloads")
    names = check_same_workloads(validations, num_runs)
    real = {v.name: {n: s for n, s in v.real_summaries(num_runs).items() if n in names} for v in validations}
    sim = {v.name: {n: s for n, s in v.sim_summaries(num_runs).items() if n in names} for v in validations}
    pairs = [
        (a, b, figures([(n, real[b][n], real[a][n]) for n in names]))
        for a, b in itertools.permutations(list(real), 2)
    ]
    sims = [(v, figures([(n, real[v][n], sim[v][n]) for n in names])) for v in real]
    by_workload = {
        n: (
            _median([_errors(real[a][n], real[b][n]) for a, b in itertools.permutations(list(real), 2)]),
            _median([_errors(sim[v][n], real[v][n]) for v in real]),
        )
        for n in names
    }
    return Spread(pairs, sims, by_workload)


def _errors(other: Summary, reference: Summary) -> Figures:
    """One workload's errors of `other` against `reference` (a one-row `figures`)."""
    return figures([("", reference, other)])


def _within(f: Figures, goal: Figures) -> bool:
    return f.ttft <= goal.ttft and f.tbt <= goal.tbt and f.attainment <= goal.attainment


def _median(figs: Sequence[Figures]) -> Figures:
    return Figures(*(statistics.median(getattr(f, k) for f in figs) for k in ("ttft", "tbt", "attainment")))


def report(result: Spread, goal: Figures, num_runs: int | None) -> str:
    pooled = "every run" if num_runs is None else f"the first {num_runs} run(s)"
    lines = [f"real against real, {pooled} of each workload pooled (the first file in the sim's place)"]
    lines.append(
        f"{'other':<20} {'reference':<20} {'TTFT p90 err':>12} {'TBT p90 err':>11} {'in SLO diff':>11}"
    )
    for a, b, f in result.pairs:
        lines.append(f"{a:<20} {b:<20} {f.ttft:11.1f}% {f.tbt:10.1f}% {f.attainment:11.1f}")
    lines.append("")
    lines.append("per workload, the median error (%; in SLO: points)")
    lines.append(
        f"{'workload':<15} {'real TTFT':>9} {'TBT':>6} {'in SLO':>6}   {'sim TTFT':>8} {'TBT':>6} {'in SLO':>6}"
    )
    for n, (r, s) in result.by_workload.items():
        lines.append(
            f"{n:<15} {r.ttft:9.1f} {r.tbt:6.1f} {r.attainment:6.1f}   {s.ttft:8.1f} {s.tbt:6.1f} {s.attainment:6.1f}"
        )
    lines.append("")
    lines.append(
        "each file's sim against its real side, beside the other files' real sides against it (median)"
    )
    for v, f in result.sims:
        others = _median([p[2] for p in result.pairs if p[1] == v])
        lines.append(f"{v:<20} sim {f.line()}; other real sides {others.line()}")
    lines.append("")
    real_ok = sum(_within(p[2], goal) for p in result.pairs)
    sim_ok = sum(_within(s[1], goal) for s in result.sims)
    goal_text = f"{goal.ttft:g}% / {goal.tbt:g}% / {goal.attainment:g} points"
    lines.append(
        f"sim vs real, median over {len(result.sims)} files: {_median([s[1] for s in result.sims]).line()}; "
        f"{sim_ok} of {len(result.sims)} within {goal_text}"
    )
    lines.append(
        f"real vs real, median over {len(result.pairs)} pairs: {_median([p[2] for p in result.pairs]).line()}; "
        f"{real_ok} of {len(result.pairs)} within {goal_text}"
    )
    return "\n".join(lines)


def spread_command(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(prog="pdserve plan spread", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="validate.json files of the same seeded workloads")
    p.add_argument("--runs", type=int, default=None, help="pool only each workload's first K runs")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="for files that do not record it")
    p.add_argument("--slo-tbt-ms", type=float, default=100.0, help="for files that do not record it")
    p.add_argument("--goal", type=float, nargs=3, default=(20.0, 20.0, 5.0), metavar=("TTFT", "TBT", "SLO"))
    args = p.parse_args(argv)
    if args.runs is not None and args.runs < 1:
        p.error("--runs must be at least 1")
    slo = Slo(args.slo_ttft_ms, args.slo_tbt_ms)
    try:
        validations = [Validation.load(f, slo) for f in args.files]
        if len({v.name for v in validations}) != len(validations):
            validations = [
                Validation(str(f), *_fields(v)) for f, v in zip(args.files, validations, strict=True)
            ]
        result = spread(validations, args.runs)
    except (OSError, KeyError, TypeError, ValueError) as e:  # NOTE: a file that is not validate.json
        p.error(str(e))
    print(report(result, Figures(*args.goal), args.runs))
    return 0


def _fields(v: Validation) -> tuple[Any, ...]:
    return (v.real, v.sim, v.runs, v.num_profiles, v.slo)

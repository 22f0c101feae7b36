"""The figures ``pdserve plan validate`` ends on and ``plan spread`` holds real sides to: one side's
largest TTFT p90 and TBT p90 errors (%) against another's and the largest SLO attainment difference
(points), over the workloads."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from deploy.planner.report import Summary


@dataclass(frozen=True)
class Figures:
    """The three figures of validate's last line: the largest TTFT p90 and TBT p90 errors (%) and the
    largest SLO attainment difference (points) over the workloads."""

    ttft: float
    tbt: float
    attainment: float

    def line(self) -> str:
        return (
            f"max TTFT p90 error {self.ttft:.1f}%, max TBT p90 error {self.tbt:.1f}%, "
            f"max SLO attainment error {self.attainment:.1f} points"
        )


def figures(rows: Sequence[tuple[str, Summary, Summary]]) -> Figures:
    """Last-line figures of (workload, reference, other) rows: `other` measured against `reference`."""
    return Figures(
        max(error_pct(s.ttft_ms.p90, r.ttft_ms.p90) for _, r, s in rows),
        max(error_pct(s.tbt_ms.p90, r.tbt_ms.p90) for _, r, s in rows),
        max(abs(s.slo_attainment - r.slo_attainment) * 100 for _, r, s in rows),
    )


def error_pct(sim: float, real: float) -> float:
    """|sim - real| in % of real (inf where real is not positive)."""
    return abs(sim - real) / real * 100 if real > 0 else math.inf

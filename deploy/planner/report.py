"""What a simulated (or measured) run comes to: latency percentiles, SLO attainment, goodput; the plan's
table and PNG.

Definitions match ``pdserve bench serve`` so simulation and reality are compared on the same terms:
TTFT per request, TBT over every gap between streamed tokens, a request meets the SLO when its TTFT and
its mean gap are both within bounds, goodput counts those per second, and a rejected request is a miss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deploy.planner.sim import RequestRecord, SimResult


@dataclass(frozen=True)
class Slo:
    ttft_ms: float = 1000.0
    tbt_ms: float = 100.0
    percentile: float = 90.0  # a configuration meets the SLO when this percentile of TTFT and TBT is in

    def met_by(self, record: RequestRecord) -> bool:
        ttft = record.ttft_s
        if record.rejected is not None or ttft is None or record.finish_s is None:
            return False
        return ttft * 1e3 <= self.ttft_ms and record.mean_tbt_s * 1e3 <= self.tbt_ms


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float

    @classmethod
    def of_ms(cls, seconds: Sequence[float] | np.ndarray) -> Percentiles:
        if len(seconds) == 0:
            return cls(math.nan, math.nan, math.nan)
        p = np.percentile(np.asarray(seconds, dtype=np.float64) * 1e3, [50, 90, 99])
        return cls(float(p[0]), float(p[1]), float(p[2]))

    def at(self, q: float) -> float:
        return {50.0: self.p50, 90.0: self.p90, 99.0: self.p99}[float(q)]


@dataclass(frozen=True)
class Summary:
    label: str
    num_requests: int
    num_rejected: int
    duration_s: float
    ttft_ms: Percentiles
    tbt_ms: Percentiles
    e2e_ms: Percentiles
    slo_attainment: float  # fraction of all requests (rejected ones included) within the SLO
    goodput_rps: float  # requests within the SLO per second
    output_tokens_per_s: float
    meets_slo: bool  # the SLO's percentile of TTFT and TBT within bounds, nothing rejected
    num_gpus: int = 0  # of the simulated layout (0: not known, a measured run's)

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput_rps / self.num_gpus if self.num_gpus else math.nan


def summarize(
    label: str, records: Sequence[RequestRecord], duration_s: float, slo: Slo, num_gpus: int = 0
) -> Summary:
    served = [r for r in records if r.rejected is None and r.ttft_s is not None]
    ttft = Percentiles.of_ms([r.ttft_s for r in served if r.ttft_s is not None])
    gaps = np.concatenate([np.frombuffer(r.gaps_s, dtype=np.float64) for r in served] or [np.zeros(0)])
    tbt = Percentiles.of_ms(gaps)
    e2e = Percentiles.of_ms([r.e2e_s for r in served if r.e2e_s is not None])
    good = sum(1 for r in records if slo.met_by(r))
    duration = max(duration_s, 1e-9)
    num_rejected = len(records) - len(served)
    q = slo.percentile
    meets = (
        num_rejected == 0
        and bool(served)
        and ttft.at(q) <= slo.ttft_ms
        and (math.isnan(tbt.at(q)) or tbt.at(q) <= slo.tbt_ms)
    )
    return Summary(
        label,
        len(records),
        num_rejected,
        duration_s,
        ttft,
        tbt,
        e2e,
        good / max(1, len(records)),
        good / duration,
        sum(r.num_tokens for r in served) / duration,
        meets,
        num_gpus,
    )


def summarize_result(result: SimResult, slo: Slo) -> Summary:
    return summarize(result.config.label, result.records, result.duration_s, slo, result.config.num_gpus)


def table(rows: Sequence[Summary], slo: Slo, recommended: str | None = None, per_gpu: bool = False) -> str:
    """One line per configuration: latency percentiles (ms), attainment, goodput, the SLO verdict;
    ``per_gpu``: its GPUs and goodput per GPU too (layouts of different tensor-parallel sizes)."""
    q = int(slo.percentile)
    width = max([16, *(len(s.label) for s in rows)])
    gpus = f" {'GPUs':>4} {'good/GPU':>8}" if per_gpu else ""
    head = (
        f"{'configuration':<{width}} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'TBT p50':>8} {'p90':>7} {'p99':>7} "
        f"{'E2E p90':>9} {'in SLO':>7} {'goodput':>8}{gpus} {'tok/s':>7}  SLO at p{q}"
    )
    lines = [head, "-" * len(head)]
    for s in rows:
        mark = " <- recommended" if s.label == recommended else ""
        gpus = f" {s.num_gpus:4d} {s.goodput_per_gpu:8.3f}" if per_gpu else ""
        lines.append(
            f"{s.label:<{width}} {s.ttft_ms.p50:9.1f} {s.ttft_ms.p90:8.1f} {s.ttft_ms.p99:8.1f} "
            f"{s.tbt_ms.p50:8.1f} {s.tbt_ms.p90:7.1f} {s.tbt_ms.p99:7.1f} {s.e2e_ms.p90:9.1f} "
            f"{s.slo_attainment:7.1%} {s.goodput_rps:8.2f}{gpus} {s.output_tokens_per_s:7.0f}  "
            f"{'met' if s.meets_slo else 'missed'}{mark}"
        )
    return "\n".join(lines)


def plot(rows: Sequence[Summary], slo: Slo, path: Path, title: str, recommended: str | None) -> bool:
    """Goodput and attainment per configuration, and its TTFT / TBT percentile against the SLO.
    False (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [s.label for s in rows]
    x = np.arange(len(rows))
    colors = ["tab:green" if s.label == recommended else "tab:blue" for s in rows]
    q = slo.percentile
    fig, axes = plt.subplots(1, 3, figsize=(max(12, 0.6 * len(rows) * 3), 4.5))
    axes[0].bar(x, [s.goodput_rps for s in rows], color=colors)
    for xi, s in zip(x, rows, strict=True):
        axes[0].annotate(f"{s.slo_attainment:.0%}", (xi, s.goodput_rps), ha="center", va="bottom", fontsize=8)
    axes[0].set(title="goodput (label: SLO attainment)", ylabel="requests/s within SLO")
    for ax, key, bound, name in (
        (axes[1], "ttft_ms", slo.ttft_ms, "TTFT"),
        (axes[2], "tbt_ms", slo.tbt_ms, "TBT"),
    ):
        ax.bar(x, [getattr(s, key).at(q) for s in rows], color=colors)
        ax.axhline(bound, color="tab:red", linestyle="--", label=f"SLO {bound:g} ms")
        ax.set(title=f"{name} p{q:g}", ylabel="ms")
        ax.legend(loc="upper right", fontsize=8)
    for ax in axes:
        ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True

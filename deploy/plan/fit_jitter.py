"""The probe's delivery jitter fits: the delay per streamed token with which the twin gives a decode
phase's measured spread of gaps between a stream's tokens (90th percentile over median): one per decode
batch (``fit_delivery_jitter_by_batch``) and one for a step that ends beside another worker's
(``fit_delivery_jitter(..., contended=True)``)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from cluster.config import ClusterConfig
from cluster.cost_model import CostProfile
from deploy.loadgen import Record
from deploy.plan.inputs import twin_config
from deploy.planner.sim import Simulation
from deploy.planner.workload import Workload

_MIN_JITTER_S, _MAX_JITTER_S = 0.00025, 0.032


def _spread(gaps: Sequence[float]) -> float:
    p50, p90 = np.percentile(np.asarray(gaps, dtype=np.float64), [50, 90])
    return float(p90 - p50)


def phase_spread(gaps_by_request: Sequence[Sequence[float]], wave: int) -> float:
    """The spread of a phase's gaps (their 90th percentile over their median; `gaps_by_request` in send
    order): with three waves of `wave` requests or more, the median of each wave's own spread, else the
    spread of all of them (0.0 without gaps).

    NOTE: one probe's decode phase of 8 streams now and then measured twice the usual spread (the jitter
    it fitted for a batch of 8 ran 0-2.7 ms over the 21 probes of stops 24-26, while long_decode's real TBT
    p90 stayed within 6.2-7.4 ms): a pause of the host in one wave lifts the pooled percentile, and one
    wave of four cannot move the median of the waves."""
    waves = [
        [g for gaps in gaps_by_request[i : i + wave] for g in gaps]
        for i in range(0, len(gaps_by_request), max(1, wave))
    ]
    waves = [w for w in waves if w]
    if len(waves) >= 3:
        return float(statistics.median(_spread(w) for w in waves))
    pooled = [g for w in waves for g in w]
    return _spread(pooled) if pooled else 0.0


def fit_delivery_jitter(
    cfg: ClusterConfig,
    profile: CostProfile,
    runs: Sequence[tuple[Workload, Sequence[Record]]],
    max_model_len: int,
    contended: bool = False,
) -> float:
    """``CostProfile.delivery_jitter_s`` (``contended``: ``delivery_jitter_contended_s``): the jitter
    with which the simulation of each run (``profile`` otherwise as is, seed 0; for the plain jitter,
    without its points by batch) gives, averaged over the runs, the measured spread of the gaps
    between a stream's tokens: their 90th percentile over their median (the spread, not the level: a
    step model a little off moves both percentiles alike), the median of its waves' (`phase_spread`,
    on both sides). The smallest such jitter, up to 32 ms (that
    if none reaches it); 0.0 when the simulation without it already reaches the measured spread."""
    base = twin_config(cfg, profile, max_model_len)
    pairs = []
    for workload, records in runs:
        served = [r.tbt_s for r in records if r.error is None]
        if any(served):
            pairs.append((workload, phase_spread(served, _wave(workload))))
    if not pairs:
        return 0.0
    if not contended:
        profile = replace(profile, delivery_jitter_by_batch=())

    def excess(jitter: float) -> float:
        if contended:
            p = replace(profile, delivery_jitter_contended_s=jitter)
        else:
            p = replace(profile, delivery_jitter_s=jitter)
        simulated = []
        for workload, real in pairs:
            gaps = [list(r.gaps_s) for r in Simulation(base, p, workload).run().records]
            simulated.append(phase_spread(gaps, _wave(workload)) - real)
        return statistics.fmean(simulated)

    if excess(0.0) >= 0.0:
        return 0.0
    # NOTE: the simulated spread grows with the jitter only up to a point: past it a stream's tokens
    # bunch up (each kept behind the one before) and the spread falls again. So the bracket is found
    # from below, doubling, and the bisection runs inside it: the smallest jitter that fits.
    lo, hi = 0.0, _MIN_JITTER_S
    while excess(hi) < 0.0:
        if hi >= _MAX_JITTER_S:
            return hi
        lo, hi = hi, min(2 * hi, _MAX_JITTER_S)
    while hi - lo > 1e-5:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) < 0.0 else (lo, mid)
    return (lo + hi) / 2


def _wave(workload: Workload) -> int:
    return workload.max_concurrency or len(workload)


def fit_delivery_jitter_by_batch(
    cfg: ClusterConfig,
    profile: CostProfile,
    runs: Sequence[tuple[int, Workload, Sequence[Record]]],
    max_model_len: int,
) -> tuple[tuple[int, float], ...]:
    """``CostProfile.delivery_jitter_by_batch``: (batch, ``fit_delivery_jitter`` of that batch's run
    alone) for each decode batch the probe ran, by batch."""
    return tuple(
        (batch, fit_delivery_jitter(cfg, profile, [(workload, records)], max_model_len))
        for batch, workload, records in sorted(runs, key=lambda run: run[0])
    )

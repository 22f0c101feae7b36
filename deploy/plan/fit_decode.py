"""The probe's decode fit through the twin: the decode terms and the base of the step model scaled so
that the twin's decode workers spend the seconds the real ones did on the same seeded requests (the
phases' own prefills and the handoffs received beside their decodes run in the twin as they did for
real); a light batch weighs the base, a heavy one the per-sequence terms (``twin_decode_terms``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from cluster.config import ClusterConfig
from cluster.cost_model import CostProfile, LinearStepCost
from deploy.plan.inputs import twin_config
from deploy.planner.sim import Simulation
from deploy.planner.workload import Workload


def twin_decode_seconds(
    cfg: ClusterConfig, profile: CostProfile, runs: Sequence[tuple[Workload, float]], max_model_len: int
) -> list[float]:
    """The twin's decode workers' busy seconds (every pool but prefill) in each run's workload."""
    base = twin_config(cfg, profile, max_model_len)
    seconds = []
    for workload, _ in runs:
        busy = Simulation(base, profile, workload).run().worker_busy_s
        seconds.append(sum(v for w, v in busy.items() if not w.startswith("prefill")))
    return seconds


def twin_decode_ratio(
    cfg: ClusterConfig, profile: CostProfile, runs: Sequence[tuple[Workload, float]], max_model_len: int
) -> float:
    """The decode workers' measured seconds over the twin's (``profile``, the same seeded requests) in
    each run, geometric mean; 1.0 without a run the twin gives time to."""
    simulated = twin_decode_seconds(cfg, profile, runs, max_model_len)
    logs = [math.log(m / s) for (_, m), s in zip(runs, simulated, strict=True) if s > 0.0 and m > 0.0]
    return math.exp(statistics.fmean(logs)) if logs else 1.0


def twin_decode_scale(
    cfg: ClusterConfig,
    profile: CostProfile,
    runs: Sequence[tuple[Workload, float]],
    max_model_len: int,
    rounds: int = 2,
) -> tuple[CostProfile, float]:
    """``profile`` with its linear step's decode terms and base times the factor that makes the twin's
    decode seconds of ``runs`` their measured ones (``twin_decode_ratio``, applied ``rounds`` times: the
    schedule, and so the ratio, moves with the scale), and that factor; a roofline profile as it is."""
    scale, step = 1.0, profile.step
    if not isinstance(step, LinearStepCost):
        return profile, 1.0
    for _ in range(rounds):
        ratio = twin_decode_ratio(cfg, profile, runs, max_model_len)
        step = step.scaled(1.0, ratio, base=ratio)
        profile = replace(profile, step=step)
        scale *= ratio
    return profile, scale


_TERMS_STEP = math.log(1.1)  # the twin's finite difference in each scale (log)
_MAX_TERMS_MOVE = math.log(4.0)  # how far the two-term fit may move either scale (log)


def twin_decode_terms(
    cfg: ClusterConfig,
    profile: CostProfile,
    runs: Sequence[tuple[Workload, float]],
    max_model_len: int,
    rounds: int = 3,
) -> tuple[CostProfile, float, float]:
    """``profile`` with its linear step's base and decode terms scaled apart, so that the twin's decode
    seconds of ``runs`` (a workload and its measured decode seconds; batches of different sizes: a light
    one weighs the base, a heavy one the per-sequence terms) come closest to the measured ones (least
    squares of the log ratios). Each round linearizes through the twin: every run at the current scales
    and with each scale 10% up (the schedule moves with the scales). The base's change is moved into
    ``prefill_step_s`` (not below 0), so a step that computes prompt tokens costs what the prefill fit
    made it. Returns (profile, base factor, decode factor). With fewer than two runs the twin gives time
    to, or two that cannot tell the scales apart, one factor for both (``twin_decode_scale``); a roofline
    profile as it is."""
    step = profile.step
    if not isinstance(step, LinearStepCost):
        return profile, 1.0, 1.0

    def scaled(log_base: float, log_decode: float) -> CostProfile:
        new = step.scaled(1.0, math.exp(log_decode), base=math.exp(log_base))
        moved = step.base_s - new.base_s
        return replace(profile, step=replace(new, prefill_step_s=max(0.0, step.prefill_step_s + moved)))

    def at(log_base: float, log_decode: float) -> list[float]:
        return twin_decode_seconds(cfg, scaled(log_base, log_decode), runs, max_model_len)

    measured = [s for _, s in runs]
    x = y = 0.0
    for _ in range(rounds):
        now, up_base, up_decode = at(x, y), at(x + _TERMS_STEP, y), at(x, y + _TERMS_STEP)
        rows, targets = [], []
        for m, s, sb, sd in zip(measured, now, up_base, up_decode, strict=True):
            if m > 0.0 and s > 0.0 and sb > 0.0 and sd > 0.0:
                rows.append((math.log(sb / s) / _TERMS_STEP, math.log(sd / s) / _TERMS_STEP))
                targets.append(math.log(m / s))
        a = np.array(rows, dtype=np.float64).reshape(-1, 2)
        if len(rows) < 2 or np.linalg.cond(a) > 1e3:
            scaled_profile, scale = twin_decode_scale(cfg, profile, runs, max_model_len)
            return scaled_profile, scale, scale
        dx, dy = np.linalg.lstsq(a, np.array(targets), rcond=None)[0]
        x = min(_MAX_TERMS_MOVE, max(-_MAX_TERMS_MOVE, x + float(dx)))
        y = min(_MAX_TERMS_MOVE, max(-_MAX_TERMS_MOVE, y + float(dy)))
    return scaled(x, y), math.exp(x), math.exp(y)

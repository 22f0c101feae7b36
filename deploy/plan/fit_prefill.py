"""The probe's prefill fits: what a prompt costs in place (a worker beside the router, the HTTP edge and
the other workers) against the engine sweep's model. Each prefill phase the probe ran (``PrefillRun``)
gives its engines' seconds; least squares of relative errors finds the scales of the prompt terms and
of their attention, and what a prefill step, each prompt chunk in it and a handoff sent beside it cost
on top (``fit_prefill_terms``), the phases' chunks and sends being the twin's schedule of their prompts
(``fit_prefill_sends``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from cluster.config import ClusterConfig
from cluster.cost_model import CostProfile, LinearStepCost, StepShape, shape_of
from deploy.loadgen import Record
from deploy.plan.harness import EngineTotals
from deploy.plan.inputs import twin_config
from deploy.planner.sim import Simulation
from deploy.planner.workload import Workload


def _prefill_chunks(n: int, budget: int) -> list[StepShape]:
    return [shape_of([(s, min(budget, n - s), False)]) for s in range(0, n, budget)]


_MIN_EXTRA_S = 1e-6  # a fitted extra below this is noise


@dataclass(frozen=True)
class PrefillRun:
    """What a prefill pool ran in one probe phase: its engines' seconds, the model's seconds of the
    prompts' own terms (a step's base excluded) apart from their attention (``attention_s``, the
    attention pairs' term), its steps, the prompt chunks they computed, and how many handoffs it sent
    beside its steps (0 until the twin counts them: ``fit_prefill_sends``)."""

    seconds: float
    prompt_s: float
    steps: int
    chunks: int
    sent: float = 0.0
    attention_s: float = 0.0

    @classmethod
    def of(cls, ran: EngineTotals, step: Any, records: Sequence[Record], budget: int) -> PrefillRun:
        chunks = [c for r in records for c in _prefill_chunks(r.prompt_len, budget)]
        prompt_s, attention_s = prompt_terms(step, chunks)
        return cls(ran.seconds, prompt_s, ran.num_steps, len(chunks), attention_s=attention_s)


def prompt_terms(step: Any, shapes: Sequence[StepShape]) -> tuple[float, float]:
    """The seconds ``step`` gives the prompts of ``shapes`` (a step's base excluded): (all but their
    attention, their attention pairs' term; a roofline model's all in the first)."""
    if not isinstance(step, LinearStepCost):
        return sum(step.step_s(s) for s in shapes), 0.0
    attention = sum(step.attention_pair_s * s.num_attention_pairs for s in shapes)
    return sum(step.step_s(s) - step.base_s for s in shapes) - attention, attention


_EXTRAS = ("step", "chunk", "sent")


def fit_prefill_terms(runs: Sequence[PrefillRun], base_s: float) -> dict[str, float]:
    """The terms of seconds - base_s x steps = scale x prompt_s + attention scale x attention_s + per
    step x steps + per chunk x chunks + per send x sent, fitted by least squares of relative errors (each
    run weighs 1 / its seconds): ``scale``, ``attention_scale`` (the scale itself where no run has
    attention seconds), ``per_step``, ``per_chunk``, ``per_sent`` (seconds). Of the fits with positive
    scales and extras of a microsecond or more (any subset of the three extras), the one with the least
    error; the ratio of the sums for both scales when none is.

    NOTE: idle prompts alone have one chunk a step and send their handoffs between steps, so they tell
    none of the extras apart; bursts (many prompts in a step, each one's handoff leaving beside the
    next step) can. Prompts of several lengths tell the attention (quadratic in a prompt's length) from
    the rest: in place it scales apart from the sweep's."""
    y = np.array([r.seconds - base_s * r.steps for r in runs], dtype=np.float64)
    columns = {
        "scale": [r.prompt_s for r in runs],
        "attention_scale": [r.attention_s for r in runs],
        "step": [float(r.steps) for r in runs],
        "chunk": [float(r.chunks) for r in runs],
        "sent": [r.sent for r in runs],
    }
    scales = ("scale", "attention_scale") if any(r.attention_s > 0.0 for r in runs) else ("scale",)
    weights = np.array([1.0 / max(r.seconds, 1e-6) for r in runs], dtype=np.float64)
    best: tuple[float, dict[str, float]] | None = None
    for k in range(len(_EXTRAS), -1, -1):
        for extras in itertools.combinations(_EXTRAS, k):
            names = scales + extras
            if len(runs) < len(names):
                continue
            design = np.array([columns[n] for n in names], dtype=np.float64).T
            coef, *_ = np.linalg.lstsq(design * weights[:, None], y * weights, rcond=None)
            if not (
                all(c > 0.0 for c in coef[: len(scales)])
                and all(c >= _MIN_EXTRA_S for c in coef[len(scales) :])
            ):
                continue
            error = float((((design @ coef - y) * weights) ** 2).sum())
            if best is None or error < best[0]:
                best = (error, dict(zip(names, (float(c) for c in coef), strict=True)))
    if best is not None:
        fit = best[1]
    else:
        fit = {"scale": float(y.sum() / sum(r.prompt_s + r.attention_s for r in runs))}
    return {
        "scale": fit["scale"],
        "attention_scale": fit.get("attention_scale", fit["scale"]),
        **{f"per_{e}": fit.get(e, 0.0) for e in _EXTRAS},
    }


def in_place_step(
    step: Any, runs: Sequence[PrefillRun], decode_scale: float
) -> tuple[Any, float, dict[str, float]]:
    """(step model, step scale, fitted terms) in place. A fitted linear model: its decode terms and its
    base scale by ``decode_scale`` (most steps decode), its prompt terms by the scales
    ``fit_prefill_terms`` finds in ``runs`` (the attention pairs' term by its own), and a prefill step
    and each prompt chunk cost its extras (``prefill_step_s``, added to ``prefill_seq_s``); step scale
    1.0; the fitted terms include the cost of a handoff sent beside a step (``per_sent``,
    ``CostProfile.handoff_send_step_s``). A roofline is kept as it is, with one factor for every step:
    the geometric mean of the prefill runs' ratio and the decode scale."""
    if isinstance(step, LinearStepCost):
        fitted = fit_prefill_terms(runs, step.base_s * decode_scale)
        scaled = step.scaled(fitted["scale"], decode_scale, base=decode_scale)
        in_place = replace(
            scaled,
            attention_pair_s=step.attention_pair_s * fitted["attention_scale"],
            prefill_step_s=fitted["per_step"],
            prefill_seq_s=scaled.prefill_seq_s + fitted["per_chunk"],
        )
        return in_place, 1.0, fitted
    ratio = sum(r.seconds for r in runs) / sum(r.prompt_s + r.attention_s for r in runs)
    fitted = {"scale": ratio, "attention_scale": ratio, "per_step": 0.0, "per_chunk": 0.0, "per_sent": 0.0}
    return step, math.sqrt(ratio * decode_scale), fitted


def twin_prefill_phase(
    cfg: ClusterConfig, profile: CostProfile, sweep_step: Any, workload: Workload, max_model_len: int
) -> tuple[float, float, int, int]:
    """How the twin's prefill workers run ``workload`` under ``profile``: (the seconds of the prompt
    terms of ``sweep_step`` over their steps, and of their attention apart (``prompt_terms``); the
    prompt chunks they compute; the handoffs they send beside a step, each charged to the step after
    it). The twin runs the real Scheduler, so its chunks are the ones a real burst is cut into (a prompt
    may span two steps)."""
    base = twin_config(cfg, profile, max_model_len)
    shapes: list[StepShape] = []

    def on_step(w: Any, t: float, shape: StepShape, step_s: float) -> None:
        if w.pool == "prefill" and shape.num_prefill_seqs:
            shapes.append(shape)

    charged = Simulation(base, profile, workload, on_step=on_step).run().worker_charged_handoffs
    prompt_s, attention_s = prompt_terms(sweep_step, shapes)
    chunks = sum(s.num_prefill_seqs for s in shapes)
    return prompt_s, attention_s, chunks, sum(n for w, n in charged.items() if w.startswith("prefill"))


def fit_prefill_sends(
    cfg: ClusterConfig,
    profile: CostProfile,
    sweep_step: Any,
    runs: Sequence[PrefillRun],
    workloads: Sequence[Workload],
    decode_scale: float,
    max_model_len: int,
    rounds: int = 2,
) -> tuple[CostProfile, dict[str, float]]:
    """``profile`` with the in-place step (``in_place_step`` of ``sweep_step``) and the send cost
    (``handoff_send_step_s``) fitted on the prefill ``runs``: each run's prompt seconds, chunks and
    handoffs sent beside a step are the twin's for its ``workloads`` entry under the profile so far
    (``twin_prefill_phase``; the measured seconds and steps stay); ``rounds`` times, since the schedule
    moves with the fitted terms. Returns the fitted terms too."""
    fitted: dict[str, float] = {}
    for _ in range(rounds):
        phases = [twin_prefill_phase(cfg, profile, sweep_step, w, max_model_len) for w in workloads]
        runs = [
            replace(r, prompt_s=prompt_s, attention_s=attention_s, chunks=chunks, sent=float(sent))
            for r, (prompt_s, attention_s, chunks, sent) in zip(runs, phases, strict=True)
        ]
        step, scale, fitted = in_place_step(sweep_step, runs, decode_scale)
        profile = replace(profile, step=step, step_scale=scale, handoff_send_step_s=fitted["per_sent"])
    return profile, fitted


def twin_prefill_s(cfg: ClusterConfig, profile: CostProfile, workload: Workload, max_model_len: int) -> float:
    """The twin's prefill workers' busy seconds in ``workload`` (``profile``)."""
    base = twin_config(cfg, profile, max_model_len)
    busy = Simulation(base, profile, workload).run().worker_busy_s
    return sum(v for w, v in busy.items() if w.startswith("prefill"))

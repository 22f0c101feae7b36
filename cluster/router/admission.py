"""SLO-aware admission (``router.admission: slo``): refuse, before anything is queued, a request predicted
to miss its SLO, and tell the client when to retry.

The predictions are the route's (cluster/router/routing.py): the cost profile (cluster/cost_model.py, the one
the planner simulates with) over the chosen worker's live queue, i.e. the prompt tokens the router has
sent there whose first token has not come back, the requests it has there and the running batch its
last heartbeat reported (cluster/router/predict.py). A request is refused when its predicted TTFT exceeds its
TTFT SLO (its own ``x-pdserve-ttft-slo-ms``, else the router's ``ttft_slo_ms``; with neither, TTFT is
not checked), or when the router has a ``tbt_slo_ms`` and the decode step it would join is predicted
to exceed it (goodput counts a request only when both hold).

A profile measured once drifts from the machine it describes (other load, a different batch mix), so
each prediction is multiplied by a correction learned from what the router measures, as the exponential
moving average of log(measured / predicted), clamped to ``[1 / MAX_CORRECTION, MAX_CORRECTION]``:

* TTFT: one correction, from every admitted request's first token;
* the decode step: one per decode or colocated worker, from its heartbeats: while it runs a batch, the
  time between two beats over the steps it took is its real step period (what its decodes see as TBT,
  prompt chunks and a shared host included), against the profile's step for the batch it reported.

``feedback=False`` turns both off (the predictions as they are).
"""

from __future__ import annotations

import math
from pathlib import Path

from cluster.config import EngineConfig, RouterConfig
from cluster.cost_model import CostProfile, default_profile_path
from cluster.protocol import SloUnattainableError
from cluster.router.predict import Admission, Predictor

MAX_CORRECTION = 4.0
FEEDBACK_WEIGHT = 0.05  # weight of one request's TTFT in its moving average (about the last 20)
STEP_WEIGHT = 0.3  # weight of one heartbeat interval's step period (each covers many steps)
MIN_STEPS = 2  # a heartbeat interval with fewer steps says little about the step period
TBT_RETRY_AFTER_S = 1  # a full decode batch frees a seat when one of its requests ends: soon, unknown


class _Correction:
    """exp of a moving average of log(measured / predicted), clamped."""

    def __init__(self) -> None:
        self.log_value = 0.0

    @property
    def value(self) -> float:
        return math.exp(self.log_value)

    def observe(self, predicted: float | None, measured: float, weight: float = FEEDBACK_WEIGHT) -> None:
        if predicted is None or predicted <= 0 or measured <= 0:
            return
        bound = math.log(MAX_CORRECTION)
        updated = (1 - weight) * self.log_value + weight * math.log(measured / predicted)
        self.log_value = min(bound, max(-bound, updated))


class _StepClock:
    """One worker's last heartbeat: when (router clock), its step count, the profile's step then."""

    def __init__(self, at_s: float, num_steps: int, predicted_step_s: float | None) -> None:
        self.at_s, self.num_steps, self.predicted_step_s = at_s, num_steps, predicted_step_s
        self.correction = _Correction()


class SloAdmission:
    """The admission decision of one router. Not thread-safe: the router's loop owns it."""

    def __init__(
        self, ttft_slo_s: float | None, tbt_slo_s: float | None = None, *, feedback: bool = True
    ) -> None:
        for name, value in (("ttft_slo_s", ttft_slo_s), ("tbt_slo_s", tbt_slo_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.ttft_slo_s, self.tbt_slo_s = ttft_slo_s, tbt_slo_s
        self.feedback = feedback
        self._ttft = _Correction()
        self._steps: dict[str, _StepClock] = {}
        self.num_admitted = 0
        self.num_rejected = 0

    @property
    def correction(self) -> float:
        """What TTFT predictions are multiplied by (1.0 until measurements say otherwise)."""
        return self._ttft.value

    def step_correction(self, worker_id: str | None) -> float:
        """What decode-step predictions for ``worker_id`` are multiplied by (1.0 for an unknown worker)."""
        clock = self._steps.get(worker_id) if worker_id is not None else None
        return clock.correction.value if clock is not None else 1.0

    def slo_s(self, requested_s: float | None) -> float | None:
        return requested_s if requested_s is not None else self.ttft_slo_s

    def check(
        self,
        predicted_ttft_s: float | None,
        predicted_tbt_s: float | None = None,
        requested_slo_s: float | None = None,
        *,
        decode_worker_id: str | None = None,
    ) -> Admission:
        """Admit unless a (corrected) prediction misses its SLO; a missing SLO or prediction is no check.
        ``decode_worker_id``: whose step the TBT prediction is. Retry-After: the TTFT excess in whole
        seconds (at least 1), or 1 s for a TBT miss."""
        ttft = predicted_ttft_s * self.correction if predicted_ttft_s is not None else None
        step = self.step_correction(decode_worker_id)
        tbt = predicted_tbt_s * step if predicted_tbt_s is not None else None
        slo = self.slo_s(requested_slo_s)
        verdict = Admission(True, ttft if ttft is not None else math.nan, 0, tbt)
        if slo is not None and ttft is not None and ttft > slo:
            verdict = Admission(False, ttft, max(1, math.ceil(ttft - slo)), tbt, "ttft")
        elif self.tbt_slo_s is not None and tbt is not None and tbt > self.tbt_slo_s:
            verdict = Admission(False, verdict.predicted_ttft_s, TBT_RETRY_AFTER_S, tbt, "tbt")
        if verdict.ok:
            self.num_admitted += 1
        else:
            self.num_rejected += 1
        return verdict

    def refusal(
        self,
        predicted_ttft_s: float | None,
        predicted_tbt_s: float | None,
        requested_slo_s: float | None,
        worker_id: str,
        decode_worker_id: str | None = None,
    ) -> SloUnattainableError | None:
        """``check``'s verdict as the error that refuses the request (None: admitted), naming what it
        missed, by how much, on ``worker_id``, and when to retry."""
        verdict = self.check(
            predicted_ttft_s, predicted_tbt_s, requested_slo_s, decode_worker_id=decode_worker_id
        )
        if verdict.ok:
            return None
        if verdict.missed == "ttft":
            slo = self.slo_s(requested_slo_s) or 0.0
            predicted, what = verdict.predicted_ttft_s, "time to first token"
        else:
            slo, predicted, what = (
                self.tbt_slo_s or 0.0,
                verdict.predicted_tbt_s or 0.0,
                "time between tokens",
            )
        return SloUnattainableError(
            f"predicted {what} {predicted * 1e3:.0f} ms exceeds the {verdict.missed.upper()} SLO "
            f"{slo * 1e3:.0f} ms (on {worker_id}); retry after {verdict.retry_after_s} s",
            verdict.retry_after_s,
        )

    def observe(self, predicted_ttft_s: float | None, measured_ttft_s: float) -> None:
        """An admitted request's first token came back ``measured_ttft_s`` after its arrival."""
        if self.feedback:
            self._ttft.observe(predicted_ttft_s, measured_ttft_s)

    def observe_steps(
        self, worker_id: str, at_s: float, num_steps: int, predicted_step_s: float | None
    ) -> None:
        """A heartbeat of ``worker_id``: at router time ``at_s`` it had taken ``num_steps`` steps, and the
        profile puts a step of the batch it reports at ``predicted_step_s`` (None: it runs nothing)."""
        clock = self._steps.get(worker_id)
        if clock is None or num_steps < clock.num_steps:  # NOTE: new, or restarted (its count began anew)
            self._steps[worker_id] = _StepClock(at_s, num_steps, predicted_step_s)
            return
        steps, elapsed = num_steps - clock.num_steps, at_s - clock.at_s
        before = clock.predicted_step_s
        if self.feedback and steps >= MIN_STEPS and elapsed > 0 and before and predicted_step_s:
            clock.correction.observe((before + predicted_step_s) / 2, elapsed / steps, STEP_WEIGHT)
        clock.at_s, clock.num_steps, clock.predicted_step_s = at_s, num_steps, predicted_step_s

    def forget(self, worker_id: str) -> None:
        self._steps.pop(worker_id, None)


DEFAULT_PROFILE = "default"


def profile_path(config: RouterConfig) -> Path | None:
    """The router's cost profile: ``router.cost_profile`` ("default": where ``pdserve plan calibrate``
    writes this machine's; "": none)."""
    if not config.cost_profile:
        return None
    return default_profile_path() if config.cost_profile == DEFAULT_PROFILE else Path(config.cost_profile)


def load_predictor(config: RouterConfig, engine: EngineConfig) -> Predictor | None:
    """The router's predictor from its cost profile; None when none is configured (conditional mode then
    uses the prompt-length rule). Raises ValueError when the profile is missing or invalid, or when
    ``admission: slo`` has no profile to predict with.

    A worker of several ranks (``engine.tensor_parallel_size``, the prefill pool's) is predicted at that
    size (``CostProfile.with_tensor_parallel``: ValueError for a measured profile of another size); a
    decode pool of another size is predicted at the prefill pool's too (one profile a router).

    NOTE: never picked up implicitly: a calibration lying around must not change how a cluster routes."""
    path = profile_path(config)
    if path is None:
        if config.admission == "slo":
            raise ValueError(
                "router.admission 'slo' predicts TTFT with a cost profile: set router.cost_profile "
                f"(a path, or {DEFAULT_PROFILE!r} for the one `pdserve plan calibrate` writes)"
            )
        return None
    if not path.exists():
        raise ValueError(
            f"router cost profile {str(path)!r} does not exist: run `pdserve plan calibrate` or fix "
            "router.cost_profile"
        )
    profile = CostProfile.load(path)
    if engine.tensor_parallel_size > 1:
        profile = profile.with_tensor_parallel(engine.tensor_parallel_size)
    tbt = config.tbt_slo_ms / 1e3 if config.tbt_slo_ms is not None else None
    return Predictor(profile, engine.max_num_batched_tokens, tbt)


def build_admission(config: RouterConfig) -> SloAdmission | None:
    if config.admission != "slo":
        return None
    ttft = config.ttft_slo_ms / 1e3 if config.ttft_slo_ms is not None else None
    return SloAdmission(ttft, config.tbt_slo_ms / 1e3 if config.tbt_slo_ms is not None else None)

"""SLO-aware admission (``router.admission: slo``): refuse, before anything is queued, a request whose
predicted TTFT misses its SLO, and tell the client when to retry.

The prediction is the route's (cluster/routing.py): the cost profile (cluster/cost_model.py, the one
the planner simulates with) over the chosen worker's live queue, i.e. the prompt tokens the router has
sent there whose first token has not come back, and the running batch its last heartbeat reported
(cluster/predict.py). The SLO is the request's own (``x-pdserve-ttft-slo-ms``), else the router's
``ttft_slo_ms``; a request with neither is admitted.

A profile measured once drifts from the machine it describes (other load, a different batch mix), so
the check multiplies the prediction by a correction learned from the router's own measurements: the
exponential moving average of log(measured TTFT / predicted TTFT) over admitted requests, clamped to
``[1 / MAX_CORRECTION, MAX_CORRECTION]``. ``feedback=False`` turns it off (the prediction as is).
"""

from __future__ import annotations

import math
from pathlib import Path

from cluster.config import EngineConfig, RouterConfig
from cluster.cost_model import CostProfile, default_profile_path
from cluster.predict import Admission, Predictor, admit

MAX_CORRECTION = 4.0
FEEDBACK_WEIGHT = 0.05  # weight of one measurement in the moving average (about the last 20 requests)


class SloAdmission:
    """The admission decision of one router. Not thread-safe: the router's loop owns it."""

    def __init__(self, ttft_slo_s: float | None, *, feedback: bool = True) -> None:
        if ttft_slo_s is not None and not ttft_slo_s > 0:
            raise ValueError(f"ttft_slo_s must be > 0, got {ttft_slo_s}")
        self.ttft_slo_s = ttft_slo_s
        self.feedback = feedback
        self._log_correction = 0.0
        self.num_admitted = 0
        self.num_rejected = 0

    @property
    def correction(self) -> float:
        """What predictions are multiplied by (1.0 until measurements say otherwise)."""
        return math.exp(self._log_correction)

    def slo_s(self, requested_s: float | None) -> float | None:
        return requested_s if requested_s is not None else self.ttft_slo_s

    def check(self, predicted_ttft_s: float | None, requested_slo_s: float | None = None) -> Admission:
        """Admit when there is no SLO or no prediction, else when the corrected prediction meets it."""
        slo = self.slo_s(requested_slo_s)
        if slo is None or predicted_ttft_s is None:
            self.num_admitted += 1
            return Admission(True, predicted_ttft_s if predicted_ttft_s is not None else math.nan, 0)
        verdict = admit(predicted_ttft_s * self.correction, slo)
        if verdict.ok:
            self.num_admitted += 1
        else:
            self.num_rejected += 1
        return verdict

    def observe(self, predicted_ttft_s: float | None, measured_ttft_s: float) -> None:
        """An admitted request's first token came back ``measured_ttft_s`` after its arrival."""
        if not self.feedback or predicted_ttft_s is None or predicted_ttft_s <= 0 or measured_ttft_s <= 0:
            return
        bound = math.log(MAX_CORRECTION)
        ratio = math.log(measured_ttft_s / predicted_ttft_s)
        updated = (1 - FEEDBACK_WEIGHT) * self._log_correction + FEEDBACK_WEIGHT * ratio
        self._log_correction = min(bound, max(-bound, updated))


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
    tbt = config.tbt_slo_ms / 1e3 if config.tbt_slo_ms is not None else None
    return Predictor(profile, engine.max_num_batched_tokens, tbt)


def build_admission(config: RouterConfig) -> SloAdmission | None:
    if config.admission != "slo":
        return None
    return SloAdmission(config.ttft_slo_ms / 1e3 if config.ttft_slo_ms is not None else None)

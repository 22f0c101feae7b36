"""SLO-aware admission (cluster/router/admission.py): the decision under a constant cost model, worked out by
hand; the corrections it learns; its profile and flags. Over HTTP: tests/cluster/test_admission_http.py."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest

from cluster.config import EngineConfig, RouterConfig
from cluster.cost_model import CostProfile, LinearStepCost, TransferCost
from cluster.frames import new_secret
from cluster.protocol import EngineStats, WorkerStats
from cluster.router.admission import SloAdmission, load_predictor
from cluster.router.predict import Admission, Predictor
from cluster.router.router import Router

# every step 2.5 s whatever it computes; a control hop 62.5 ms each way (binary-exact sums)
CONSTANT = CostProfile(
    "constant",
    "hand",
    LinearStepCost(2.5, 0.0, 0.0, 0.0, 0.0, 0.0),
    TransferCost(0.0, 1e9),
    1000,
    hop_s=0.0625,
)


@dataclass
class Queue:
    """A worker as the predictor sees it."""

    num_prompt_tokens: int = 0
    num_queued_prompts: int = 0
    block_size: int = 16
    stats: WorkerStats | None = None
    num_assigned: int = 0


def test_admission_decision_with_a_constant_cost_model() -> None:
    predictor = Predictor(CONSTANT, budget=100)
    network = 2 * 0.0625
    # 250 queued tokens + 50 of its own in chunks of 100: 3 steps
    busy = Queue(250, 2)
    assert predictor.ttft_s(busy, 50) == network + 3 * 2.5 == 7.625
    # a cached prefix is not recomputed (40 of 50 cached: 260 tokens, still 3 steps; 1000 queued: 11)
    assert predictor.ttft_s(busy, 50, cached_tokens=40) == 7.625
    assert predictor.ttft_s(Queue(1000, 4), 50) == network + 11 * 2.5
    # 60 running decodes take 60 of each step's 100 tokens: 300 tokens in 8 steps of 40
    stats = WorkerStats(
        "w", "decode", engine=EngineStats(num_running=60, num_total_blocks=100, num_free_blocks=50)
    )
    assert predictor.ttft_s(Queue(250, 2, stats=stats), 50) == network + 8 * 2.5

    admission = SloAdmission(7.625, feedback=False)
    assert admission.check(7.625) == Admission(True, 7.625, 0)  # exactly at the SLO: admitted
    refused = Admission(False, 7.625, 1, None, "ttft")
    assert admission.check(7.625, requested_slo_s=7.5) == refused  # the request's own SLO
    assert admission.check(28.125, requested_slo_s=0.125) == Admission(False, 28.125, 28, None, "ttft")
    assert admission.check(28.125, requested_slo_s=0.1) == Admission(False, 28.125, 29, None, "ttft")
    assert (admission.num_admitted, admission.num_rejected) == (1, 3)
    assert SloAdmission(None).check(100.0).ok  # no SLO anywhere: admitted
    assert admission.check(None).ok  # no prediction: admitted


def test_admission_by_the_decode_step_it_would_join() -> None:
    # 250 ms a step + 125 ms per decode sequence
    predictor = Predictor(
        CostProfile(
            "d", "hand", LinearStepCost(0.25, 0.0, 0.0, 0.125, 0.0, 0.0), TransferCost(0.0, 1e9), 1000
        ),
        budget=100,
    )
    stats = WorkerStats(
        "w", "decode", engine=EngineStats(num_running=3, num_total_blocks=100, num_free_blocks=90)
    )
    # the router has 5 requests there, 1 still queued for its prefill: 4 running (more than the 3 the last
    # heartbeat saw), 1 queued + 2 joining from the prefill pool + the new one: 8 sequences
    worker = Queue(40, 1, stats=stats, num_assigned=5)
    assert predictor.tbt_s(worker, 30, num_joining=2) == 0.25 + 8 * 0.125 == 1.25
    admission = SloAdmission(None, tbt_slo_s=1.0, feedback=False)
    verdict = admission.check(None, 1.25)
    assert (verdict.ok, verdict.retry_after_s, verdict.predicted_tbt_s, verdict.missed) == (
        False,
        1,
        1.25,
        "tbt",
    )
    assert math.isnan(verdict.predicted_ttft_s)  # no TTFT prediction
    assert admission.check(0.5, 1.0) == Admission(True, 0.5, 0, 1.0)  # exactly at the bound: admitted
    both = SloAdmission(0.25, tbt_slo_s=1.0, feedback=False)
    assert both.check(0.5, 2.0) == Admission(False, 0.5, 1, 2.0, "ttft")  # TTFT is checked first


def test_admission_learns_a_correction_from_measured_ttft() -> None:
    admission = SloAdmission(1.0)
    admission.observe(0.5, 1.0)  # twice as slow as predicted: 5% of log(2)
    assert admission.correction == pytest.approx(2**0.05, rel=1e-12)
    assert admission.check(0.97).ok is False  # 0.97 x 1.035 > 1
    for _ in range(500):
        admission.observe(0.1, 10.0)
    assert admission.correction == pytest.approx(4.0, rel=1e-12)  # clamped
    for _ in range(500):
        admission.observe(10.0, 0.1)
    assert admission.correction == pytest.approx(0.25, rel=1e-12)
    off = SloAdmission(1.0, feedback=False)
    off.observe(0.5, 1.0)
    assert off.correction == 1.0


def test_decode_step_correction_from_heartbeats() -> None:
    admission = SloAdmission(None, tbt_slo_s=1.0)
    admission.observe_steps("decode-0", 0.0, 10, 0.1)
    admission.observe_steps("decode-0", 1.0, 15, 0.1)  # 5 steps in 1 s: 0.2 s each, twice the profile's
    assert admission.step_correction("decode-0") == pytest.approx(2**0.3, rel=1e-12)
    assert admission.step_correction("decode-1") == 1.0
    refused = admission.check(None, 0.9, decode_worker_id="decode-0")  # 0.9 x 1.23 > 1
    assert (refused.ok, refused.missed) == (False, "tbt")
    assert admission.check(None, 0.9, decode_worker_id="decode-1").ok
    admission.observe_steps("decode-0", 2.0, 16, 0.1)  # one step: says too little
    admission.observe_steps("decode-0", 3.0, 30, None)  # idle at this beat: no batch to compare with
    assert admission.step_correction("decode-0") == pytest.approx(2**0.3, rel=1e-12)
    admission.observe_steps("decode-0", 4.0, 3, 0.1)  # restarted: its step count began anew, and its clock
    assert admission.step_correction("decode-0") == 1.0
    admission.observe_steps("decode-0", 5.0, 13, 0.05)  # 0.1 s a step against 0.075 predicted on average
    assert admission.step_correction("decode-0") == pytest.approx((0.1 / 0.075) ** 0.3, rel=1e-12)
    admission.forget("decode-0")
    assert admission.step_correction("decode-0") == 1.0


def test_admission_slo_needs_a_profile(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = EngineConfig(max_num_batched_tokens=256)
    missing = str(tmp_path / "none.json")
    with pytest.raises(ValueError, match="does not exist"):
        load_predictor(RouterConfig(admission="slo", cost_profile=missing), engine)
    with pytest.raises(ValueError, match=r"set router\.cost_profile"):
        load_predictor(RouterConfig(admission="slo"), engine)
    assert load_predictor(RouterConfig(), engine) is None  # never picked up implicitly
    with pytest.raises(ValueError, match="needs a cost profile"):
        Router(RouterConfig(admission="slo"), new_secret())
    path = tmp_path / "p.json"
    CONSTANT.save(path)
    predictor = load_predictor(RouterConfig(cost_profile=str(path), tbt_slo_ms=50.0), engine)
    assert predictor == Predictor(CONSTANT, 256, 0.05)
    monkeypatch.setenv("PDSERVE_PROFILE", str(path))
    assert load_predictor(RouterConfig(cost_profile="default"), engine) == Predictor(CONSTANT, 256, None)
    with pytest.raises(ValueError, match="ttft_slo_ms must be > 0"):
        RouterConfig(ttft_slo_ms=0.0)
    with pytest.raises(ValueError, match="admission must be one of"):
        RouterConfig(admission="maybe")


def test_admission_flags_over_the_yaml() -> None:
    import argparse

    from deploy.cli_args import add_cluster_arguments, build_config

    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    flags = ["--admission", "slo", "--ttft-slo-ms", "500", "--tbt-slo-ms", "40", "--cost-profile", "default"]
    router = build_config(parser.parse_args(flags)).router
    assert (router.admission, router.ttft_slo_ms, router.tbt_slo_ms, router.cost_profile) == (
        "slo",
        500.0,
        40.0,
        "default",
    )
    with pytest.raises(ValueError, match="admission must be one of"):
        build_config(parser.parse_args(["--admission", "always"]))


def test_a_tensor_parallel_pool_is_predicted_at_its_size(tmp_path: Any) -> None:
    from deploy.planner.profiles import HARDWARE, ModelShape, roofline_profile

    roofline = roofline_profile(HARDWARE["h100"], ModelShape.from_config("bench/configs/llama-3-8b"))
    path = tmp_path / "roofline.json"
    roofline.save(path)
    engine = EngineConfig(max_num_batched_tokens=256, tensor_parallel_size=2)
    predictor = load_predictor(RouterConfig(cost_profile=str(path)), engine)
    assert predictor == Predictor(roofline.with_tensor_parallel(2), 256, None)
    assert predictor.profile != roofline
    CONSTANT.save(path)  # a measured profile knows one size only: said at start, not mispredicted
    with pytest.raises(ValueError, match="tensor"):
        load_predictor(RouterConfig(cost_profile=str(path)), engine)

"""``pdserve plan validate`` of a mock cluster: the profile's host terms, the mock probe's fits
(deploy/plan/fit_mock.py) and validate's cluster options."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cluster.cost_model import CostProfile, LinearStepCost, StepShape, TransferCost
from cluster.protocol import StepSplit, TransferStats
from deploy.loadgen import Record, Scenario
from deploy.plan.fit_mock import (
    PhaseRun,
    fit_decode_host,
    fit_frontend_in_order,
    fit_loaded_transfer,
    fit_prompt_host,
    fit_spinning_scale,
    nonnegative_lstsq,
    twin_transfer_s,
)
from deploy.plan.harness import EngineTotals
from deploy.plan.inputs import load_cluster_config, twin_config
from deploy.plan.mock_probe import steady_scenario
from deploy.plan.probe_loads import decode_scenario
from deploy.planner.sim import Simulation
from deploy.planner.twin import SimWorker

STEP = LinearStepCost(0.004, 1e-5, 0.0, 1e-4, 0.0, 0.0)


FAST = TransferCost(0.002, 1e9)


def make_profile(transfer: TransferCost = FAST, **kw: float) -> CostProfile:
    return CostProfile("t", "hand-made", STEP, transfer, 2048, **kw)  # type: ignore[arg-type]


def test_host_terms_add_to_every_step_that_computes_something(tmp_path: Path) -> None:
    prof = make_profile(host_step_s=0.001, host_decode_s=2e-5, host_chunk_s=3e-4, host_token_s=1e-6)
    shape = StepShape(100, 2, 8, 4000, 5000, 6000)
    own = STEP.step_s(shape)
    assert prof.step_s(shape) == pytest.approx(own + 0.001 + 8 * 2e-5 + 2 * 3e-4 + 100 * 1e-6, rel=1e-12)
    assert prof.step_s(StepShape()) == 0.0
    assert replace(prof, step_scale=2.0).step_s(shape) == pytest.approx(prof.step_s(shape) + own, rel=1e-12)
    full = replace(prof, host_transfer_s=0.002, frontend_fifo=True, spinning_transfer_scale=2.5)
    full.save(tmp_path / "p.json")
    assert CostProfile.load(tmp_path / "p.json") == full


def test_nonnegative_least_squares() -> None:
    design = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert nonnegative_lstsq(design, design @ np.array([0.5, 0.25])) == pytest.approx([0.5, 0.25])
    # the unconstrained fit wants a negative slope: the best fit of the intercept alone
    assert nonnegative_lstsq(design, np.array([3.0, 2.0, 1.0])) == pytest.approx([2.0, 0.0])


def records_with_edges(edges_ms: list[float]) -> list[Record]:
    return [Record(16, 2, ttft_s=0.040 + e / 1e3, server={"ttft_s": 0.040}) for e in edges_ms]


def test_a_front_end_in_order_routes_a_burst_per_request_apart() -> None:
    # edge times 4 ms apart in a burst of 8 (whatever they start at), 6 ms in one of 32: the least, 4 ms
    bursts = [
        records_with_edges([20 + 4 * i for i in range(8)]),
        records_with_edges([30 + 6 * i for i in range(32)]),
    ]
    assert fit_frontend_in_order(bursts) == pytest.approx(0.004)
    # in any order the records come; failed ones and lone requests say nothing
    shuffled = records_with_edges([8.0, 0.0, 4.0])
    assert fit_frontend_in_order(
        [shuffled, [Record(16, 2, error="boom")] * 4, records_with_edges([9.0])]
    ) == (pytest.approx(0.004))
    assert fit_frontend_in_order([]) == 0.0


def phase(
    name: str,
    scenario: Scenario,
    seed: int = 1,
    *,
    totals: dict[str, EngineTotals] | None = None,
    split: StepSplit | None = None,
    received: TransferStats | None = None,
    records: list[Record] | None = None,
) -> PhaseRun:
    return PhaseRun(
        name, scenario, seed, records or [], totals or {}, split or StepSplit(), received or TransferStats()
    )


def test_the_handoffs_bandwidth_in_place_keeps_the_idle_latency() -> None:
    idle = TransferCost(0.010, 2e9)
    # 10 handoffs of 40 MB in 1.1 s: 0.1 s of latency, 400 MB in 1 s
    loaded = [
        phase(
            "a",
            decode_scenario(8),
            received=TransferStats(num_ok=10, bytes_total=400_000_000, seconds_total=1.1),
        )
    ]
    assert fit_loaded_transfer(idle, loaded) == TransferCost(0.010, pytest.approx(4e8))
    assert fit_loaded_transfer(idle, [phase("b", decode_scenario(8))]) == idle


def test_the_prompts_host_terms_from_prompts_sent_one_at_a_time() -> None:
    # each idle phase: 4 prompts of n tokens alone in their steps (budget 1024 cuts 2048 in two); the
    # prefill pool measured the profile's seconds + 1 ms a step + 0.3 ms a chunk + 0.5 us a token
    prof = make_profile(host_step_s=0.001)
    idle = []
    for n in (16, 256, 2048):
        chunks = 4 * -(-n // 1024)
        own = 4 * sum(
            STEP.step_s(StepShape(c, 1, 0, 0, 0, 0)) for c in ([n] if n <= 1024 else [1024, n - 1024])
        )
        seconds = own + chunks * (0.001 + 3e-4) + 4 * n * 5e-7
        done = [Record(n, 2) for _ in range(4)]
        idle.append(
            phase(
                f"p{n}",
                Scenario(4, (n, n), (2, 2)),
                totals={"prefill": EngineTotals(chunks, seconds, 4)},
                records=done,
            )
        )
    chunk_s, token_s = fit_prompt_host(prof, idle, "prefill", 1024)
    assert (chunk_s, token_s) == (pytest.approx(3e-4), pytest.approx(5e-7))


def twin_split(cfg, prof: CostProfile, workload) -> StepSplit:  # type: ignore[no-untyped-def]
    """The decode pool's steps in the twin of ``cfg`` under ``prof``, as a worker's split counts them
    (no transfer finishes beside a step in these loads' twin: the handoff costs are 0)."""
    split = StepSplit()

    def on_step(w: SimWorker, t: float, shape: StepShape, step_s: float) -> None:
        if w.pool == "decode":
            split.count(step_s, shape.num_decode_seqs, shape.num_prefill_tokens, 0)

    Simulation(twin_config(cfg, prof, 2048), prof, workload, on_step=on_step).run()
    return split


def test_the_decode_host_terms_through_the_twin() -> None:
    # the probe's decode phases (2, 8 and 32 streams after 256-token prompts, 8 and 32 after 16-token
    # ones) "measured" by the twin itself with 0.8 ms a step, 20 us a decode sequence and 1.5 ms a step
    # beside a transfer: three rounds find them again (one falls short: which steps begin beside a
    # transfer moves with the terms)
    cfg = load_cluster_config("deploy/cpu-disagg.yaml")
    prof = make_profile(TransferCost(0.002, 2e7))
    truth = replace(prof, host_step_s=8e-4, host_decode_s=2e-5, host_transfer_s=0.0015)
    loads = [(decode_scenario(2, 8), 3), (decode_scenario(8, 4), 1), (decode_scenario(32), 2)]
    loads += [(steady_scenario(8), 4), (steady_scenario(32), 5)]
    phases = []
    for scenario, seed in loads:
        workload = phase("d", scenario, seed).workload(1000, 2048)
        phases.append(phase("d", scenario, seed, split=twin_split(cfg, truth, workload)))
    assert fit_decode_host(cfg, prof, phases, 1000, 2048) == (
        pytest.approx(8e-4, rel=1e-6),
        pytest.approx(2e-5, rel=1e-6),
        pytest.approx(0.0015, rel=1e-6),
    )
    assert fit_decode_host(cfg, prof, phases, 1000, 2048, rounds=1)[2] != pytest.approx(0.0015, rel=0.01)
    assert fit_decode_host(cfg, prof, [], 1000, 2048) == (0.0, 0.0, 0.0)


def test_the_spinning_scale_through_the_twin() -> None:
    # a burst of 1024-token prompts holding more KV than the prefill worker has (96 usable blocks): its
    # handoffs "measured" by the twin itself 3x slower beside a spinning worker; the fit finds 3 again,
    # and 1 where the burst fits
    cfg = load_cluster_config("deploy/cpu-disagg.yaml")
    prof = make_profile(TransferCost(0.002, 5e8))
    small = replace(cfg, engine={**cfg.engine, "num_kv_blocks": 97})
    burst = Scenario(8, (1024, 1024), (2, 2))
    workload = phase("s", burst, 5).workload(1000, 2048)
    seconds, _ = twin_transfer_s(small, replace(prof, spinning_transfer_scale=3.0), workload, 2048)
    spin = phase("s", burst, 5, received=TransferStats(num_ok=8, seconds_total=seconds))
    assert fit_spinning_scale(small, prof, spin, 1000, 2048) == pytest.approx(3.0, rel=0.05)
    plain, spinning = twin_transfer_s(cfg, prof, workload, 2048)
    assert spinning == 0.0
    fits = phase("s", burst, 5, received=TransferStats(num_ok=8, seconds_total=plain))
    assert fit_spinning_scale(cfg, prof, fits, 1000, 2048) == 1.0


def test_validate_takes_the_serve_flags_and_the_mock_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deploy.plan.inputs import mock_step_profile
    from deploy.plan.validate import validate_command
    from deploy.planner.profiles import HARDWARE, ModelShape, roofline_profile

    monkeypatch.setenv("PDSERVE_PROFILE", str(tmp_path / "cpu-profile.json"))
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    import argparse

    from deploy.cli_args import add_cluster_arguments, build_config

    model = "bench/configs/llama-3-8b"
    p = argparse.ArgumentParser()
    add_cluster_arguments(p)
    args = p.parse_args(
        [model, "--config", "deploy/mock-cluster.yaml", "--gpu", "h100", "--num-decode-workers", "1"]
    )
    cfg = build_config(args)
    assert (cfg.prefill.num_workers, cfg.decode.num_workers) == (8, 1)
    estimate = roofline_profile(HARDWARE["h100"], ModelShape.from_config(model))
    nic = TransferCost(estimate.transfer.latency_s, estimate.transfer.bytes_per_s, 50e9)  # the H100's NIC
    assert mock_step_profile(cfg) == replace(estimate, transfer=nic)
    assert mock_step_profile(load_cluster_config("deploy/cpu-disagg.yaml")) is None
    # a mock cluster without a profile to wait, and --gpu without a mock engine: refused before anything
    # starts
    for argv in (["--config", "deploy/mock-cluster.yaml"], ["--gpu", "h100"]):
        with pytest.raises(SystemExit) as e:
            validate_command(argv)
        assert e.value.code == 2

"""The planner end to end: workloads, summaries, the split search, ``pdserve plan``, and that the twin
runs the engine's own classes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import cluster.router.handoff
import cluster.router.placement
import cluster.router.router
import cluster.router.routing
import workers.engine
import workers.scheduler
from cluster.cost_model import CostProfile, LinearStepCost, TransferCost
from cluster.router.predict import TrafficLog
from deploy.cli import main as cli_main
from deploy.planner import sim, twin
from deploy.planner.advice import advise, traffic_workload
from deploy.planner.report import Percentiles, Slo, Summary, summarize
from deploy.planner.search import PlanRow, recommend, search, splits
from deploy.planner.sim import RequestRecord
from deploy.planner.twin import SimConfig
from deploy.planner.workload import load_trace, poisson
from workers.block_manager import KVCacheManager

PROFILE = CostProfile(
    "t", "hand", LinearStepCost(0.002, 5e-5, 0.0, 1e-4, 1e-7, 0.0), TransferCost(0.002, 1e9), 2048
)


def test_the_twin_runs_the_engines_own_scheduler_and_the_routers_policy() -> None:
    assert twin.Scheduler is workers.engine.Scheduler is workers.scheduler.Scheduler
    worker = twin.SimWorker("w", "colocated", SimConfig("colocated", num_colocated=1))
    assert type(worker.scheduler) is workers.engine.Scheduler
    assert type(worker.scheduler.kv) is KVCacheManager
    # the route decision (cluster/router/routing.py) and the handoff's decode pick are the router's own
    assert sim.decide is cluster.router.routing.decide is cluster.router.router.decide
    assert sim.pick_decode is cluster.router.placement.pick_decode is cluster.router.handoff.pick_decode
    for name in ("explain_prefill", "pick_decode", "pick_least_loaded"):
        assert getattr(cluster.router.routing, name) is getattr(cluster.router.placement, name)


def test_poisson_workload_is_seeded_and_bounded() -> None:
    a = poisson(5.0, 50, (10, 20), (3, 6), seed=7, vocab_size=500, max_model_len=24)
    b = poisson(5.0, 50, (10, 20), (3, 6), seed=7, vocab_size=500, max_model_len=24)
    assert a.requests == b.requests
    assert [a.prompt_tokens(i) for i in range(50)] == [b.prompt_tokens(i) for i in range(50)]
    assert a.requests != poisson(5.0, 50, (10, 20), (3, 6), seed=8, vocab_size=500).requests
    arrivals = [r.arrival_s for r in a.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert all(10 <= r.prompt_len + r.output_len <= 24 and 3 <= r.output_len <= 6 for r in a.requests)
    assert all(len(a.prompt_tokens(i)) == r.prompt_len for i, r in enumerate(a.requests))


def test_prefix_groups_share_their_first_tokens() -> None:
    wl = poisson(5.0, 40, (40, 60), (2, 2), seed=1, num_prefix_groups=2, prefix_len=32)
    by_group: dict[int | None, list[list[int]]] = {}
    for i, r in enumerate(wl.requests):
        by_group.setdefault(r.prefix_group, []).append(wl.prompt_tokens(i))
    assert sorted(by_group) == [0, 1]
    heads = {g: {tuple(p[:32]) for p in ps} for g, ps in by_group.items()}
    assert [len(h) for h in heads.values()] == [1, 1] and heads[0] != heads[1]
    tails = [tuple(p[32:]) for ps in by_group.values() for p in ps]
    assert len(set(tails)) == len(tails)


def test_trace_files(tmp_path: Path) -> None:
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(
        '{"arrival_s": 0.5, "prompt_len": 10, "output_len": 4}\n'
        '{"arrival_s": 0.1, "prompt_len": 20, "output_len": 2, "prefix_group": 3, "prefix_len": 16}\n'
    )
    wl = load_trace(jsonl)
    assert [(r.arrival_s, r.prompt_len, r.output_len, r.prefix_group) for r in wl.requests] == [
        (0.1, 20, 2, 3),
        (0.5, 10, 4, None),
    ]
    csv = tmp_path / "t.csv"
    csv.write_text("arrival_s,prompt_len,output_len,prefix_group,prefix_len\n0,8,2,,\n1.5,9,3,1,4\n")
    assert [(r.prompt_len, r.prefix_group, r.prefix_len) for r in load_trace(csv).requests] == [
        (8, None, 0),
        (9, 1, 4),
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_len": 5, "output_len": 1, "tokens": 3}\n')
    with pytest.raises(ValueError, match=r"request 0: unknown field\(s\) \['tokens'\]"):
        load_trace(bad)


def record(ttft: float | None, gaps: list[float], rejected: str | None = None) -> RequestRecord:
    r = RequestRecord(10, len(gaps) + 1, send_s=0.0, rejected=rejected)
    if ttft is not None:
        r.first_token_s = ttft
        r.gaps_s.extend(gaps)
        r.finish_s = ttft + sum(gaps)
        r.num_tokens = len(gaps) + 1
    return r


def test_summary_counts_rejections_as_misses() -> None:
    records = [
        record(0.5, [0.05, 0.05]),  # in
        record(1.5, [0.05]),  # TTFT out
        record(0.2, [0.05, 0.25]),  # mean gap 150 ms: out
        record(None, [], rejected="queue_full"),
    ]
    s = summarize("x", records, 2.0, Slo(1000.0, 100.0))
    assert (s.num_requests, s.num_rejected) == (4, 1)
    assert s.slo_attainment == 0.25
    assert s.goodput_rps == 0.5
    assert s.ttft_ms.p50 == pytest.approx(500.0)
    assert s.tbt_ms.p50 == pytest.approx(50.0)
    assert not s.meets_slo
    assert summarize("y", records[:1], 1.0, Slo(1000.0, 100.0)).meets_slo


def test_search_covers_colocated_and_every_split() -> None:
    assert splits(4) == [(1, 3), (2, 2), (3, 1)]
    base = SimConfig("disaggregated", num_prefill=1, num_decode=1, num_kv_blocks=512, max_model_len=1024)
    wl = poisson(20.0, 60, (32, 256), (8, 32), seed=0, vocab_size=1000)
    rows = search(base, [2, 3], PROFILE, wl, Slo(200.0, 50.0))
    assert [r.config.label for r in rows] == ["colocated x2", "1P:1D", "colocated x3", "1P:2D", "2P:1D"]
    assert all(r.summary.num_requests == 60 and r.summary.num_rejected == 0 for r in rows)


def summary(label: str, meets: bool, goodput: float, attainment: float = 1.0) -> Summary:
    p = Percentiles(1.0, 2.0, 3.0)
    return Summary(label, 10, 0, 1.0, p, p, p, attainment, goodput, 100.0, meets)


def test_recommendation_rule() -> None:
    base = SimConfig("colocated", num_colocated=2)

    def row(cfg: SimConfig, meets: bool, goodput: float, attainment: float = 1.0) -> PlanRow:
        return PlanRow(cfg, summary(cfg.label, meets, goodput, attainment), None)  # type: ignore[arg-type]

    rows = [
        row(base, False, 9.0, 0.9),
        row(base.split(1, 1), True, 7.0),
        row(base.colocated(3), True, 9.5),
        row(base.split(2, 1), True, 9.9),
    ]
    # the fewest workers that meet the SLO, before more goodput on more workers
    assert recommend(rows).config.label == "1P:1D"
    assert recommend([rows[2], rows[3]]).config.label == "2P:1D"
    # none meets it: the most goodput, then attainment
    misses = [
        row(base, False, 5.0, 0.5),
        row(base.split(1, 1), False, 5.0, 0.6),
        row(base.colocated(3), False, 4.0),
    ]
    assert recommend(misses).config.label == "1P:1D"


def test_pdserve_plan_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile_path = tmp_path / "profile.json"
    PROFILE.save(profile_path)
    out = tmp_path / "plan"
    argv = ["plan", "--profile", str(profile_path), "--workload", "poisson:10", "--num-requests", "40"]
    argv += ["--prompt-len", "32", "256", "--output-len", "8", "32", "--workers", "2", "--out", str(out)]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    result = json.loads((out / "plan.json").read_text())
    labels = [row["label"] for row in result["rows"]]
    assert labels == ["colocated x2", "1P:1D"]
    assert result["recommended"] in labels
    assert any(line.startswith(f"recommended: {result['recommended']} -- ") for line in printed)
    assert (out / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_traffic_log_window_and_bound() -> None:
    log = TrafficLog(window_s=10.0, max_entries=3)
    for t in (1.0, 2.0, 3.0, 4.0):
        log.record(t, 100, 10)
    assert [e.arrival_s for e in log.snapshot(now=5.0)] == [2.0, 3.0, 4.0]  # bounded to the last 3
    assert [e.arrival_s for e in log.snapshot(now=13.5)] == [4.0]  # older than 10 s dropped
    assert len(log) == 1


def test_live_advice_replays_recent_traffic() -> None:
    log = TrafficLog(window_s=60.0)
    wl = poisson(10.0, 50, (32, 256), (8, 32), seed=3)
    for r in wl.requests:
        log.record(1000.0 + r.arrival_s, r.prompt_len, r.output_len)
    entries = log.snapshot(now=1000.0 + wl.duration_hint_s)
    current = SimConfig("disaggregated", num_prefill=1, num_decode=1, num_kv_blocks=512, max_model_len=1024)
    advice = advise(entries, current, PROFILE, Slo(500.0, 50.0), vocab_size=1000)
    assert (advice.num_requests, advice.current) == (50, "1P:1D")
    assert advice.window_s == pytest.approx(wl.requests[-1].arrival_s - wl.requests[0].arrival_s)
    assert advice.recommended in {"colocated x2", "1P:1D"}
    replay = traffic_workload(entries, 1000, 1024)
    assert [(r.prompt_len, r.output_len) for r in replay.requests] == [
        (r.prompt_len, r.output_len) for r in wl.requests
    ]
    rows = search(current, [2], PROFILE, replay, Slo(500.0, 50.0))
    by_label = {r.config.label: r.summary for r in rows}
    assert advice.current_slo_attainment == by_label["1P:1D"].slo_attainment
    assert advice.recommended_goodput_rps == by_label[advice.recommended].goodput_rps


def test_large_budgets_search_a_coarse_grid_then_refine() -> None:
    base = SimConfig("disaggregated", num_prefill=1, num_decode=1, num_kv_blocks=256, max_model_len=512)
    wl = poisson(50.0, 12, (16, 64), (2, 4), seed=0, vocab_size=1000)
    rows = search(base, [20], PROFILE, wl, Slo(), include_colocated=False)
    prefills = [r.config.num_prefill for r in rows]
    coarse = list(range(2, 20, 2))
    assert prefills[: len(coarse)] == coarse
    refined = prefills[len(coarse) :]
    assert refined and all(p % 2 == 1 for p in refined) and len(set(prefills)) == len(prefills)
    best_coarse = min(
        rows[: len(coarse)],
        key=lambda r: (-r.summary.goodput_rps, -r.summary.slo_attainment, r.summary.ttft_ms.p90),
    )
    assert all(abs(p - best_coarse.config.num_prefill) == 1 for p in refined)


def test_validate_writes_each_request_as_a_row() -> None:
    from deploy.plan.validate import request_rows

    served = RequestRecord(10, 5, send_s=1.0, first_token_s=1.0125, num_tokens=3)
    served.gaps_s.extend([0.002, 0.004])
    refused = RequestRecord(7, 2, send_s=0.0, rejected="too_long")
    assert request_rows([served, refused]) == [
        [10, 5, 12.5, 3.0, 3, [2.0, 4.0]],
        [7, 2, None, 0.0, 0, []],
    ]


def test_validate_pools_the_twin_over_both_probes_profiles() -> None:
    """`plan validate --probes 2`: each workload's runs are simulated with the probe's profile before the
    real runs and the one after; the table's sim column pools both, and each profile's own figures are
    exactly what it gives alone."""
    from dataclasses import replace

    from deploy.plan.inputs import load_cluster_config
    from deploy.plan.validate import twin_side, validation_workloads

    cfg = load_cluster_config("deploy/cpu-disagg.yaml")
    slower = replace(PROFILE, step=LinearStepCost(0.004, 1e-4, 0.0, 2e-4, 2e-7, 0.0))
    runs = validation_workloads("smoke", [11, 12], 1000, 512)
    slo = Slo(1000.0, 100.0)
    both = twin_side(cfg, [PROFILE, slower], runs, 512, slo, "decode")
    alone = [twin_side(cfg, [p], runs, 512, slo, "decode") for p in (PROFILE, slower)]
    assert both.per_profile == [a.pooled for a in alone]
    assert both.records == alone[0].records + alone[1].records
    assert len(both.records) == 2 * sum(len(w) for w in runs)
    # the prefill workers' busy seconds per profile (as the real runs' sum), the steps' mean over both
    prefill = [a.diagnostics["sim_prefill_s"] for a in alone]
    assert both.diagnostics["sim_prefill_s"] == pytest.approx(sum(prefill) / 2)
    assert prefill[1] > prefill[0] > 0.0
    fast, slow = (a.diagnostics["sim_step_ms"] for a in alone)
    assert fast < both.diagnostics["sim_step_ms"] < slow
    # the pooled TTFT p90 lies between the two profiles' own
    assert alone[0].pooled.ttft_ms.p90 <= both.pooled.ttft_ms.p90 <= alone[1].pooled.ttft_ms.p90

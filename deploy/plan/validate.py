"""``pdserve plan validate``: hold the simulation against the real cluster on the same seeded workloads.

    pdserve plan validate --config deploy/cpu-disagg.yaml [--profile P.json] [--workloads ...] [--runs N]
    pdserve plan validate bench/configs/llama-3-8b --config deploy/mock-cluster.yaml --gpu h100 \
        --num-prefill-workers 1 --num-decode-workers 1 --num-kv-blocks 1024       # at GPU rates

The cluster is ``pdserve serve``'s: its config, MODEL and override flags (deploy/cli_args.py). A mock
cluster (``load_format: mock``, with ``--gpu NAME`` or ``--cost-profile``) waits a known cost profile
each step, so it is not calibrated: the mock probe (deploy/plan/mock_probe.py) fits what surrounds the
steps over that profile, and what is validated is the twin's model of queues, routing, handoffs and the
front end at GPU rates.

Starts the cluster (HTTP on a free loopback port), calibrates on it (the engine sweep in
a Ray worker, then the probe of deploy/plan/probe.py) unless ``--profile`` is given, runs every
workload through the HTTP API (the load generator, deploy/loadgen.py: the six scenarios and two Poisson
rates, seeded), shuts it down, simulates each workload with the profile, and prints a table whose last
line is ``sim vs real: max TTFT p90 error X%, max TBT p90 error Y%, max SLO attainment error Z points``.
With ``--runs N`` (3 unless told) each workload runs N times (other seeds, so other prompts) on both
sides and the percentiles are of the pooled requests; each real run's TTFT p90 is printed too. NOTE: 3
because the real side of one run alone moves more than the goal from one validation to the next: over
twelve validations of this 2-core box, one run's real sides differed by a median of 33% on TBT p90,
three runs' by 23% (``pdserve plan spread``).

With ``--probes 2`` (the default) the probe runs again after the real runs, and the sim runs every
workload with both probes' profiles and pools their requests: the real runs take ~10 minutes, and this
shared box's speed drifts over that time (the same workload's real decode steps moved 10-20% between
validations), so one probe before them samples one moment of it; two bracket it. Each profile's own
figures are printed above the table. Writes ``<out>/validate.json`` (with every request's TTFT and mean
TBT on both sides, the runs, seeds and SLO) and ``<out>/profile.json`` (``profile-after.json`` for the
second probe). ``pdserve plan spread`` holds the real sides of several such files against each other
(deploy/plan/spread.py): the same seeded workloads measured again, the floor under these figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig
from cluster.cost_model import CostProfile
from deploy.cli_args import add_cluster_arguments, build_config
from deploy.loadgen import SCENARIOS, ClientSettings, Record, Scenario, run_scenario
from deploy.plan.calibrate import calibrate_profile, mock_probe_and_report, probe_and_report
from deploy.plan.figures import error_pct, figures
from deploy.plan.harness import EngineTotals, running_cluster
from deploy.plan.inputs import cpu_kv_blocks, mock_step_profile, scenario_workload, workload_of
from deploy.planner.report import Slo, Summary, summarize
from deploy.planner.search import simulate
from deploy.planner.sim import RequestRecord
from deploy.planner.twin import SimConfig
from deploy.planner.workload import Workload

# The two Poisson rates validate runs besides the six scenarios (a light and a busy load for 1P:1D on CPU).
POISSON = {
    "poisson_light": Scenario(64, (64, 512), (32, 128), request_rate=2.0),
    "poisson_busy": Scenario(96, (64, 512), (32, 128), request_rate=6.0),
}
WORKLOADS = {**SCENARIOS, **POISSON}
_SEED_BASE = 1_000_000  # validation seeds start past the probe's (seed x 1000 + 1 ...)
_RUN_STRIDE = 10_000  # between one run's seeds and the next's


def as_records(records: Sequence[Record]) -> list[RequestRecord]:
    """The benchmark's client records in the simulator's terms (send time 0, times relative to it)."""
    out = []
    for r in records:
        rec = RequestRecord(r.prompt_len, r.max_tokens, send_s=0.0)
        if r.error is not None or r.ttft_s is None:
            rec.rejected = r.error or "no token"
        else:
            rec.first_token_s = r.ttft_s
            rec.finish_s = r.e2e_s
            rec.gaps_s.extend(r.tbt_s)
            rec.num_tokens = r.output_tokens
        out.append(rec)
    return out


def request_rows(records: Sequence[RequestRecord]) -> list[list[Any]]:
    """Each request as ``[prompt_len, output_len, TTFT ms, mean TBT ms, tokens, [gap ms, ...]]``
    (validate.json's "requests", in send order per run; TTFT None: rejected or no token), for comparing
    the distributions behind a percentile or an attainment gap: the TBT percentiles pool the gaps."""
    return [
        [
            r.prompt_len,
            r.output_len,
            None if r.ttft_s is None else round(r.ttft_s * 1e3, 3),
            round(r.mean_tbt_s * 1e3, 3),
            r.num_tokens,
            [round(g * 1e3, 3) for g in r.gaps_s],
        ]
        for r in records
    ]


# ---- validation ---------------------------------------------------------------------------------------
def validation_workload(name: str, vocab_size: int, max_model_len: int, seed: int) -> Workload:
    if name in SCENARIOS:
        return scenario_workload(name, vocab_size, max_model_len, seed)
    return workload_of(name, POISSON[name], vocab_size, max_model_len, seed)


def validation_workloads(
    name: str, run_seeds: Sequence[int], vocab_size: int, max_model_len: int
) -> list[Workload]:
    return [validation_workload(name, vocab_size, max_model_len, seed) for seed in run_seeds]


@dataclass
class TwinSide:
    """The twin's side of one workload's row: its runs simulated with each profile, pooled (`pooled`,
    `records`) and per profile (`per_profile`), and the diagnostics (the pool's mean step and batch over
    all of them; the prefill workers' busy seconds per profile, as the real runs' sum)."""

    pooled: Summary
    per_profile: list[Summary]
    records: list[RequestRecord]
    diagnostics: dict[str, float]


def twin_side(
    cfg: ClusterConfig,
    profiles: Sequence[CostProfile],
    runs: Sequence[Workload],
    max_model_len: int,
    slo: Slo,
    pool: str,
) -> TwinSide:
    """Simulate every run of one workload (`runs`, one name) with every profile, the twin's context as
    long as the real cluster's `max_model_len`; `pool`: the workers the step figures are of."""
    name = runs[0].name
    per_profile: list[Summary] = []
    results = []
    for profile in profiles:
        base = SimConfig.from_cluster(
            cfg, num_kv_blocks=cpu_kv_blocks(cfg, profile), max_model_len=max_model_len
        )
        mine = [simulate(base, profile, workload, slo).result for workload in runs]
        records = [r for res in mine for r in res.records]
        per_profile.append(summarize(name, records, sum(res.duration_s for res in mine), slo))
        results += mine
    busy: dict[str, float] = {}
    steps: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for result in results:
        for w, v in result.worker_busy_s.items():
            busy[w] = busy.get(w, 0.0) + v
            steps[w] = steps.get(w, 0) + result.worker_steps[w]
            tokens[w] = tokens.get(w, 0) + result.worker_tokens[w]
    ids = [w for w in steps if w.startswith(pool)]
    num_steps = max(1, sum(steps[w] for w in ids))
    diagnostics = {
        "sim_step_ms": sum(busy[w] for w in ids) / num_steps * 1e3,
        "sim_batch": sum(tokens[w] for w in ids) / num_steps,
    }
    if pool == "decode":
        prefill_s = sum(v for w, v in busy.items() if w.startswith("prefill"))
        diagnostics["sim_prefill_s"] = prefill_s / max(1, len(profiles))
    records = [r for res in results for r in res.records]
    pooled = summarize(name, records, sum(res.duration_s for res in results), slo)
    return TwinSide(pooled, per_profile, records, diagnostics)


def comparison(rows: list[tuple[str, Summary, Summary]], slo: Slo) -> str:
    head = (
        f"{'workload':<15} {'TTFT p90 real':>13} {'sim':>9} {'err':>7} {'TBT p90 real':>12} {'sim':>7} {'err':>7} "
        f"{'in SLO real':>11} {'sim':>6} {'diff':>6}"
    )
    lines = [
        f"SLO: TTFT <= {slo.ttft_ms:g} ms and mean TBT <= {slo.tbt_ms:g} ms per request; latency in ms",
        head,
    ]
    for name, real, sim in rows:
        lines.append(
            f"{name:<15} {real.ttft_ms.p90:13.1f} {sim.ttft_ms.p90:9.1f} {error_pct(sim.ttft_ms.p90, real.ttft_ms.p90):6.1f}% "
            f"{real.tbt_ms.p90:12.1f} {sim.tbt_ms.p90:7.1f} {error_pct(sim.tbt_ms.p90, real.tbt_ms.p90):6.1f}% "
            f"{real.slo_attainment:11.1%} {sim.slo_attainment:6.1%} {abs(sim.slo_attainment - real.slo_attainment) * 100:6.1f}"
        )
    return "\n".join(lines)


def diagnostics_table(diagnostics: dict[str, dict[str, float]], pool: str, profile: CostProfile) -> str:
    """Where a gap comes from: the engines' own step time and batch (real: their stats; sim: the twin),
    the prefill workers' busy seconds in a disaggregated cluster, and the front end's CPU per streamed
    token in each run (the probe's figure is what the sim used)."""
    prefill = all("real_prefill_s" in d for d in diagnostics.values())
    lines = [
        f"{pool} workers, per step (real: engine stats)    front end CPU per token (probe: "
        f"{profile.frontend_cpu_per_token_s * 1e6:.0f} us)"
        + ("    prefill workers' busy seconds" if prefill else ""),
        f"{'workload':<15} {'step ms real':>12} {'sim':>7} {'batch real':>10} {'sim':>6} {'front end us':>13}"
        + (f" {'prefill s real':>14} {'sim':>6}" if prefill else ""),
    ]
    for name, d in diagnostics.items():
        lines.append(
            f"{name:<15} {d['real_step_ms']:12.1f} {d['sim_step_ms']:7.1f} {d['real_batch']:10.1f} "
            f"{d['sim_batch']:6.1f} {d['real_frontend_us']:13.0f}"
            + (f" {d['real_prefill_s']:14.2f} {d['sim_prefill_s']:6.2f}" if prefill else "")
        )
    return "\n".join(lines)


def validate_command(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(prog="pdserve plan validate", description="simulation vs the real cluster")
    # NOTE: the cluster is `pdserve serve`'s: its config, MODEL and override flags (--gpu, --load-format,
    # --num-prefill-workers, ...), and the twin reads the very same ClusterConfig
    add_cluster_arguments(p)
    p.add_argument(
        "--profile", default=None, help="use this profile (default: calibrate + probe now; mock: probe now)"
    )
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--runs",
        type=int,
        default=3,
        help="run each workload this many times (other seeds); pool them (fewer: the real side alone "
        "moves more than the goal between validations; see pdserve plan spread)",
    )
    p.add_argument(
        "--probes",
        type=int,
        choices=(1, 2),
        default=2,
        help="probe before the real runs only (1), or before and after them (2; the sim pools both)",
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)
    p.add_argument("--out", type=Path, default=Path("plan_results/validate"))
    args = p.parse_args(argv)
    try:
        cfg = build_config(args)
        # NOTE: no API keys (PDSERVE_API_KEY included): the cluster serves a loopback port to the load
        # generator in this process alone
        cfg = replace(cfg, server=replace(cfg.server, api_key=None, api_keys_file=None))
        mock = mock_step_profile(cfg)
    except (ValueError, OSError) as e:
        p.error(str(e))
    if cfg.engine_config(cfg.decode_pool).load_format == "mock" and mock is None and not args.profile:
        p.error("a mock cluster's steps wait a cost profile: give --gpu NAME (and MODEL) or --cost-profile")
    slo = Slo(args.slo_ttft_ms, args.slo_tbt_ms)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    real: dict[str, Summary] = {}
    per_request: dict[str, dict[str, list[list[Any]]]] = {}  # validate.json's "requests"
    # NOTE: a seed per workload and run, apart from the probe's (seed x 1000 + 1 ...): with one seed,
    # each scenario's first prompt starts with the previous one's tokens, and the real cluster's prefix
    # cache (which lives on) would serve them
    seeds = {
        name: [_SEED_BASE + args.seed * 100 + i + run * _RUN_STRIDE for run in range(args.runs)]
        for i, name in enumerate(WORKLOADS)
    }
    diagnostics: dict[str, dict[str, float]] = {}
    spread: dict[str, list[float]] = {}  # each run's real TTFT p90 (ms)
    pool = "colocated" if cfg.router.mode == "colocated" else "decode"
    sweep: CostProfile | None = None
    with running_cluster(cfg) as (url, handle):
        if args.profile:
            profiles = [CostProfile.load(args.profile)]
        elif mock is not None:
            label = " (before the runs)" if args.probes == 2 else ""
            profiles = [mock_probe_and_report(url, handle, mock, args.seed, label)]
        else:
            sweep = calibrate_profile(handle.config, reps=args.reps, seed=args.seed, in_ray=True)
            label = " (before the runs)" if args.probes == 2 else ""
            profiles = [probe_and_report(url, handle, sweep, args.seed, label)]
        card_vocab, card_len = _card(url)
        for name in args.workloads:
            before, cpu0 = EngineTotals.of(handle, pool), time.process_time()
            before_prefill = EngineTotals.of(handle, "prefill") if pool == "decode" else None
            pooled: list[RequestRecord] = []
            total_s, num_tokens = 0.0, 0
            for run_seed in seeds[name]:
                client = ClientSettings(run_seed)
                records, duration = asyncio.run(run_scenario(url, name, client, WORKLOADS[name]))
                run_records = as_records(records)
                spread.setdefault(name, []).append(summarize(name, run_records, duration, slo).ttft_ms.p90)
                pooled += run_records
                total_s += duration
                num_tokens += sum(r.output_tokens for r in records)
                print(f"real {name}: {len(records)} requests in {duration:.1f} s", flush=True)
            engine, cpu = EngineTotals.of(handle, pool) - before, time.process_time() - cpu0
            real[name] = summarize(name, pooled, total_s, slo)
            per_request[name] = {"real": request_rows(pooled)}
            diagnostics[name] = {
                "real_step_ms": engine.seconds / max(1, engine.num_steps) * 1e3,
                "real_batch": engine.num_generated / max(1, engine.num_steps),
                "real_frontend_us": cpu / max(1, num_tokens) * 1e6,
            }
            if before_prefill is not None:
                diagnostics[name]["real_prefill_s"] = (
                    EngineTotals.of(handle, "prefill") - before_prefill
                ).seconds
        # NOTE: another seed: the first probe's prompts are in the prefix cache
        if sweep is not None and args.probes == 2:
            profiles.append(probe_and_report(url, handle, sweep, args.seed + 1, " (after the runs)"))
        elif mock is not None and not args.profile and args.probes == 2:
            profiles.append(mock_probe_and_report(url, handle, mock, args.seed + 1, " (after the runs)"))
    args.out.mkdir(parents=True, exist_ok=True)
    for profile, file in zip(profiles, ("profile.json", "profile-after.json"), strict=False):
        profile.save(args.out / file)
    by_profile: list[list[tuple[str, Summary, Summary]]] = [[] for _ in profiles]
    rows = []
    for name in args.workloads:
        runs = validation_workloads(name, seeds[name], card_vocab, card_len)
        twin = twin_side(cfg, profiles, runs, card_len, slo, pool)
        diagnostics[name].update(twin.diagnostics)
        per_request[name]["sim"] = request_rows(twin.records)
        rows.append((name, real[name], twin.pooled))
        for k, summary in enumerate(twin.per_profile):
            by_profile[k].append((name, real[name], summary))
    print(diagnostics_table(diagnostics, pool, profiles[0]))
    if args.runs > 1:
        print(
            f"real TTFT p90 of each of the {args.runs} runs (ms): "
            + "; ".join(f"{n} " + " ".join(f"{v:.1f}" for v in spread[n]) for n in args.workloads)
        )
    if len(profiles) > 1:
        for which, profile_rows in zip(("before", "after"), by_profile, strict=True):
            print(f"the sim with the probe {which} the runs alone: {_last_line(profile_rows)}")
    print(comparison(rows, slo))
    (args.out / "validate.json").write_text(
        json.dumps(
            {
                "profile": profiles[0].to_dict(),
                "profiles": [profile.to_dict() for profile in profiles],
                "rows_by_profile": [[[n, asdict(s)] for n, _, s in r] for r in by_profile],
                "rows": [[n, asdict(r), asdict(s)] for n, r, s in rows],
                "diagnostics": diagnostics,
                "real_ttft_p90_ms_per_run": spread,
                "runs": {name: args.runs for name in args.workloads},
                "seeds": {name: seeds[name] for name in args.workloads},
                "slo": asdict(slo),
                "requests": per_request,
            },
            indent=1,
        )
    )
    print(f"sim vs real: {_last_line(rows)}")
    return 0


def _last_line(rows: list[tuple[str, Summary, Summary]]) -> str:
    return figures(rows).line()


def _card(url: str) -> tuple[int, int]:
    from cluster.client.sdk import Client

    client = Client(url, max_retries=0, timeout=30)
    try:
        card = client.models()[0]
    finally:
        client.close()
    return int(card.get("vocab_size", 1000)), int(card.get("max_model_len", 2048))

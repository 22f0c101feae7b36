"""``pdserve plan calibrate`` and ``pdserve plan validate``: fit this machine's cost profile, then hold the
simulation against the real cluster on the same seeded workloads.

calibrate: the engine sweep (deploy/planner/calibrate.py); with ``--probe`` it also starts the cluster
of ``--config`` and measures what surrounds a step there: one control hop (the router's queue time of an
idle request), the HTTP edge (client TTFT minus the router's), the KV handoff (latency + bytes /
bandwidth, fitted to the decode side's transfer times) and the in-cluster step scale (client-side gaps
of steady decode batches and idle prefills over what the sweep predicts for the same shapes).

validate: calibrate + probe (unless ``--profile``), then every workload on the real cluster through its
HTTP API (``pdserve bench serve``'s code path), then the simulation of each; a table and, last, one line:
``sim vs real: max TTFT p90 error X%, max TBT p90 error Y%, max SLO attainment error Z points``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.plan import DEFAULT_CONFIG, default_profile_path, load_cluster_config, scenario_workload
from bench.serve import SCENARIOS, Record, Scenario, build_dataset
from bench.serve import run as run_scenario
from cluster.config import ClusterConfig
from cluster.cost_model import CostProfile, StepShape, TransferCost, shape_of
from deploy.planner.report import Slo, Summary, summarize
from deploy.planner.search import simulate
from deploy.planner.sim import RequestRecord
from deploy.planner.twin import SimConfig
from deploy.planner.workload import Workload, from_prompts

# The two Poisson rates validate runs besides the six scenarios (a light and a busy load for 1P:1D on CPU).
POISSON = {
    "poisson_light": Scenario(64, (64, 512), (32, 128), request_rate=2.0),
    "poisson_busy": Scenario(96, (64, 512), (32, 128), request_rate=6.0),
}
WORKLOADS = {**SCENARIOS, **POISSON}


def _client_args(seed: int) -> argparse.Namespace:
    return argparse.Namespace(
        api_key=None, timeout=600.0, model=None, temperature=0.0, ignore_eos=True, quiet=True, seed=seed
    )


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


# ---- calibration --------------------------------------------------------------------------------------
def _prefill_shape(n: int, budget: int) -> list[StepShape]:
    return [shape_of([(s, min(budget, n - s), False)]) for s in range(0, n, budget)]


async def probe(
    url: str, profile: CostProfile, cfg: ClusterConfig, seed: int
) -> tuple[CostProfile, dict[str, Any]]:
    """Measure hops, the HTTP edge, KV handoffs and the in-cluster step scale on a running cluster."""
    engine = cfg.engine_config()
    args = _client_args(seed)
    idle: list[Record] = []
    for n in (16, 256, 1024, 1792):
        recs, _ = await run_scenario(url, f"probe-{n}", args, Scenario(4, (n, n), (2, 2), max_concurrency=1))
        idle += [r for r in recs if r.error is None and r.server]
    if not idle:
        raise RuntimeError("cluster probe: every probe request failed")
    hop = statistics.median(r.server["queue_s"] for r in idle)  # type: ignore[index]
    http = max(0.0, statistics.median((r.ttft_s - r.server["ttft_s"]) / 2 for r in idle))  # type: ignore[index,operator]
    ratios = []
    for r in idle:
        model = sum(
            profile.step.step_s(s) for s in _prefill_shape(r.prompt_len, engine.max_num_batched_tokens)
        )
        ratios.append(max(1e-3, r.server["prefill_s"] - hop) / model)  # type: ignore[index]
    moved = np.array(
        [-(-r.prompt_len // engine.block_size) * engine.block_size * profile.kv_bytes_per_token for r in idle]
    )
    seconds = np.array([r.server["transfer_s"] for r in idle])  # type: ignore[index]
    slope, latency = (
        np.polyfit(moved, seconds, 1) if len(set(moved.tolist())) > 1 else (0.0, float(seconds.mean()))
    )
    transfer = TransferCost(
        max(0.0, float(latency)), 1.0 / slope if slope > 0 else profile.transfer.bytes_per_s
    )
    decode_ratios = []
    for batch in (8, 32):
        batch = min(batch, engine.max_num_seqs)
        recs, _ = await run_scenario(
            url, f"probe-decode-{batch}", args, Scenario(batch, (32, 32), (96, 96), max_concurrency=batch)
        )
        gaps = [g for r in recs for g in r.tbt_s[16:80]]
        if gaps:
            # NOTE: in the steady middle every sequence decodes; context = prompt + about 48 tokens
            model = profile.step.step_s(
                StepShape(num_decode_seqs=batch, num_context_tokens=batch * (32 + 48))
            )
            decode_ratios.append(statistics.median(gaps) / model)
    scale = math.exp(statistics.fmean(math.log(x) for x in [statistics.median(ratios), *decode_ratios]))
    measured = replace(profile, hop_s=hop, http_s=http, transfer=transfer, step_scale=scale)
    report = {
        "hop_ms": hop * 1e3,
        "http_ms": http * 1e3,
        "transfer_latency_ms": transfer.latency_s * 1e3,
        "transfer_gb_per_s": transfer.bytes_per_s / 1e9,
        "prefill_scale": statistics.median(ratios),
        "decode_scales": decode_ratios,
        "step_scale": scale,
    }
    return measured, report


def calibrate_profile(cfg: ClusterConfig, *, reps: int, seed: int, verbose: bool = True) -> CostProfile:
    import torch

    from deploy.planner.calibrate import calibrate, fit_table

    pool = cfg.colocated if cfg.router.mode == "colocated" else cfg.decode
    torch.set_num_threads(pool.torch_threads)  # NOTE: as many threads as one worker of the cluster uses
    profile, samples = calibrate(cfg.engine_config(), reps=reps, seed=seed)
    if verbose:
        print(fit_table(profile, samples), flush=True)
    return profile


@contextlib.contextmanager
def running_cluster(cfg: ClusterConfig) -> Iterator[str]:
    """The cluster of ``cfg`` served over HTTP on a free loopback port; yields its URL."""
    from deploy.http_host import start_http
    from deploy.launch import start_cluster

    handle = start_cluster(cfg)
    try:
        with start_http(handle) as http:
            yield http.url
    finally:
        handle.shutdown()


def calibrate_command(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(prog="pdserve plan calibrate", description="fit this machine's cost profile")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--out", type=Path, default=default_profile_path())
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--probe", action="store_true", help="also measure hops, handoffs and step scale on the cluster"
    )
    args = p.parse_args(argv)
    cfg = load_cluster_config(args.config)
    profile = calibrate_profile(cfg, reps=args.reps, seed=args.seed)
    if args.probe:
        with running_cluster(cfg) as url:
            profile, report = asyncio.run(probe(url, profile, cfg, args.seed))
        print(
            "cluster probe: "
            + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in report.items())
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(args.out)
    print(f"profile: {args.out}\n{json.dumps(profile.to_dict(), indent=1)}")
    return 0


# ---- validation ---------------------------------------------------------------------------------------
def validation_workload(name: str, vocab_size: int, max_model_len: int, seed: int) -> Workload:
    if name in SCENARIOS:
        return scenario_workload(name, vocab_size, max_model_len, seed)
    s = POISSON[name]
    from bench.serve import arrival_offsets

    return from_prompts(
        name,
        build_dataset(s, vocab_size, max_model_len, seed),
        arrival_offsets(s, seed),
        vocab_size=vocab_size,
    )


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
            f"{name:<15} {real.ttft_ms.p90:13.1f} {sim.ttft_ms.p90:9.1f} {_err(sim.ttft_ms.p90, real.ttft_ms.p90):6.1f}% "
            f"{real.tbt_ms.p90:12.1f} {sim.tbt_ms.p90:7.1f} {_err(sim.tbt_ms.p90, real.tbt_ms.p90):6.1f}% "
            f"{real.slo_attainment:11.1%} {sim.slo_attainment:6.1%} {abs(sim.slo_attainment - real.slo_attainment) * 100:6.1f}"
        )
    return "\n".join(lines)


def _err(sim: float, real: float) -> float:
    return abs(sim - real) / real * 100 if real > 0 else math.inf


def validate_command(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(prog="pdserve plan validate", description="simulation vs the real cluster")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--profile", default=None, help="use this profile (default: calibrate + probe now)")
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)
    p.add_argument("--out", type=Path, default=Path("plan_results/validate"))
    args = p.parse_args(argv)
    cfg = load_cluster_config(args.config)
    slo = Slo(args.slo_ttft_ms, args.slo_tbt_ms)
    profile = (
        CostProfile.load(args.profile)
        if args.profile
        else calibrate_profile(cfg, reps=args.reps, seed=args.seed)
    )
    real: dict[str, Summary] = {}
    with running_cluster(cfg) as url:
        if not args.profile:
            profile, report = asyncio.run(probe(url, profile, cfg, args.seed))
            print("cluster probe: " + json.dumps(report), flush=True)
        card_vocab, card_len = _card(url)
        for name in args.workloads:
            s = WORKLOADS[name]
            records, duration = asyncio.run(run_scenario(url, name, _client_args(args.seed), s))
            real[name] = summarize(name, as_records(records), duration, slo)
            print(f"real {name}: {len(records)} requests in {duration:.1f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    profile.save(args.out / "profile.json")
    num_blocks = cfg.engine_config().num_kv_blocks or 2048
    base = SimConfig.from_cluster(cfg, num_kv_blocks=num_blocks, max_model_len=card_len)
    rows = []
    for name in args.workloads:
        sim = simulate(base, profile, validation_workload(name, card_vocab, card_len, args.seed), slo).summary
        rows.append((name, real[name], sim))
    print(comparison(rows, slo))
    (args.out / "validate.json").write_text(
        json.dumps(
            {"profile": profile.to_dict(), "rows": [[n, asdict(r), asdict(s)] for n, r, s in rows]}, indent=1
        )
    )
    x = max(_err(s.ttft_ms.p90, r.ttft_ms.p90) for _, r, s in rows)
    y = max(_err(s.tbt_ms.p90, r.tbt_ms.p90) for _, r, s in rows)
    z = max(abs(s.slo_attainment - r.slo_attainment) * 100 for _, r, s in rows)
    print(
        f"sim vs real: max TTFT p90 error {x:.1f}%, max TBT p90 error {y:.1f}%, max SLO attainment error {z:.1f} points"
    )
    return 0


def _card(url: str) -> tuple[int, int]:
    from cluster.client import Client

    client = Client(url, max_retries=0, timeout=30)
    try:
        card = client.models()[0]
    finally:
        client.close()
    return int(card.get("vocab_size", 1000)), int(card.get("max_model_len", 2048))

"""SLO-aware admission under overload: goodput with ``router.admission: slo`` vs without, in one run.

    pdserve bench admission [--config deploy/cpu-disagg.yaml] [--profile P.json] [--overload 1.5]

Starts the cluster of ``--config`` (HTTP on a free loopback port) and keeps it for the whole run:

1. the cost profile: ``--profile``, else calibrated on this cluster (``pdserve plan calibrate --probe``'s
   engine sweep in a Ray worker and its cluster probe);
2. the saturation rate: the workload's requests from a closed loop of ``--saturation-concurrency``
   clients (the cluster kept full); the completion rate over the middle half of the run is what the
   cluster can serve;
3. ``--rounds`` rounds of the same seeded Poisson workload at ``--overload`` x that rate, each round once
   without admission and once with it (order alternating, so drift of a shared machine hits both
   alike); admission is switched on the live router (a fresh ``SloAdmission`` with the TTFT and, unless
   ``--admit-on ttft``, the TBT SLO), and the cluster is left to go quiet between runs.

Goodput is ``pdserve bench serve``'s: requests that meet the TTFT SLO and whose mean gap between tokens
meets the TBT SLO, per second of the run (first send to last answer); a refused request (429) is a miss.
Prints a row per run and, last, the ratio of the median goodputs; writes ``<out>/admission.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.serve import summarize
from cluster.cost_model import CostProfile
from cluster.router.admission import SloAdmission
from cluster.router.predict import Predictor
from deploy.loadgen import ClientSettings, Record, Scenario, run_scenario
from deploy.plan.calibrate import calibrate_and_probe
from deploy.plan.harness import running_cluster
from deploy.plan.inputs import DEFAULT_CONFIG, load_cluster_config

if TYPE_CHECKING:
    from deploy.launch import Cluster


def set_admission(handle: Cluster, predictor: Predictor, admission: SloAdmission | None) -> None:
    """On the router's loop: the predictor, and the admission policy (None: off)."""

    async def apply() -> None:
        handle.router.predictor = predictor
        handle.router.admission = admission

    handle.run(apply(), timeout=10)


def measure(url: str, args: argparse.Namespace, scenario: Scenario, label: str) -> tuple[list[Record], float]:
    client = ClientSettings(args.seed)  # quiet, no retries of 429s (a refusal is a miss)
    return asyncio.run(run_scenario(url, label, client, scenario))


def saturation_rate(url: str, handle: Cluster, args: argparse.Namespace) -> float:
    """Requests per second the cluster completes while it is kept full: a closed loop of
    ``--saturation-concurrency`` clients, the completion rate over the middle half of the run (the ramp
    up and the drain at the ends excluded)."""
    n = args.saturation_requests
    loop = Scenario(
        n, tuple(args.prompt_len), tuple(args.output_len), max_concurrency=args.saturation_concurrency
    )
    records, _ = measure(url, args, loop, "saturation")
    handle.wait_until_quiet(120)
    done = sorted(r.send_time + r.e2e_s for r in records if r.error is None and r.e2e_s is not None)
    if len(done) < 8:
        raise RuntimeError(f"only {len(done)} of {n} saturation requests finished")
    lo, hi = len(done) // 4, 3 * len(done) // 4
    return (hi - lo) / (done[hi] - done[lo])


def row(label: str, s: dict[str, Any]) -> str:
    return (
        f"{label:<24} {s['num_ok']:>4}/{s['num_requests']:<4} {s['num_errors']:>6} "
        f"{_p(s['ttft_ms'], 'p50'):>9} {_p(s['ttft_ms'], 'p90'):>9} {_p(s['tbt_ms'], 'p90'):>8} "
        f"{s['goodput_ratio']:>7.1%} {s['goodput_requests_per_s']:>8.2f} {s['duration_s']:>8.1f}"
    )


def _p(q: dict[str, float | None], key: str) -> str:
    value = q[key]
    return "-" if value is None else f"{value:.0f}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench admission", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--profile", type=Path, help="cost profile JSON (default: calibrate on the cluster)")
    p.add_argument("--calibration-reps", type=int, default=3)
    p.add_argument("--overload", type=float, default=1.5, help="offered rate / saturation rate")
    p.add_argument("--saturation-requests", type=int, default=128)
    p.add_argument("--saturation-concurrency", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=150, help="requests per run")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)
    p.add_argument("--rounds", type=int, default=2, help="runs with and without admission each")
    p.add_argument("--admit-on", choices=["ttft", "both"], default="both", help="which SLOs admission checks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    args = p.parse_args(argv)

    cfg = load_cluster_config(args.config)
    results: list[dict[str, Any]] = []
    with running_cluster(cfg) as (url, handle):
        if args.profile is not None:
            profile = CostProfile.load(args.profile)
        else:
            profile = calibrate_and_probe(url, handle, reps=args.calibration_reps, seed=args.seed)
            handle.wait_until_quiet(120)
        predictor = Predictor(profile, cfg.engine_config(cfg.prefill_pool).max_num_batched_tokens)
        set_admission(handle, predictor, None)
        tbt_slo_s = args.slo_tbt_ms / 1e3 if args.admit_on == "both" else None
        saturation = saturation_rate(url, handle, args)
        rate = args.overload * saturation
        print(
            f"saturation: {saturation:.2f} req/s ({args.saturation_requests} requests, "
            f"{args.saturation_concurrency} at a time); offered "
            f"{rate:.2f} req/s ({args.overload:g}x), {args.num_requests} requests per run",
            flush=True,
        )
        scenario = Scenario(
            args.num_requests, tuple(args.prompt_len), tuple(args.output_len), request_rate=rate
        )
        print(
            f"{'run':<24} {'served':>9} {'errors':>6} {'TTFT p50':>9} {'p90':>9} {'TBT p90':>8} {'in SLO':>7} "
            f"{'goodput':>8} {'wall s':>8}   (ms; errors: refused 429s and failures; goodput req/s)"
        )
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for admission in order:
                policy = SloAdmission(args.slo_ttft_ms / 1e3, tbt_slo_s) if admission else None
                set_admission(handle, predictor, policy)
                label = f"round {r + 1} {'admission' if admission else 'no admission'}"
                records, duration = measure(url, args, scenario, label)
                summary = summarize(records, duration, args.slo_ttft_ms, args.slo_tbt_ms)
                if policy is not None:
                    summary["policy"] = {
                        "admitted": policy.num_admitted,
                        "refused": policy.num_rejected,
                        "ttft_correction": policy.correction,
                        "step_correction": {
                            w.worker_id: policy.step_correction(w.worker_id) for w in handle.router.workers
                        },
                    }
                results.append({"round": r + 1, "admission": admission, **summary})
                print(row(label, summary), flush=True)
                set_admission(handle, predictor, None)
                handle.wait_until_quiet(300)
    on = [x["goodput_requests_per_s"] for x in results if x["admission"]]
    off = [x["goodput_requests_per_s"] for x in results if not x["admission"]]
    ratio = statistics.median(on) / max(1e-9, statistics.median(off))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "config": args.config,
        "profile": profile.to_dict(),
        "saturation_rps": saturation,
        "offered_rps": rate,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": results,
        "goodput_ratio": ratio,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (args.out / "admission.json").write_text(json.dumps(report, indent=1, default=str))
    print(
        f"goodput at {args.overload:g}x saturation ({rate:.2f} req/s), median of {args.rounds} runs each: "
        f"{statistics.median(on):.2f} req/s with admission vs {statistics.median(off):.2f} without = "
        f"{ratio:.2f}x (SLO: TTFT <= {args.slo_ttft_ms:g} ms, mean TBT <= {args.slo_tbt_ms:g} ms)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

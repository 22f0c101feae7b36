"""Online serving benchmark (``pdserve bench serve``): against a running server (``--url``), or against
local clusters it starts in turn (``--config A.yaml --config B.yaml`` / ``--compare A.yaml B.yaml``:
build_cluster + start_http, the chosen scenarios, shutdown) and then one comparison table.

Sends random token-id prompts (lengths drawn from ranges, fixed seed) as streaming completions with
Poisson / gamma arrivals (``--request-rate``, ``--burstiness``: 1 is Poisson, < 1 burstier) or a fixed
concurrency, and measures at the client: TTFT, time between tokens (TBT), E2E, output tokens/s and
goodput (requests/s meeting ``--slo-ttft-ms`` and ``--slo-tbt-ms``, TBT as the request's mean gap),
plus the server's queue/prefill/transfer/decode split. Writes ``<out>/<scenario>.json`` and ``.png``.

The scenarios (``--scenario``; flags override their fields) and the client that sends them are the load
generator's (deploy/loadgen.py, which lists them); this script prints and plots the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from deploy.loadgen import SCENARIOS, ClientSettings, Record, Scenario, run_scenario


def client_settings(args: argparse.Namespace) -> ClientSettings:
    """The load generator's client, as the command line asks."""
    return ClientSettings(
        seed=args.seed,
        api_key=args.api_key,
        timeout=args.timeout,
        model=args.model,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        quiet=args.quiet,
    )


def _pct(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(values) * 1000.0
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "mean": float(a.mean()),
    }


def summarize(
    records: list[Record], duration_s: float, slo_ttft_ms: float, slo_tbt_ms: float
) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.ttft_s is not None]
    tokens = sum(r.output_tokens for r in ok)
    good = [
        r
        for r in ok
        if (r.ttft_s or 0) * 1000 <= slo_ttft_ms and (np.mean(r.tbt_s) * 1000 if r.tbt_s else 0) <= slo_tbt_ms
    ]
    split = (
        {
            k: float(np.mean([r.server[k] for r in ok if r.server])) * 1000
            for k in ("queue_s", "prefill_s", "transfer_s", "decode_s")
        }
        if any(r.server for r in ok)
        else {}
    )
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "duration_s": duration_s,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration_s,
        "requests_per_s": len(ok) / duration_s,
        "goodput_requests_per_s": len(good) / duration_s,
        "goodput_ratio": len(good) / max(1, len(records)),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tbt_ms": slo_tbt_ms,
        "ttft_ms": _pct([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tbt_ms": _pct([g for r in ok for g in r.tbt_s]),
        "e2e_ms": _pct([r.e2e_s for r in ok if r.e2e_s is not None]),
        "server_split_mean_ms": split,
        "errors": sorted({r.error for r in records if r.error})[:10],
    }


def plot(records: list[Record], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.error is None and r.ttft_s is not None]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ttft = np.sort([(r.ttft_s or 0) * 1000 for r in ok])
    axes[0, 0].plot(ttft, np.arange(1, len(ttft) + 1) / max(1, len(ttft)))
    axes[0, 0].set(title="TTFT CDF", xlabel="ms", ylabel="fraction")
    axes[0, 1].hist([g * 1000 for r in ok for g in r.tbt_s] or [0.0], bins=50)
    axes[0, 1].set(title="time between tokens", xlabel="ms", ylabel="count")
    axes[1, 0].scatter([r.prompt_len for r in ok], [(r.e2e_s or 0) * 1000 for r in ok], s=8)
    axes[1, 0].set(title="E2E latency vs prompt length", xlabel="prompt tokens", ylabel="ms")
    times = np.sort([t for r in ok for t in r.token_times])
    axes[1, 1].plot(times, np.arange(1, len(times) + 1))
    axes[1, 1].set(title="streamed deltas over time", xlabel="s since start", ylabel="cumulative deltas")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__.split("\n\n")[0])
    target = p.add_mutually_exclusive_group()
    target.add_argument("--url", default=None, help="a running server (default http://127.0.0.1:8000)")
    target.add_argument(
        "--config", action="append", help="start this cluster config, bench it, shut it down (repeatable)"
    )
    target.add_argument("--compare", nargs="+", metavar="CONFIG", help="same as one --config per path")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name (default: the server's)")
    p.add_argument(
        "--scenario", nargs="+", choices=[*sorted(SCENARIOS), "all"], default=["smoke"], help="one or more"
    )
    p.add_argument("--scale", type=float, default=1.0, help="multiply every scenario's request count")
    p.add_argument("--num-requests", type=int)
    p.add_argument("--request-rate", type=float, help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, help="gamma shape of inter-arrival gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)
    p.add_argument("--timeout", type=float, default=600.0, help="client read timeout, seconds")
    p.add_argument(
        "--pin-cpu-cores",
        action="store_true",
        help="pin each CPU worker to its own core in every config (a fair race: one core per device)",
    )
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    args.configs = args.config or args.compare or []
    if "all" in args.scenario:
        args.scenario = list(SCENARIOS)
    return args


def scenarios(args: argparse.Namespace) -> dict[str, Scenario]:
    """The chosen scenarios with the command line's overrides and ``--scale`` applied."""
    overrides = {
        k: v
        for k, v in {
            "num_requests": args.num_requests,
            "request_rate": args.request_rate,
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "prompt_len": tuple(args.prompt_len) if args.prompt_len else None,
            "output_len": tuple(args.output_len) if args.output_len else None,
        }.items()
        if v is not None
    }
    chosen = {}
    for name in dict.fromkeys(args.scenario):
        s = replace(SCENARIOS[name], **overrides)
        scaled = max(1, round(s.num_requests * args.scale))
        concurrency = None if s.max_concurrency is None else max(1, min(s.max_concurrency, scaled))
        chosen[name] = replace(s, num_requests=scaled, max_concurrency=concurrency)
    return chosen


def bench_url(url: str, label: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every chosen scenario against ``url``; writes ``<out>/<label>/<scenario>.json`` (+ ``.png``)."""
    out_dir = args.out / label if label else args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = {}
    for name, scenario in scenarios(args).items():
        run_name = f"{label}:{name}" if label else name
        records, duration = asyncio.run(run_scenario(url, run_name, client_settings(args), scenario))
        summary = {
            "scenario": name,
            "target": label or url,
            "config": asdict(scenario),
            **summarize(records, duration, args.slo_ttft_ms, args.slo_tbt_ms),
        }
        out_json = out_dir / f"{name}.json"
        out_json.write_text(
            json.dumps({"summary": summary, "requests": [asdict(r) for r in records]}, indent=1)
        )
        if not args.no_plot:
            plot(records, out_dir / f"{name}.png", f"pdserve bench serve: {label or url} / {name}")
        print_summary(summary)
        summaries[name] = summary
    return summaries


def bench_config(path: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Start the cluster of ``path``, serve it on a free loopback port, bench it, shut it down. This
    process freezes its start-up heap once serving, as a serving process does (``serve_on_loop``)."""
    from cluster.config import ClusterConfig
    from cluster.heap import freeze_startup_heap
    from deploy.http_host import start_http
    from deploy.launch import build_cluster

    label = Path(path).stem
    print(f"== {label}: starting {path}", flush=True)
    cfg = ClusterConfig.from_yaml(path)
    handle = build_cluster(replace(cfg, pin_cpu_cores=True) if args.pin_cpu_cores else cfg)
    try:
        with start_http(handle) as http:
            freeze_startup_heap()
            return bench_url(http.url, label, args)
    finally:
        handle.shutdown()


def print_summary(summary: dict[str, Any]) -> None:
    print(f"-- {summary['target']} / {summary['scenario']}")
    for key in ("ttft_ms", "tbt_ms", "e2e_ms"):
        q = summary[key]
        if q["p50"] is not None:
            print(f"{key:>7}: p50 {q['p50']:9.2f}  p90 {q['p90']:9.2f}  p99 {q['p99']:9.2f}")
    print(
        f"{summary['num_ok']}/{summary['num_requests']} ok in {summary['duration_s']:.2f} s: "
        f"{summary['output_tokens_per_s']:.1f} output tok/s, {summary['requests_per_s']:.2f} req/s, "
        f"goodput {summary['goodput_requests_per_s']:.2f} req/s ({summary['goodput_ratio']:.0%} within SLOs)",
        flush=True,
    )


def comparison_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """One markdown table: a row per (scenario, target), latency percentiles in ms."""
    head = ["scenario", "target", "ok"]
    head += [f"{m} p{q}" for m in ("TTFT", "TBT", "E2E") for q in (50, 90, 99)]
    head += ["out tok/s", "goodput req/s", "in SLO", "queue", "prefill", "transfer", "decode"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    names = list(dict.fromkeys(n for per_target in results.values() for n in per_target))
    for name in names:
        for target, per_target in results.items():
            s = per_target.get(name)
            if s is None:
                continue
            cells = [name, target, f"{s['num_ok']}/{s['num_requests']}"]
            for key in ("ttft_ms", "tbt_ms", "e2e_ms"):
                cells += [_fmt(s[key][q]) for q in ("p50", "p90", "p99")]
            cells += [f"{s['output_tokens_per_s']:.0f}", f"{s['goodput_requests_per_s']:.2f}"]
            cells += [f"{s['goodput_ratio']:.0%}"]
            split = s["server_split_mean_ms"]
            cells += [_fmt(split.get(k)) for k in ("queue_s", "prefill_s", "transfer_s", "decode_s")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    if args.configs:
        for path in args.configs:
            results[Path(path).stem] = bench_config(path, args)
    else:
        url = args.url or "http://127.0.0.1:8000"
        results[url] = bench_url(url, "", args)
    table = comparison_table(results)
    print(f"\nlatency in ms (client-measured; queue/prefill/transfer/decode: router's mean split)\n{table}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "comparison.md").write_text(table + "\n")
    (args.out / "comparison.json").write_text(json.dumps(results, indent=1))
    failed = sum(s["num_errors"] for per_target in results.values() for s in per_target.values())
    return 0 if failed == 0 else 1

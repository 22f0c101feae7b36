"""Multi-turn conversations (``pdserve bench multiturn``): what a KV tier and prefix routing buy when the
conversations' histories do not fit the device KV cache.

N conversations of T turns run at once. Turn t's prompt is the conversation's whole history: an optional
system prompt shared by every conversation, then each earlier turn's user message (M random token ids,
seeded) and the model's answer (K tokens, ``ignore_eos``), then turn t's new message. Prompts are token
ids (completions API), so the history is exactly the ids the server saw and produced: nothing is
re-tokenized. A conversation waits a think time (exponential, ``--think-time-s`` mean, seeded) before
each turn, its first included.

Reported per turn index: TTFT p50 / p90 at the client, count, the cached prompt tokens the server
reports; per run: TTFT of turn 1 and of the later turns, the prefix hit rate by tier and the KV bytes
offloaded and loaded (the server's ``pdserve_*`` counters before and after), the routes' reasons and how
often a turn went to the prefill worker of the conversation's previous turn, and the working set (the KV
blocks of every conversation's last prompt) against the device KV blocks of the pool that prefills. The
comparison table adds, for the later turns, the first run's TTFT p50 over each run's (2.00x: half the
first run's), and where it went as the router splits it (its queue, and the prefill up to the first token).

Targets: a running server (``--url``), or local clusters started in turn, one at a time (``--config
A.yaml``; ``--run LABEL='pdserve serve flags'``, e.g. ``--run on='--config deploy/cpu-colocated.yaml
--num-kv-blocks 64 --kv-offload-gib 0.25'``; ``--cluster-args`` go before every run's own flags), then one
comparison table. Writes ``<out>/<label>.json``, ``<out>/comparison.md`` and ``comparison.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import shlex
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from cluster.client.sdk import AsyncClient
from deploy.loadgen import ClientSettings, Record, stream_completion

# (per-worker series, the key it is summed under); counters lose their _total in the parser's families
WORKER_SERIES = {
    "pdserve_prefix_cache_queries": "queries",
    "pdserve_prefix_cache_hits": "hits",
    "pdserve_prefix_cache_host_hits": "host_hits",
    "pdserve_kv_offloaded_bytes": "offloaded_bytes",
    "pdserve_kv_loaded_bytes": "loaded_bytes",
    "pdserve_kv_offloaded_blocks": "offloaded_blocks",
    "pdserve_kv_loaded_blocks": "loaded_blocks",
    "pdserve_preemptions": "preemptions",
    "pdserve_kv_cache_total_blocks": "device_blocks",
    "pdserve_kv_host_cache_total_blocks": "host_blocks",
}
GAUGE_KEYS = ("device_blocks", "host_blocks")


@dataclass(frozen=True)
class Workload:
    num_conversations: int = 16
    num_turns: int = 6
    system_prompt_len: int = 64  # shared by every conversation; 0: none
    message_len: int = 96
    output_len: int = 24
    think_time_s: float = 1.0  # mean of the exponential wait before each turn
    max_concurrency: int | None = None  # requests in flight; None: one per conversation
    seed: int = 0

    def prompt_len(self, turn: int) -> int:
        """Prompt tokens of turn ``turn`` (1-based)."""
        return self.system_prompt_len + turn * self.message_len + (turn - 1) * self.output_len

    def working_set_blocks(self, block_size: int) -> int:
        """KV blocks of every conversation's last prompt, the shared system prompt's full blocks once."""
        shared = self.system_prompt_len // block_size
        per_conversation = math.ceil(self.prompt_len(self.num_turns) / block_size) - shared
        return shared + self.num_conversations * per_conversation


@dataclass
class Turn:
    conversation: int
    turn: int  # 1-based
    record: Record
    prefill_worker: str | None = None
    route: str | None = None  # "mode/reason"


def build_messages(w: Workload, vocab_size: int) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and each conversation's user messages (seeded; a conversation's draws do
    not depend on how many conversations there are)."""
    hi = max(11, vocab_size // 4)  # NOTE: as the load generator: low ids skip most special tokens
    system = np.random.default_rng([w.seed, 0]).integers(10, hi, size=w.system_prompt_len).tolist()
    messages = []
    for c in range(w.num_conversations):
        rng = np.random.default_rng([w.seed, 1, c])
        messages.append([rng.integers(10, hi, size=w.message_len).tolist() for _ in range(w.num_turns)])
    return system, messages


def think_times(w: Workload) -> list[list[float]]:
    """Seconds each conversation waits before each of its turns."""
    if w.think_time_s <= 0:
        return [[0.0] * w.num_turns for _ in range(w.num_conversations)]
    return [
        np.random.default_rng([w.seed, 2, c]).exponential(w.think_time_s, size=w.num_turns).tolist()
        for c in range(w.num_conversations)
    ]


async def run_conversations(url: str, w: Workload, settings: ClientSettings) -> tuple[list[Turn], float]:
    """Every conversation against ``url``; a conversation whose turn fails sends no further turn.
    Returns the turns in the order they finished and the run's wall seconds."""
    async with AsyncClient(url, settings.api_key, timeout=settings.timeout, max_retries=0) as client:
        card = (await client.models())[0]
        max_model_len = int(card.get("max_model_len", 2048))
        if w.prompt_len(w.num_turns) + w.output_len > max_model_len:
            raise SystemExit(
                f"the last turn needs {w.prompt_len(w.num_turns) + w.output_len} tokens, more than the "
                f"server's max_model_len {max_model_len}: lower --turns, --message-len or --output-len"
            )
        system, messages = build_messages(w, int(card.get("vocab_size", 1000)))
        waits = think_times(w)
        sem = asyncio.Semaphore(w.max_concurrency or w.num_conversations)
        turns: list[Turn] = []
        start = time.perf_counter()

        async def conversation(c: int) -> None:
            history = list(system)
            for t in range(w.num_turns):
                await asyncio.sleep(waits[c][t])
                prompt = history + messages[c][t]
                async with sem:
                    rec, output = await stream_completion(
                        client, settings, prompt, w.output_len, start, include_usage=True
                    )
                route = (rec.server or {}).get("route") or {}
                turns.append(
                    Turn(
                        c,
                        t + 1,
                        rec,
                        route.get("prefill_worker"),
                        f"{route['mode']}/{route['reason']}" if route.get("mode") else None,
                    )
                )
                if rec.error is not None:
                    return
                history = prompt + output

        await asyncio.gather(*(conversation(c) for c in range(w.num_conversations)))
        return turns, time.perf_counter() - start


def scrape(url: str, api_key: str | None) -> dict[str, dict[str, float]]:
    """Per pool, the sum over its workers of each ``WORKER_SERIES`` value now (/metrics)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(f"{url.rstrip('/')}/metrics", headers=headers, timeout=30.0).text
    pools: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        key = WORKER_SERIES.get(family.name)
        if key is None:
            continue
        for s in family.samples:
            if s.name.endswith(("_created",)) or "pool" not in s.labels:
                continue
            per_pool = pools.setdefault(s.labels["pool"], dict.fromkeys(WORKER_SERIES.values(), 0.0))
            per_pool[key] += s.value
    return pools


def _ms(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None}
    a = np.asarray(values) * 1000.0
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90))}


def summarize(
    turns: list[Turn],
    duration_s: float,
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    w: Workload,
    block_size: int,
) -> dict[str, Any]:
    """The run's figures (see the module docstring); ``before`` / ``after``: ``scrape`` around the run."""
    ok = [t for t in turns if t.record.error is None and t.record.ttft_s is not None]
    per_turn = []
    for k in range(1, w.num_turns + 1):
        at = [t for t in turns if t.turn == k]
        done = [t for t in ok if t.turn == k]
        cached = [t.record for t in done if t.record.cached_tokens is not None]
        per_turn.append(
            {
                "turn": k,
                "count": len(done),
                "errors": len(at) - len(done),
                "prompt_len": w.prompt_len(k),
                "ttft_ms": _ms([t.record.ttft_s or 0.0 for t in done]),
                "cached_ratio": (
                    sum(r.cached_tokens or 0 for r in cached) / sum(r.prompt_len for r in cached)
                    if cached
                    else None
                ),
            }
        )
    prefill_pool = "colocated" if "colocated" in after else "prefill"
    delta = {
        pool: {k: v - before.get(pool, {}).get(k, 0.0) for k, v in values.items() if k not in GAUGE_KEYS}
        for pool, values in after.items()
    }
    tier = delta.get(prefill_pool, {})
    device_blocks = int(after.get(prefill_pool, {}).get("device_blocks", 0))
    working_set = w.working_set_blocks(block_size)
    previous = {(t.conversation, t.turn): t.prefill_worker for t in ok}
    follows = [t for t in ok if t.prefill_worker and previous.get((t.conversation, t.turn - 1))]
    same = [t for t in follows if t.prefill_worker == previous[t.conversation, t.turn - 1]]
    return {
        "duration_s": duration_s,
        "num_requests": len(turns),
        "num_ok": len(ok),
        "num_errors": len(turns) - len(ok),
        "errors": sorted({t.record.error for t in turns if t.record.error})[:10],
        "per_turn": per_turn,
        "ttft_ms_turn1": _ms([t.record.ttft_s or 0.0 for t in ok if t.turn == 1]),
        "ttft_ms_later": _ms([t.record.ttft_s or 0.0 for t in ok if t.turn > 1]),
        "server_ms_later": server_split(t.record for t in ok if t.turn > 1),
        "kv": {
            "block_size": block_size,
            "working_set_blocks": working_set,
            "prefill_pool": prefill_pool,
            "device_blocks": device_blocks,
            "device_to_working_set": device_blocks / working_set,
            "host_blocks": int(after.get(prefill_pool, {}).get("host_blocks", 0)),
        },
        "hits": hit_rates(ok, tier),
        "per_pool": delta,
        "routes": dict(Counter(t.route for t in ok if t.route)),
        "prefill_workers": dict(sorted(Counter(t.prefill_worker for t in ok if t.prefill_worker).items())),
        "same_prefill_worker_ratio": len(same) / len(follows) if follows else None,
    }


def server_split(records: Iterable[Record]) -> dict[str, float | None]:
    """Where the TTFT of ``records`` went as the router split it (``pdserve_timings``), p50 in ms: waiting
    for a worker (``queue``), the prefill until the first token (``prefill``: its worker's queue, the
    host-tier loads and the forward), and the router's whole TTFT (``ttft``: no HTTP, no client)."""
    timed = [r.server for r in records if r.server]
    return {
        k: _ms([float(t.get(f"{k}_s") or 0.0) for t in timed])["p50"] for k in ("queue", "prefill", "ttft")
    }


def hit_rates(ok: list[Turn], counted: dict[str, float]) -> dict[str, Any]:
    """Prompt tokens found in each tier over the tokens looked up, as the prefilling pool's counters say
    (``counted``: their change over the run), and the cached prompt tokens each request's usage reports.

    NOTE: the engine counts a lookup when its blocks are taken, again when a preempted request returns.
    The usage is per request but is the last worker's: in a disaggregated cluster the decode worker's
    cache (what the handoff did not move), not the prefill worker's.
    """
    with_usage = [t.record for t in ok if t.record.cached_tokens is not None]
    prompt_tokens = sum(r.prompt_len for r in with_usage)
    cached = sum(r.cached_tokens or 0 for r in with_usage)
    queries, hits, host = (counted.get(k, 0.0) for k in ("queries", "hits", "host_hits"))
    return {
        **counted,
        "device_hit_rate": (hits - host) / queries if queries else None,
        "host_hit_rate": host / queries if queries else None,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached,
            "cached_ratio": cached / prompt_tokens if prompt_tokens else None,
        },
    }


def print_summary(label: str, s: dict[str, Any]) -> None:
    print(f"-- {label}: {s['num_ok']}/{s['num_requests']} turns ok in {s['duration_s']:.1f} s")
    for p in s["per_turn"]:
        q = p["ttft_ms"]
        cached = "-" if p["cached_ratio"] is None else f"{p['cached_ratio']:.0%}"
        print(
            f"   turn {p['turn']:2d} ({p['prompt_len']:5d} tokens): {p['count']:3d} ok, TTFT p50 "
            f"{_fmt(q['p50'])} p90 {_fmt(q['p90'])} ms, cached {cached}"
        )
    h = s["hits"]
    print(
        f"   prefix hits of the {s['kv']['prefill_pool']} pool: device {_pct(h['device_hit_rate'])}, host "
        f"{_pct(h['host_hit_rate'])} (usage: {_pct(h['usage']['cached_ratio'])} cached); offloaded "
        f"{h.get('offloaded_bytes', 0) / 2**20:.1f} MiB, loaded {h.get('loaded_bytes', 0) / 2**20:.1f} MiB, "
        f"preemptions {h.get('preemptions', 0):.0f}; routes {s['routes']}, prefill workers "
        f"{s['prefill_workers']}",
        flush=True,
    )


def comparison_table(results: dict[str, dict[str, Any]]) -> str:
    """A row per run, then a row per turn index (TTFT p50 / p90 in ms of each run)."""
    head = [
        "run",
        "ok",
        "TTFT p50 turn 1",
        "TTFT p50 turns 2+",
        "TTFT p90 turns 2+",
        "turns 2+ p50: first run / this run",
        "router queue / prefill p50 turns 2+",
        "device hit",
        "host hit",
    ]
    head += ["usage cached", "offloaded MiB", "loaded MiB", "device KV / working set", "same prefill worker"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    first = next(iter(results.values()), {}).get("ttft_ms_later", {}).get("p50")
    for label, s in results.items():
        h, kv, split = s["hits"], s["kv"], s.get("server_ms_later", {})
        later = s["ttft_ms_later"]["p50"]
        cells = [label, f"{s['num_ok']}/{s['num_requests']}", _fmt(s["ttft_ms_turn1"]["p50"])]
        cells += [_fmt(later), _fmt(s["ttft_ms_later"]["p90"])]
        cells += ["-" if not first or not later else f"{first / later:.2f}x"]
        cells += [f"{_fmt(split.get('queue'))} / {_fmt(split.get('prefill'))}"]
        cells += [_pct(h["device_hit_rate"]), _pct(h["host_hit_rate"]), _pct(h["usage"]["cached_ratio"])]
        cells += [f"{h.get('offloaded_bytes', 0) / 2**20:.1f}", f"{h.get('loaded_bytes', 0) / 2**20:.1f}"]
        cells += [f"{kv['device_blocks']} / {kv['working_set_blocks']} ({kv['device_to_working_set']:.0%})"]
        cells += [_pct(s["same_prefill_worker_ratio"])]
        lines.append("| " + " | ".join(cells) + " |")
    labels = list(results)
    lines += ["", "| turn | " + " | ".join(f"{label} p50 / p90" for label in labels) + " |"]
    lines.append("|" + "---|" * (len(labels) + 1))
    num_turns = max((len(s["per_turn"]) for s in results.values()), default=0)
    for k in range(num_turns):
        cells = [str(k + 1)]
        for label in labels:
            q = results[label]["per_turn"][k]["ttft_ms"]
            cells.append(f"{_fmt(q['p50'])} / {_fmt(q['p90'])}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def bench_url(url: str, label: str, block_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run against ``url``: scrape, the conversations, scrape; writes ``<out>/<label>.json``."""
    w, settings = workload(args), client_settings(args)
    before = scrape(url, args.api_key)
    blocks = int(before.get("colocated", before.get("prefill", {})).get("device_blocks", 0))
    working_set = w.working_set_blocks(block_size)
    print(
        f"== {label}: working set {working_set} blocks of {block_size} tokens ({w.num_conversations} "
        f"conversations x {w.num_turns} turns, last prompt {w.prompt_len(w.num_turns)} tokens); device "
        f"KV of the prefilling pool {blocks} blocks ({blocks / working_set:.0%} of it)",
        flush=True,
    )
    turns, duration = asyncio.run(run_conversations(url, w, settings))
    summary = {
        "label": label,
        "target": url,
        "workload": asdict(w),
        **summarize(turns, duration, before, scrape(url, args.api_key), w, block_size),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [{"conversation": t.conversation, "turn": t.turn, **asdict(t.record)} for t in turns]
    (args.out / f"{label}.json").write_text(json.dumps({"summary": summary, "turns": rows}, indent=1))
    print_summary(label, summary)
    return summary


def bench_cluster(label: str, flags: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start the cluster ``pdserve serve`` would start with ``flags``, bench it, shut it down."""
    from cluster.heap import freeze_startup_heap
    from deploy.cli_args import add_cluster_arguments, build_config
    from deploy.http_host import start_http
    from deploy.launch import build_cluster

    parser = argparse.ArgumentParser(prog=f"--run {label}")
    add_cluster_arguments(parser)
    cfg = build_config(parser.parse_args(shlex.split(flags)))
    if args.pin_cpu_cores:
        cfg = replace(cfg, pin_cpu_cores=True)
    print(f"== {label}: starting a cluster with {flags!r}", flush=True)
    handle = build_cluster(cfg)
    try:
        with start_http(handle) as http:
            freeze_startup_heap()
            return bench_url(http.url, label, cfg.engine_config(cfg.prefill_pool).block_size, args)
    finally:
        handle.shutdown()


def workload(args: argparse.Namespace) -> Workload:
    return Workload(
        args.conversations,
        args.turns,
        args.system_prompt_len,
        args.message_len,
        args.output_len,
        args.think_time_s,
        args.max_concurrency,
        args.seed,
    )


def client_settings(args: argparse.Namespace) -> ClientSettings:
    return ClientSettings(seed=args.seed, api_key=args.api_key, timeout=args.timeout, model=args.model)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    d = Workload()
    p = argparse.ArgumentParser(prog="pdserve bench multiturn", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default, without runs: 127.0.0.1:8000)")
    p.add_argument("--block-size", type=int, default=16, help="with --url: the server's KV block size")
    p.add_argument("--config", action="append", default=[], help="a cluster YAML to start (repeatable)")
    p.add_argument(
        "--run", action="append", default=[], metavar="LABEL=FLAGS", help="a cluster `pdserve serve FLAGS`"
    )
    p.add_argument("--cluster-args", default="", help="`pdserve serve` flags before every run's own")
    p.add_argument("--conversations", type=int, default=d.num_conversations)
    p.add_argument("--turns", type=int, default=d.num_turns)
    p.add_argument("--system-prompt-len", type=int, default=d.system_prompt_len, help="shared; 0: none")
    p.add_argument("--message-len", type=int, default=d.message_len, help="tokens of each user message")
    p.add_argument("--output-len", type=int, default=d.output_len, help="tokens of each answer")
    p.add_argument("--think-time-s", type=float, default=d.think_time_s, help="mean wait before a turn")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight (default: N)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name (default: the server's)")
    p.add_argument("--timeout", type=float, default=600.0, help="client read timeout, seconds")
    p.add_argument("--pin-cpu-cores", action="store_true", help="local clusters: a core per CPU worker")
    p.add_argument("--out", type=Path, default=Path("bench_results/multiturn"))
    args = p.parse_args(argv)
    runs = [(Path(c).stem, f"--config {shlex.quote(c)}") for c in args.config]
    for spec in args.run:
        label, sep, flags = spec.partition("=")
        if not sep or not label:
            p.error(f"--run takes LABEL=FLAGS, got {spec!r}")
        runs.append((label, flags))
    if args.url and runs:
        p.error("--url and --config / --run exclude each other")
    args.runs = [(label, f"{args.cluster_args} {flags}".strip()) for label, flags in runs]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # NOTE: not a line per request under Ray's logging
    results: dict[str, dict[str, Any]] = {}
    if args.runs:
        for label, flags in args.runs:
            results[label] = bench_cluster(label, flags, args)
    else:
        url = args.url or "http://127.0.0.1:8000"
        results["server"] = bench_url(url, "server", args.block_size, args)
    table = comparison_table(results)
    print(f"\nTTFT in ms at the client; hits: the prefilling pool's prompt tokens by tier\n{table}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "comparison.md").write_text(table + "\n")
    (args.out / "comparison.json").write_text(json.dumps(results, indent=1))
    return 0 if all(s["num_errors"] == 0 for s in results.values()) else 1

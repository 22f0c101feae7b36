"""A 16-GPU deployment rehearsed on this box: mock workers start, serve, scale up and back down.

    python -m bench.mock_cluster [--model bench/configs/qwen3-0.6b] [--gpu h100] [--prefill 8] [--decode 8]
                                 [--scale-to 10] [--requests 64] [--prompt-len 32 256] [--max-tokens 32]
                                 [--num-kv-blocks 128]

Runs ``pdserve serve MODEL --config deploy/mock-cluster.yaml --gpu GPU`` (Ray actors: ``--prefill``
prefill + ``--decode`` decode workers with ``load_format: mock``: no weights; each step waits the GPU's
roofline estimate for the model), then prints:

* the profile: a prefill's and a decode step's time, and what a KV handoff moves of each block (the
  signature word of each K and V row) before it waits out the rest of the GPU's link (transfer/paced_link.py);
* start: seconds from the command to every worker admitted (``/metrics``: ``pdserve_worker_healthy``),
  and the resident memory of the worker processes;
* three rounds of ``--requests`` concurrent greedy streaming completions (seeded token-id prompts),
  each with 16 workers, after ``pdserve scale --pool decode --workers SCALE_TO``, and after scaling back:
  requests served, tokens, wall time, how many outputs equal the mock's rule token for token, and how
  many prefill and decode workers moved KV in the round;
* each ``pdserve scale``'s wall time and the pool it left.

Figures, not pass/fail (tests/workers/test_mock_engine.py asserts the mock's behaviour exactly).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil

from cluster.client.sdk import AsyncClient
from cluster.client.types import StreamResult
from cluster.cost_model import CostProfile, shape_of
from cluster.tokenizer import Tokenizer
from deploy.mock_profile import write_gpu_profile
from transfer.paced_link import PacedLink
from transfer.protocol import DTYPE_ITEMSIZE, KVLayout
from workers.mock_runner import MockTokens
from workers.models.arch import ArchConfig

REPO = Path(__file__).resolve().parents[1]
START_LIMIT_S = 600.0
_SAMPLE = re.compile(r"^(pdserve_\w+)\{([^}]*)\} ([0-9.e+-]+)$", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_metric(url: str, name: str) -> dict[tuple[str, str], float]:
    """(worker, pool) -> value of one per-worker metric on /metrics (counters: the ``_total`` sample)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {}
    for sample, labels, value in _SAMPLE.findall(text):
        if sample in (name, f"{name}_total"):
            label = dict(_LABEL.findall(labels))
            values[label["worker"], label["pool"]] = float(value)
    return values


def wait_healthy(url: str, num_workers: int, limit_s: float, server: subprocess.Popen[bytes]) -> float:
    """Seconds until ``num_workers`` workers are healthy on /metrics (polled with a bound)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if server.poll() is not None:
            raise RuntimeError(f"pdserve serve exited with {server.returncode}")
        try:
            healthy = worker_metric(url, "pdserve_worker_healthy")
            if sum(healthy.values()) >= num_workers:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1.0)  # NOTE: polling a condition with a bound
    raise TimeoutError(f"{num_workers} workers not healthy within {limit_s} s")


def worker_rss_mib() -> tuple[int, float]:
    """(number, total resident MiB) of this machine's EngineWorker actor processes."""
    procs = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "ray::EngineWorker" in " ".join(p.info["cmdline"] or [])
    ]
    return len(procs), sum(p.memory_info().rss for p in procs) / 2**20


async def serve_round(url: str, prompts: list[list[int]], max_tokens: int) -> list[StreamResult]:
    """Every prompt at once, streamed greedily; each stream's result as the client measured it."""
    async with AsyncClient(url, max_retries=0, timeout=300) as client:

        async def one(prompt: list[int]) -> StreamResult:
            stream = await client.completions.create(
                stream=True, prompt=prompt, max_tokens=max_tokens, temperature=0.0
            )
            async for _ in stream:
                pass
            return stream.result

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def run_round(
    url: str, label: str, prompts: list[list[int]], max_tokens: int, expected: list[list[int]]
) -> None:
    before = worker_metric(url, "pdserve_kv_transfers")
    t0 = time.perf_counter()
    results = asyncio.run(serve_round(url, prompts, max_tokens))
    wall = time.perf_counter() - t0
    served, num_tokens = len(results), sum(len(r.token_ids) for r in results)
    exact = sum(r.token_ids == want for r, want in zip(results, expected, strict=True))
    ttft = [r.ttft_s or 0.0 for r in results]
    tbt = [gap for r in results for gap in r.tbt_s]
    split = [r.timings for r in results if r.timings is not None]
    phases = {
        name: statistics.median(getattr(t, f"{name}_s") for t in split) * 1e3
        for name in ("queue", "prefill", "transfer", "decode")
    }
    after = worker_metric(url, "pdserve_kv_transfers")
    moved = {k for k, v in after.items() if v > before.get(k, 0.0)}
    pools = {pool: sum(1 for _, p in moved if p == pool) for pool in ("prefill", "decode")}
    print(
        f"{label}: {served} requests served, {num_tokens} tokens in {wall:.2f} s ({num_tokens / wall:.0f} tok/s); "
        f"{exact}/{served} equal the mock's rule; KV moved by {pools['prefill']} prefill and "
        f"{pools['decode']} decode workers; TTFT p50 {statistics.median(ttft) * 1e3:.0f} ms, "
        f"max {max(ttft) * 1e3:.0f} ms; TBT p50 {statistics.median(tbt) * 1e3:.1f} ms, "
        f"p90 {statistics.quantiles(tbt, n=10)[-1] * 1e3:.1f} ms; the router's split, p50 ms: "
        + ", ".join(f"{name} {ms:.0f}" for name, ms in phases.items()),
        flush=True,
    )


def scale(url: str, env: dict[str, str], pool: str, num_workers: int) -> None:
    t0 = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "scale",
        "--url",
        url,
        "--pool",
        pool,
        "--workers",
        str(num_workers),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=START_LIMIT_S)
    if out.returncode != 0:
        raise RuntimeError(f"pdserve scale failed: {out.stderr.strip()}")
    print(
        f"pdserve scale --pool {pool} --workers {num_workers}: {time.perf_counter() - t0:.1f} s -> {out.stdout.strip()}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.mock_cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "bench" / "configs" / "qwen3-0.6b"))
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--scale-to", type=int, default=10, help="the decode pool's size in the second round")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--num-kv-blocks", type=int, default=128, help="per worker (host memory: the KV's bytes)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    arch = ArchConfig.from_pretrained(args.model)
    rule = MockTokens.for_model(arch, Tokenizer.from_pretrained(args.model))
    rng = random.Random(args.seed)
    prompts = [
        [rng.choice(rule.allowed_ids) for _ in range(rng.randint(*args.prompt_len))]
        for _ in range(args.requests)
    ]
    expected = []
    for p in prompts:
        out, token, position = [], p[-1], len(p) - 1
        for _ in range(args.max_tokens):
            token, position = rule.next_token(token, position), position + 1
            out.append(token)
        expected.append(out)

    profile = CostProfile.load(write_gpu_profile(args.gpu, args.model))
    mean_len = sum(map(len, prompts)) // len(prompts)
    batch = -(-args.requests // args.decode)
    print(
        f"profile {profile.name!r}: a {mean_len}-token prefill "
        f"{profile.step_s(shape_of([(0, mean_len, False)])) * 1e3:.2f} ms, a decode step of {batch} sequences "
        f"at {mean_len} positions {profile.step_s(shape_of([(mean_len, 1, True)] * batch)) * 1e3:.2f} ms"
    )
    dtype = arch.torch_dtype if arch.torch_dtype in DTYPE_ITEMSIZE else "bfloat16"
    layout = KVLayout(arch.num_hidden_layers, 16, arch.num_key_value_heads, arch.head_dim, dtype)
    print(f"handoffs: {PacedLink(profile.transfer, '127.0.0.1').describe(layout)}")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PDSERVE_ADMIN_KEY": secrets.token_hex(16)}
    cmd = [
        sys.executable, "-m", "deploy.cli", "serve", args.model, "--config", str(REPO / "deploy" / "mock-cluster.yaml"),
        "--gpu", args.gpu, "--port", str(port), "--num-prefill-workers", str(args.prefill),
        "--num-decode-workers", str(args.decode), "--num-kv-blocks", str(args.num_kv_blocks),
        "--log-level", "WARNING",
    ]  # fmt: skip
    num_workers = args.prefill + args.decode
    print(
        f"$ {' '.join(cmd[2:])}  (on {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB)"
    )
    t0 = time.monotonic()
    log = tempfile.NamedTemporaryFile("wb", prefix="mock-cluster-", suffix=".log", delete=False)  # noqa: SIM115
    print(f"server log: {log.name}")
    server = subprocess.Popen(
        cmd, env=env, cwd=REPO, start_new_session=True, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        up_s = wait_healthy(url, num_workers, START_LIMIT_S, server)
        count, rss = worker_rss_mib()
        print(
            f"start: {num_workers} workers ({args.prefill} prefill + {args.decode} decode) healthy {up_s:.1f} s "
            f"after the command; {count} worker processes, {rss:.0f} MiB resident in all ({rss / max(count, 1):.0f} each)",
            flush=True,
        )
        run_round(url, f"round 1 ({num_workers} workers)", prompts, args.max_tokens, expected)
        scale(url, env, "decode", args.scale_to)
        run_round(
            url, f"round 2 ({args.prefill + args.scale_to} workers)", prompts, args.max_tokens, expected
        )
        scale(url, env, "decode", args.decode)
        run_round(url, f"round 3 ({num_workers} workers)", prompts, args.max_tokens, expected)
        count, rss = worker_rss_mib()
        print(f"end: {count} worker processes, {rss:.0f} MiB resident; {time.monotonic() - t0:.1f} s in all")
    finally:
        server.send_signal(signal.SIGINT)  # NOTE: pdserve serve shuts its cluster down on SIGINT
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

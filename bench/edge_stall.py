"""Does one huge prompt stall everyone else? Two measures, each alone and while other clients post ~1 MiB
text prompts:

- a stream's time between tokens (TBT), while ``--flooders`` clients keep posting huge prompts;
- a small request's latency (a 1-token completion), while 8 huge prompts arrive at once (issue 31 row 8:
  before the fix, 8 at once made a small request wait 5.8 s behind the two shared tokenizer threads).

    python bench/edge_stall.py [--config deploy/cpu-disagg.yaml] [--max-tokens 300] [--flooders 2]
    python bench/edge_stall.py --edge [--one-lane]

On a live cluster (the default) a ~1 MiB prompt is far past max_model_len x the tokenizer's longest
token, so the edge refuses it on its characters, untokenized. ``--edge`` serves the HTTP edge alone over
an in-process stub router whose max_model_len (2**20) admits the huge prompts: each is tokenized in full
(the bundled tokenizer), the case the large-body lane exists for; ``--one-lane`` puts every body on the
shared edge threads, as before the fix, for comparison. Prints p50 / p90 / max of each measure and how the
huge prompts were answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

NUM_BURST = 8


def huge_prompt(seed: int, num_bytes: int) -> str:
    rng = random.Random(seed)
    words = []
    size = 0
    while size < num_bytes:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:num_bytes]


async def stream_gaps(url: str, max_tokens: int) -> list[float]:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    body["stream"] = True
    gaps: list[float] = []
    last: float | None = None
    async with (
        httpx.AsyncClient(timeout=300) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if not json.loads(line[6:])["choices"]:
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


async def post_huge(client: httpx.AsyncClient, url: str, payload: bytes) -> int:
    r = await client.post(
        f"{url}/v1/completions", content=payload, headers={"content-type": "application/json"}
    )
    return r.status_code


async def flood(url: str, payload: bytes, stop: asyncio.Event, counts: list[int]) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        while not stop.is_set():
            counts.append(await post_huge(client, url, payload))


async def tbt_phase(
    url: str, max_tokens: int, num_flooders: int, payload: bytes
) -> tuple[list[float], list[int]]:
    stop = asyncio.Event()
    counts: list[int] = []
    flooders = [asyncio.create_task(flood(url, payload, stop, counts)) for _ in range(num_flooders)]
    try:
        if flooders:
            await asyncio.sleep(0.5)  # NOTE: let the first huge prompts reach the server (a benchmark)
        gaps = await stream_gaps(url, max_tokens)
    finally:
        stop.set()
        await asyncio.gather(*flooders)
    return gaps, counts


async def small_latency(client: httpx.AsyncClient, url: str) -> float:
    t0 = time.perf_counter()
    r = await client.post(f"{url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 1})
    r.raise_for_status()
    return time.perf_counter() - t0


async def burst_phase(
    url: str, payload: bytes | None, num_small: int
) -> tuple[list[float], list[int], float]:
    """Small requests one after another (``num_small`` of them, or while the burst lasts); with a payload,
    ``NUM_BURST`` huge prompts are posted at once first. Returns the small latencies, the huge prompts'
    statuses and how long the burst took."""
    async with httpx.AsyncClient(timeout=300) as client, httpx.AsyncClient(timeout=300) as big_client:
        t0 = time.perf_counter()
        burst = (
            asyncio.gather(*(post_huge(big_client, url, payload) for _ in range(NUM_BURST)))
            if payload is not None
            else None
        )
        burst_task = asyncio.ensure_future(burst) if burst is not None else None
        if burst_task is not None:
            await asyncio.sleep(0.05)  # NOTE: let the burst's bodies reach the server first (a benchmark)
        latencies = [await small_latency(client, url)]
        while len(latencies) < num_small or (burst_task is not None and not burst_task.done()):
            latencies.append(await small_latency(client, url))
        statuses = list(await burst_task) if burst_task is not None else []
        return latencies, statuses, time.perf_counter() - t0


def summary(name: str, values: list[float], counts: list[int], unit: str) -> str:
    q = statistics.quantiles(values, n=100) if len(values) > 1 else values * 99
    ms = [1000 * v for v in (statistics.median(values), q[89], max(values))]
    statuses = {s: counts.count(s) for s in sorted(set(counts))}
    return (
        f"{name:<34} {unit} p50 {ms[0]:7.1f}  p90 {ms[1]:7.1f}  max {ms[2]:8.1f} ms  (n={len(values)})"
        f"   huge prompts answered: {statuses or '-'}"
    )


@contextlib.contextmanager
def edge_only(one_lane: bool) -> Iterator[str]:
    """The HTTP edge over the tests' stub router, the bundled tokenizer and max_model_len 2**20."""
    from cluster.http.app import create_app
    from cluster.protocol import ModelInfo
    from cluster.tokenizer import Tokenizer
    from tests.support.stub_router import ServerThread, StubRouter

    tokenizer = Tokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "workers/assets/pdserve-tiny")
    assert tokenizer is not None
    router = StubRouter(max_model_len=1 << 20)
    router.model_info = ModelInfo("stub-model", "/models/stub", 1 << 20, tokenizer.vocab_size)
    app = create_app(router, tokenizer)
    if one_lane:
        app.state.pdserve.large_body_bytes = 1 << 62  # every body on the shared edge threads
    with ServerThread(app) as server:
        yield server.url


@contextlib.contextmanager
def live_cluster(config: str) -> Iterator[str]:
    from deploy.http_host import start_http
    from deploy.launch import build_cluster

    handle = build_cluster(config)
    try:
        with start_http(handle) as http:
            yield http.url
    finally:
        handle.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="deploy/cpu-disagg.yaml")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--flooders", type=int, default=2)
    ap.add_argument("--prompt-bytes", type=int, default=(1 << 20) - 4096)
    ap.add_argument("--small", type=int, default=20, help="small requests in the baseline")
    ap.add_argument("--edge", action="store_true", help="the HTTP edge alone, huge prompts admitted")
    ap.add_argument("--one-lane", action="store_true", help="with --edge: no large-body lane (as before)")
    args = ap.parse_args()
    payload = json.dumps({"prompt": huge_prompt(0, args.prompt_bytes), "max_tokens": 1}).encode()
    lines = []
    with edge_only(args.one_lane) if args.edge else live_cluster(args.config) as url:
        asyncio.run(stream_gaps(url, 8))  # warm-up
        base = asyncio.run(burst_phase(url, None, args.small))
        loaded = asyncio.run(burst_phase(url, payload, args.small))
        lines.append(summary("small request alone", base[0], base[1], "latency"))
        lines.append(summary(f"small request, {NUM_BURST} x 1 MiB at once", loaded[0], loaded[1], "latency"))
        lines.append(f"{'':<34} the {NUM_BURST} huge prompts took {loaded[2]:.2f} s")
        if not args.edge:
            quiet = asyncio.run(tbt_phase(url, args.max_tokens, 0, payload))
            flooded = asyncio.run(tbt_phase(url, args.max_tokens, args.flooders, payload))
            lines.append(summary("stream alone", *quiet, "TBT"))
            lines.append(summary(f"stream, {args.flooders} x 1 MiB flood", *flooded, "TBT"))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

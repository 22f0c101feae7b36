"""Does one huge prompt stall everyone else's tokens? A stream's time between tokens (TBT) on a live
cluster, alone and while other clients keep posting ~1 MiB text prompts (each ends in a 400 once
tokenized: far past max_model_len).

    python bench/edge_stall.py [--config deploy/cpu-disagg.yaml] [--max-tokens 300] [--flooders 2]

Prints TBT p50 / p90 / p99 / max of the streaming request in both phases and how many huge prompts the
flooders got answered meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from deploy.http_host import start_http
from deploy.launch import start_cluster


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


async def flood(url: str, payload: bytes, stop: asyncio.Event, counts: list[int]) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        while not stop.is_set():
            r = await client.post(
                f"{url}/v1/completions", content=payload, headers={"content-type": "application/json"}
            )
            counts.append(r.status_code)


async def phase(
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


def summary(name: str, gaps: list[float], counts: list[int]) -> str:
    q = statistics.quantiles(gaps, n=100)
    ms = [1000 * v for v in (statistics.median(gaps), q[89], q[98], max(gaps))]
    statuses = {s: counts.count(s) for s in sorted(set(counts))}
    return (
        f"{name:<24} TBT p50 {ms[0]:7.1f}  p90 {ms[1]:7.1f}  p99 {ms[2]:7.1f}  max {ms[3]:7.1f} ms"
        f"   huge prompts answered: {statuses or '-'}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="deploy/cpu-disagg.yaml")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--flooders", type=int, default=2)
    ap.add_argument("--prompt-bytes", type=int, default=(1 << 20) - 4096)
    args = ap.parse_args()
    payload = json.dumps({"prompt": huge_prompt(0, args.prompt_bytes), "max_tokens": 1}).encode()
    handle = start_cluster(args.config)
    try:
        with start_http(handle) as http:
            asyncio.run(stream_gaps(http.url, 8))  # warm-up
            quiet = asyncio.run(phase(http.url, args.max_tokens, 0, payload))
            loaded = asyncio.run(phase(http.url, args.max_tokens, args.flooders, payload))
        print(summary("alone", *quiet))
        print(summary(f"with {args.flooders} x 1 MiB flood", *loaded))
    finally:
        handle.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

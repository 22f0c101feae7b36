"""kill -9 of each worker of a served cluster under 16 streams: client errors, texts, time to heal.

    python -m bench.serve_kill --config deploy/cpu-disagg.yaml [--port 8765] [--max-tokens 96]

Starts `pdserve serve` with the config, streams 16 greedy completions through the official openai client
once undisturbed (the reference texts), then for each worker's first process in turn: 16 streams again
with that process killed (SIGKILL) 0.6 s in, and prints the client errors, how many texts equal the
reference, how long after the kill every worker was healthy again (the killed one restarted by Ray and
re-admitted: `pdserve_worker_healthy` on /metrics), and a round after it. Figures, not a pass/fail test:
tests/e2e/test_elastic.py asserts the same behaviour exactly.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx
from openai import OpenAI

NUM_STREAMS = 16
KILL_AFTER_S = 0.6
HEAL_LIMIT_S = 90.0
START_LIMIT_S = 240.0


def worker_pids() -> list[int]:
    """The pids of this machine's EngineWorker actor processes."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return sorted(int(line.split()[0]) for line in out.splitlines() if "ray::EngineWorker" in line)


def healthy(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    pattern = r'pdserve_worker_healthy\{[^}]*worker="([^"]+)"[^}]*\} ([0-9.]+)'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text)}


def stream(client: OpenAI, model: str, prompt: str, max_tokens: int) -> str:
    chunks = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    return "".join(chunk.choices[0].text for chunk in chunks)


def one_round(
    client: OpenAI, model: str, max_tokens: int, victim: int | None
) -> tuple[list[str | None], int]:
    """Every prompt streamed at once; ``victim`` killed ``KILL_AFTER_S`` in. The texts and the errors."""
    prompts = [f"Once upon a time {i}" for i in range(NUM_STREAMS)]
    with cf.ThreadPoolExecutor(NUM_STREAMS) as pool:
        futures = [pool.submit(stream, client, model, p, max_tokens) for p in prompts]
        if victim is not None:
            time.sleep(KILL_AFTER_S)
            os.kill(victim, signal.SIGKILL)
        texts: list[str | None] = []
        for future in futures:
            try:
                texts.append(future.result())
            except Exception as e:  # noqa: BLE001 - a client error is what this counts
                print(f"  client error: {type(e).__name__}: {str(e)[:200]}")
                texts.append(None)
    return texts, sum(t is None for t in texts)


def wait_until_served(url: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not come up within {START_LIMIT_S:.0f} s")


def run(url: str, max_tokens: int) -> None:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    names = sorted(healthy(url))
    reference, errors = one_round(client, model, max_tokens, None)
    print(f"workers {names}; undisturbed round: {errors} client errors")
    for victim in worker_pids():
        killed_at = time.monotonic()
        texts, errors = one_round(client, model, max_tokens, victim)
        equal = sum(t == r for t, r in zip(texts, reference, strict=True))
        healed = False
        while not healed and time.monotonic() - killed_at < HEAL_LIMIT_S:
            pids = worker_pids()
            now = healthy(url)
            healed = victim not in pids and len(pids) == len(names) and all(now.get(n) == 1.0 for n in names)
            time.sleep(0.25)
        heal_s = time.monotonic() - killed_at
        after, after_errors = one_round(client, model, max_tokens, None)
        after_equal = sum(t == r for t, r in zip(after, reference, strict=True))
        print(
            f"kill -9 pid {victim}: {errors} client errors, {equal}/{NUM_STREAMS} texts equal the undisturbed "
            f"round; every worker healthy again: {f'{heal_s:.1f} s after the kill' if healed else 'NO'}; "
            f"the round after: {after_errors} errors, {after_equal}/{NUM_STREAMS} equal"
        )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_kill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="deploy/cpu-disagg.yaml")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "deploy.cli", "serve", "--config", args.config, "--port", str(args.port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_served(url, server)
        print(f"config {args.config}")
        run(url, args.max_tokens)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

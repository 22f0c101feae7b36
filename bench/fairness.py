"""Can one client starve the others? (issue 31 row 5: 64 requests x n=16 from one client made another
client's request a 429 "1024 requests in flight".)

Two tenants, keys ``alpha`` and ``beta``. ``alpha`` floods: ``--flooders`` clients each post n=16
completions back to back, so alpha sits at its per-key cap the whole time (after a 429 a client waits the
Retry-After, or ``--pause`` seconds). Meanwhile ``beta`` posts ``--probes`` small completions one after
another. Printed: beta's latency alone and under the flood (p50 / p90 / max) and status counts, and
alpha's status counts. With ``--max-requests-per-key 0`` (no per-key limit) the flood fills the router's
global cap instead, and beta is refused, as before the fix.

    python -m bench.fairness --edge [--max-requests-per-key 64] [--flooders 64]
    python -m bench.fairness [--config deploy/cpu-disagg.yaml] [--max-requests-per-key 32]

``--edge`` serves the HTTP edge alone over the tests' stub router (tokens every millisecond) with the
router's global cap of 1024 requests in flight emulated; the default runs a live cluster from ``--config``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx

KEYS = {"alpha": "sk-bench-alpha", "beta": "sk-bench-beta"}
GLOBAL_CAP = 1024  # the router's default max_pending_requests


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


async def flooder(
    url: str, n: int, max_tokens: int, pause_s: float | None, stop: asyncio.Event, statuses: Counter[str]
) -> None:
    body = {"prompt": "Once upon a time", "n": n, "max_tokens": max_tokens, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600) as client:
        while not stop.is_set():
            r = await client.post(f"{url}/v1/completions", json=body, headers=auth("alpha"))
            code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
            statuses[f"{r.status_code} {code}" if code else str(r.status_code)] += 1
            if r.status_code == 429:
                wait_s = pause_s if pause_s is not None else float(r.headers.get("retry-after", 1))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait_s)


async def probes(url: str, count: int) -> tuple[list[float], Counter[str]]:
    """``count`` small beta requests one after another: their latencies (200s only) and statuses."""
    body = {"prompt": "The little dog ran to the park", "max_tokens": 8, "ignore_eos": True}
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(count):
            t0 = time.perf_counter()
            r = await client.post(f"{url}/v1/completions", json=body, headers=auth("beta"))
            code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
            statuses[f"{r.status_code} {code}" if code else str(r.status_code)] += 1
            if r.status_code == 200:
                latencies.append(time.perf_counter() - t0)
    return latencies, statuses


async def flood_phase(url: str, args: argparse.Namespace) -> tuple[list[float], Counter[str], Counter[str]]:
    stop = asyncio.Event()
    alpha: Counter[str] = Counter()
    tasks = [
        asyncio.create_task(flooder(url, args.n, args.max_tokens, args.pause, stop, alpha))
        for _ in range(args.flooders)
    ]
    try:
        # NOTE: start probing once alpha is refused (at its cap, or the global one), bounded
        deadline = time.monotonic() + 120
        while not any(s.startswith("429") for s in alpha) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        latencies, beta = await probes(url, args.probes)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return latencies, beta, alpha


def line(name: str, latencies: list[float], statuses: Counter[str]) -> str:
    if latencies:
        q = statistics.quantiles(latencies, n=10)[8] if len(latencies) > 1 else latencies[0]
        ms = f"p50 {1000 * statistics.median(latencies):7.1f}  p90 {1000 * q:7.1f}  max {1000 * max(latencies):7.1f} ms"
    else:
        ms = "no request served"
    return f"{name:<42} {ms}   statuses {dict(sorted(statuses.items()))}"


def _keys_file(directory: Path) -> Path:
    """The tenants KEYS as a keys file in ``directory``."""
    keys_file = directory / "keys"
    keys_file.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    return keys_file


@contextlib.contextmanager
def edge_only(args: argparse.Namespace) -> Iterator[str]:
    """The HTTP edge over the tests' stub router, with the router's global cap emulated."""
    from cluster.config import ServerConfig
    from cluster.http.app import create_app
    from cluster.protocol import GenerateRequest, QueueFullError, TokenDelta
    from tests.support.stub_router import ServerThread, StubRouter, make_tokenizer

    class CappedStubRouter(StubRouter):
        def __init__(self) -> None:
            super().__init__(max_model_len=4096)
            self.in_flight = 0

        async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
            if self.in_flight >= GLOBAL_CAP:
                raise QueueFullError(f"{self.in_flight} requests in flight (max_pending_requests)")
            self.in_flight += 1
            try:
                async for delta in super().generate(req):
                    yield delta
            finally:
                self.in_flight -= 1

    router = CappedStubRouter()
    router.calls = _Discard()  # NOTE: the stub records every request; a benchmark would grow it forever
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerConfig(
            api_keys_file=str(_keys_file(Path(tmp))),
            max_requests_per_key=args.max_requests_per_key,
            max_tokens_per_key=args.max_tokens_per_key,
        )
        with ServerThread(create_app(router, make_tokenizer(), server)) as thread:
            yield thread.url


class _Discard(list[Any]):
    def append(self, item: Any) -> None:
        pass


@contextlib.contextmanager
def live_cluster(args: argparse.Namespace) -> Iterator[str]:
    from cluster.config import ClusterConfig
    from deploy.cli_args import config_path, load_config_data
    from deploy.http_host import start_http
    from deploy.launch import build_cluster

    with tempfile.TemporaryDirectory() as tmp:
        data = load_config_data(config_path(args.config))
        data["server"] = {
            **(data.get("server") or {}),
            "api_keys_file": str(_keys_file(Path(tmp))),
            "max_requests_per_key": args.max_requests_per_key,
            "max_tokens_per_key": args.max_tokens_per_key,
        }
        handle = build_cluster(ClusterConfig.from_dict(data))
        try:
            with start_http(handle) as http:
                yield http.url
        finally:
            handle.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.fairness", description=__doc__.split("\n\n")[0])
    ap.add_argument("--edge", action="store_true", help="the HTTP edge alone over a stub router")
    ap.add_argument("--config", default="deploy/cpu-disagg.yaml")
    ap.add_argument(
        "--max-requests-per-key", type=int, default=None, help="0: off (default: 64 edge, 32 live)"
    )
    ap.add_argument("--max-tokens-per-key", type=int, default=0)
    ap.add_argument("--flooders", type=int, default=64, help="alpha's concurrent clients")
    ap.add_argument("--n", type=int, default=16, help="choices per alpha request")
    ap.add_argument(
        "--max-tokens", type=int, default=None, help="per alpha choice (default: 256 edge, 64 live)"
    )
    ap.add_argument(
        "--pause", type=float, default=None, help="alpha's pause after a 429 (default: its Retry-After)"
    )
    ap.add_argument("--probes", type=int, default=30, help="beta's requests in each phase")
    args = ap.parse_args(argv)
    if args.max_requests_per_key is None:
        args.max_requests_per_key = 64 if args.edge else 32
    if args.max_tokens is None:
        args.max_tokens = 256 if args.edge else 64
    with edge_only(args) if args.edge else live_cluster(args) as url:
        asyncio.run(probes(url, 3))  # warm-up
        alone = asyncio.run(probes(url, args.probes))
        flooded = asyncio.run(flood_phase(url, args))
    cap = args.max_requests_per_key or "off"
    print(
        f"{'edge + stub router' if args.edge else args.config}; max_requests_per_key {cap}; alpha: "
        f"{args.flooders} clients x n={args.n} x {args.max_tokens} tokens"
    )
    print(line("beta alone", *alone))
    print(line("beta while alpha floods", flooded[0], flooded[1]))
    print(f"{'alpha (the flood)':<42} statuses {dict(sorted(flooded[2].items()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

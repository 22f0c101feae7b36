"""Per-request HTTP overhead of pdserve's API on a kept-alive connection (issue 11, "the 40 ms").

    python -m bench.http_overhead                                   # stub router + minimal apps
    python -m bench.http_overhead --config deploy/cpu-disagg.yaml   # also a live cluster

Targets, all measured in one run:

* pdserve: ``create_app`` over a router whose generate yields one token at once (engine time ~0),
  hosted the way ``pdserve serve`` hosts it (``deploy.http_host``: its listening socket, uvicorn
  ``serve(sockets=...)`` on an asyncio loop thread standing in for the router's loop).
* minimal: a minimal FastAPI app with the same three answers, uvicorn binding its own socket (what
  ``uvicorn app:app`` does) on its own loop thread: the reference.
* minimal@pdserve-host: the minimal app hosted like pdserve; separates the app's cost from the hosting's.
* cluster (``--config``): ``build_cluster`` + ``start_http``, the real thing; engine time is the
  router's ``pdserve_timings.e2e_s``.

Kinds: a non-streaming completion (``max_tokens=1``), the same streamed, and a 400 (``max_tokens=-1``).
Clients: ``httpx.Client``, the ``openai`` client, and a raw socket with TCP_NODELAY that writes each
request in one ``sendall``. Each (kind, client, target) sends ``--warmup`` then ``--requests`` requests
on one kept-alive connection, the targets taken in turn ``--block`` requests at a time. Goal per row:
the median of (latency - the request's own engine time) <= 1.5 x the minimal app's median (same kind
and client) + 1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import re
import socket
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.http.app import create_app, create_server
from cluster.protocol import FinishReason, GenerateRequest, ModelInfo, RequestTimings, TokenDelta, WorkerStats
from cluster.router.stream import OutputListener, RequestStream
from deploy.http_host import HttpServerHandle, listen

PROMPT = [10, 11, 12]
KINDS = {
    "json": {"prompt": PROMPT, "max_tokens": 1},
    "stream": {"prompt": PROMPT, "max_tokens": 1, "stream": True},
    "400": {"prompt": PROMPT, "max_tokens": -1},
}
_E2E = re.compile(rb'"e2e_s":\s*([0-9.eE+-]+)')


class OneTokenRouter:
    """A RouterLike whose stream gets its one token in the next turn of the loop: what remains is the HTTP
    path's cost."""

    def __init__(self) -> None:
        self.model_info = ModelInfo("stub-model", "/models/stub", 128, 512)
        self.mode = "disaggregated"

    def open(
        self,
        req: GenerateRequest,
        listener: OutputListener | None = None,
        *,
        max_unread_bytes: int | None = None,
        unread_elsewhere: Callable[[], int] | None = None,
    ) -> RequestStream:
        stream = RequestStream(
            req.request_id, listener, max_unread_bytes=max_unread_bytes, unread_elsewhere=unread_elsewhere
        )
        timings = RequestTimings(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        delta = TokenDelta(req.request_id, [7], "", None, FinishReason.LENGTH, timings=timings)
        asyncio.get_running_loop().call_soon(stream.put, delta)
        return stream

    def is_healthy(self) -> bool:
        return True

    def worker_stats(self) -> list[WorkerStats]:
        return []

    def rejected_frames(self) -> dict[str, int]:
        return {}

    def route_decisions(self) -> dict[tuple[str, str], int]:
        return {}


def minimal_app() -> FastAPI:
    """The reference: the same three answers with nothing behind them."""
    app = FastAPI()
    chunk = {"id": "cmpl-0", "object": "text_completion", "model": "m", "choices": []}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        if body.get("max_tokens", 1) < 1:
            return JSONResponse({"error": {"message": "max_tokens must be >= 1"}}, status_code=400)
        choice = {"index": 0, "text": "", "finish_reason": "length", "logprobs": None}
        if not body.get("stream"):
            return JSONResponse({**chunk, "choices": [choice]})

        async def events() -> AsyncIterator[bytes]:
            yield f"data: {json.dumps({**chunk, 'choices': [choice]})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class LoopThread:
    """An asyncio loop on a daemon thread (stands in for the router's loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@dataclass
class Target:
    """A served app: where to reach it, the model name to send, and its uvicorn server and loop."""

    name: str
    url: str
    model: str
    server: uvicorn.Server
    loop: asyncio.AbstractEventLoop

    def accepted_nodelay(self) -> list[int]:
        """TCP_NODELAY of the server's accepted sockets, read on its loop while a client is connected."""

        async def read() -> list[int]:
            return [
                conn.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                for conn in self.server.server_state.connections
            ]

        with httpx.Client(base_url=self.url, timeout=30) as client:
            client.get("/health")
            return asyncio.run_coroutine_threadsafe(read(), self.loop).result(10)


def host_like_pdserve(app: FastAPI, loop: asyncio.AbstractEventLoop) -> HttpServerHandle:
    """``start_http``'s hosting, for any app: pdserve's listening socket, ``serve(sockets=...)`` on ``loop``."""
    sock = listen("127.0.0.1", 0)
    server = create_server(app, "127.0.0.1", int(sock.getsockname()[1]), "warning")
    future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop)
    http = HttpServerHandle(server, future, sock)
    http.wait_ready(30.0)
    return http


def host_like_uvicorn(
    app: FastAPI, loop: asyncio.AbstractEventLoop
) -> tuple[uvicorn.Server, str, Callable[[], None]]:
    """uvicorn binding its own socket (port 0) on ``loop``; returns the server, its URL and a stop."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    future = asyncio.run_coroutine_threadsafe(server.serve(), loop)
    deadline = time.monotonic() + 30.0
    while not server.started:
        if time.monotonic() > deadline or concurrent.futures.wait([future], timeout=0.02)[0]:
            raise RuntimeError("the minimal app's server did not start")

    def stop() -> None:
        server.should_exit = True
        future.result(15.0)

    return server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", stop


# ---- clients: each returns (latency_s, engine_s) for one request ----


class RawClient:
    """One kept-alive socket, TCP_NODELAY, each request written with one sendall."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def _read_until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("server closed the connection")
            self.buf += data
        head, self.buf = self.buf.split(sep, 1)
        return head

    def _read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("server closed the connection")
            self.buf += data
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def request(self, body: dict[str, Any]) -> tuple[float, float]:
        payload = json.dumps(body).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        start = time.perf_counter()
        self.sock.sendall(head + payload)
        headers = self._read_until(b"\r\n\r\n").lower()
        if m := re.search(rb"content-length:\s*(\d+)", headers):
            content = self._read_exact(int(m.group(1)))
        else:  # chunked
            parts = []
            while size := int(self._read_until(b"\r\n").split(b";")[0], 16):
                parts.append(self._read_exact(size + 2)[:-2])
            self._read_until(b"\r\n")
            content = b"".join(parts)
        return time.perf_counter() - start, _engine_s(content)

    def close(self) -> None:
        self.sock.close()


def _engine_s(content: bytes) -> float:
    m = _E2E.search(content)
    return float(m.group(1)) if m else 0.0


def httpx_client(url: str) -> tuple[Callable[[dict[str, Any]], tuple[float, float]], Callable[[], None]]:
    client = httpx.Client(base_url=url, timeout=30)

    def request(body: dict[str, Any]) -> tuple[float, float]:
        start = time.perf_counter()
        with client.stream("POST", "/v1/completions", json=body) as r:
            content = r.read()
        return time.perf_counter() - start, _engine_s(content)

    return request, client.close


def openai_client(url: str) -> tuple[Callable[[dict[str, Any]], tuple[float, float]], Callable[[], None]]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)

    def request(body: dict[str, Any]) -> tuple[float, float]:
        extra: dict[str, Any] = {}
        start = time.perf_counter()
        try:
            if body.get("stream"):
                for chunk in client.completions.create(**body):
                    if chunk.choices and chunk.choices[0].finish_reason is not None:
                        extra = chunk.choices[0].model_extra or {}
            else:
                out = client.completions.create(**body)
                extra = out.choices[0].model_extra or {}
        except openai.BadRequestError:
            pass
        elapsed = time.perf_counter() - start
        return elapsed, float((extra.get("pdserve_timings") or {}).get("e2e_s", 0.0))

    return request, client.close


def raw_client(url: str) -> tuple[Callable[[dict[str, Any]], tuple[float, float]], Callable[[], None]]:
    client = RawClient(url)
    return client.request, client.close


CLIENTS = {"httpx": httpx_client, "openai": openai_client, "raw": raw_client}


@dataclass
class Row:
    """One (kind, client, target)'s figures in seconds; ``http`` is each request's latency minus its
    engine time (the router's e2e_s; 0 where the answer carries none)."""

    median: float
    p90: float
    engine: float
    http: float
    http_p90: float


def _p90(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.9 * len(values)))]


def measure(targets: list[Target], kind: str, client: str, warmup: int, num: int, block: int) -> list[Row]:
    """``num`` requests (after ``warmup``) per target, each target on one kept-alive connection of
    ``client``, in blocks of ``block`` back-to-back requests per target, target after target.

    NOTE: blocks in turn expose every target to the same load from the rest of a shared box. Within a
    block, each request follows the last answer at once, as a client's next request does: Linux only
    delays ACKs (the 40 ms of issue 11) on a connection that answers what it received within the
    delayed-ACK timeout, so a connection left idle for a while between requests would hide the stall.
    """
    clients = [CLIENTS[client](t.url) for t in targets]
    bodies = [{"model": t.model, **KINDS[kind]} for t in targets]
    samples: list[list[tuple[float, float]]] = [[] for _ in targets]
    try:
        for (request, _), body in zip(clients, bodies, strict=True):
            for _ in range(warmup):
                request(body)
        while len(samples[0]) < num:
            n = min(block, num - len(samples[0]))
            for (request, _), body, out in zip(clients, bodies, samples, strict=True):
                out += [request(body) for _ in range(n)]
    finally:
        for _, close in clients:
            close()
    rows = []
    for s in samples:
        latencies, http = [x[0] for x in s], [x[0] - x[1] for x in s]
        engine = statistics.median(x[1] for x in s)
        rows.append(
            Row(statistics.median(latencies), _p90(latencies), engine, statistics.median(http), _p90(http))
        )
    return rows


def run(targets: list[Target], warmup: int, num: int, block: int) -> bool:
    """Measure every (kind, client, target), print the table and the goal check; True if it is met."""
    for t in targets:
        print(f"{t.name}: TCP_NODELAY on accepted sockets = {t.accepted_nodelay()}")
    print(f"{warmup} warm-up + {num} timed requests per row on one kept-alive connection, targets in turn")
    print(f"{block} requests at a time (ms); http = latency - engine time per request;")
    print("goal: median http <= 1.5 x minimal + 1 ms")
    print(f"{'kind':<7}{'client':<8}{'target':<22}{'median':>8}{'p90':>8}{'engine':>8}{'http':>8}"
          f"{'http p90':>9}{'limit':>8}  goal")  # fmt: skip
    all_ok = True
    for kind in KINDS:
        for client in CLIENTS:
            ref: float | None = None
            for t, row in zip(targets, measure(targets, kind, client, warmup, num, block), strict=True):
                if t.name == "minimal":
                    ref = row.median
                    verdict, limit = "(reference)", ""
                elif t.name.startswith("minimal@"):
                    verdict, limit = "(hosting check)", ""
                else:
                    assert ref is not None, "the minimal app is measured first"
                    bound = 1.5 * ref + 1e-3
                    ok = row.http <= bound
                    all_ok &= ok
                    verdict, limit = ("ok" if ok else "MISSED"), f"{bound * 1e3:8.2f}"
                print(f"{kind:<7}{client:<8}{t.name:<22}{row.median * 1e3:8.2f}{row.p90 * 1e3:8.2f}"
                      f"{row.engine * 1e3:8.2f}{row.http * 1e3:8.2f}{row.http_p90 * 1e3:9.2f}"
                      f"{limit:>8}  {verdict}", flush=True)  # fmt: skip
    print(f"goal (every path <= 1.5 x minimal + 1 ms + engine time): {'MET' if all_ok else 'MISSED'}")
    return all_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200, help="timed requests per row")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--block", type=int, default=20, help="back-to-back requests per target in turn")
    parser.add_argument("--config", help="also measure a live cluster started from this config")
    args = parser.parse_args(argv)

    with contextlib.ExitStack() as stack:
        minimal_loop, pdserve_loop = LoopThread(), LoopThread()
        stack.callback(minimal_loop.close)
        stack.callback(pdserve_loop.close)
        server, url, stop = host_like_uvicorn(minimal_app(), minimal_loop.loop)
        stack.callback(stop)
        targets = [Target("minimal", url, "m", server, minimal_loop.loop)]
        for name, app, model in [
            ("minimal@pdserve-host", minimal_app(), "m"),
            ("pdserve", create_app(OneTokenRouter(), None), "stub-model"),
        ]:
            http = stack.enter_context(host_like_pdserve(app, pdserve_loop.loop))
            targets.append(Target(name, http.url, model, http.server, pdserve_loop.loop))
        if args.config:
            from deploy.http_host import start_http
            from deploy.launch import build_cluster

            handle = build_cluster(args.config)
            stack.callback(handle.shutdown)
            http = stack.enter_context(start_http(handle))
            targets.append(Target("cluster", http.url, handle.model_info.name, http.server, handle.loop))
        return 0 if run(targets, args.warmup, args.requests, args.block) else 1


if __name__ == "__main__":
    raise SystemExit(main())

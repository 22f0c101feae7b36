"""Connections accepted by pdserve's HTTP hosting have TCP_NODELAY (issue 11, "the 40 ms").

uvicorn writes a response's head and body (and every streamed chunk) with separate sends. Without
TCP_NODELAY, Nagle holds the second send until the client ACKs the first, and clients delay that ACK
(~40 ms on Linux), so kept-alive requests stalled. Latency itself is measured by bench/http_overhead.py.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from cluster.http.app import create_app, create_server
from deploy.http_host import HttpServerHandle, listen
from tests.support.stub_router import StubRouter, make_tokenizer


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An asyncio loop on its own thread, as the router's loop is in ``start_http``."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_accepted_connections_have_tcp_nodelay(loop: asyncio.AbstractEventLoop, host: str) -> None:
    # NOTE: the hosting of start_http / serve_on_loop, step by step, minus the cluster behind the app
    sock = listen(host, 0)
    server = create_server(create_app(StubRouter(), make_tokenizer()), host, sock.getsockname()[1], "warning")
    future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop)
    with HttpServerHandle(server, future, sock) as http:
        http.wait_ready(30.0)

        async def accepted_nodelay() -> list[int]:
            return [
                conn.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                for conn in server.server_state.connections
            ]

        with (
            httpx.Client(base_url=http.url, timeout=30) as a,
            httpx.Client(base_url=http.url, timeout=30) as b,
        ):
            assert a.get("/health").json() == {"status": "ok"}
            assert b.post("/v1/completions", json={"max_tokens": 0}).status_code == 400
            # NOTE: a and b are still open (wait_ready's own connection may not be reaped yet)
            values = asyncio.run_coroutine_threadsafe(accepted_nodelay(), loop).result(10)
            assert len(values) >= 2 and values == [1] * len(values)

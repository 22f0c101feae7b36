"""Issue 31 row 7 (slow clients): a connection that sends half a request head, or a head and part of its
body, is answered 408 and closed after ``header_timeout_s`` / ``body_timeout_s``; a connection beyond
``max_connections`` is answered 503 and closed at once; an idle keep-alive connection is closed after
``keep_alive_timeout_s``. Issue 31 rows 7 and 10: a client that disconnects mid-body is answered quietly
(a 499 in the error metrics), never an ERROR traceback in the log.

The deadlines here are short so each test ends quickly; every wait on the client side is bounded by a
socket timeout far above them, and the tests assert what the server does (status line, closed socket),
never how fast."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI

from cluster.http.app import create_app, create_server
from cluster.http.connections import ConnectionLimits
from tests.support.cluster_utils import wait_for
from tests.support.stub_router import ServerThread, StubRouter, make_tokenizer

WAIT_S = 20.0  # NOTE: the bound of every client-side wait; the server's deadlines are well below it
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\nContent-Type: application/json\r\n"


class LimitedServerThread(ServerThread):
    """ServerThread whose uvicorn server has the given connection limits."""

    def __init__(self, app: FastAPI, limits: ConnectionLimits) -> None:
        super().__init__(app)
        self.server = create_server(app, "127.0.0.1", self.port, "warning", limits)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)


@pytest.fixture
def router() -> StubRouter:
    return StubRouter(max_model_len=64)


def serve(router: StubRouter, **limits: float) -> LimitedServerThread:
    defaults = {"max_connections": 64, "header_timeout_s": 0.3, "body_timeout_s": 0.3}
    settings = ConnectionLimits(**{**defaults, **limits})  # type: ignore[arg-type]
    return LimitedServerThread(create_app(router, make_tokenizer()), settings)


@pytest.fixture
def server(router: StubRouter) -> Iterator[LimitedServerThread]:
    with serve(router) as s:
        yield s


def connect(server: ServerThread) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    sock.settimeout(WAIT_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _health_ok(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=WAIT_S).status_code == 200
    except httpx.TransportError:
        return False


def test_issue31_row7_a_half_sent_head_is_answered_408_and_closed(server: LimitedServerThread) -> None:
    with connect(server) as sock:
        sock.sendall(HEAD)  # the blank line that ends the head never comes
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert reply.endswith(b"request head not received within header_timeout_s\n")


def test_issue31_row7_a_silent_connection_is_closed(server: LimitedServerThread) -> None:
    with connect(server) as sock:
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ")


def test_issue31_row7_a_stalled_body_is_answered_408_and_closed(
    server: LimitedServerThread, router: StubRouter
) -> None:
    with connect(server) as sock:
        sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert reply.endswith(b"request body not received within body_timeout_s\n")
    assert router.calls == []
    # NOTE: the route saw the cut-off as a disconnect: counted as a 499, nothing queued
    metrics = httpx.get(f"{server.url}/metrics", timeout=WAIT_S).text
    assert 'code="client_disconnected",model_name="stub-model",status="499"} 1.0' in metrics


def test_issue31_row7_connections_beyond_the_cap_get_503_and_are_closed(router: StubRouter) -> None:
    with serve(router, max_connections=2, header_timeout_s=30.0) as server:
        first, second = connect(server), connect(server)
        try:
            with connect(server) as third:
                reply = read_until_closed(third)
            assert reply.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
            assert b"retry-after: 1\r\n" in reply and reply.endswith(b"too many open connections to pdserve")
        finally:
            first.close()
            second.close()
        # NOTE: the closed ones free their places (the server notices a close on its own loop: poll)
        wait_for(lambda: _health_ok(server.url), WAIT_S, "a place freed under the connection cap")


def test_issue31_row7_an_idle_keep_alive_connection_is_closed(router: StubRouter) -> None:
    with serve(router, keep_alive_timeout_s=0.3, header_timeout_s=30.0) as server, connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: pdserve\r\n\r\n")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200 OK\r\n") and reply.endswith(b'{"status":"ok"}')


def test_issue31_rows7_and_10_a_disconnect_mid_body_is_quiet(
    server: LimitedServerThread, router: StubRouter, caplog: pytest.LogCaptureFixture
) -> None:
    uvicorn_logger = logging.getLogger("uvicorn")  # NOTE: uvicorn's loggers do not propagate to root
    uvicorn_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO), connect(server) as sock:
            sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')
            # the server has the head (it would answer a bad one at once); then the client goes away
            sock.shutdown(socket.SHUT_RDWR)
        needle = 'code="client_disconnected",model_name="stub-model",status="499"} 1.0'
        wait_for(
            lambda: needle in httpx.get(f"{server.url}/metrics", timeout=WAIT_S).text,
            WAIT_S,
            "the disconnect counted as a 499",
        )
    finally:
        uvicorn_logger.removeHandler(caplog.handler)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert router.calls == []

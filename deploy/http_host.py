"""Hosting the HTTP app on a running cluster: the app is served on the router's own event loop
(``handle.loop``), so handlers and the router share one loop and no request crosses threads.

``start_http(handle)`` (tests, benchmarks, the demo) returns once /health answers; ``serve_on_loop(handle)``
(``pdserve serve``: the one serving path) blocks until Ctrl-C / SIGTERM. Sits above ``deploy.launch``,
whose ``ClusterHandle`` it serves; launch never imports it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import logging
import signal
import socket
import threading
import time
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

import httpx
import uvicorn
from fastapi import FastAPI

from cluster.config import ClusterConfig, ServerConfig
from cluster.heap import freeze_startup_heap
from cluster.http.app import create_app, create_server
from cluster.http.auth import load_keys_file, read_key_file
from cluster.http.connections import ConnectionLimits
from cluster.http.fanout import StreamLimits
from cluster.http.quotas import TenantLimits
from cluster.http.server_state import Scaler
from cluster.router.router import Router
from cluster.tokenizer import Tokenizer
from deploy.planner.advice import Advisor

if TYPE_CHECKING:
    from deploy.launch import ClusterHandle

logger = logging.getLogger(__name__)


def create_cluster_app(handle: ClusterHandle) -> FastAPI:
    """The app over ``handle.router`` with the cluster's config; ``POST /v1/pdserve/scale`` scales its
    pools (``create_router_app``)."""
    return create_router_app(handle.router, handle.config, scaler=handle)


def create_router_app(
    router: Router, config: ClusterConfig, scaler: Scaler | None = None, replica: int | None = None
) -> FastAPI:
    """The app over ``router`` with the cluster's ``server:`` config and the model's tokenizer; client
    deadlines are capped at the router's ``request_timeout_s``; ``scaler`` (a cluster's handle) serves
    ``POST /v1/pdserve/scale``. Structured outputs are on: every worker's engine masks constrained
    requests (workers/structured.py). With a cost profile, live advice (/v1/pdserve/advice) is on: the
    planner replays the router's recent traffic. ``replica``: a front-end replica's index (a response
    header). Needs an admitted worker (the model's facts)."""
    cfg = config.server
    predictor = router.predictor
    info = router.model_info
    advisor = (
        Advisor(
            router,
            config,
            predictor.profile,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
        )
        if predictor is not None
        else None
    )
    return create_app(
        router,
        Tokenizer.from_pretrained(info.model_dir),
        api_key=cfg.api_key,
        api_keys=load_keys_file(cfg.api_keys_file) if cfg.api_keys_file else None,
        admin_key=admin_key(cfg),
        tenant_limits=TenantLimits(cfg.max_requests_per_key, cfg.max_tokens_per_key),
        max_body_bytes=cfg.max_body_bytes,
        served_model_name=cfg.served_model_name,
        max_timeout_s=config.router.request_timeout_s,
        metrics_compat=cfg.metrics_compat,
        structured_outputs=True,
        tool_call_parser=cfg.tool_call_parser if cfg.enable_auto_tool_choice else None,
        scaler=scaler,
        advisor=advisor,
        stream_limits=StreamLimits(cfg.stream_buffer_bytes, cfg.stream_stall_timeout_s),
        replica=replica,
    )


def admin_key(cfg: ServerConfig) -> str | None:
    """The admin key: ``server.admin_key`` ($PDSERVE_ADMIN_KEY), else ``server.admin_key_file``'s."""
    if cfg.admin_key:
        return cfg.admin_key
    return read_key_file(cfg.admin_key_file, "server.admin_key_file") if cfg.admin_key_file else None


def connection_limits(cfg: ServerConfig) -> ConnectionLimits:
    return ConnectionLimits(
        cfg.max_connections, cfg.header_timeout_s, cfg.body_timeout_s, cfg.keep_alive_timeout_s
    )


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` reaches this machine only (``localhost`` or a loopback address)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # NOTE: any other name may resolve to a public address: treat it as public


def check_exposure(cfg: ServerConfig, host: str) -> None:
    """Refuse (ValueError) to serve a non-loopback ``host`` without an API key unless
    ``allow_unauthenticated``; when allowed, say so in the log. Never names a key."""
    if is_loopback(host) or cfg.api_key or cfg.api_keys_file:
        return
    if not cfg.allow_unauthenticated:
        raise ValueError(
            f"server.host {host!r} is not a loopback address and no API key is set: anyone who reaches "
            "it could use the model. Set --api-key / $PDSERVE_API_KEY or --api-keys-file, or pass "
            "--allow-unauthenticated (server.allow_unauthenticated) to serve it open"
        )
    logger.warning(
        "serving %s WITHOUT an API key (--allow-unauthenticated): anyone who can reach it can generate",
        host,
    )


def listen(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    # NOTE: bound here, in the caller's thread: uvicorn answers a bind failure with sys.exit(1), which
    # on the router's loop would stop that loop instead of reaching the caller.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # NOTE: proto must say IPPROTO_TCP: asyncio turns Nagle off (TCP_NODELAY) on accepted connections
    # only when the listening socket's proto is IPPROTO_TCP, and socket.socket's default is 0. With Nagle
    # on, uvicorn's separate sends of a response's head and body stall ~40 ms on the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:  # NOTE: front-end replicas share the port; the kernel spreads connections
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class HttpServerHandle:
    """The HTTP server of :func:`start_http`, running on a cluster's router loop.

    Lifecycle: ``stop()`` asks uvicorn to exit (in-flight responses get its 5 s graceful window), waits
    at most ``timeout_s`` for ``serve()`` to return and closes the listening socket; it is idempotent
    and must run before ``handle.shutdown()`` (which stops the loop the server runs on).
    """

    def __init__(
        self, server: uvicorn.Server, future: concurrent.futures.Future[None], sock: socket.socket
    ) -> None:
        self.server, self.future, self.sock = server, future, sock
        host, self.port = sock.getsockname()[:2]
        # NOTE: the address to *reach* a server that was told to bind every interface is loopback
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        self.url = f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def wait_ready(self, timeout_s: float) -> None:
        """Poll GET /health (bounded) until the server answers 200; raise if serve() ended instead."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=max(1.0, timeout_s)) as http:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.TransportError):
                    if http.get(f"{self.url}/health").status_code == 200:
                        return
                # NOTE: waiting on serve()'s future (not a bare sleep) also surfaces a startup failure.
                done, _ = concurrent.futures.wait([self.future], timeout=0.05)
                if done:
                    self.future.result()
                    raise RuntimeError(f"HTTP server on {self.url} stopped during startup")
        raise TimeoutError(f"HTTP server on {self.url} not healthy within {timeout_s} s")

    def stop(self, timeout_s: float = 15.0) -> None:
        # NOTE: uvicorn's main loop polls should_exit every 0.1 s; a plain attribute write is enough.
        self.server.should_exit = True
        try:
            self.future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            self.server.force_exit = True
            self.future.cancel()
            logger.error("HTTP server on %s did not stop within %s s; cancelled", self.url, timeout_s)
        except (concurrent.futures.CancelledError, Exception):
            # NOTE: stop() only stops; a serve() failure surfaces where it is awaited (wait_ready,
            # serve_on_loop).
            logger.debug("HTTP server on %s ended with an error", self.url, exc_info=True)
        finally:
            self.sock.close()

    def __enter__(self) -> HttpServerHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_http(
    handle: ClusterHandle,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    ready_timeout_s: float = 30.0,
    log_level: str = "warning",
) -> HttpServerHandle:
    """Serve the cluster's API on ``handle.loop`` without blocking; port 0 picks a free port. Returns
    once /health answers 200 (bounded by ``ready_timeout_s``). The caller must ``stop()`` it."""
    check_exposure(handle.config.server, host)
    sock = listen(host, port)
    server = create_server(
        create_cluster_app(handle),
        host,
        int(sock.getsockname()[1]),
        log_level,
        connection_limits(handle.config.server),
    )
    future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), handle.loop)
    http = HttpServerHandle(server, future, sock)
    try:
        http.wait_ready(ready_timeout_s)
    except BaseException:
        http.stop()
        raise
    return http


def serve_on_loop(handle: ClusterHandle, host: str | None = None, port: int | None = None) -> None:
    """Serve the cluster's API on ``handle.loop`` and block until Ctrl-C / SIGTERM (then a graceful
    stop). host/port default to ``handle.config.server``. The caller still owns ``handle.shutdown()``."""
    cfg = handle.config.server
    check_exposure(cfg, host or cfg.host)
    sock = listen(host or cfg.host, cfg.port if port is None else port)
    server = create_server(
        create_cluster_app(handle),
        host or cfg.host,
        int(sock.getsockname()[1]),
        limits=connection_limits(cfg),
    )
    future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), handle.loop)
    http = HttpServerHandle(server, future, sock)

    def on_signal(sig: int, frame: FrameType | None) -> None:
        if server.should_exit:  # a second Ctrl-C: drop in-flight responses
            server.force_exit = True
        server.should_exit = True

    # NOTE: uvicorn installs signal handlers only when serve() runs on the main thread; here it runs on
    # the router thread, so the main thread catches the signals and tells uvicorn to exit.
    previous = (
        {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    try:
        print(
            f"pdserve: serving {handle.model_info.name} ({handle.config.router.mode}) on {http.url}",
            flush=True,
        )
        # NOTE: after the line above (printed as soon as serving starts, as before); this process serves
        # until it exits, so a full collection need not rescan its start-up heap
        freeze_startup_heap()
        while not concurrent.futures.wait([future], timeout=0.5)[0]:
            pass
        future.result()
    finally:
        http.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

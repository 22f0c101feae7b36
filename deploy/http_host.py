"""Hosting the HTTP app on a running cluster with one front end: the app is served on the router's own
event loop (``cluster.loop``), so handlers and the router share one loop and no request crosses threads.
(Front-end replicas serve the app themselves: deploy/replicas.py.)

``start_http(cluster)`` (tests, benchmarks, the demo) returns once /health answers; ``serve(cluster)``
(``pdserve serve``: the one serving path, either front end) blocks until Ctrl-C / SIGTERM. Sits above
``deploy.launch``, whose ``Cluster`` it serves; launch never imports it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
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
from cluster.http.connections import ConnectionLimits
from cluster.http.server_state import Scaler
from cluster.router.router import Router
from cluster.tokenizer import Tokenizer
from deploy.front_end import check_exposure
from deploy.planner.advice import Advisor
from deploy.replica_set import ReplicatedFrontEnd

if TYPE_CHECKING:
    from deploy.launch import Cluster

logger = logging.getLogger(__name__)


def create_cluster_app(cluster: Cluster) -> FastAPI:
    """The app over ``cluster.router`` with the cluster's config; ``POST /v1/pdserve/scale`` scales its
    pools (``create_router_app``)."""
    return create_router_app(cluster.router, cluster.config, scaler=cluster)


def create_router_app(
    router: Router, config: ClusterConfig, scaler: Scaler | None = None, replica: int | None = None
) -> FastAPI:
    """The app over ``router`` with the cluster's ``server:`` config and the model's tokenizer; client
    deadlines are capped at the router's ``request_timeout_s``; ``scaler`` (a cluster) serves
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
        cfg,
        max_timeout_s=config.router.request_timeout_s,
        structured_outputs=True,
        scaler=scaler,
        advisor=advisor,
        replica=replica,
    )


def connection_limits(cfg: ServerConfig) -> ConnectionLimits:
    return ConnectionLimits(
        cfg.max_connections, cfg.header_timeout_s, cfg.body_timeout_s, cfg.keep_alive_timeout_s
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
    and must run before ``cluster.shutdown()`` (which stops the loop the server runs on).
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
    cluster: Cluster,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    ready_timeout_s: float = 30.0,
    log_level: str = "warning",
) -> HttpServerHandle:
    """Serve the cluster's API on ``cluster.loop`` without blocking; port 0 picks a free port. Returns
    once /health answers 200 (bounded by ``ready_timeout_s``). The caller must ``stop()`` it."""
    check_exposure(cluster.config.server, host)
    loop = cluster.loop  # NOTE: a cluster whose routers run in replica processes refuses before a bind
    sock = listen(host, port)
    server = create_server(
        create_cluster_app(cluster),
        host,
        int(sock.getsockname()[1]),
        log_level,
        connection_limits(cluster.config.server),
    )
    future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop)
    http = HttpServerHandle(server, future, sock)
    try:
        http.wait_ready(ready_timeout_s)
    except BaseException:
        http.stop()
        raise
    return http


def serve(cluster: Cluster) -> None:
    """``pdserve serve``: serve the cluster's API on ``cluster.config.server``'s host and port until
    Ctrl-C / SIGTERM. One front end: the app on the router's loop (``serve_on_loop``); replicas: they
    serve already, and this process supervises them meanwhile. The caller still owns
    ``cluster.shutdown()``."""
    front = cluster.front_end
    if not isinstance(front, ReplicatedFrontEnd):
        serve_on_loop(cluster)
        return
    stop = threading.Event()

    def on_signal(sig: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        pids = [slot.pid for slot in front.replicas.slots]
        print(
            f"pdserve: serving ({cluster.config.router.mode}) on {front.url} with {len(pids)} front-end "
            f"replicas (pids {pids})",
            flush=True,
        )
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_on_loop(cluster: Cluster, host: str | None = None, port: int | None = None) -> None:
    """Serve the cluster's API on ``cluster.loop`` and block until Ctrl-C / SIGTERM (then a graceful
    stop). host/port default to ``cluster.config.server``. The caller still owns ``cluster.shutdown()``."""
    cfg = cluster.config.server
    check_exposure(cfg, host or cfg.host)
    loop = cluster.loop  # NOTE: a cluster whose routers run in replica processes refuses before a bind
    sock = listen(host or cfg.host, cfg.port if port is None else port)
    server = create_server(
        create_cluster_app(cluster),
        host or cfg.host,
        int(sock.getsockname()[1]),
        limits=connection_limits(cfg),
    )
    future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop)
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
            f"pdserve: serving {cluster.model_info.name} ({cluster.config.router.mode}) on {http.url}",
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

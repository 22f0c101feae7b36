"""One front-end replica process (``python -m deploy.replicas``, spawned by deploy/replica_set.py's
``ReplicaSet``): a router and the HTTP app on one event loop, fed its :class:`ReplicaSpec` on stdin,
serving on the port it shares with the other replicas until SIGTERM / SIGINT. What replicas are and how
they are supervised: deploy/replica_set.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import socket
import sys

from cluster.config import ClusterConfig
from deploy.replica_set import EVENTS_TIMEOUT_S, REPLICA_MARK, START_TIMEOUT_S, ReplicaSpec


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its supervisor dies (the thread that spawned it ends: the
    supervisor's main thread, or its supervising thread for a restarted replica, both of which live
    until the cluster stops), so no replica outlives its cluster."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


async def _serve_replica(spec: ReplicaSpec) -> None:
    from cluster.heap import freeze_startup_heap
    from cluster.http.app import create_server
    from cluster.router.admission import load_predictor
    from cluster.router.router import Router
    from deploy.http_host import connection_limits, create_router_app, listen

    cfg = ClusterConfig.from_dict(spec.config)
    router = Router(
        cfg.router,
        bytes.fromhex(spec.secret_hex),
        served_model_name=cfg.server.served_model_name,
        bind_host=spec.bind_host,
        predictor=load_predictor(cfg.router, cfg.engine_config(cfg.prefill_pool)),
        replica=spec.index,
        event_port=spec.event_port,
    )
    await router.start()
    socks: list[socket.socket] = []
    try:
        print(f"{REPLICA_MARK} {spec.index} EVENTS {router.endpoint}", flush=True)
        await router.wait_healthy(START_TIMEOUT_S)
        server = cfg.server
        socks.append(listen(server.host, spec.http_port, reuse_port=True))
        if server.metrics_port:
            socks.append(listen(server.host, server.metrics_port + spec.index))
        http = create_server(
            create_router_app(router, cfg, replica=spec.index),
            server.host,
            spec.http_port,
            limits=connection_limits(server),
        )
        serving = asyncio.create_task(http.serve(sockets=socks))
        async with asyncio.timeout(EVENTS_TIMEOUT_S):
            while not http.started and not serving.done():
                await asyncio.sleep(0.05)  # NOTE: uvicorn's own flag (it has no event to wait on)
        if serving.done():
            serving.result()
            raise RuntimeError(f"replica {spec.index}: the HTTP server stopped during startup")
        print(f"{REPLICA_MARK} {spec.index} SERVING pid {os.getpid()}", flush=True)
        freeze_startup_heap()
        await serving
    finally:
        await router.close()
        for sock in socks:
            sock.close()


def replica_main() -> int:
    """``python -m deploy.replicas``: one replica, its spec on stdin, until SIGTERM / SIGINT."""
    from deploy.logs import configure_logging

    _die_with_parent()
    raw = json.loads(sys.stdin.readline())
    spec = ReplicaSpec(**raw)
    configure_logging(ClusterConfig.from_dict(spec.config).log)
    asyncio.run(_serve_replica(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(replica_main())

"""One cluster builder (deploy/launch.py ``build_cluster``) and one handle (``Cluster``), without Ray: the
front end it swaps in for ``server.replicas``, the checks that fail before anything starts, what a cluster
without a router in this process refuses, and its one teardown (order, idempotence, a failing step, a
start that fails half way). The running clusters: tests/e2e (one front end) and tests/e2e/test_replicas.py
(N replicas)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from cluster.config import ClusterConfig
from cluster.protocol import SamplingParams, WorkerStats
from cluster.wire import WorkerControl
from deploy import device_check, launch
from deploy.front_end import RouterFrontEnd
from deploy.launch import Cluster, NoLocalRouterError, build_cluster
from deploy.replica_set import ReplicatedFrontEnd


class FakeFrontEnd:
    """A front end that records what the cluster asks of it (``FrontEnd``'s shape); ``wait_error`` makes
    ``wait_serving`` fail, ``stop_error`` makes ``stop`` fail."""

    def __init__(self, calls: list[str], wait_error: Exception | None = None) -> None:
        self.calls = calls
        self.wait_error = wait_error
        self.stop_error: Exception | None = None
        self.watched: list[str] = []

    def start(self, secret: bytes, bind_host: str) -> tuple[str, ...]:
        self.calls.append(f"start {bind_host}")
        return ("tcp://127.0.0.1:1",)

    def watch(self, worker_id: str, actor: Any) -> None:
        self.watched.append(worker_id)

    def wait_serving(self, worker_ids: Sequence[str], timeout_s: float) -> None:
        self.calls.append(f"wait {list(worker_ids)}")
        if self.wait_error is not None:
            raise self.wait_error

    def live_worker_ids(self) -> list[str]:
        return list(self.watched)

    def worker_stats(self) -> list[WorkerStats]:
        return []

    def stop(self) -> None:
        self.calls.append("stop front end")
        if self.stop_error is not None:
            raise self.stop_error


class FakeLauncher:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.actors: dict[str, Any] = {"colocated-0": object()}

    def stop_all(self) -> None:
        self.calls.append("stop workers")
        self.actors.clear()


def test_the_front_end_is_the_one_part_swapped_by_server_replicas() -> None:
    one = launch._front_end(ClusterConfig.from_dict({"server": {"replicas": 1}}))
    assert type(one) is RouterFrontEnd
    many = launch._front_end(ClusterConfig.from_dict({"server": {"replicas": 3}}))
    assert type(many) is ReplicatedFrontEnd
    with pytest.raises(ValueError, match=r"^a replicated front end needs server.replicas >= 2, got 1$"):
        ReplicatedFrontEnd(ClusterConfig.from_dict({"server": {"replicas": 1}}))


def test_what_a_front_end_checks_fails_before_ray_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)

    def no_ray(cfg: ClusterConfig) -> bool:
        raise AssertionError("Ray must not start")

    monkeypatch.setattr(launch, "_init_ray", no_ray)
    missing = str(tmp_path / "none.json")
    with pytest.raises(ValueError, match=r"^router cost profile .*none\.json' does not exist"):
        build_cluster({"router": {"cost_profile": missing}})
    with pytest.raises(ValueError, match="--allow-unauthenticated"):
        build_cluster({"server": {"replicas": 2, "host": "0.0.0.0"}})


def test_a_cluster_without_a_router_here_refuses_what_needs_one() -> None:
    cfg = ClusterConfig.from_dict({"server": {"replicas": 2}})
    cluster = Cluster(cfg, b"k" * 32, FakeFrontEnd([]), None, started_ray=False)
    refusal = r"^generate needs the router in this process; this cluster's routers run in its 2 front-end"
    with pytest.raises(NoLocalRouterError, match=refusal):
        cluster.generate([1, 2, 3], SamplingParams(max_tokens=1))
    for what, ask in [
        ("router", lambda: cluster.router),
        ("loop", lambda: cluster.loop),
        ("scale", lambda: cluster.scale("prefill", 2)),
    ]:
        with pytest.raises(NoLocalRouterError, match=f"^{what} needs the router in this process"):
            ask()
    assert isinstance(NoLocalRouterError("x"), RuntimeError)


def test_shutdown_stops_the_front_end_then_the_workers_once_even_when_a_step_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[str] = []
    front = FakeFrontEnd(calls)
    front.stop_error = OSError("socket already gone")
    launcher: Any = FakeLauncher(calls)
    cluster = Cluster(ClusterConfig(), b"k" * 32, front, launcher, started_ray=False)
    with cluster:
        assert cluster.actors == launcher.actors
    cluster.shutdown()
    assert calls == ["stop front end", "stop workers"]
    assert [r.getMessage() for r in caplog.records] == ["cluster shutdown: stopping the front end failed"]
    with pytest.raises(RuntimeError, match=r"^the cluster is not running$"):
        cluster.kill_worker("colocated-0")


def test_a_start_that_fails_half_way_stops_what_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    calls: list[str] = []
    front = FakeFrontEnd(calls, wait_error=RuntimeError("replica 1 exited with 1 while starting"))
    monkeypatch.setattr(launch, "_front_end", lambda cfg: front)
    monkeypatch.setattr(device_check, "check_local", lambda cfg: None)
    monkeypatch.setattr(launch, "_init_ray", lambda cfg: False)
    monkeypatch.setattr(launch, "_bind_host", lambda cfg: ("loopback", "127.0.0.1"))
    created: list[str] = []

    def create_actor(self: launch.WorkerLauncher, worker_id: str, pool: str, core: int | None) -> Any:
        created.append(worker_id)
        return object()

    def release(self: launch.WorkerLauncher, actors: list[Any]) -> None:
        calls.append(f"stop {len(actors)} workers")

    monkeypatch.setattr(launch.WorkerLauncher, "_create_actor", create_actor)
    monkeypatch.setattr(launch.WorkerLauncher, "_release", release)
    cfg = {"router": {"mode": "colocated"}, "pools": {"colocated": {"num_workers": 2}}}
    with pytest.raises(RuntimeError, match=r"^replica 1 exited with 1 while starting$"):
        build_cluster(cfg)
    assert created == front.watched == ["colocated-0", "colocated-1"]
    assert calls == [
        "start 127.0.0.1",
        "wait ['colocated-0', 'colocated-1']",
        "stop front end",
        "stop 2 workers",
    ]


@pytest.mark.parametrize(
    ("mode", "pools", "moves_kv"),
    [
        ("colocated", {"colocated": {"num_workers": 1}}, False),
        ("disaggregated", {"prefill": {"num_workers": 1}, "decode": {"num_workers": 1}}, True),
        ("conditional", {"prefill": {"num_workers": 1}, "decode": {"num_workers": 1}}, True),
    ],
)
def test_a_cluster_opens_no_store_for_its_kv_pairs(
    monkeypatch: pytest.MonkeyPatch, mode: str, pools: dict[str, Any], moves_kv: bool
) -> None:
    """Issue 41 item 4: each prefill/decode pair rendezvous over its own signed handshake link, so the
    builder hosts no torch.distributed store (an open, unauthenticated port) and listens on nothing of
    its own (the front end binds its sockets); a worker moves KV by its control's ``moves_kv`` flag."""
    pytest.importorskip("ray")
    import socket

    import torch.distributed as dist

    opened: list[str] = []

    def no_store(*args: Any, **kwargs: Any) -> Any:
        opened.append(f"TCPStore{args}")
        raise AssertionError("the cluster builder opened a torch.distributed TCPStore")

    real_listen = socket.socket.listen

    def listen(self: socket.socket, *args: Any) -> None:
        opened.append(f"listen {self.getsockname()}")
        real_listen(self, *args)

    monkeypatch.setattr(dist, "TCPStore", no_store)
    monkeypatch.setattr(socket.socket, "listen", listen)
    calls: list[str] = []
    front = FakeFrontEnd(calls)
    monkeypatch.setattr(launch, "_front_end", lambda cfg: front)
    monkeypatch.setattr(device_check, "check_local", lambda cfg: None)
    monkeypatch.setattr(launch, "_init_ray", lambda cfg: False)
    monkeypatch.setattr(launch, "_bind_host", lambda cfg: ("loopback", "127.0.0.1"))
    controls: list[WorkerControl] = []

    def create_actor(self: launch.WorkerLauncher, worker_id: str, pool: str, core: int | None) -> Any:
        controls.append(self.control)
        return object()

    monkeypatch.setattr(launch.WorkerLauncher, "_create_actor", create_actor)
    monkeypatch.setattr(launch.WorkerLauncher, "_release", lambda self, actors: calls.append("stop workers"))
    with build_cluster({"router": {"mode": mode}, "pools": pools}) as cluster:
        assert opened == []
        assert [c.moves_kv for c in controls] == [moves_kv] * len(pools)
        assert not hasattr(cluster, "kv_store_address")
        assert not any("store" in name for name in vars(cluster))
    assert calls[-2:] == ["stop front end", "stop workers"]

"""Clusters heal by default: every pool restarts its dead workers, a bounded number of times over each
worker's life (Ray's ``max_restarts``), unless its config says otherwise. The cluster that shows a
restart on the default: tests/e2e/test_elastic.py's kill -9 test."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.config import DEFAULT_MAX_RESTARTS, ClusterConfig
from cluster.wire import WorkerControl
from deploy import launch
from deploy.cli_args import PACKAGE_DIR


@pytest.mark.parametrize("name", sorted(p.name for p in PACKAGE_DIR.glob("*.yaml")))
def test_every_pool_of_a_shipped_config_restarts_its_workers(name: str) -> None:
    cfg = ClusterConfig.from_yaml(str(PACKAGE_DIR / name))
    assert DEFAULT_MAX_RESTARTS == 3
    assert {pool: cfg.pool(pool).max_restarts for pool in cfg.pool_names} == {
        pool: DEFAULT_MAX_RESTARTS for pool in cfg.pool_names
    }


def test_a_config_keeps_a_dead_worker_down_or_always_restarts_it() -> None:
    cfg = ClusterConfig.from_dict({"pools": {"prefill": {"max_restarts": 0}, "decode": {"max_restarts": -1}}})
    assert (cfg.prefill.max_restarts, cfg.decode.max_restarts) == (0, -1)
    with pytest.raises(
        ValueError, match=r"^pools\.decode\.max_restarts must be >= -1 \(-1: always\), got -2$"
    ):
        ClusterConfig.from_dict({"pools": {"decode": {"max_restarts": -2}}})


class _RecordingActorClass:
    """What ``ray.remote(EngineWorker)`` returns, recording the options each actor is created with."""

    def __init__(self) -> None:
        self.options_seen: list[dict[str, Any]] = []

    def options(self, **options: Any) -> _RecordingActorClass:
        self.options_seen.append(options)
        return self

    def remote(self, *args: Any, **kwargs: Any) -> object:
        return object()


def test_the_launcher_asks_ray_to_restart_each_worker_its_pool_allows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ray = pytest.importorskip("ray")
    actor_class = _RecordingActorClass()
    monkeypatch.setattr(ray, "remote", lambda cls: actor_class)
    cfg = ClusterConfig.from_dict({"pools": {"prefill": {"max_restarts": 0}, "decode": {}}})
    launcher = launch.WorkerLauncher(cfg, b"k" * 32, WorkerControl(("tcp://127.0.0.1:1",), 1.0), False)
    assert [launcher.create(pool)[0] for pool in ("decode", "prefill", "decode")] == [
        "decode-0",
        "prefill-0",
        "decode-1",
    ]
    assert [o["max_restarts"] for o in actor_class.options_seen] == [
        DEFAULT_MAX_RESTARTS,
        0,
        DEFAULT_MAX_RESTARTS,
    ]

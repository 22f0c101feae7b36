"""Front-end replicas (``pdserve serve --api-server-count 2``): two HTTP edge + router processes on one
port over the same mock workers (Ray actors). kill -9 of one replica while 32 streams run through both:
every stream on the other replica finishes with the exact mock output; the killed replica's streams end
with a connection error; once its lease runs out no KV block is held on any worker; the replica is
restarted and serves again. Then a worker killed without last words and not restarted: the replicas
(which run no Ray) hear it from the supervisor's relay and every stream moves on. The two-host lab runs the same with the workers on both hosts
(tests/e2e/test_two_hosts.py)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from deploy.cli import build_parser
from deploy.cli_args import build_config
from deploy.launch import NoLocalRouterError, build_cluster
from deploy.replica_set import ReplicatedFrontEnd
from tests.support.cluster_utils import wait_for
from tests.support.replica_streams import (
    MAX_TOKENS,
    PROMPTS,
    check_streams,
    rule_outputs,
    serve_on_every_replica,
    slow_profile,
    streams_with_a_fault,
    streams_with_a_kill,
)

ray = pytest.importorskip("ray")  # NOTE: this test starts a Ray cluster; a bare GPU machine has none

pytestmark = pytest.mark.slow

LEASE_S = 2.0


def test_kill_9_of_one_of_two_replicas_loses_only_its_own_streams_and_it_comes_back(tmp_path: Path) -> None:
    flags = [
        "serve",
        "--config",
        "deploy/mock-cluster.yaml",
        "--cost-profile",
        slow_profile(tmp_path / "p.json"),
    ]
    flags += ["--num-prefill-workers", "1", "--num-decode-workers", "1", "--num-kv-blocks", "1024"]
    flags += ["--api-server-count", "2", "--port", "0"]
    cfg = build_config(build_parser().parse_args(flags))
    assert cfg.server.replicas == 2
    cfg = replace(cfg, router=replace(cfg.router, health_interval_s=0.2, router_lease_s=LEASE_S))
    expected = rule_outputs()

    cluster = build_cluster(cfg)
    try:
        front = cluster.front_end
        assert isinstance(front, ReplicatedFrontEnd)
        with pytest.raises(NoLocalRouterError, match=f"send requests over HTTP to {re.escape(front.url)}$"):
            cluster.generate(PROMPTS[0])
        victim = front.replicas.slots[1]
        victim_pid = victim.pid
        assert victim_pid is not None and front.replicas.slots[0].pid != victim_pid
        streams = streams_with_a_kill(front.url, victim_pid)
        check_streams([s.as_dict() for s in streams], expected, killed=1)

        # its requests are freed on every worker once its lease runs out (or its successor renews it)
        def clean() -> bool:
            return all(report is None for report in cluster.check_leaks(10).values())

        wait_for(clean, LEASE_S + 20, "no KV held for the dead replica's requests")
        # NOTE: freed for the lease (or its successor's), not by finishing: each outlives the lease
        killed = sum(1 for s in streams if s.replica == 1)
        decode = ray.get(cluster.actors["decode-0"].stats.remote(), timeout=30)
        assert decode.num_freed_for_router == killed
        # the supervisor restarted it (a new process in slot 1, on the same event port) and it serves
        wait_for(lambda: victim.num_restarts == 1 and victim.serving.is_set(), 120, "replica 1 restarted")
        assert victim.pid != victim_pid
        assert serve_on_every_replica(front.url, expected, {0, 1}) == {0, 1}
        assert all(report is None for report in cluster.check_leaks(10).values())

        # the decode worker killed (-9, no restart): each replica migrates its streams (to the prefill
        # worker, which runs them whole), and the mock's output is exact across the move
        streams = streams_with_a_fault(front.url, lambda: cluster.kill_worker("decode-0"), num=16)
        assert {s.replica for s in streams} == {0, 1}
        for s, want in zip(streams, expected, strict=False):
            assert (s.finished, s.error, s.tokens) == (True, None, want[: len(s.tokens)])
            assert len(s.tokens) == MAX_TOKENS
        assert front.relay.num_told >= 1
        # the dead worker is out of the cluster's live view; the one left holds nothing
        assert cluster.check_leaks(10) == {"prefill-0": None}
    finally:
        cluster.shutdown()
    # no replica outlives the cluster
    assert all(slot.proc is not None and slot.proc.poll() is not None for slot in front.replicas.slots)

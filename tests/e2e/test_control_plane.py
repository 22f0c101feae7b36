"""Control plane v2 on a live cluster (local Ray, CPU, bundled model): every frame is untrusted input,
health tells the truth, a dead thread takes its worker down loudly, a stopped worker is routed around
and comes back."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq

from bench.fuzz_frames import make_plan
from cluster.protocol import SamplingParams, WorkerFailedError
from cluster.wire import ROUTER_ID
from deploy.http_host import start_http
from deploy.launch import Cluster, build_cluster
from tests.support.cluster_utils import (
    cluster_config,
    greedy,
    run_concurrently,
    shared_prefix_prompts,
    wait_for,
)
from workers.llm import LLM

ray = pytest.importorskip("ray")  # NOTE: these tests start a Ray cluster; a bare GPU machine has none

pytestmark = pytest.mark.slow

VOCAB = 1229  # the bundled model's
NUM_STREAMS = 16
NUM_FUZZ_FRAMES = 10_000
HEALTH = {"health_interval_s": 0.2, "health_timeout_s": 1.5, "request_timeout_s": 120.0}


def config(**overrides: Any) -> dict[str, Any]:
    return cluster_config("", router=HEALTH, **overrides)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    handle = build_cluster(config(decode={"num_workers": 2}))
    yield handle
    handle.shutdown()


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(device="cpu", block_size=4)


def send_frames(frames: list[tuple[str, bytes]], dealers: frozenset[str] = frozenset()) -> None:
    """Each frame to its endpoint: from a PUSH socket, or a DEALER one for the ``dealers`` (KV handshake
    sockets are ZMQ ROUTER sockets)."""
    ctx: zmq.Context[Any] = zmq.Context()
    sockets: dict[str, zmq.Socket[Any]] = {}
    try:
        for endpoint, frame in frames:
            if endpoint not in sockets:
                sockets[endpoint] = ctx.socket(zmq.DEALER if endpoint in dealers else zmq.PUSH)
                sockets[endpoint].setsockopt(zmq.SNDTIMEO, 30_000)  # NOTE: bounded, never a hang
                sockets[endpoint].connect(endpoint)
            sockets[endpoint].send(frame)
    finally:
        for sock in sockets.values():
            sock.close(linger=10_000)
        ctx.term()


def total_rejected(handle: Cluster) -> int:
    workers = sum(sum(s.rejected_frames.values()) for s in handle.worker_stats())
    return workers + sum(handle.router.rejected_frames().values())


def threads_alive(handle: Cluster) -> bool:
    healths = ray.get([a.health.remote() for a in handle.actors.values()], timeout=30)
    return all(healths) and handle.router.dead_tasks() == [] and handle.router.is_healthy()


def test_fuzzed_frames_to_every_socket_while_requests_stream(cluster: Cluster, offline: LLM) -> None:
    prompts = shared_prefix_prompts(NUM_STREAMS, seed=8, vocab=VOCAB)
    params = [greedy(24 + i % 5 * 8) for i in range(NUM_STREAMS)]
    reference = [o.token_ids for o in offline.generate(prompts, params)]
    targets = {w.peer_name: w.info.request_endpoint for w in cluster.router.workers}  # ops go to a process
    targets[ROUTER_ID] = cluster.router.endpoint
    # every KV sender's handshake socket too (the prefill workers')
    kv_targets = {w.peer_name: w.info.kv_endpoint for w in cluster.router.workers if w.info.kv_endpoint}
    assert sorted(kv_targets) == [w.peer_name for w in cluster.router.workers if w.pool == "prefill"]
    plan = make_plan(4, NUM_FUZZ_FRAMES, cluster.secret, targets, kv_targets)
    before = total_rejected(cluster)
    fuzzer = threading.Thread(target=send_frames, args=(plan.frames, frozenset(plan.dealer_endpoints)))
    fuzzer.start()
    try:
        assert run_concurrently(cluster, prompts, params) == reference
    finally:
        fuzzer.join(timeout=120)
    assert not fuzzer.is_alive()
    assert len(plan.frames) >= NUM_FUZZ_FRAMES and set(plan.by_kind) >= {
        "random_bytes",
        "replay",
        "wrong_key",
    }
    assert sum(endpoint in plan.dealer_endpoints for endpoint, _ in plan.frames) > 1000
    wait_for(lambda: total_rejected(cluster) - before == plan.num_bad, 20, "every bad frame counted")
    assert total_rejected(cluster) - before == plan.num_bad
    assert threads_alive(cluster)
    out = cluster.generate(prompts[0], params[0], timeout_s=60)
    assert out.token_ids == reference[0]
    cluster.wait_until_quiet(timeout_s=30)
    assert set(cluster.check_leaks().values()) == {None}


def test_the_four_byte_frame_no_longer_kills_a_worker(cluster: Cluster, offline: LLM) -> None:
    decode = next(w for w in cluster.router.workers if w.pool == "decode")
    before = total_rejected(cluster)
    send_frames([(decode.info.request_endpoint, bytes.fromhex("81910102"))])
    wait_for(lambda: total_rejected(cluster) == before + 1, 10, "the frame counted")
    with start_http(cluster) as http:
        assert httpx.get(f"{http.url}/health").json() == {"status": "ok"}
        prompt = shared_prefix_prompts(1, seed=3, vocab=VOCAB)[0]
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        answer = httpx.post(f"{http.url}/v1/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["token_ids"] == offline.generate([prompt], greedy(8))[0].token_ids
    assert threads_alive(cluster)


def test_a_stopped_worker_is_routed_around_and_comes_back(cluster: Cluster, offline: LLM) -> None:
    router = cluster.router
    victim = [w for w in router.workers if w.pool == "decode"][-1]
    assert victim.healthy
    pid = ray.get(cluster.actors[victim.worker_id].ping.remote(), timeout=30)
    prompts = shared_prefix_prompts(8, seed=5, vocab=VOCAB)
    reference = [o.token_ids for o in offline.generate(prompts, [greedy(6)] * len(prompts))]
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        wait_for(lambda: not victim.healthy, 5, f"{victim.worker_id} marked unhealthy")
        assert router.is_healthy()  # the other decode worker still makes a path
        served = 0
        # NOTE: keep serving for the whole 6 s stop; a request routed to the stopped worker could not
        # finish before SIGCONT, so each one finishing (exactly) shows it went elsewhere.
        while time.monotonic() - stopped_at < 6.0 or served == 0:
            i = served % len(prompts)
            assert cluster.generate(prompts[i], greedy(6), timeout_s=30).token_ids == reference[i]
            assert victim.num_assigned == 0 and not victim.healthy
            served += 1
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: victim.healthy, 10, f"{victim.worker_id} healthy again")
    outputs = run_concurrently(cluster, prompts, [greedy(6)] * len(prompts))
    assert outputs == reference
    # NOTE: the router's copy of its stats comes with its next heartbeat
    wait_for(
        lambda: victim.stats is not None and victim.stats.transfer.num_ok > 0,
        10,
        f"{victim.worker_id} took KV",
    )
    cluster.wait_until_quiet(timeout_s=30)
    assert set(cluster.check_leaks().values()) == {None}


@pytest.mark.loaded  # NOTE: decisive under load (make test-faults runs every fault test so)
def test_a_dead_step_thread_fails_its_requests_fast_and_ray_restarts_the_worker(offline: LLM) -> None:
    # NOTE: no migration and no colocated fallback, so losing the one decode worker leaves no path
    router_cfg = {**HEALTH, "max_migrations": 0, "colocated_fallback": False}
    handle = build_cluster(
        cluster_config("", router=router_cfg, decode={"max_restarts": 1}), fault_injection=True
    )
    try:
        router, actor = handle.router, handle.actors["decode-0"]
        old_pid = ray.get(actor.ping.remote(), timeout=30)
        prompt = shared_prefix_prompts(1, seed=6, vocab=VOCAB)[0]
        with start_http(handle) as http:
            assert httpx.get(f"{http.url}/health").status_code == 200

            async def stream() -> tuple[float, BaseException | None]:
                tokens: list[int] = []
                injected: float | None = None
                try:
                    async for d in handle.agenerate(
                        prompt, SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
                    ):
                        tokens += d.token_ids
                        # NOTE: at least 3: a stream hands over every token it holds at once (a busy loop
                        # may take several in one delta), so a count of exactly 3 may never be seen
                        if len(tokens) >= 3 and injected is None:
                            handle.inject_fault("decode-0", "step")
                            injected = time.monotonic()
                except WorkerFailedError as e:
                    return (-1.0 if injected is None else time.monotonic() - injected), e
                return -1.0, None

            latency, error = asyncio.run(stream())
            assert isinstance(error, WorkerFailedError)
            assert "step thread died: RuntimeError: injected fault" in str(error)
            assert 0 <= latency <= HEALTH["health_interval_s"] + 1.0
            assert worker_state(handle, "decode-0") == "dead"
            assert not router.is_healthy()
            health = httpx.get(f"{http.url}/health")
            assert (health.status_code, health.json()) == (503, {"status": "unhealthy"})
            metrics = httpx.get(f"{http.url}/metrics").text
            assert (
                'pdserve_worker_healthy{model_name="pdserve-tiny",pool="decode",worker="decode-0"} 0.0'
                in metrics
            )
            assert (
                'pdserve_worker_healthy{model_name="pdserve-tiny",pool="prefill",worker="prefill-0"} 1.0'
                in metrics
            )
        new_pid = wait_for(lambda: _pid_if_back(actor, old_pid), 120, "Ray restarted decode-0")
        assert new_pid != old_pid
        # the new incarnation registers itself and serves again
        wait_for(lambda: worker_state(handle, "decode-0") == "healthy", 60, "decode-0 re-admitted")
        out = handle.generate(prompt, greedy(8), timeout_s=60)
        assert out.token_ids == offline.generate([prompt], greedy(8))[0].token_ids
        handle.wait_until_quiet(timeout_s=30)
        assert handle.check_leaks() == {"prefill-0": None, "decode-0": None}
    finally:
        handle.shutdown()


def worker_state(handle: Cluster, worker_id: str) -> str | None:
    return next((w.state.value for w in handle.router.workers if w.worker_id == worker_id), None)


def _pid_if_back(actor: Any, old_pid: int) -> int | None:
    try:
        pid: int = ray.get(actor.ping.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None
    return pid if pid != old_pid else None

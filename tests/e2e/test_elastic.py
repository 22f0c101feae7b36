"""Elastic cluster on CPU (local Ray, bundled model): kill -9 under load migrates and re-admits, pools
scale up and down under load, and every output stays exact with no leaked block."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import threading
from typing import Any

import pytest

from cluster.protocol import SamplingParams
from deploy.cli import main as cli_main
from deploy.http_host import start_http
from deploy.launch import Cluster, build_cluster
from tests.support.cluster_utils import (
    cluster_config,
    collect,
    greedy,
    run_concurrently,
    shared_prefix_prompts,
    wait_for,
    with_processors,
)
from workers.llm import LLM

pytestmark = pytest.mark.slow

VOCAB = 1229  # the bundled model's
NUM_STREAMS = 32
ADMIN_KEY = "sk-admin-elastic"  # NOTE: the admin routes are off without an admin key
HEALTH = {"health_interval_s": 0.2, "health_timeout_s": 2.0, "request_timeout_s": 300.0}


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(device="cpu", block_size=4)


def workload(
    seed: int, offline: LLM, max_tokens: int = 48, processors: bool = False
) -> tuple[list[list[int]], list[SamplingParams], Any]:
    """32 streams; ``processors``: with the logits processors' mix (``with_processors``), whose outputs
    must survive a migration exactly as greedy ones do (token history and seeded streams)."""
    prompts = shared_prefix_prompts(NUM_STREAMS, seed=seed, vocab=VOCAB)
    lengths = [max_tokens + i % 4 * 8 for i in range(NUM_STREAMS)]
    if processors:
        params = [with_processors(i, n, VOCAB) for i, n in enumerate(lengths)]
    else:
        params = [greedy(n) for n in lengths]
    return prompts, params, [o.token_ids for o in offline.generate(prompts, params)]


def incarnation(handle: Cluster, worker_id: str) -> tuple[str, str] | None:
    w = next((w for w in handle.router.workers if w.worker_id == worker_id), None)
    return None if w is None else (w.state.value, w.info.incarnation)


@pytest.mark.loaded  # NOTE: decisive under load (make test-faults runs every fault test so)
def test_kill9_of_the_decode_worker_under_32_streams(offline: LLM) -> None:
    prompts, params, reference = workload(11, offline, max_tokens=64, processors=True)
    # NOTE: the pools' default max_restarts: a cluster heals by default
    handle = build_cluster(cluster_config("", router=HEALTH))
    try:
        victim = next(w for w in handle.router.workers if w.worker_id == "decode-0")
        old = victim.info.incarnation

        async def main() -> list[list[int]]:
            tasks = [
                asyncio.ensure_future(collect(handle, p, sp, f"s{i}"))
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            ]
            # NOTE: kill once streams are decoding there (bounded: tasks may not finish first)
            for _ in range(4000):
                if victim.num_assigned >= 8 or all(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.005)
            os.kill(victim.info.pid, signal.SIGKILL)
            return list(await asyncio.gather(*tasks))

        assert asyncio.run(main()) == reference  # 0 client errors, every output exact
        back = wait_for(
            lambda: (s := incarnation(handle, "decode-0")) and s[0] == "healthy" and s[1] != old, 30,
            "the restarted decode worker re-admitted",
        )  # fmt: skip
        assert back
        # the new incarnation takes handoffs: its pair with prefill-0 is built on first use
        assert run_concurrently(handle, prompts[:8], params[:8]) == reference[:8]
        stats = wait_for(
            lambda: (s := {s.worker_id: s for s in handle.worker_stats()})["decode-0"].transfer.num_ok > 0 and s,
            10, "the restarted decode worker's stats",
        )  # fmt: skip
        assert stats["decode-0"].engine.num_generation_tokens > 0
        assert stats["decode-0"].transfer.num_failed == 0 and stats["decode-0"].broken_peers == []
        handle.wait_until_quiet(timeout_s=60)
        assert handle.check_leaks() == {"prefill-0": None, "decode-0": None}
    finally:
        handle.shutdown()


def test_killed_prefill_worker_then_no_decode_worker_left_lose_no_request(offline: LLM) -> None:
    """kill -9 a prefill worker mid-prefill: its requests are prefilled again on the other one. Then
    kill -9 the only decode worker (no restarts): its requests migrate to the prefill worker, which runs
    them whole (colocated fallback), as it does new requests until a decode worker returns. 0 client
    errors, every output exact, no leaked block on the survivor."""
    prompts, params, reference = workload(17, offline, max_tokens=24)
    no_restarts = {"max_restarts": 0}
    cfg = cluster_config("", router=HEALTH, prefill={"num_workers": 2, **no_restarts}, decode=no_restarts)
    handle = build_cluster(cfg)
    try:

        async def kill_under_load(worker_id: str, assigned: int) -> list[list[int]]:
            victim = next(w for w in handle.router.workers if w.worker_id == worker_id)
            tasks = [
                asyncio.ensure_future(collect(handle, p, sp, f"{worker_id}-{i}"))
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            ]
            for _ in range(4000):  # NOTE: bounded: the tasks may all finish first
                if victim.num_assigned >= assigned or all(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.005)
            os.kill(victim.info.pid, signal.SIGKILL)
            return list(await asyncio.gather(*tasks))

        assert asyncio.run(kill_under_load("prefill-0", 4)) == reference
        assert asyncio.run(kill_under_load("decode-0", 8)) == reference
        states = {w.worker_id: w.state.value for w in handle.router.workers}
        assert states.get("prefill-0", "dead") == states.get("decode-0", "dead") == "dead"
        assert run_concurrently(handle, prompts[:8], params[:8]) == reference[:8]  # whole, on prefill-1
        stats = {s.worker_id: s for s in handle.worker_stats()}
        assert stats["prefill-1"].engine.num_generation_tokens > len(
            prompts
        )  # it decoded, not only first tokens
        handle.wait_until_quiet(timeout_s=60)
        assert handle.check_leaks() == {"prefill-1": None}
    finally:
        handle.shutdown()


def test_scale_pools_up_and_down_under_32_streams(offline: LLM) -> None:
    prompts, params, reference = workload(12, offline, processors=True)
    handle = build_cluster(
        cluster_config("", router={**HEALTH, "drain_timeout_s": 60.0}, server={"admin_key": ADMIN_KEY})
    )
    http = start_http(handle, port=0)
    try:
        for steps in ((("decode", 2), ("prefill", 2)), (("decode", 1), ("prefill", 1))):
            sizes: list[list[str]] = []

            def scale(steps: tuple[tuple[str, int], ...] = steps, sizes: list[list[str]] = sizes) -> None:
                if steps[0][1] == 2:  # up through the handle, down through `pdserve scale` (the admin route)
                    sizes.extend(handle.scale(pool, n) for pool, n in steps)
                    return
                for pool, n in steps:
                    out = io.StringIO()
                    with contextlib.redirect_stdout(out):
                        assert (
                            cli_main(
                                [
                                    "scale",
                                    "--url",
                                    http.url,
                                    "--admin-key",
                                    ADMIN_KEY,
                                    "--pool",
                                    pool,
                                    "--workers",
                                    str(n),
                                ]
                            )
                            == 0
                        )
                    sizes.append(out.getvalue().split(": ", 2)[2].split())

            scaler = threading.Thread(target=scale)
            scaler.start()
            waves = 0
            while scaler.is_alive() or waves == 0:  # NOTE: streams run for as long as scaling does
                assert run_concurrently(handle, prompts, params) == reference
                waves += 1
            scaler.join()
            assert [len(ids) for ids in sizes] == [n for _, n in steps]
            if steps[0][1] == 2:
                # the new workers take traffic: handoffs from prefill-1, into decode-1
                assert run_concurrently(handle, prompts, params) == reference

                def new_ones_served() -> bool:  # NOTE: stats arrive with heartbeats
                    stats = {s.worker_id: s for s in handle.worker_stats()}
                    return (
                        stats["prefill-1"].engine.num_prompt_tokens > 0
                        and stats["decode-1"].transfer.num_ok > 0
                    )

                wait_for(new_ones_served, 10, "prefill-1 and decode-1 took handoffs")
        assert sorted(w.worker_id for w in handle.router.workers) == ["decode-0", "prefill-0"]
        assert sorted(handle.actors) == ["decode-0", "prefill-0"]
        handle.wait_until_quiet(timeout_s=60)
        assert handle.check_leaks() == {"prefill-0": None, "decode-0": None}
    finally:
        http.stop()
        handle.shutdown()


def test_a_decode_worker_waiting_for_seats_keeps_the_prefill_lease_alive(offline: LLM) -> None:
    """Handoffs wait on the decode side far longer than the lease (2 seats, long decodes): the decode worker
    keeps the prefill side holding the KV (KeepAlive -> ExtendLease), so nothing fails."""
    prompts = shared_prefix_prompts(6, seed=13, vocab=VOCAB)
    params = [greedy(120) for _ in prompts]
    reference = [o.token_ids for o in offline.generate(prompts, params)]
    cfg = cluster_config(
        "",
        engine={"max_num_seqs": 2},
        transfer={"lease_s": 0.5, "failure_policy": "fail"},
        router=HEALTH,
    )
    handle = build_cluster(cfg)
    try:
        assert run_concurrently(handle, prompts, params) == reference
        stats = {s.worker_id: s for s in handle.worker_stats()}
        assert stats["decode-0"].transfer.num_failed == 0 and stats["prefill-0"].transfer.num_failed == 0
        assert stats["decode-0"].transfer.num_ok == len(prompts)
        handle.wait_until_quiet(timeout_s=60)
        assert handle.check_leaks() == {"prefill-0": None, "decode-0": None}
    finally:
        handle.shutdown()

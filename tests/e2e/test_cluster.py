"""Disaggregated cluster on CPU (local Ray, gloo): equality with HF and the colocated engine, leaks
after finishes and aborts, and the failure paths (lease expiry -> fail / recompute, a killed decode
worker)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from typing import Any

import pytest

from cluster.block_hash import hash_full_blocks
from cluster.protocol import FinishReason, RouteInfo, RouterError, WorkerFailedError
from cluster.router.kv_index import KvHit
from deploy.launch import Cluster, build_cluster
from tests.support.cluster_utils import (
    cluster_config,
    collect,
    greedy,
    run_concurrently,
    shared_prefix_prompts,
    wait_for,
)
from tests.support.hf_models import hf_greedy, make_random_hf_model
from workers.llm import LLM

ray = pytest.importorskip("ray")  # NOTE: these tests start a Ray cluster; a bare GPU machine has none

pytestmark = pytest.mark.slow

NUM_REQUESTS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_random_hf_model("qwen3", tmp_path_factory.mktemp("cluster")))


@pytest.fixture(scope="module")
def workload(model_dir: str) -> tuple[list[list[int]], list[int], list[list[int]]]:
    prompts = shared_prefix_prompts(NUM_REQUESTS, seed=1)
    max_tokens = [4 + i % 9 for i in range(NUM_REQUESTS)]
    return prompts, max_tokens, hf_greedy(model_dir, prompts, max_tokens)


@pytest.fixture(scope="module")
def disagg(model_dir: str) -> Any:
    handle = build_cluster(cluster_config(model_dir, prefill={"num_workers": 2}, decode={"num_workers": 2}))
    yield handle
    handle.shutdown()


def test_the_workers_of_a_cluster_it_starts_run_at_normal_priority(disagg: Cluster) -> None:
    """Ray would run them 15 niceness steps below the process that started it (its default worker
    niceness): every thread of every worker runs at that process's own priority, 0 in CI."""

    def niceness_of_every_thread(_worker: Any) -> set[int]:  # NOTE: runs in the worker's process
        values = set()
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                values.add(os.getpriority(os.PRIO_PROCESS, int(tid)))  # Linux: a thread id is a target
        return values

    refs = {wid: a.__ray_call__.remote(niceness_of_every_thread) for wid, a in disagg.actors.items()}
    niceness = {wid: ray.get(ref, timeout=60) for wid, ref in refs.items()}
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert niceness == {"prefill-0": {own}, "prefill-1": {own}, "decode-0": {own}, "decode-1": {own}}


def assert_no_leaks(handle: Cluster) -> None:
    handle.wait_until_quiet(timeout_s=30)
    assert handle.check_leaks() == {wid: None for wid in handle.check_leaks()}


def test_disaggregated_equals_hf_and_colocated(disagg: Cluster, model_dir: str, workload: Any) -> None:
    prompts, max_tokens, reference = workload
    colocated = LLM(model_dir, device="cpu", block_size=4).generate(prompts, [greedy(m) for m in max_tokens])
    assert [o.token_ids for o in colocated] == reference
    # NOTE: the cluster is the module's (tests run in random order): count this test's transfers only
    assert_no_leaks(disagg)
    refs = {wid: disagg.actors[wid].stats.remote() for wid in ("decode-0", "decode-1")}
    before = {wid: ray.get(ref, timeout=30).transfer.num_ok for wid, ref in refs.items()}
    assert run_concurrently(disagg, prompts, [greedy(m) for m in max_tokens]) == reference
    wait_for(lambda: _decode_transfers(disagg) >= sum(before.values()) + NUM_REQUESTS, 10, "stats refresh")
    stats = {s.worker_id: s for s in disagg.worker_stats()}
    moved = {wid: stats[wid].transfer.num_ok - before[wid] for wid in ("decode-0", "decode-1")}
    # every request went through a KV handoff, spread over both decode workers
    assert moved["decode-0"] + moved["decode-1"] == NUM_REQUESTS
    assert moved["decode-0"] > 0 and moved["decode-1"] > 0
    assert stats["decode-0"].transfer.bytes_total + stats["decode-1"].transfer.bytes_total > 0
    assert_no_leaks(disagg)
    # the same prompts again: prefix caches on both sides hit, output unchanged
    assert run_concurrently(disagg, prompts, [greedy(m) for m in max_tokens]) == reference
    assert_no_leaks(disagg)


def test_aborts_mid_prefill_transfer_and_decode_leak_nothing(disagg: Cluster, workload: Any) -> None:
    prompts, _, _ = workload
    router = disagg.router
    assert router is not None

    async def abort_after(rid: str, prompt: list[int], num_tokens: int) -> int:
        seen = 0
        agen = disagg.agenerate(prompt, greedy(400), request_id=rid)
        async for d in agen:
            seen += len(d.token_ids)
            if seen >= num_tokens:
                break
        await agen.aclose()  # leaving the stream aborts the request everywhere
        return seen

    async def abort_mid_prefill(rid: str, prompt: list[int]) -> None:
        task = asyncio.create_task(collect(disagg, prompt, greedy(400), rid))
        # wait (bounded) until the router has placed it on a prefill worker, then abort before any token
        for _ in range(500):
            if router.placement(rid)[0] is not None:
                break
            await asyncio.sleep(0.002)
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(router.abort(rid), disagg.loop))
        with pytest.raises(RouterError):
            await task

    async def main() -> list[int]:
        long_prompt = prompts[0] + prompts[1] + prompts[2]
        await abort_mid_prefill("abort-prefill", long_prompt)
        return list(
            await asyncio.gather(
                abort_after(
                    "abort-transfer-0", prompts[3], 1
                ),  # right after the first token: handoff under way
                abort_after("abort-transfer-1", prompts[4], 1),
                abort_after("abort-decode-0", prompts[5], 5),
                abort_after("abort-decode-1", prompts[6], 12),
            )
        )

    assert asyncio.run(main()) == [1, 1, 5, 12]
    assert_no_leaks(disagg)


def test_a_repeated_prompt_goes_where_the_workers_kv_events_say_it_is_cached(disagg: Cluster) -> None:
    """The prefill worker that ran a prompt reports its blocks (KvEvents); the router's index then holds
    every full block of it there, on the device tier, and the same prompt again goes to that worker with
    a device hit of every block the engine can use (its last token is always computed)."""
    router = disagg.router
    assert router is not None
    prompt = [5 + (i * 13) % 500 for i in range(121)]  # 30 usable blocks of 4 tokens
    hashes = hash_full_blocks(prompt, 4)

    async def route_of(rid: str) -> RouteInfo:
        route = None
        async for delta in disagg.agenerate(prompt, greedy(2), request_id=rid):
            if delta.timings is not None:
                route = delta.timings.route
        assert route is not None
        return route

    first = asyncio.run(route_of("kv-first"))
    holder = first.prefill_worker
    assert holder is not None
    wait_for(lambda: router.kv_index.hit(holder, hashes, 121, 4) == KvHit(30, 0), 10, "the index")
    second = asyncio.run(route_of("kv-second"))
    assert (second.reason, second.prefill_worker, second.prefill_hit_tokens) == (
        "kv_index_device_hit",
        holder,
        120,
    )
    # the index loses track of the holder (as after a lost frame): the router asks it for a snapshot at
    # its next heartbeat, and the worker's answer (a reset frame) gives back every block
    w = router.members.get(holder)
    assert w is not None and w.info.kv_events
    snapshots = router.kv_index.num_snapshots

    async def lose_track() -> None:
        router.kv_index.forget(holder, w.info.incarnation)

    disagg.run(lose_track(), timeout=10)
    wait_for(lambda: router.kv_index.hit(holder, hashes, 121, 4) == KvHit(30, 0), 10, "the snapshot")
    assert router.kv_index.is_complete(holder) and router.kv_index.num_snapshots > snapshots


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_transfer_failure_policy(model_dir: str, workload: Any, policy: str) -> None:
    """A lease that expires before the decode side asks makes every handoff fail for real. (Without
    early decode admission: with it, the decode side asks before the offer, so no lease runs out.)"""
    prompts, max_tokens, reference = workload
    transfer = {"lease_s": 0.001, "failure_policy": policy}
    cfg = cluster_config(model_dir, transfer=transfer, router={"early_decode_admission": False})
    handle = build_cluster(cfg)
    try:
        n = 8
        if policy == "recompute":
            assert run_concurrently(handle, prompts[:n], [greedy(m) for m in max_tokens[:n]]) == reference[:n]
        else:
            for p in prompts[:2]:
                with pytest.raises(WorkerFailedError, match="KV transfer failed"):
                    handle.generate(p, greedy(6), timeout_s=60)
        failed = wait_for(
            lambda: sum(s.transfer.num_failed for s in handle.worker_stats() if s.pool == "decode"),
            10,
            "failure counted",
        )
        assert failed > 0
        assert_no_leaks(handle)
    finally:
        handle.shutdown()


def test_conditional_mode_equals_hf(model_dir: str, workload: Any) -> None:
    prompts, max_tokens, reference = workload
    cfg = cluster_config(model_dir, router={"mode": "conditional", "conditional_max_prompt_tokens": 60})
    handle = build_cluster(cfg)
    try:
        assert run_concurrently(handle, prompts, [greedy(m) for m in max_tokens]) == reference
        num_long = sum(len(p) > 60 for p in prompts)
        assert 0 < num_long < NUM_REQUESTS
        wait_for(lambda: _decode_transfers(handle) >= num_long, 10, "stats refresh")
        assert _decode_transfers(handle) == num_long  # short prompts never left the decode worker
        assert_no_leaks(handle)
    finally:
        handle.shutdown()


def _decode_transfers(handle: Cluster) -> int:
    return sum(s.transfer.num_ok for s in handle.worker_stats() if s.pool == "decode")


@pytest.mark.parametrize("max_migrations", [3, 0])
def test_killed_decode_worker_migrates_or_fails_only_its_requests(
    model_dir: str, workload: Any, max_migrations: int
) -> None:
    """Kill a decode worker mid-stream: its requests migrate (prompt + tokens so far) and finish with
    the HF tokens; with max_migrations 0 exactly its requests fail. Either way the rest is untouched."""
    prompts, _, _ = workload
    cfg = cluster_config(model_dir, decode={"num_workers": 2}, router={"max_migrations": max_migrations})
    handle = build_cluster(cfg)
    router = handle.router
    try:

        async def main() -> dict[str, Any]:
            rids = [f"victim-{i}" for i in range(4)]
            tasks = {
                rid: asyncio.create_task(collect(handle, prompts[i + 8], greedy(600), rid))
                for i, rid in enumerate(rids)
            }
            placed = {}
            for _ in range(2000):  # bounded: until every request has a decode worker
                placed = {rid: router.placement(rid)[1] for rid in rids}
                if all(placed.values()):
                    break
                await asyncio.sleep(0.005)
            assert set(placed.values()) == {"decode-0", "decode-1"}
            # its KV tiers' events reached the router's index (received KV is cached there too)
            victim = router.members.get("decode-0")
            assert victim is not None
            for _ in range(2000):  # bounded
                if router.kv_index.num_blocks("decode-0"):
                    break
                await asyncio.sleep(0.005)
            assert router.kv_index.incarnation("decode-0") == victim.info.incarnation
            handle.kill_worker("decode-0")
            results: dict[str, Any] = {}
            for rid, task in tasks.items():
                try:
                    results[rid] = await asyncio.wait_for(task, timeout=60)
                except WorkerFailedError as e:
                    results[rid] = e
            return {rid: (placed[rid], results[rid]) for rid in rids}

        outcome = asyncio.run(main())
        expected = hf_greedy(model_dir, [prompts[8 + i] for i in range(4)], [600] * 4)
        for i, (worker, result) in enumerate(outcome.values()):
            if worker == "decode-0" and max_migrations == 0:
                assert isinstance(result, WorkerFailedError) and "decode-0" in str(result)
            else:
                assert result == expected[i]
        # the cluster keeps serving on the surviving decode worker
        out = handle.generate(prompts[0], greedy(5), timeout_s=60)
        assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 5
        assert router.is_healthy()
        assert [w.worker_id for w in router.workers if not w.healthy] == ["decode-0"]
        # kill -9 under load: no tier entry of the dead process is left in the router's index
        assert (router.kv_index.incarnation("decode-0"), router.kv_index.num_blocks("decode-0")) == (None, 0)
        handle.wait_until_quiet(timeout_s=30)
        assert handle.check_leaks() == {"prefill-0": None, "decode-1": None}
    finally:
        handle.shutdown()


def test_a_dead_prefill_worker_while_the_decode_side_is_reserved_migrates_and_leaks_nothing(
    model_dir: str,
) -> None:
    """Early admission: the decode worker reserved blocks and posted its fetch; the prefill worker is
    stopped mid-prefill (so it cannot finish), then killed. The attempt migrates to the other prefill
    worker, the reservation is released (the same decode worker takes the new attempt), the output is
    HF's, and nothing leaks."""
    prompt = [3 + (i * 37) % 500 for i in range(900)]
    reference = hf_greedy(model_dir, [prompt], [8])[0]
    # NOTE: 8-token prefill chunks: ~110 steps, far longer than it takes to stop the worker
    cfg = cluster_config(model_dir, prefill={"num_workers": 2}, engine={"max_num_batched_tokens": 8})
    handle = build_cluster(cfg)
    router = handle.router
    try:
        pids = {
            wid: ray.get(handle.actors[wid].ping.remote(), timeout=30) for wid in ("prefill-0", "prefill-1")
        }

        async def until(condition: Any, what: str) -> Any:
            """Poll (bounded) without blocking this loop, which runs the request's stream."""
            for _ in range(2000):
                value = condition()
                if value:
                    return value
                await asyncio.sleep(0.005)
            raise TimeoutError(f"{what} not reached within 10 s")

        def decode_waiting_for_kv() -> list[int]:
            return [s.num_waiting_for_kv for s in handle.worker_stats() if s.pool == "decode"]

        async def main() -> tuple[str, list[int], int]:
            tokens: list[int] = []
            migrations = -1
            stream = handle.agenerate(prompt, greedy(8), request_id="victim")
            first = asyncio.ensure_future(stream.__anext__())
            victim = await until(lambda: router.placement("victim")[0], "prefill placed")
            os.kill(pids[victim], signal.SIGSTOP)
            await until(lambda: decode_waiting_for_kv() == [1], "the decode worker's reservation")
            assert not first.done()  # no first token: the stopped worker never finished the prefill
            handle.kill_worker(victim)
            for delta in [await first, *[d async for d in stream]]:
                tokens += delta.token_ids
                if delta.timings is not None:
                    migrations = delta.timings.num_migrations
            return victim, tokens, migrations

        victim, tokens, migrations = asyncio.run(main())
        assert tokens == reference and migrations == 1
        survivor = "prefill-1" if victim == "prefill-0" else "prefill-0"
        handle.wait_until_quiet(timeout_s=30)
        assert handle.check_leaks() == {survivor: None, "decode-0": None}
    finally:
        handle.shutdown()

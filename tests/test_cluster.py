"""Disaggregated cluster on CPU (local Ray, gloo): equality with HF and the colocated engine, leaks
after finishes and aborts, and the failure paths (lease expiry -> fail / recompute, a killed decode
worker)."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest

from cluster.protocol import FinishReason, RouterError, WorkerFailedError
from deploy.launch import ClusterHandle, start_cluster
from tests.cluster_utils import (
    cluster_config,
    collect,
    counter_delta,
    greedy,
    run_concurrently,
    settled_stats,
    shared_prefix_prompts,
)
from tests.hf_models import hf_greedy, make_random_hf_model
from workers.llm import LLM

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
    handle = start_cluster(cluster_config(model_dir, prefill={"num_workers": 2}, decode={"num_workers": 2}))
    yield handle
    handle.shutdown()


def assert_no_leaks(handle: ClusterHandle) -> None:
    handle.wait_until_quiet(timeout_s=30)
    assert handle.check_leaks() == {wid: None for wid in handle.check_leaks()}


def test_disaggregated_equals_hf_and_colocated(disagg: ClusterHandle, model_dir: str, workload: Any) -> None:
    prompts, max_tokens, reference = workload
    colocated = LLM(model_dir, device="cpu", block_size=4).generate(prompts, [greedy(m) for m in max_tokens])
    assert [o.token_ids for o in colocated] == reference
    before = settled_stats(disagg)
    assert run_concurrently(disagg, prompts, [greedy(m) for m in max_tokens]) == reference
    after = settled_stats(disagg)
    # every request went through a KV handoff, spread over both decode workers
    transfers = counter_delta(before, after, "num_transfers", "decode")
    assert sum(transfers.values()) == NUM_REQUESTS
    assert transfers["decode-0"] > 0 and transfers["decode-1"] > 0
    assert all(n > 0 for n in counter_delta(before, after, "transfer_bytes", "decode").values())
    assert counter_delta(before, after, "num_failed_transfers") == {wid: 0 for wid in after}
    assert_no_leaks(disagg)
    # the same prompts again: prefix caches on both sides hit, output unchanged
    assert run_concurrently(disagg, prompts, [greedy(m) for m in max_tokens]) == reference
    assert_no_leaks(disagg)


def test_aborts_mid_prefill_transfer_and_decode_leak_nothing(disagg: ClusterHandle, workload: Any) -> None:
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


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_transfer_failure_policy(model_dir: str, workload: Any, policy: str) -> None:
    """A lease that expires before the decode side asks makes every handoff fail for real."""
    prompts, max_tokens, reference = workload
    cfg = cluster_config(model_dir, transfer={"lease_s": 0.001, "failure_policy": policy})
    handle = start_cluster(cfg)
    try:
        n = 8
        if policy == "recompute":
            assert run_concurrently(handle, prompts[:n], [greedy(m) for m in max_tokens[:n]]) == reference[:n]
        else:
            for p in prompts[:2]:
                with pytest.raises(WorkerFailedError, match="KV transfer failed"):
                    handle.generate(p, greedy(6), timeout_s=60)
        assert sum(s.num_failed_transfers for s in settled_stats(handle).values()) > 0
        assert_no_leaks(handle)
    finally:
        handle.shutdown()


def test_conditional_mode_equals_hf(model_dir: str, workload: Any) -> None:
    prompts, max_tokens, reference = workload
    cfg = cluster_config(model_dir, router={"mode": "conditional", "conditional_max_prompt_tokens": 60})
    handle = start_cluster(cfg)
    try:
        assert run_concurrently(handle, prompts, [greedy(m) for m in max_tokens]) == reference
        num_long = sum(len(p) > 60 for p in prompts)
        assert 0 < num_long < NUM_REQUESTS
        # short prompts never left the decode worker
        assert [s.num_transfers for s in settled_stats(handle).values() if s.pool == "decode"] == [num_long]
        assert_no_leaks(handle)
    finally:
        handle.shutdown()


def test_killed_decode_worker_fails_its_requests_only(
    model_dir: str, workload: Any, tmp_path: pathlib.Path
) -> None:
    prompts, _, _ = workload
    handle = start_cluster(cluster_config(model_dir, decode={"num_workers": 2}))
    router = handle.router
    assert router is not None
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
            handle.kill_worker("decode-0")
            results: dict[str, Any] = {}
            for rid, task in tasks.items():
                try:
                    results[rid] = await asyncio.wait_for(task, timeout=30)
                except WorkerFailedError as e:
                    results[rid] = e
            return {rid: (placed[rid], results[rid]) for rid in rids}

        outcome = asyncio.run(main())
        survivors = [i for i, (worker, _) in enumerate(outcome.values()) if worker == "decode-1"]
        expected = hf_greedy(model_dir, [prompts[8 + i] for i in survivors], [600] * len(survivors))
        for i, (worker, result) in enumerate(outcome.values()):
            if worker == "decode-0":
                assert isinstance(result, WorkerFailedError) and "decode-0" in str(result)
            else:
                assert result == expected[survivors.index(i)]
        # the cluster keeps serving on the surviving decode worker
        out = handle.generate(prompts[0], greedy(5), timeout_s=60)
        assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 5
        assert router.is_healthy()
        assert [w.worker_id for w in router.workers if not w.healthy] == ["decode-0"]
        handle.wait_until_quiet(timeout_s=30)
        assert handle.check_leaks() == {"prefill-0": None, "decode-1": None}
    finally:
        handle.shutdown()

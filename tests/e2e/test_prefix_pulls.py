"""Prefix pulls in a disaggregated CPU cluster (local Ray, gloo): a
conversation's history that only the decode worker's device cache holds (turn 1's answer) is pulled into
the prefill worker that gets turn 2, instead of recomputed (1 prefill + 1 decode worker: the puller and
the holder); outputs equal the offline engine's, greedy
and seeded; the pulled blocks hold exactly the holder's bytes; nothing leaks on any worker. Then the
holder is stopped and killed -9 while a pull waits on it: the request is still served exactly (the pull
ends with the holder's death, the prompt is computed), nothing leaks, nothing hangs."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from typing import Any

import pytest

from cluster.protocol import SamplingParams, WorkerStats
from deploy.launch import Cluster, build_cluster
from tests.support.cluster_utils import cluster_config, collect, greedy, wait_for
from tests.support.hf_models import make_random_hf_model
from workers.llm import LLM

ray = pytest.importorskip("ray")  # NOTE: these tests start a Ray cluster; a bare GPU machine has none

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
BLOCK = 4


def _turns(model_dir: str) -> tuple[list[list[int]], list[list[int]], list[SamplingParams]]:
    """Prompts, the offline engine's answers and params of five requests: turn 1 of two conversations
    (greedy, seeded), their turn 2 (prompt + answer + new tokens), then turn 3 of the greedy one."""
    rng = random.Random(3)
    greedy_, seeded = (
        greedy(MAX_TOKENS),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=5, ignore_eos=True),
    )
    params = [greedy_, seeded, greedy_, seeded, greedy_]
    prompts: list[list[int]] = [[rng.randrange(3, 512) for _ in range(rng.randint(40, 60))] for _ in range(2)]
    answers: list[list[int]] = []
    with LLM(model_dir, device="cpu", block_size=BLOCK, num_kv_blocks=512, detokenize_thread=False) as llm:
        for turn in (slice(0, 2), slice(2, 4), slice(4, 5)):
            for i in range(len(prompts), turn.stop):
                prompts.append(prompts[i - 2] + answers[i - 2] + [11 + i] * 9)
            answers += [o.token_ids for o in llm.generate(prompts[turn], params[turn])]
    return prompts, answers, params


def _turn(
    handle: Cluster, prompts: list[list[int]], params: list[SamplingParams], tag: str
) -> list[list[int]]:
    async def main() -> list[list[int]]:
        return list(
            await asyncio.gather(
                *(
                    collect(handle, p, sp, f"{tag}-{i}")
                    for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
                )
            )
        )

    return asyncio.run(main())


def _puller(handle: Cluster) -> WorkerStats:
    return next(s for s in handle.worker_stats() if s.worker_id == "prefill-0")


def _cached_kv(handle: Cluster, worker_id: str, token_ids: list[int]) -> bytes:
    kv: bytes = ray.get(handle.actors[worker_id].cached_kv.remote(token_ids), timeout=60)
    return kv


def test_pulled_prefixes_equal_the_holders_and_a_killed_holder_leaks_nothing(
    tmp_path: Any, request: pytest.FixtureRequest
) -> None:
    model_dir = str(make_random_hf_model("qwen3", tmp_path))
    prompts, expected, params = _turns(model_dir)
    # NOTE: a pull may wait 30 s here: the holder's death, not the timeout, must end the last one
    cfg = cluster_config(model_dir, router={"pull_min_blocks": 4, "pull_timeout_s": 30.0})
    handle: Cluster = build_cluster(cfg)
    try:
        router = handle.router
        assert router is not None
        assert _turn(handle, prompts[:2], params[:2], "t1") == expected[:2]
        handle.wait_until_quiet(timeout_s=30)

        # turn 2: the decode worker holds prompt + answer; the prefill worker the index picks lacks the
        # answer's blocks and pulls them
        history = [p + a for p, a in zip(prompts[:2], expected[:2], strict=True)]
        want = sum((len(h) - 1) // BLOCK for h in history)
        wait_for(lambda: router.kv_index.num_blocks("decode-0") >= want, 30, "the decode worker's KV events")
        assert _turn(handle, prompts[2:4], params[2:4], "t2") == expected[2:4]
        assert router.pulls.counts["pulled"] == 2 and router.pulls.counts["started"] == 2
        # the answers' blocks, at least (the stats come with the next heartbeat)
        want_pulled = sum(
            (len(h) - 1) // BLOCK - len(p) // BLOCK for h, p in zip(history, prompts[:2], strict=True)
        )
        wait_for(lambda: _puller(handle).num_pulled_blocks >= want_pulled, 10, "the puller's stats")
        stats = {s.worker_id: s for s in handle.worker_stats()}
        assert stats["prefill-0"].num_pulled_blocks == want_pulled, stats["prefill-0"]
        assert stats["prefill-0"].num_pulled_bytes > 0 and stats["prefill-0"].num_pull_failures == 0
        # the puller's cached KV of the history (its own blocks + the pulled ones), every full block of it
        # (turn 2's handoff gave the decode worker the last one)
        for h in history:
            holder = _cached_kv(handle, "decode-0", h)
            assert len(holder) == len(h) // BLOCK * len(_cached_kv(handle, "decode-0", h[:BLOCK])) > 0
            assert _cached_kv(handle, "prefill-0", h) == holder
        handle.wait_until_quiet(timeout_s=30)
        assert handle.check_leaks() == {"prefill-0": None, "decode-0": None}

        # turn 3 of the greedy conversation: its holder (the decode worker) is stopped, then killed -9
        # while the pull waits on it; the pull ends with it, the prompt is computed, and the request (no
        # decode worker left) finishes whole on a prefill worker, exactly
        want += (len(prompts[2]) + MAX_TOKENS - 1) // BLOCK - (len(history[0]) - 1) // BLOCK
        wait_for(lambda: router.kv_index.num_blocks("decode-0") >= want, 30, "the decode worker's KV events")
        pid = ray.get(handle.actors["decode-0"].ping.remote(), timeout=30)
        # NOTE: a kill -9 under load is decisive only on a busy box: this part runs under the `loaded`
        # fixture (the whole test does with --loaded: make test-faults)
        request.getfixturevalue("loaded")

        async def killed() -> list[int]:
            os.kill(pid, signal.SIGSTOP)
            task = asyncio.create_task(collect(handle, prompts[4], params[4], "t3"))
            for _ in range(2000):  # bounded: until the pull waits on the stopped holder
                if len(router.pulls):
                    break
                await asyncio.sleep(0.005)
            assert len(router.pulls) == 1 and not task.done()
            handle.kill_worker("decode-0")
            return await asyncio.wait_for(task, timeout=120)

        assert asyncio.run(killed()) == expected[4]
        assert router.pulls.counts["worker_died"] == 1 and len(router.pulls) == 0
        handle.wait_until_quiet(timeout_s=30)
        assert handle.check_leaks() == {"prefill-0": None}
    finally:
        handle.shutdown()

"""The host KV tier in a disaggregated CPU cluster (local Ray, gloo): turns of conversations whose working
set is several times the device KV, with aborts, handoffs, decode-side preemptions and a prefill worker
killed -9 under load (its requests migrate); outputs equal the offline engine's without a tier, the tiers
were used on both sides, the router's index keeps nothing of the dead process, and no block of either
tier leaks on any worker."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from deploy.launch import Cluster, build_cluster
from tests.support.cluster_utils import cluster_config, collect, greedy
from tests.support.hf_models import make_random_hf_model
from workers.kv_events import TIER_HOST
from workers.llm import LLM

ray = pytest.importorskip("ray")  # NOTE: these tests start a Ray cluster; a bare GPU machine has none

pytestmark = pytest.mark.slow

NUM_CONVERSATIONS = 8
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_random_hf_model("qwen3", tmp_path_factory.mktemp("tier-cluster")))


def _first_turns() -> list[list[int]]:
    rng = random.Random(7)
    system = [rng.randrange(3, 512) for _ in range(32)]
    return [
        system + [rng.randrange(3, 512) for _ in range(rng.randint(30, 70))] for _ in range(NUM_CONVERSATIONS)
    ]


@pytest.mark.loaded  # NOTE: a kill -9 under load is decisive only on a busy box (make test-faults too)
def test_turns_through_both_tiers_and_a_killed_worker_equal_the_offline_engine_and_leak_nothing(
    model_dir: str,
) -> None:
    # NOTE: the engine section merges into cluster_config's: 63 usable blocks of 4 tokens a worker, and
    # the conversations' working set is ~8 x 40 blocks
    handle: Cluster = build_cluster(
        cluster_config(model_dir, engine={"num_kv_blocks": 64, "kv_offload_gib": 0.01})
    )
    try:
        first = _first_turns()
        aborted = {2, 5}

        async def turn(prompts: list[list[int]], tag: str) -> list[list[int]]:
            async def one(i: int, prompt: list[int]) -> list[int]:
                if i not in aborted or tag != "t1":
                    return await collect(handle, prompt, greedy(MAX_TOKENS), f"{tag}-{i}")
                seen: list[int] = []
                stream = handle.agenerate(prompt, greedy(MAX_TOKENS), request_id=f"{tag}-{i}")
                async for d in stream:
                    seen += d.token_ids
                    if len(seen) >= 3:
                        break
                await stream.aclose()  # NOTE: leaving the stream aborts the request everywhere
                return seen

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

        answers = asyncio.run(turn(first, "t1"))
        second = [p + a + [11 + i] * 9 for i, (p, a) in enumerate(zip(first, answers, strict=True))]
        answers_2 = asyncio.run(turn(second, "t2"))

        with LLM(model_dir, device="cpu", block_size=4, num_kv_blocks=512, detokenize_thread=False) as llm:
            expected = [o.token_ids for o in llm.generate(first, greedy(MAX_TOKENS))]
            expected_2 = [o.token_ids for o in llm.generate(second, greedy(MAX_TOKENS))]
        for i in range(NUM_CONVERSATIONS):
            if i in aborted:
                assert answers[i] == expected[i][: len(answers[i])] and len(answers[i]) >= 3
            else:
                assert answers[i] == expected[i]
        assert answers_2 == expected_2

        stats: dict[str, Any] = {s.worker_id: s.engine for s in handle.worker_stats()}
        prefill, decode = stats["prefill-0"], stats["decode-0"]
        assert prefill.kv_offloaded_blocks > 0 and prefill.kv_loaded_blocks > 0  # turn 2 reloaded history
        assert prefill.prefix_cache_host_hits == prefill.kv_loaded_blocks * 4
        assert decode.num_preemptions > 0 and decode.kv_offloaded_blocks > 0
        assert handle.check_leaks() == {"prefill-0": None, "decode-0": None}

        # turn 3, and kill -9 of the prefill worker under it: its requests migrate (run whole on the decode
        # worker, from its own tiers) and finish exactly; the router's index had its host tier's entries
        # and keeps none of the dead process
        router = handle.router
        assert router is not None
        assert router.kv_index.num_blocks("prefill-0", TIER_HOST) > 0
        third = [p + a + [21 + i] * 9 for i, (p, a) in enumerate(zip(second, answers_2, strict=True))]

        async def killed_turn() -> list[list[int]]:
            tasks = [
                asyncio.create_task(collect(handle, p, greedy(MAX_TOKENS), f"t3-{i}"))
                for i, p in enumerate(third)
            ]
            for _ in range(2000):  # bounded: until a few are placed
                if sum(router.placement(f"t3-{i}")[0] is not None for i in range(len(third))) >= 3:
                    break
                await asyncio.sleep(0.005)
            handle.kill_worker("prefill-0")
            return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout=120))

        answers_3 = asyncio.run(killed_turn())
        with LLM(model_dir, device="cpu", block_size=4, num_kv_blocks=512, detokenize_thread=False) as llm:
            assert answers_3 == [o.token_ids for o in llm.generate(third, greedy(MAX_TOKENS))]
        assert (router.kv_index.incarnation("prefill-0"), router.kv_index.num_blocks("prefill-0")) == (
            None,
            0,
        )
        handle.wait_until_quiet(timeout_s=30)
        assert handle.check_leaks() == {"decode-0": None}
    finally:
        handle.shutdown()

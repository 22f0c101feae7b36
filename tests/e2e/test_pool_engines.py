"""Per-pool engine settings on a running cluster (local Ray, CPU, the bundled model): a decode pool with 4x
the seats of its prefill pool decodes more requests at once than the prefill pool can hold, with the
offline engine's greedy outputs, and every worker runs (and reports) its own pool's settings. The config
side (merging, errors naming the key): tests/deploy/test_pool_engines.py."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from deploy.launch import Cluster, build_cluster
from tests.support.cluster_utils import cluster_config, collect, greedy
from workers.llm import LLM

ray = pytest.importorskip("ray")  # NOTE: these tests start a Ray cluster; a bare GPU machine has none

pytestmark = pytest.mark.slow

VOCAB = 1229  # the bundled model's
PREFILL_SEATS, DECODE_SEATS = 2, 8  # the decode pool has 4x the prefill pool's seats
MAX_TOKENS = 160  # long enough that every request is still decoding when the last one arrives


async def _serve_and_watch(
    handle: Cluster, prompts: list[list[int]]
) -> tuple[list[list[int]], dict[str, int]]:
    """The requests at once; meanwhile each worker's running requests, sampled from its own stats."""
    tasks = [asyncio.create_task(collect(handle, p, greedy(MAX_TOKENS))) for p in prompts]
    peak = {"prefill-0": 0, "decode-0": 0}
    while not all(t.done() for t in tasks):
        for worker_id in peak:
            stats = await handle.actors[worker_id].stats.remote()
            peak[worker_id] = max(peak[worker_id], stats.engine.num_running)
        await asyncio.sleep(0.005)  # NOTE: sampling a gauge while the requests run, not waiting for one
    return [t.result() for t in tasks], peak


def test_a_decode_pool_with_4x_the_seats_decodes_them_all_at_once() -> None:
    rng = random.Random(29)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(8, 40))] for _ in range(DECODE_SEATS)]
    reference = [o.token_ids for o in LLM(device="cpu", block_size=4).generate(prompts, greedy(MAX_TOKENS))]
    cfg = cluster_config(
        "",
        prefill={"engine": {"max_num_seqs": PREFILL_SEATS}},
        decode={
            "engine": {"max_num_seqs": DECODE_SEATS, "num_kv_blocks": 1024, "max_num_batched_tokens": 64}
        },
    )
    handle = build_cluster(cfg)
    try:
        engines = {pool: handle.config.engine_config(pool) for pool in ("prefill", "decode")}
        assert (engines["prefill"].max_num_seqs, engines["decode"].max_num_seqs) == (2, 8)
        # each worker runs its own pool's EngineConfig, and reports its own pool's KV pool and context
        for worker_id, pool in (("prefill-0", "prefill"), ("decode-0", "decode")):
            ran: Any = ray.get(
                handle.actors[worker_id].__ray_call__.remote(lambda w: w.engine.config), timeout=30
            )
            assert ran == engines[pool]
        infos = {w.worker_id: w.info for w in handle.router.workers}
        assert (infos["prefill-0"].num_blocks, infos["prefill-0"].max_model_len) == (512, 511 * 4)
        assert (infos["decode-0"].num_blocks, infos["decode-0"].max_model_len) == (1024, 2048)

        outputs, peak = asyncio.run(_serve_and_watch(handle, prompts))
        assert outputs == reference
        assert peak["decode-0"] == DECODE_SEATS  # every request decoding at once: 4x the prefill seats
        # NOTE: a prefill leaves the running set when its step ends (its KV is held for the transfer)
        assert peak["prefill-0"] <= PREFILL_SEATS
        handle.wait_until_quiet(timeout_s=60)
        assert handle.check_leaks() == {"prefill-0": None, "decode-0": None}
    finally:
        handle.shutdown()

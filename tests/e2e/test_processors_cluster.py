"""The logits processors (penalties, logit_bias, min_tokens, bad words, allowed ids; half of them seeded
samples) through the router and real workers in one process (tests/support/local_cluster.py, no Ray):
disaggregated == colocated == offline, token for token, with KV short enough that both sides preempt
(recompute) mid-request. The kill -9 of a decode worker mid-stream (a migration) runs the same mix in
tests/e2e/test_elastic.py."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from cluster.config import RouterConfig
from tests.support.cluster_utils import shared_prefix_prompts, with_processors
from tests.support.local_cluster import LocalCluster, engine_config
from tests.support.oracle_cache import qwen3_model
from workers.llm import LLM

NUM_REQUESTS = 16
MAX_TOKENS = 20
# NOTE: 16 requests of up to ~200 + 20 tokens in 4-token blocks need far more than 96 blocks at once:
# each side preempts (and recomputes) some of them mid-request.
FEW_BLOCKS = 96


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return qwen3_model(tmp_path_factory)


@pytest.fixture(scope="module")
def workload(model_dir: str) -> tuple[list[list[int]], list, list[list[int]]]:  # type: ignore[type-arg]
    vocab = json.loads((pathlib.Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = shared_prefix_prompts(NUM_REQUESTS, seed=21, vocab=vocab)
    params = [with_processors(i, MAX_TOKENS, vocab) for i in range(NUM_REQUESTS)]
    offline = LLM(model_dir, device="cpu", block_size=4)
    reference = [o.token_ids for o in offline.generate(prompts, params)]
    return prompts, params, reference


def tokens(out: list[list]) -> list[list[int]]:  # type: ignore[type-arg]
    return [[t for d in deltas for t in d.token_ids] for deltas in out]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_processors_equal_offline_through_handoffs_and_preemptions(
    model_dir: str,
    workload: tuple,
    mode: str,  # type: ignore[type-arg]
) -> None:
    prompts, params, reference = workload
    pools = {"prefill": 1, "decode": 1} if mode == "disaggregated" else {"colocated": 1}
    cluster = LocalCluster(
        engine_config(model_dir, num_kv_blocks=FEW_BLOCKS, max_num_batched_tokens=64),
        pools,
        router=RouterConfig(mode=mode, health_interval_s=0.1, health_timeout_s=10.0),
    )
    try:
        assert tokens(cluster.generate(prompts, params)) == reference
        # prompt_logprobs: computed where the prompt is prefilled, carried with the first token (through
        # the handoff when disaggregated), equal to the offline engine's
        asked = [dataclasses.replace(p, prompt_logprobs=3) for p in params[:4]]
        streamed = cluster.generate(prompts[:4], asked)
        offline = LLM(model_dir, device="cpu", block_size=4).generate(prompts[:4], asked)
        for deltas, out in zip(streamed, offline, strict=True):
            carrying = [i for i, d in enumerate(deltas) if d.prompt_logprobs is not None]
            assert carrying == [0] and deltas[0].token_ids == out.token_ids[:1]
            got, want = deltas[0].prompt_logprobs, out.prompt_logprobs
            assert got is not None and want is not None and len(got) == len(want) == len(out.prompt_token_ids)
            assert got[0] is None and want[0] is None
            # NOTE: ids exact; values to float noise (the cluster's chunks batch the prompt differently)
            assert [(g.token_id, g.top_token_ids) for g in got[1:] if g] == [
                (w.token_id, w.top_token_ids) for w in want[1:] if w
            ]
            assert [x for g in got[1:] if g for x in (g.logprob, *g.top_logprobs)] == pytest.approx(
                [x for w in want[1:] if w for x in (w.logprob, *w.top_logprobs)], abs=1e-4
            )
        cluster.wait_until_quiet()  # every block free or cached with no users, on every worker
        stats = {wid: w.stats() for wid, w in cluster.workers.items()}
        assert sum(s.engine.num_preemptions for s in stats.values()) > 0, stats
        if mode == "disaggregated":
            assert stats["decode-0"].transfer.num_ok == NUM_REQUESTS + 4
        assert cluster.fatal == []
    finally:
        cluster.close()

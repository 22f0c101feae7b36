"""A tensor-parallel worker in a cluster: ``pdserve serve --config deploy/cpu-colocated.yaml -tp 2`` (one
colocated worker of two ranks, CPU, gloo) through the official ``openai`` client, greedy and seeded,
against the offline engine at one rank by the oracle's rule (tests/support/tp_oracle.py); no block held
after, and no rank process left once the cluster is shut down."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from cluster.protocol import RequestOutput, SamplingParams
from deploy.cli import build_parser
from deploy.cli_args import build_config
from deploy.http_host import start_http
from deploy.launch import Cluster, build_cluster
from tests.support.cluster_utils import wait_for
from tests.support.tp_oracle import check_tokens
from workers.llm import LLM

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The little robot", "One day, a girl named Lily"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    flags = ["serve", "--config", "deploy/cpu-colocated.yaml", "-tp", "2", "--num-colocated-workers", "1"]
    cfg = build_config(build_parser().parse_args([*flags, "--port", "0"]))
    assert (cfg.colocated.tensor_parallel_size, cfg.colocated.num_workers) == (2, 1)
    handle = build_cluster(cfg)
    yield handle
    handle.shutdown()


def _offline(params: SamplingParams) -> list[RequestOutput]:
    cfg = build_config(build_parser().parse_args(["serve", "--config", "deploy/cpu-colocated.yaml"]))
    engine: dict[str, Any] = dict(cfg.engine)
    with LLM("", dtype="float32", **engine) as llm:
        return llm.generate([llm.tokenizer.encode(p) for p in PROMPTS], params)


def test_colocated_tp2_serves_what_one_rank_computes(cluster: Cluster) -> None:
    with start_http(cluster) as server:
        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        for seed in (None, 7):
            temperature = 0.0 if seed is None else 0.9
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, logprobs=3)
            reference = _offline(params)
            batch = oai.completions.create(
                model="pdserve-tiny",
                prompt=PROMPTS,
                max_tokens=MAX_TOKENS,
                temperature=temperature,
                seed=seed,
            )
            for choice, ref in zip(batch.choices, reference, strict=True):
                ids: list[int] = choice.model_extra["token_ids"]  # type: ignore[index]
                assert len(ids) == MAX_TOKENS
                check_tokens(ref, ids)
            stream = oai.completions.create(
                model="pdserve-tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=temperature,
                seed=seed, stream=True,
            )  # fmt: skip
            check_tokens(reference[0], [t for c in stream for t in c.choices[0].model_extra["token_ids"]])  # type: ignore[index]
    assert all(report is None for report in cluster.check_leaks(10).values())
    pids = ray.get(cluster.actors["colocated-0"].rank_pids.remote(), timeout=30)
    assert len(pids) == 1 and _alive(pids[0])
    cluster.shutdown()
    wait_for(lambda: not _alive(pids[0]), 30, "rank 1 gone with its worker")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

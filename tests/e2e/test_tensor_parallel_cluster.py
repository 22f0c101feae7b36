"""Tensor-parallel workers in a cluster, through ``pdserve serve`` flags and the official ``openai`` client
(CPU, gloo, the bundled model): colocated TP=2, and KV handed off between workers of different sizes
(prefill TP=2 -> decode TP=1, TP=1 -> TP=2, TP=2 -> TP=2), greedy and seeded, against the offline
engine at one rank by the oracle's rule (tests/support/tp_oracle.py); the decode worker holds the
prefill engine's KV for the prompt byte for byte, every head in its place; no block held after, and no
rank process left once the cluster is shut down."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch

from cluster.protocol import RequestOutput, SamplingParams
from cluster.tokenizer import Tokenizer
from deploy.cli import build_parser
from deploy.cli_args import build_config
from deploy.http_host import start_http
from deploy.launch import Cluster, build_cluster
from tests.support.cluster_utils import wait_for
from tests.support.tp_oracle import check_tokens
from workers.engine import BUNDLED_MODEL
from workers.llm import LLM
from workers.parallel_kv import cached_kv

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


def _offline(
    params: SamplingParams, tp: int = 1, config: str = "deploy/cpu-colocated.yaml"
) -> list[RequestOutput]:
    cfg = build_config(build_parser().parse_args(["serve", "--config", config]))
    engine: dict[str, Any] = dict(cfg.engine)
    with LLM("", dtype="float32", tensor_parallel_size=tp, **engine) as llm:
        return llm.generate([llm.tokenizer.encode(p) for p in PROMPTS], params)


def _offline_kv(tp: int, prompt_ids: list[int]) -> bytes:
    """The prompt's full blocks' KV as the offline engine at ``tp`` ranks computes it (one-rank layout)."""
    cfg = build_config(build_parser().parse_args(["serve", "--config", "deploy/cpu-disagg.yaml"]))
    with LLM("", dtype="float32", tensor_parallel_size=tp, **dict(cfg.engine)) as llm:
        llm.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0.0))
        kv = cached_kv(llm.engine.runner, llm.engine.scheduler.kv, prompt_ids)
        return bytes(kv.contiguous().view(torch.uint8).numpy())


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)])
def test_kv_handed_off_between_tensor_parallel_sizes(prefill_tp: int, decode_tp: int) -> None:
    flags = ["serve", "--config", "deploy/cpu-disagg.yaml", "--port", "0"]
    flags += [
        "--prefill-tensor-parallel-size",
        str(prefill_tp),
        "--decode-tensor-parallel-size",
        str(decode_tp),
    ]
    cfg = build_config(build_parser().parse_args(flags))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3)
    seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7, logprobs=3)
    references = {
        None: _offline(greedy, config="deploy/cpu-disagg.yaml"),
        7: _offline(seeded, config="deploy/cpu-disagg.yaml"),
    }
    long_prompt = " ".join(PROMPTS * 4)  # NOTE: several full blocks of 16 tokens
    cluster = build_cluster(cfg)
    try:
        with start_http(cluster) as server:
            oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
            for seed, reference in references.items():
                temperature = 0.0 if seed is None else 0.9
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
            done = oai.completions.create(
                model="pdserve-tiny", prompt=long_prompt, max_tokens=2, temperature=0
            )
            assert done.usage is not None and done.usage.prompt_tokens >= 48
        prompt_ids = Tokenizer.from_pretrained(BUNDLED_MODEL).encode(long_prompt)
        delivered = ray.get(cluster.actors["decode-0"].cached_kv.remote(prompt_ids), timeout=60)
        assert len(delivered) > 0 and delivered == _offline_kv(prefill_tp, prompt_ids)
        assert all(report is None for report in cluster.check_leaks(10).values())
        stats = {s.worker_id: s for s in cluster.worker_stats()}
        # NOTE: 2 x 3 prompts, then the long one: every request's KV moved, none failed or was refused
        assert stats["decode-0"].transfer.num_ok == 7
        assert (stats["decode-0"].transfer.num_failed, stats["decode-0"].transfer.num_rejected_chunks) == (
            0,
            0,
        )
    finally:
        cluster.shutdown()


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

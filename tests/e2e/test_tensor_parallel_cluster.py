"""Tensor-parallel workers in a cluster, through ``pdserve serve`` flags and the official ``openai`` client
(CPU, gloo, the bundled model): colocated TP=2, and KV handed off between workers of different sizes
(prefill TP=2 -> decode TP=1, TP=1 -> TP=2, TP=2 -> TP=2), greedy and seeded, against the offline
engine at one rank by the oracle's rule (tests/support/tp_oracle.py); the decode worker holds the
prefill engine's KV for the prompt byte for byte, every head in its place; no block held after, and no
rank process left once the cluster is shut down."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
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
from tests.support.replica_streams import PROMPTS as STREAM_PROMPTS
from tests.support.tp_oracle import check_tokens
from workers.engine import BUNDLED_MODEL
from workers.llm import LLM
from workers.mock_runner import MockTokens
from workers.models.arch import ArchConfig
from workers.parallel_kv import cached_kv

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The little robot", "One day, a girl named Lily"]
MAX_TOKENS = 16
FAULT_PROMPTS = [list(STREAM_PROMPTS[i]) for i in range(16)]
NUM_TOKENS = 48


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    flags = ["serve", "--config", "deploy/cpu-colocated.yaml", "-tp", "2", "--num-colocated-workers", "1"]
    cfg = build_config(build_parser().parse_args([*flags, "--port", "0"]))
    assert (cfg.colocated.tensor_parallel_size, cfg.colocated.num_workers) == (2, 1)
    handle = build_cluster(cfg)
    yield handle
    handle.shutdown()


def _check_batch(oai: openai.OpenAI, seed: int | None, reference: list[RequestOutput]) -> None:
    """PROMPTS as one completions call (greedy without a seed, else sampled at 0.9 with it) against the
    offline outputs, by the oracle's rule."""
    temperature = 0.0 if seed is None else 0.9
    batch = oai.completions.create(
        model="pdserve-tiny", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=temperature, seed=seed
    )
    for choice, ref in zip(batch.choices, reference, strict=True):
        ids: list[int] = choice.model_extra["token_ids"]  # type: ignore[index]
        assert len(ids) == MAX_TOKENS
        check_tokens(ref, ids)


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
                _check_batch(oai, seed, reference)
            done = oai.completions.create(
                model="pdserve-tiny", prompt=long_prompt, max_tokens=2, temperature=0
            )
            assert done.usage is not None and done.usage.prompt_tokens >= 48
        prompt_ids = Tokenizer.from_pretrained(BUNDLED_MODEL).encode(long_prompt)
        delivered = ray.get(cluster.actors["decode-0"].cached_kv.remote(prompt_ids), timeout=60)
        assert len(delivered) > 0 and delivered == _offline_kv(prefill_tp, prompt_ids)
        assert all(report is None for report in cluster.check_leaks(10).values())
        # NOTE: 2 x 3 prompts, then the long one: every request's KV moved, none failed or was refused
        stats = wait_for(
            lambda: (s := {s.worker_id: s for s in cluster.worker_stats()})["decode-0"].transfer.num_ok == 7 and s,
            10, "the decode worker's heartbeat counting every handoff",
        )  # fmt: skip
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
            _check_batch(oai, seed, reference)
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


@pytest.mark.loaded
def test_kill_9_of_rank_1_of_the_decode_worker_fails_it_as_a_unit_and_loses_no_stream() -> None:
    """Prefill TP=1 -> decode TP=2 under 16 streams on a busy box: kill -9 of the decode worker's rank 1
    fails the worker at once (its rank 0 says so and exits), every stream finishes with the offline
    engine's text (migrated), Ray restarts the worker as a unit (a new rank 0 with a new rank 1) and it
    serves handoffs again, no block is held, and no process of the dead group is left."""
    flags = [
        "serve",
        "--config",
        "deploy/cpu-disagg.yaml",
        "--port",
        "0",
        "--decode-tensor-parallel-size",
        "2",
    ]
    cfg = build_config(build_parser().parse_args(flags))
    with LLM("", dtype="float32", **dict(cfg.engine)) as llm:
        params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
        reference = llm.generate(FAULT_PROMPTS, params)
    cluster = build_cluster(cfg)
    try:
        victim = next(w for w in cluster.router.workers if w.worker_id == "decode-0")
        old_incarnation, old_pid = victim.info.incarnation, victim.info.pid
        decode = cluster.actors["decode-0"]
        old_ranks = ray.get(decode.rank_pids.remote(), timeout=30)
        assert len(old_ranks) == 1
        with start_http(cluster) as server:
            streams = asyncio.run(
                _streams(server.url, FAULT_PROMPTS, NUM_TOKENS, lambda: os.kill(old_ranks[0], signal.SIGKILL))
            )
            for tokens, ref in zip(streams, reference, strict=True):
                assert len(tokens) == NUM_TOKENS
                check_tokens(ref, tokens)

            def restarted() -> bool:
                w = next((w for w in cluster.router.workers if w.worker_id == "decode-0"), None)
                return w is not None and w.state.value == "healthy" and w.info.incarnation != old_incarnation

            wait_for(restarted, 120, "the decode worker restarted (a new rank 0 and rank 1) and re-admitted")
            new_ranks = ray.get(decode.rank_pids.remote(), timeout=30)
            assert len(new_ranks) == 1 and new_ranks != old_ranks
            again = asyncio.run(_streams(server.url, FAULT_PROMPTS[:2], 8, lambda: None))
            assert again == [ref.token_ids[:8] for ref in reference[:2]]
        stats = wait_for(
            lambda: (s := {s.worker_id: s for s in cluster.worker_stats()})["decode-0"].transfer.num_ok >= 2 and s,
            30, "the restarted decode worker's handoffs",
        )  # fmt: skip
        assert stats["decode-0"].transfer.num_failed == 0
        cluster.wait_until_quiet(timeout_s=60)
        assert cluster.check_leaks() == {"prefill-0": None, "decode-0": None}
        wait_for(
            lambda: not _alive(old_pid) and not _alive(old_ranks[0]), 30, "the dead group's processes gone"
        )
    finally:
        cluster.shutdown()


async def _streams(
    url: str, prompts: list[list[int]], max_tokens: int, fault: Callable[[], None]
) -> list[list[int]]:
    """Streams ``prompts`` at once (greedy, EOS ignored); ``fault()`` once each has its first token;
    every stream's token ids once all ended with [DONE] (an error or a missing [DONE] fails the test)."""
    first = [asyncio.Event() for _ in prompts]

    async def one(i: int, prompt: list[int]) -> list[int]:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
        }
        tokens: list[int] = []
        async with (
            httpx.AsyncClient(timeout=120) as http,
            http.stream("POST", f"{url}/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return tokens
                if line.startswith("data: "):
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"]
                    first[i].set()
        raise AssertionError(f"stream {i} ended without [DONE] after {len(tokens)} tokens")

    tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
    async with asyncio.timeout(120):
        for event in first:
            await event.wait()
    fault()
    async with asyncio.timeout(180):
        return list(await asyncio.gather(*tasks))


def test_a_mock_cluster_of_tensor_parallel_workers_serves_the_rule_with_paced_handoffs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pdserve serve qwen3-0.6b --config deploy/mock-cluster.yaml --gpu h100 -tp 2``: mock workers of two
    real ranks each (the step broadcast, the relay), each step waiting the H100 roofline's time at TP=2;
    the handoff moves the first word of each block's K and V of the one-rank layout (rank 0 holds it)."""
    monkeypatch.setenv("PDSERVE_PROFILE", str(tmp_path / "cpu-profile.json"))
    model = str(Path(__file__).resolve().parents[2] / "bench" / "configs" / "qwen3-0.6b")
    flags = ["serve", model, "--config", "deploy/mock-cluster.yaml", "--gpu", "h100", "--num-kv-blocks", "16"]
    flags += ["--num-prefill-workers", "1", "--num-decode-workers", "1", "--max-num-batched-tokens", "256"]
    cfg = build_config(build_parser().parse_args([*flags, "-tp", "2", "--port", "0"]))
    rule = MockTokens.for_model(ArchConfig.from_pretrained(model), None)
    prompts = [[1000 + 13 * i + j for j in range(n)] for i, n in enumerate([5, 16, 40])]
    cluster = build_cluster(cfg)
    try:
        for prompt in prompts:
            assert cluster.generate(prompt, SamplingParams(max_tokens=6)).token_ids == rule.continuation(
                prompt, 6
            )
        moved = sum(-(-len(p) // 16) for p in prompts) * 28 * 2 * 8  # 8 B of each block's K and V, 28 layers

        def decode_bytes() -> int:
            return sum(
                s.transfer.bytes_total for s in cluster.worker_stats() if s.worker_id.startswith("decode")
            )

        wait_for(lambda: decode_bytes() == moved, 10, "the decode worker's heartbeat counting every handoff")
        assert [len(ray.get(a.rank_pids.remote(), timeout=30)) for a in cluster.actors.values()] == [1, 1]
        assert all(report is None for report in cluster.check_leaks(10).values())
    finally:
        cluster.shutdown()

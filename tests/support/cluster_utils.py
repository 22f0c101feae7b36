"""Test utilities for cluster tests (not a test module)."""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from collections.abc import Callable
from typing import Any

from cluster.config import POOLS
from cluster.protocol import SamplingParams
from deploy.launch import Cluster


def shared_prefix_prompts(num: int, seed: int, vocab: int = 512) -> list[list[int]]:
    """Prompts of 1..~200 tokens; every fourth one extends a shared 48-token prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(48)]
    prompts = []
    for i in range(num):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 160))]
        prompts.append(prefix + tail if i % 4 == 0 else tail)
    return prompts


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def with_processors(index: int, max_tokens: int, vocab: int) -> SamplingParams:
    """Request ``index`` of a mixed workload: the logits processors vLLM serves, one kind per index
    (mod 8), half of them seeded samples (their random stream must continue across a handoff, a
    migration or a preemption exactly as their token history does), the rest plain greedy."""
    kinds: list[dict[str, Any]] = [
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.8, "frequency_penalty": 0.5, "temperature": 0.8, "seed": 1000 + index},
        {"bad_words_token_ids": [[5 + index % 7], [11, 12 + index % 5]]},
        {"min_tokens": max_tokens // 2, "ignore_eos": False, "stop_token_ids": [7, 9, 13]},
        {"logit_bias": {3 + index % 11: 4.0, 17: -100.0}, "temperature": 1.0, "seed": 2000 + index},
        {"allowed_token_ids": list(range(index % 5, vocab, 7)), "temperature": 0.7, "seed": 3000 + index},
        {"repetition_penalty": 0.8, "presence_penalty": -0.5, "top_k": 20, "temperature": 0.9, "seed": index},
        {},
    ]
    options: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True, **kinds[index % len(kinds)]}
    return SamplingParams(max_tokens=max_tokens, **options)


async def collect(
    handle: Cluster, prompt: list[int], params: SamplingParams, rid: str | None = None
) -> list[int]:
    tokens: list[int] = []
    async for d in handle.agenerate(prompt, params, request_id=rid):
        tokens.extend(d.token_ids)
    return tokens


def run_concurrently(
    handle: Cluster, prompts: list[list[int]], params: list[SamplingParams]
) -> list[list[int]]:
    async def main() -> list[list[int]]:
        return list(
            await asyncio.gather(*(collect(handle, p, sp) for p, sp in zip(prompts, params, strict=True)))
        )

    return asyncio.run(main())


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll a condition with a bound (never a bare sleep)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"{what} not reached within {timeout_s} s")


JOB_AGENT_NOT_READY = "No available agent"  # the dashboard's answer while its job agent starts
JOB_RETRY_PAUSE_S = 2.0


def submit_job(
    command: list[str],
    *,
    env: dict[str, str],
    timeout_s: float,
    cwd: Any = None,
    ready_within_s: float = 300.0,
    alive: Callable[[], bool] = lambda: True,
) -> subprocess.CompletedProcess[str]:
    """Run a ``ray job submit`` command. Right after ``ray start`` the dashboard may have no job agent
    yet, and says so: only that answer is retried, with a pause, while ``alive()`` and within
    ``ready_within_s``; any other outcome is returned as it is."""
    deadline = time.monotonic() + ready_within_s
    while True:
        job = subprocess.run(
            command, env=env, cwd=cwd, timeout=timeout_s, capture_output=True, text=True, check=False
        )
        if JOB_AGENT_NOT_READY not in job.stdout + job.stderr or not alive() or time.monotonic() > deadline:
            return job
        time.sleep(JOB_RETRY_PAUSE_S)  # NOTE: a bounded retry of the one answer that says "not yet"


def cluster_config(model_dir: str, **overrides: Any) -> dict[str, Any]:
    """A small cluster's YAML mapping; each override is merged into its section (``decode={...}`` into
    ``pools.decode``)."""
    cfg: dict[str, Any] = {
        "model": {"path": model_dir},
        # NOTE: CPU even where CUDA exists: outputs are compared exactly with fp32 CPU transformers.
        "engine": {"device": "cpu", "block_size": 4, "num_kv_blocks": 512, "max_num_batched_tokens": 256},
        "pools": {"prefill": {"num_workers": 1}, "decode": {"num_workers": 1}},
        "transfer": {"timeout_s": 20.0},
        "router": {"health_interval_s": 0.2, "health_timeout_s": 5.0, "request_timeout_s": 120.0},
    }
    for key, value in overrides.items():
        section = cfg["pools"] if key in POOLS else cfg
        section[key] = {**section.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg

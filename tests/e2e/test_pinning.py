"""pin_cpu_cores: each CPU worker runs on its own core, so two workers on two cores stand for two devices
(the fair-race benchmark between modes relies on it)."""

from __future__ import annotations

import os

import pytest

from deploy.launch import build_cluster
from tests.support.cluster_utils import cluster_config, greedy, shared_prefix_prompts
from workers.llm import LLM

pytestmark = pytest.mark.slow


def test_workers_are_pinned_one_core_each_and_still_exact() -> None:
    cores = sorted(os.sched_getaffinity(0))
    cfg = cluster_config("", router={"mode": "colocated"}, colocated={"num_workers": 2}, pin_cpu_cores=True)
    handle = build_cluster(cfg)
    try:
        pinned = {w.worker_id: w.info.cpu_cores for w in handle.router.workers}
        assert pinned == {"colocated-0": [cores[0]], "colocated-1": [cores[1 % len(cores)]]}
        # each actor froze its start-up heap (torch, tokenizer, model: far more than 10k objects)
        assert all(w.info.gc_frozen_objects > 10_000 for w in handle.router.workers)
        prompt = shared_prefix_prompts(1, seed=2, vocab=1229)[0]
        expected = LLM(device="cpu", block_size=4).generate([prompt], greedy(8))[0].token_ids
        assert handle.generate(prompt, greedy(8), timeout_s=60).token_ids == expected
    finally:
        handle.shutdown()

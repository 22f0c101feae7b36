"""Placement by the router's KV index (cluster/router/placement.py ``explain_by_index``, through
cluster/router/routing.py ``decide``): the exact worker and reason for constructed cases; cost = tokens
left to compute + 0.25 a host-hit token + the worker's queued prompt tokens (+ 32 a running request on
a colocated worker)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cluster.block_hash import hash_full_blocks
from cluster.config import RouterConfig
from cluster.protocol import EngineStats, RouteInfo, WorkerStats
from cluster.router.kv_index import KvIndex
from cluster.router.placement import HOST_HIT_COST, REQUEST_COST_TOKENS
from cluster.router.routing import Pools, decide

BLOCK = 16
CONFIG = RouterConfig(mode="disaggregated")
PROMPT = [10 + (i * 31) % 400 for i in range(65)]  # 4 full blocks usable ((65 - 1) // 16)
HASHES = hash_full_blocks(PROMPT, BLOCK)


@dataclass
class Fake:
    worker_id: str
    block_size: int = BLOCK
    num_assigned: int = 0
    num_prompt_tokens: int = 0
    num_queued_prompts: int = 0
    stats: WorkerStats | None = None


def holding(**blocks: tuple[int, int]) -> KvIndex:
    """An index where each named worker holds the prompt's first (device, host) blocks."""
    ix = KvIndex(1 << 10, 16)
    for wid, (device, host) in blocks.items():
        stored = [(0, h) for h in HASHES[:device]] + [(1, h) for h in HASHES[device : device + host]]
        ix.apply(wid, "i", 0, stored, [])
    return ix


def test_a_device_hit_draws_the_prompt_to_a_busier_worker_within_what_it_saves() -> None:
    a, b, d = Fake("prefill-a", num_prompt_tokens=47), Fake("prefill-b"), Fake("decode-0")
    ix = holding(**{"prefill-a": (3, 0)})  # 48 tokens: a computes 17 + 47 queued = 64 < 65
    route = decide("disaggregated", PROMPT, Pools([a, b], [d]), CONFIG, index=ix)
    assert (route.mode, route.reason, route.worker, route.hold) == (
        "disaggregated",
        "kv_index_device_hit",
        a,
        True,
    )
    assert route.info() == RouteInfo("disaggregated", "kv_index_device_hit", "prefill-a", None, 48, 0, None)
    a.num_prompt_tokens = 48  # 65 = 65: a tie goes to the fewer requests, then the id
    b.num_assigned = 1
    assert (decide("disaggregated", PROMPT, Pools([a, b], [d]), CONFIG, index=ix).worker) is a
    a.num_prompt_tokens = 49  # what it saves no longer pays for its queue: the idle miss
    route = decide("disaggregated", PROMPT, Pools([a, b], [d]), CONFIG, index=ix)
    assert (route.reason, route.worker, route.prefill_hit_tokens) == ("kv_index_miss", b, 0)


def test_a_host_hit_costs_more_than_a_device_hit_and_less_than_a_miss() -> None:
    a, b, c, d = Fake("prefill-a"), Fake("prefill-b"), Fake("prefill-c"), Fake("decode-0")
    ix = holding(**{"prefill-a": (2, 0), "prefill-b": (1, 3)})  # a: 32 device; b: 16 device + 48 host
    route = decide("disaggregated", PROMPT, Pools([a, b, c], [d]), CONFIG, index=ix)
    assert (route.reason, route.worker, route.prefill_hit_tokens) == ("kv_index_host_hit", b, 64)
    assert HOST_HIT_COST * 48 + 1 < 65 - 32  # b: 1 + 12 = 13 against a: 33
    assert route.queued_tokens == 13  # what b's queue counts: its work, not the 65 tokens
    b.num_prompt_tokens = 21  # 34 > 33
    route = decide("disaggregated", PROMPT, Pools([a, b, c], [d]), CONFIG, index=ix)
    assert (route.reason, route.worker, route.prefill_hit_tokens) == ("kv_index_device_hit", a, 32)
    assert route.queued_tokens == 33
    route = decide("disaggregated", PROMPT, Pools([a, b, c], [d]), CONFIG)  # no index: the whole prompt
    assert route.queued_tokens is None


def test_a_host_hit_weighs_what_its_worker_measured_a_copy_to_cost() -> None:
    def measured(wid: str, ratio: float) -> Fake:
        return Fake(wid, stats=WorkerStats(wid, "prefill", engine=EngineStats(host_load_cost=ratio)))

    d = Fake("decode-0")
    ix = holding(**{"prefill-a": (2, 0), "prefill-b": (1, 3)})  # a: 32 device; b: 16 device + 48 host
    a, b = Fake("prefill-a", num_prompt_tokens=25), measured("prefill-b", 0.5)
    # b: 1 + 0.5 * 48 = 25, + 8 queued = 33; a: 33 + 25 = 58 (at the default 0.25, b would cost 21)
    b.num_prompt_tokens = 8
    route = decide("disaggregated", PROMPT, Pools([a, b], [d]), CONFIG, index=ix)
    assert (route.worker, route.queued_tokens) == (b, 25)
    # a load rule that recomputes (ratio >= 1): a host-hit token costs what computing it does
    b = measured("prefill-b", 3.0)
    route = decide("disaggregated", PROMPT, Pools([a, b], [d]), CONFIG, index=ix)
    assert (route.worker, route.queued_tokens) == (b, 49)  # 1 + 48: still below a's 58
    a.num_prompt_tokens = 0  # a: 33 against b's 49
    route = decide("disaggregated", PROMPT, Pools([a, b], [d]), CONFIG, index=ix)
    assert (route.worker, route.reason) == (a, "kv_index_device_hit")
    # nothing measured yet (-1): the default
    b = measured("prefill-b", -1.0)
    assert decide("disaggregated", PROMPT, Pools([a, b], [d]), CONFIG, index=ix).queued_tokens == 13


def test_a_prompt_shorter_than_a_block_is_a_miss_on_the_least_loaded_worker() -> None:
    a, b, d = Fake("prefill-a", num_prompt_tokens=3), Fake("prefill-b", num_prompt_tokens=2), Fake("d")
    route = decide("disaggregated", PROMPT[:10], Pools([a, b], [d]), CONFIG, index=holding())
    assert (route.reason, route.worker) == ("kv_index_miss", b)


def test_colocated_workers_weigh_their_running_requests() -> None:
    running = WorkerStats("c", "colocated", engine=EngineStats(num_running=2))
    a, b = Fake("colocated-a", stats=running), Fake("colocated-b")
    ix = holding(**{"colocated-a": (4, 0)})  # a: 1 + 2 x 32 = 65 against b: 65; tie: fewer requests
    config = RouterConfig(mode="colocated")
    route = decide("colocated", PROMPT, Pools(colocated=[a, b]), config, index=ix)
    assert len(PROMPT) == 1 + 2 * REQUEST_COST_TOKENS
    assert (route.mode, route.reason, route.worker) == ("colocated", "kv_index_miss", b)
    a.stats = WorkerStats("c", "colocated", engine=EngineStats(num_running=1))
    route = decide("colocated", PROMPT, Pools(colocated=[a, b]), config, index=ix)
    assert (route.reason, route.worker, route.prefill_hit_tokens, route.decode_hit_tokens) == (
        "kv_index_device_hit",
        a,
        64,
        64,
    )
    resumed = decide("colocated", PROMPT, Pools(colocated=[a, b]), config, index=ix, resume=True)
    assert (resumed.reason, resumed.worker) == ("resume_mid_stream", a)


def test_without_an_index_the_affinity_guess_decides_as_before() -> None:
    a, b, d = Fake("prefill-a"), Fake("prefill-b"), Fake("decode-0")
    route = decide("disaggregated", PROMPT, Pools([a, b], [d]), CONFIG)
    assert route.reason == "prefix_affinity"


def test_the_policy_and_the_index_bounds_come_from_the_flag_and_the_yaml() -> None:
    import argparse

    from deploy.cli_args import add_cluster_arguments, build_config

    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    assert build_config(parser.parse_args([])).router.prefix_routing == "index"
    assert (
        build_config(parser.parse_args(["--prefix-routing", "affinity"])).router.prefix_routing == "affinity"
    )
    with pytest.raises(ValueError, match="prefix_routing must be one of"):
        build_config(parser.parse_args(["--prefix-routing", "guess"]))
    with pytest.raises(ValueError, match="kv_index_max_workers must be >= 1, got 0"):
        RouterConfig(kv_index_max_workers=0)

"""Route decisions and their reasons (cluster/router/routing.py) for constructed cases, and the router-side
prefix view. Costs come from a hand-made profile: a step is 10 ms + 1 ms per prompt token, a handoff
5 ms + 0.1 ms per token moved, no hops, so every predicted time below is worked out by hand."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import pytest

from cluster.block_hash import ROOT_HASH, hash_block, hash_full_blocks
from cluster.config import RouterConfig
from cluster.cost_model import CostProfile, LinearStepCost, TransferCost
from cluster.protocol import ClusterUnavailableError, EngineStats, RouteInfo, WorkerStats
from cluster.router.placement import pick_decode
from cluster.router.predict import Predictor
from cluster.router.routing import Pools, PrefixView, decide

BLOCK = 16
PROFILE = CostProfile(
    "t", "hand", LinearStepCost(0.010, 0.001, 0.0, 0.0, 0.0, 0.0), TransferCost(0.005, 1e7), 1000
)
PREDICTOR = Predictor(PROFILE, budget=512)
CONFIG = RouterConfig(mode="conditional", conditional_max_prompt_tokens=64, affinity_slack_tokens=100)


@dataclass
class Fake:
    """The router's view of one worker (what cluster/router/routing.py reads)."""

    worker_id: str
    block_size: int = BLOCK
    num_assigned: int = 0
    num_prompt_tokens: int = 0
    num_queued_prompts: int = 0
    stats: WorkerStats | None = None


def running(n: int, used_blocks: int) -> WorkerStats:
    return WorkerStats(
        "d",
        "decode",
        engine=EngineStats(num_running=n, num_total_blocks=100, num_free_blocks=100 - used_blocks),
    )


def prompt(n: int, seed: int = 0) -> list[int]:
    return [10 + (seed * 7919 + i * 31) % 400 for i in range(n)]


def preferred_prefill(workers: list[Fake], tokens: list[int]) -> Fake:
    """The worker rendezvous hashing on the first block picks (cluster/router/placement.py's affinity)."""
    key = hash_block(ROOT_HASH, tokens[:BLOCK])
    return max(workers, key=lambda w: hashlib.blake2b(key + w.worker_id.encode(), digest_size=8).digest())


def test_colocated_mode_takes_the_least_loaded_worker() -> None:
    a, b = Fake("colocated-0", num_assigned=2), Fake("colocated-1", num_assigned=1)
    route = decide("colocated", prompt(40), Pools(colocated=[a, b]), CONFIG)
    assert (route.mode, route.reason, route.worker, route.hold) == ("colocated", "least_loaded", b, False)
    assert route.info() == RouteInfo("colocated", "least_loaded", "colocated-1", "colocated-1", 0, 0, None)
    resumed = decide("colocated", prompt(40), Pools(colocated=[a, b]), CONFIG, resume=True)
    assert (resumed.reason, resumed.worker) == ("resume_mid_stream", b)


def test_the_workers_own_report_counts_the_other_replicas_requests() -> None:
    """Front-end replicas: this router routed nothing to either worker, but colocated-0 reports 5
    requests of another replica's: the least loaded is colocated-1. A router's own count still wins
    where it is the larger (requests routed since the last report)."""
    other = WorkerStats("c", "colocated", engine=EngineStats(num_running=3, num_waiting=2))
    a, b = Fake("colocated-0", stats=other), Fake("colocated-1", num_assigned=4)
    route = decide("colocated", prompt(40), Pools(colocated=[a, b]), CONFIG)
    assert route.worker is b
    b.num_assigned = 6
    assert decide("colocated", prompt(40), Pools(colocated=[a, b]), CONFIG).worker is a
    d0 = Fake("decode-0", stats=running(4, used_blocks=10))
    d1 = Fake("decode-1", num_assigned=2, stats=replace(running(1, used_blocks=50), num_waiting_for_kv=1))
    assert pick_decode([d0, d1]) is d1  # NOTE: 2 against 4, though it has fewer free blocks


def test_disaggregated_mode_says_why_that_prefill_worker() -> None:
    tokens = prompt(40)
    p0, p1, d = Fake("prefill-0"), Fake("prefill-1"), Fake("decode-0")
    mode = replace(CONFIG, mode="disaggregated")
    preferred = preferred_prefill([p0, p1], tokens)
    other = p1 if preferred is p0 else p0
    route = decide("disaggregated", tokens, Pools([p0, p1], [d]), mode)
    assert (route.mode, route.reason, route.worker, route.hold) == (
        "disaggregated",
        "prefix_affinity",
        preferred,
        True,
    )
    assert route.info().decode_worker is None  # picked at the handoff
    preferred.num_prompt_tokens = 101  # past the 100-token slack over the idle one
    route = decide("disaggregated", tokens, Pools([p0, p1], [d]), mode)
    assert (route.reason, route.worker) == ("affinity_target_busy", other)
    route = decide("disaggregated", tokens[: BLOCK - 1], Pools([p0, p1], [d]), mode)
    assert (route.reason, route.worker) == ("prompt_shorter_than_a_block", other)


def test_an_empty_pool_runs_requests_whole_on_the_other() -> None:
    p, d = Fake("prefill-0"), Fake("decode-0")
    route = decide("disaggregated", prompt(40), Pools([], [d]), CONFIG)
    assert (route.mode, route.reason, route.worker, route.hold) == (
        "colocated",
        "no_healthy_prefill_worker",
        d,
        False,
    )
    route = decide("disaggregated", prompt(40), Pools([p], []), CONFIG)
    assert (route.mode, route.reason, route.worker) == ("colocated", "no_healthy_decode_worker", p)
    with pytest.raises(ClusterUnavailableError):
        decide("disaggregated", prompt(40), Pools([p], []), replace(CONFIG, colocated_fallback=False))
    route = decide("disaggregated", prompt(40), Pools([p], [d]), CONFIG, resume=True)
    assert (route.mode, route.reason, route.worker) == ("colocated", "resume_mid_stream", d)


def test_conditional_mode_without_a_profile_goes_by_prompt_length() -> None:
    p, d = Fake("prefill-0"), Fake("decode-0")
    short = decide("conditional", prompt(64), Pools([p], [d]), CONFIG)
    assert (short.mode, short.reason, short.worker, short.hold) == ("conditional", "short_prompt", d, False)
    long = decide("conditional", prompt(65), Pools([p], [d]), CONFIG)
    assert (long.mode, long.reason, long.worker, long.hold) == ("disaggregated", "long_prompt", p, True)


def test_conditional_mode_by_predicted_cost() -> None:
    p, d = Fake("prefill-0"), Fake("decode-0")
    # idle both sides, 32 tokens: locally 42 ms to the first token + a 10 ms decode step; remotely the
    # same 42 ms + an 8.2 ms handoff + the decode step: local
    route = decide("conditional", prompt(32), Pools([p], [d]), CONFIG, predictor=PREDICTOR)
    assert (route.mode, route.reason, route.worker) == ("conditional", "local_prefill_cheaper", d)
    assert route.predicted_ttft_s == pytest.approx(0.042, abs=1e-12)
    # 100 tokens (past the 64-token rule) on an idle decode worker: still local, by cost
    route = decide("conditional", prompt(100), Pools([p], [d]), CONFIG, predictor=PREDICTOR)
    assert (route.mode, route.reason) == ("conditional", "local_prefill_cheaper")
    # the decode worker already has a 1000-token prompt queued: 1032 tokens in 3 steps = 1062 ms locally
    # against 42 ms on the prefill worker: hand off
    d.num_prompt_tokens, d.num_queued_prompts = 1000, 1
    route = decide("conditional", prompt(32), Pools([p], [d]), CONFIG, predictor=PREDICTOR)
    assert (route.mode, route.reason, route.worker, route.hold) == (
        "disaggregated",
        "handoff_cheaper",
        p,
        True,
    )
    assert route.predicted_ttft_s == pytest.approx(0.042, abs=1e-12)


def test_a_local_prefill_that_would_stall_running_decodes_is_handed_off() -> None:
    p = Fake("prefill-0")
    d = Fake("decode-0", stats=running(4, used_blocks=8))
    strict = replace(PREDICTOR, tbt_slo_s=0.02)  # a 32-token chunk makes a 42 ms step: past 20 ms
    route = decide("conditional", prompt(32), Pools([p], [d]), CONFIG, predictor=strict)
    assert (route.mode, route.reason) == ("disaggregated", "local_prefill_would_stall_decodes")
    route = decide(
        "conditional", prompt(32), Pools([p], [d]), CONFIG, predictor=replace(strict, tbt_slo_s=0.05)
    )
    assert (route.mode, route.reason) == ("conditional", "local_prefill_cheaper")


def test_the_decode_workers_own_prefix_hit_decides() -> None:
    tokens = prompt(256)
    p = Fake("prefill-0")
    d0 = Fake("decode-0", num_prompt_tokens=1000, num_queued_prompts=1)  # pick_decode's choice (fewest)
    d1 = Fake("decode-1", num_assigned=3, num_prompt_tokens=100, num_queued_prompts=1)
    pools = Pools([p], [d0, d1])
    # no cached prefix anywhere: the prefill worker's 266 ms + a 30.6 ms handoff + a 10 ms step (306.6)
    # beats d1 prefilling its queue and the prompt (366 + 10 ms) and busy d0: hand off
    route = decide("conditional", tokens, pools, CONFIG, predictor=PREDICTOR, view=PrefixView())
    assert (route.mode, route.reason, route.worker) == ("disaggregated", "handoff_cheaper", p)
    assert route.prefill_hit_tokens == route.decode_hit_tokens == 0
    # d1 served this prefix before: 15 of its 16 blocks are cached, 100 + 16 tokens to compute (126 ms
    # + 10) against 266 + 6.6 + 10 ms through the prefill worker: d1 prefills it, for its prefix
    view = PrefixView()
    view.record("decode-1", hash_full_blocks(tokens, BLOCK), capacity=100)
    route = decide("conditional", tokens, pools, CONFIG, predictor=PREDICTOR, view=view)
    assert (route.mode, route.reason, route.worker) == ("conditional", "decode_prefix_hit", d1)
    assert (route.prefill_hit_tokens, route.decode_hit_tokens) == (240, 240)
    assert route.predicted_ttft_s == pytest.approx(0.126, abs=1e-12)
    # the decode step it joins: 10 ms (this profile charges nothing per sequence)
    info = RouteInfo(
        "conditional", "decode_prefix_hit", "decode-1", "decode-1", 240, 240, route.predicted_ttft_s, 0.01
    )
    assert route.info() == info


def test_prefix_view_hits_and_eviction() -> None:
    tokens = prompt(64)  # 4 blocks
    hashes = hash_full_blocks(tokens, BLOCK)
    view = PrefixView()
    view.record("w", hashes, capacity=100)
    assert view.hit_tokens("w", hashes, 64, BLOCK) == 48  # the last token is always computed
    assert view.hit_tokens("w", hashes, 65, BLOCK) == 64
    assert view.hit_tokens("other", hashes, 65, BLOCK) == 0
    other = hash_full_blocks(prompt(48, seed=1), BLOCK)  # 3 blocks more: 7 > 5, two evicted
    view = PrefixView()
    view.record("w", hashes, capacity=5)
    view.record("w", other, capacity=5)
    assert view.num_blocks("w") == 5
    # the tail of the older prompt goes first: its first 2 blocks are left
    assert view.hit_tokens("w", hashes, 65, BLOCK) == 32
    view.forget("w")
    assert view.hit_tokens("w", other, 49, BLOCK) == 0

"""The router and real workers in one process (tests/support/local_cluster.py: no Ray): what the disaggregated
path moves and reuses, counted exactly, and the colocated mode, each equal to transformers."""

from __future__ import annotations

import pytest

from cluster.config import RouterConfig
from cluster.protocol import TransferStats, WorkerStats
from cluster.router.membership import WorkerState
from tests.support.cluster_utils import greedy, shared_prefix_prompts, wait_for
from tests.support.local_cluster import LocalCluster, engine_config
from tests.support.oracle_cache import hf_reference, qwen3_model
from transfer.channel import layout_of
from transfer.pairs import PairChannel
from transfer.protocol import TransferResult
from workers.decode_role import DecodeRole
from workers.prefill_role import PrefillRole
from workers.role import WorkerContext

BLOCK_SIZE = 4
# first blocks all differ (no hit inside a pass); lengths with and without a partial last block
PROMPTS = [
    [40 + i, *range(100 + 7 * i, 100 + 7 * i + n - 1)] for i, n in enumerate([5, 8, 9, 13, 16, 23, 3, 30])
]
MAX_TOKENS = [6, 3, 7, 5, 4, 8, 6, 2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return qwen3_model(tmp_path_factory)


def tokens(out: list[list]) -> list[list[int]]:  # type: ignore[type-arg]
    return [[t for d in deltas for t in d.token_ids] for deltas in out]


def check_results(
    results: list[TransferResult], stats: TransferStats, bytes_per_block: int, is_sender: bool
) -> None:
    """Every transfer one side saw: whole blocks, a pair of generation 0, its phases inside its wire time
    inside its total time, and the side's own phases measured (the sender gathers, the receiver
    scatters, both hash); the side's counters are the sums."""
    eps = 1e-6  # NOTE: float sums of the phase times only
    for r in results:
        assert r.ok and r.error is None and r.generation == 0, r
        assert r.nbytes == r.num_blocks * bytes_per_block, r
        phases = r.gather_seconds + r.hash_seconds + r.scatter_seconds + r.blocked_seconds
        assert 0.0 <= phases <= r.wire_seconds + eps and r.wire_seconds <= r.seconds, r
        assert min(r.gather_seconds, r.hash_seconds, r.scatter_seconds, r.blocked_seconds) >= 0.0, r
        if r.num_blocks:  # NOTE: a prompt cached whole on the decode side moves nothing
            assert r.hash_seconds > 0.0 and (r.gather_seconds if is_sender else r.scatter_seconds) > 0.0, r
    assert (stats.num_ok, stats.num_failed) == (len(results), 0)
    assert stats.bytes_total == sum(r.nbytes for r in results)
    assert stats.seconds_total == sum(r.seconds for r in results)


def settled(cluster: LocalCluster) -> dict[str, WorkerStats]:
    cluster.wait_until_quiet()
    return {wid: w.stats() for wid, w in cluster.workers.items()}


def test_second_pass_hits_both_prefix_caches_and_moves_only_uncached_blocks(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pass 1 moves every prompt block; pass 2 (same prompts) hits each prompt's full blocks on the
    decode worker (so only a partial last block moves) and all but the block holding the last prompt
    token on the prefill worker that affinity picks again. Shutdown releases the KV-transfer pairs."""
    reference = hf_reference(model_dir, PROMPTS, MAX_TOKENS)
    channels: dict[str, PairChannel] = {}
    make_channel = WorkerContext.channel

    def recorded(ctx: WorkerContext) -> PairChannel | None:
        channel = make_channel(ctx)
        assert channel is not None  # every worker of a disaggregated cluster can move KV
        # NOTE: a worker's first channel is its handoff role's; its prefix pulls build their own after it
        channels.setdefault(ctx.worker_id, channel)
        return channel

    monkeypatch.setattr(WorkerContext, "channel", recorded)
    cluster = LocalCluster(engine_config(model_dir), {"prefill": 2, "decode": 1})
    try:
        bytes_per_block = layout_of(cluster.workers["decode-0"].engine.runner.kv_cache).bytes_per_block
        params = [greedy(m) for m in MAX_TOKENS]
        full = [len(p) // BLOCK_SIZE for p in PROMPTS]
        blocks = [-(-len(p) // BLOCK_SIZE) for p in PROMPTS]
        before = settled(cluster)
        expected_moved = {1: sum(blocks), 2: sum(b - f for b, f in zip(blocks, full, strict=True))}
        expected_decode_hits = {1: 0, 2: BLOCK_SIZE * sum(full)}
        expected_prefill_hits = {1: 0, 2: BLOCK_SIZE * sum((len(p) - 1) // BLOCK_SIZE for p in PROMPTS)}
        for n in (1, 2):
            assert tokens(cluster.generate(PROMPTS, params)) == reference
            after = settled(cluster)
            d0, d1 = before["decode-0"], after["decode-0"]
            assert d1.transfer.num_ok - d0.transfer.num_ok == len(PROMPTS)
            assert d1.transfer.bytes_total - d0.transfer.bytes_total == expected_moved[n] * bytes_per_block
            assert d1.engine.prefix_cache_hits - d0.engine.prefix_cache_hits == expected_decode_hits[n]
            prefill_hits = sum(
                after[w].engine.prefix_cache_hits - before[w].engine.prefix_cache_hits
                for w in ("prefill-0", "prefill-1")
            )
            assert prefill_hits == expected_prefill_hits[n]
            # what the prefill side sent is what the decode side received
            sent = sum(
                after[w].transfer.bytes_total - before[w].transfer.bytes_total
                for w in ("prefill-0", "prefill-1")
            )
            assert sent == expected_moved[n] * bytes_per_block
            before = after
        assert expected_moved[2] < expected_moved[1]
        decode = cluster.workers["decode-0"].role
        senders = [cluster.workers[w].role for w in ("prefill-0", "prefill-1")]
        assert isinstance(decode, DecodeRole) and decode.receiver is not None
        received = decode.receiver.results()
        check_results(received, decode.receiver.stats(), bytes_per_block, is_sender=False)
        sent = []
        for role in senders:
            assert isinstance(role, PrefillRole) and role.sender is not None
            check_results(role.sender.results(), role.sender.stats(), bytes_per_block, is_sender=True)
            sent += role.sender.results()
        assert sorted((r.request_id, r.num_blocks) for r in sent) == sorted(
            (r.request_id, r.num_blocks) for r in received
        )
        assert sum(r.num_blocks for r in received) == expected_moved[1] + expected_moved[2]
        assert cluster.fatal == []
        # one pair per prefill worker that sent, on both sides
        senders_used = [
            w
            for w, role in zip(("prefill-0", "prefill-1"), senders, strict=True)
            if role.sender and role.sender.results()
        ]
        assert sorted(k.prefill.worker_id for k in channels["decode-0"].pairs()) == senders_used
        for w in ("prefill-0", "prefill-1"):
            assert [k.decode.worker_id for k in channels[w].pairs()] == (
                ["decode-0"] if w in senders_used else []
            )
    finally:
        cluster.close()
    # shutdown ends every KV-transfer thread and releases every pair
    assert [
        t.name for w in cluster.workers.values() if w.role for t in w.role.threads() if t.is_alive()
    ] == []
    assert sorted(channels) == ["decode-0", "prefill-0", "prefill-1"]
    assert {w: c.pairs() for w, c in channels.items()} == {w: [] for w in channels}


def test_a_dead_transfer_thread_makes_its_worker_say_so_and_leave_the_cluster(model_dir: str) -> None:
    cluster = LocalCluster(engine_config(model_dir), {"prefill": 1, "decode": 1})
    try:
        for wid, name in (("decode-0", "KVReceiver-decode-0"), ("prefill-0", "KVSender-prefill-0")):
            role = cluster.workers[wid].role
            assert role is not None
            (thread,) = role.threads()
            assert thread.name == name and thread.is_alive()
            role.close()  # the transfer thread ends under a live worker
            reason = f"step thread died: RuntimeError: transfer thread(s) ['{name}'] died"
            wait_for(lambda r=reason: r in cluster.fatal, 10, f"{wid} reports its dead transfer thread")
            assert not cluster.workers[wid].health()
            wait_for(
                lambda w=wid: any(
                    x.worker_id == w and x.state == WorkerState.DEAD for x in cluster.router.workers
                ),
                10,
                f"the router drops {wid}",
            )
        assert not cluster.router.is_healthy()
    finally:
        cluster.close()


def test_multi_turn_follow_ups_hit_what_each_side_computed_and_move_only_the_rest(model_dir: str) -> None:
    """Each turn's prompt is the previous prompt + its answer + new text. The decode worker holds every
    full block of what it computed (the prompt it received, then its decode: all but the last sampled
    token), the prefill worker every full block of the prompt it computed; only the blocks past the
    decode side's hit move."""
    cluster = LocalCluster(engine_config(model_dir), {"prefill": 1, "decode": 1})
    try:
        bytes_per_block = layout_of(cluster.workers["decode-0"].engine.runner.kv_cache).bytes_per_block
        max_tokens = [9, 6, 4]
        new_text = [[5, 77, 402, 18, 260], [90, 91, 92]]
        prompts = [[11, 48, 301, 7, 250, 99, 3, 480, 17, 64]]  # 10 tokens
        outputs: list[list[int]] = []
        seen: list[tuple[int, int, int]] = []  # (decode hit, prefill hit, blocks moved) per turn
        before = settled(cluster)
        for turn, num in enumerate(max_tokens):
            if turn > 0:
                prompts.append(prompts[-1] + outputs[-1] + new_text[turn - 1])
            (out,) = tokens(cluster.generate([prompts[-1]], [greedy(num)]))
            outputs.append(out)
            after = settled(cluster)
            d0, d1, p0, p1 = before["decode-0"], after["decode-0"], before["prefill-0"], after["prefill-0"]
            moved = d1.transfer.bytes_total - d0.transfer.bytes_total
            assert moved % bytes_per_block == 0
            seen.append(
                (
                    d1.engine.prefix_cache_hits - d0.engine.prefix_cache_hits,
                    p1.engine.prefix_cache_hits - p0.engine.prefix_cache_hits,
                    moved // bytes_per_block,
                )
            )
            before = after
        # turn 2 (24 tokens): decode computed 10 + 9 - 1 = 18 tokens (4 full blocks), prefill 10 (2);
        # turn 3 (33 tokens): decode computed 24 + 6 - 1 = 29 (7 full blocks), prefill 24 (6)
        assert [len(p) for p in prompts] == [10, 24, 33]
        assert seen == [(0, 0, 3), (16, 8, 6 - 4), (28, 24, 9 - 7)]
        assert outputs == hf_reference(model_dir, prompts, max_tokens)
        assert cluster.fatal == []
    finally:
        cluster.close()


def test_colocated_mode_equals_transformers(model_dir: str) -> None:
    prompts = shared_prefix_prompts(12, seed=5)
    max_tokens = [3 + i % 6 for i in range(len(prompts))]
    reference = hf_reference(model_dir, prompts, max_tokens)
    cluster = LocalCluster(
        engine_config(model_dir, max_num_batched_tokens=64),
        {"colocated": 2},
        router=RouterConfig(mode="colocated", health_interval_s=0.1, health_timeout_s=10.0),
    )
    try:
        before = settled(cluster)
        assert tokens(cluster.generate(prompts, [greedy(m) for m in max_tokens])) == reference
        after = settled(cluster)
        generated = {
            wid: after[wid].engine.num_generation_tokens - before[wid].engine.num_generation_tokens
            for wid in after
        }
        # every request ran whole on one worker, and the router spread them over both
        assert sum(generated.values()) == sum(max_tokens)
        assert all(n > 0 for n in generated.values())
        assert all(s.transfer.num_ok == 0 for s in after.values())
        assert cluster.fatal == []
    finally:
        cluster.close()

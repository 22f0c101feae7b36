"""The router's KV index fed by fake workers' KvEvents over the real wire (tests/support/fake_workers.py):
placement by it, every way a worker's entries leave it (death, a new incarnation, a stale heartbeat,
drain), late frames of a dead process left out, and the snapshots the router asks for when it lost
track of a worker."""

from __future__ import annotations

from cluster.block_hash import hash_full_blocks
from cluster.router.kv_index import RESYNC_INTERVAL_S
from cluster.router.router import Router
from cluster.wire import KvEvents, KvResync, WorkerFailed
from tests.support.fake_workers import BLOCK_SIZE, FakeWorkers, Stream, run, until

PROMPT = list(range(50, 67))  # 17 tokens: 4 full blocks, all usable ((17 - 1) // 4)
HASHES = hash_full_blocks(PROMPT, BLOCK_SIZE)
DEVICE = 0


def stored(worker_id: str, incarnation: str, seq: int, hashes: list[bytes]) -> KvEvents:
    return KvEvents(worker_id, incarnation, seq, [(DEVICE, h) for h in hashes])


async def route(router: Router, fakes: FakeWorkers, rid: str, prompt: list[int]) -> tuple[str, str, int]:
    """Open ``rid``; its prefill worker (which gets the op), route reason and expected hit tokens."""
    Stream(router, rid, prompt)
    await until(lambda: router.placement(rid)[0] is not None, f"{rid} placed")
    wid = router.placement(rid)[0]
    assert wid is not None
    assert (await fakes.op(wid)).request_id == rid
    info = router._flights.get(rid).route  # type: ignore[union-attr]  # NOTE: no public view of a flight's route
    assert info is not None and info.prefill_worker == wid
    return wid, info.reason, info.prefill_hit_tokens


def test_a_prefix_held_on_a_busier_worker_draws_the_request_there_by_the_index() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-a", "prefill")
        await fakes.add("prefill-b", "prefill")
        await fakes.add("decode-0", "decode")

        def queued() -> tuple[int, int]:
            a, b = (
                next(w for w in router.workers if w.worker_id == wid) for wid in ("prefill-a", "prefill-b")
            )
            return a.num_prompt_tokens, b.num_prompt_tokens

        # both idle and empty: a tie, to the id; prefill-a then has 24 prompt tokens queued
        assert await route(router, fakes, "r0", list(range(900, 924))) == ("prefill-a", "kv_index_miss", 0)
        await fakes.send(stored("prefill-a", "i0", 0, HASHES))
        await until(lambda: router.kv_index.num_blocks("prefill-a") == 4, "prefill-a's blocks indexed")
        # prefill-a: 1 token to compute + 24 queued = 25 against prefill-b's 17: the busier holder loses
        assert await route(router, fakes, "r1", PROMPT) == ("prefill-b", "kv_index_miss", 0)
        assert queued() == (24, 17)
        # 25 against 17 + 17: the holder wins, and its queue grows by the 1 token it computes, not by 17
        assert await route(router, fakes, "r2", PROMPT) == ("prefill-a", "kv_index_device_hit", 16)
        assert queued() == (25, 17)
        # 26 against 34 again: a queued hit is no work, so the holder keeps drawing the prompt
        assert await route(router, fakes, "r3", PROMPT) == ("prefill-a", "kv_index_device_hit", 16)
        assert queued() == (26, 17)
        assert router.route_decisions() == {
            ("disaggregated", "kv_index_miss"): 2,
            ("disaggregated", "kv_index_device_hit"): 2,
        }

    run(scenario)


def test_the_affinity_policy_stays_selectable_and_the_index_is_fed_under_it() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-a", "prefill")
        await fakes.add("decode-0", "decode")
        await fakes.send(stored("prefill-a", "i0", 0, HASHES))
        await until(lambda: router.kv_index.num_blocks("prefill-a") == 4, "indexed")
        assert await route(router, fakes, "r1", PROMPT) == ("prefill-a", "prefix_affinity", 0)

    run(scenario, prefix_routing="affinity")


def test_a_dead_or_replaced_process_leaves_no_entry_and_its_late_frames_are_left_out() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-a", "prefill")
        await fakes.add("decode-0", "decode")
        await fakes.send(stored("prefill-a", "i0", 0, HASHES), stored("decode-0", "i0", 0, HASHES[:1]))
        await until(lambda: router.kv_index.num_blocks("prefill-a") == 4, "indexed")
        await fakes.send(WorkerFailed("prefill-a", "step thread died"))
        await until(lambda: "prefill-a" not in router.kv_index.worker_ids, "prefill-a dropped")
        await fakes.send(stored("prefill-a", "i0", 1, HASHES))  # late: its process is dead
        await fakes.add("prefill-a", "prefill", incarnation="i1", pid=2)
        await fakes.send(stored("prefill-a", "i0", 2, HASHES), stored("prefill-a", "i1", 0, HASHES[:2]))
        await until(lambda: router.kv_index.num_blocks("prefill-a") == 2, "the new process indexed")
        assert router.kv_index.incarnation("prefill-a") == "i1"
        # a new incarnation's heartbeat alone (no WorkerFailed: kill -9) drops the old one's entries
        await fakes.add("prefill-a", "prefill", incarnation="i2", pid=3)
        assert (router.kv_index.worker_ids, router.kv_index.num_entries) == (["decode-0"], 1)
        await fakes.send(stored("ghost", "i0", 0, HASHES))  # not admitted: left out, not refused
        await fakes.send(stored("decode-0", "i0", 1, HASHES[1:2]))
        await until(lambda: router.kv_index.num_blocks("decode-0") == 2, "decode-0's frame taken")
        assert router.kv_index.worker_ids == ["decode-0"]

    run(scenario)


def test_a_worker_whose_heartbeat_goes_stale_or_that_drains_is_dropped() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-a", "prefill")
        await fakes.add("prefill-b", "prefill")
        await fakes.send(stored("prefill-a", "i0", 0, HASHES), stored("prefill-b", "i0", 0, HASHES))
        await until(lambda: router.kv_index.num_entries == 8, "indexed")
        await router.drain("prefill-b", timeout_s=1.0)
        assert router.kv_index.worker_ids == ["prefill-a"]
        # prefill-a beats no more: past health_timeout_s it is unhealthy, and out of the index
        await until(lambda: router.kv_index.worker_ids == [], "prefill-a dropped when stale")
        assert [w.state.value for w in router.workers] == ["unhealthy"]

    run(scenario, health_timeout_s=0.5)


def test_the_router_asks_a_worker_for_a_snapshot_whenever_its_index_lost_track() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        now = [100.0]
        router.kv_feed.clock = lambda: now[0]
        await fakes.add("prefill-a", "prefill", kv_events=True)
        await fakes.add("decode-0", "decode")  # publishes no events: never asked
        # admitted with nothing known of it (its first frames may have come before): asked at once
        assert await fakes.op("prefill-a") == KvResync()
        snapshot = [(DEVICE, h) for h in HASHES[:2]]
        await fakes.send(KvEvents("prefill-a", "i0", 0, snapshot, reset=True))
        await until(lambda: router.kv_index.is_complete("prefill-a"), "the snapshot taken")
        await fakes.beat("prefill-a")  # complete: a heartbeat asks nothing
        # a lost frame (1): the index clears the worker, asks, and the answer replaces what it holds
        now[0] += RESYNC_INTERVAL_S
        await fakes.send(stored("prefill-a", "i0", 2, HASHES[3:]))
        assert await fakes.op("prefill-a") == KvResync()
        await fakes.send(KvEvents("prefill-a", "i0", 3, [(DEVICE, h) for h in HASHES], reset=True))
        await until(lambda: router.kv_index.is_complete("prefill-a"), "the second snapshot taken")
        assert router.kv_index.num_blocks("prefill-a") == 4
        # unhealthy: its entries go; healthy again: asked once (the heartbeat's check is within the
        # interval of the ask made when it turned healthy)
        now[0] += RESYNC_INTERVAL_S
        await fakes.beat("prefill-a", healthy=False)
        await until(lambda: router.kv_index.num_blocks("prefill-a") == 0, "entries dropped")
        await fakes.beat("prefill-a")
        assert await fakes.op("prefill-a") == KvResync()
        assert await fakes.pending_ops("prefill-a") == [] and await fakes.pending_ops("decode-0") == []
        assert (router.kv_feed.num_resyncs, router.kv_index.num_gaps, router.kv_index.num_snapshots) == (
            3,
            1,
            2,
        )

    run(scenario)

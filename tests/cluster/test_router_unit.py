"""Router unit tests against fake workers (tests/support/fake_workers.py: the real wire protocol, no engine, no
Ray): the disaggregated path and its bookkeeping, decode choice, prefix affinity, modes, health,
re-admission of a restarted worker, admission limits."""

from __future__ import annotations

import pytest

from cluster.protocol import (
    ClusterUnavailableError,
    FinishReason,
    InvalidRequestError,
    QueueFullError,
    TokenDelta,
)
from cluster.router.membership import WorkerState
from cluster.router.router import Router
from cluster.wire import (
    Deltas,
    Generate,
    PeerDead,
    Prefilled,
    Transferred,
)
from tests.support.fake_workers import (
    FakeWorkers,
    Stream,
    assert_idle,
    decode_of,
    delta,
    prefilled,
    run,
    until,
)

PROMPT = [11, 12, 13, 14, 15, 16]  # 6 tokens, first block [11, 12, 13, 14]


def test_the_disaggregated_path_picks_decode_workers_by_load_then_free_blocks() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        await fakes.add("decode-0", "decode", num_free_blocks=10)
        await fakes.add("decode-1", "decode", num_free_blocks=50)
        streams = {rid: Stream(router, rid, PROMPT) for rid in "abc"}
        for i, s in enumerate(streams.values()):
            await prefilled(fakes, s, "prefill-0", 100 + i)
        # a: both idle, decode-1 has more free blocks; b: decode-0 has fewer requests; c: tie, more free
        assert [decode_of(router, rid) for rid in streams] == ["decode-1", "decode-0", "decode-1"]
        prefill = next(w for w in router.workers if w.worker_id == "prefill-0")
        assert (prefill.num_assigned, prefill.num_prompt_tokens) == (3, 0)
        for i, (rid, s) in enumerate(streams.items()):
            w = decode_of(router, rid)
            await fakes.send(
                Transferred(w, rid, 0.5 + i, 4096),
                Deltas(w, [delta(rid, 200 + i)]),
                Deltas(w, [delta(rid, 300 + i, finish=FinishReason.LENGTH)]),
            )
            second, last = await s.next(), await s.next()
            assert isinstance(second, TokenDelta) and isinstance(last, TokenDelta)
            assert (second.request_id, second.token_ids, second.finish_reason) == (rid, [200 + i], None)
            assert (last.request_id, last.token_ids, last.finish_reason) == (
                rid,
                [300 + i],
                FinishReason.LENGTH,
            )
            assert last.timings is not None and last.timings.transfer_s == 0.5 + i
            assert last.timings.num_migrations == 0
            assert await s.next() is None
        assert_idle(router)
        Stream(router, "next", PROMPT)  # a finished request is not aborted: prefill-0's next op is this
        assert (await fakes.op("prefill-0")).request_id == "next"

    run(scenario)


@pytest.mark.parametrize("reported_by", ["prefill", "decode"])
def test_a_handoff_avoids_a_broken_kv_pair_while_a_sound_one_exists(reported_by: str) -> None:
    """decode-0 is the better choice (more free blocks), but its pair with prefill-0 is broken (either
    end may report it): the handoff takes decode-1. Once every pair is broken, any decode worker."""

    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        await fakes.add("decode-0", "decode", num_free_blocks=90)
        await fakes.add("decode-1", "decode", num_free_blocks=10)
        if reported_by == "prefill":
            await fakes.beat("prefill-0", broken_peers=["decode-0/i0"])
        else:
            await fakes.beat("decode-0", num_free_blocks=90, broken_peers=["prefill-0/i0"])
        await until(lambda: any(w.stats and w.stats.broken_peers for w in router.workers), "stats")
        await prefilled(fakes, Stream(router, "a", PROMPT), "prefill-0", 7)
        assert decode_of(router, "a") == "decode-1"
        await fakes.beat("decode-1", num_free_blocks=10, broken_peers=["prefill-0/i0"])
        await until(lambda: bool(router.workers[2].stats and router.workers[2].stats.broken_peers), "stats")
        await prefilled(fakes, Stream(router, "b", PROMPT), "prefill-0", 8)
        assert decode_of(router, "b") == "decode-0"  # nothing sound left: fewest requests, most free

    run(scenario)


def test_prefix_affinity_keeps_a_first_block_on_one_prefill_worker_within_the_slack() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        for i in range(3):
            await fakes.add(f"prefill-{i}", "prefill")
        await fakes.add("decode-0", "decode")

        async def route(rid: str, prompt: list[int]) -> str:
            Stream(router, rid, prompt)
            await until(lambda: router.placement(rid)[0] is not None, f"{rid} placed")
            wid = router.placement(rid)[0]
            assert wid is not None
            gen = await fakes.op(wid)
            assert (gen.request_id, gen.prompt_token_ids, gen.hold) == (rid, prompt, True)
            return wid

        preferred = await route("r1", PROMPT)  # 6 outstanding prompt tokens there
        assert await route("r2", [*PROMPT[:4], 90]) == preferred  # 6 - 0 <= slack 10: 11 there now
        others = sorted({"prefill-0", "prefill-1", "prefill-2"} - {preferred})
        assert await route("r3", [*PROMPT[:4], 91, 92]) == others[0]  # 11 - 0 > 10: the least loaded
        assert await route("r4", [5, 6]) == others[1]  # shorter than a block: the least loaded
        await fakes.send(Prefilled(preferred, delta("r1", 7), b"kv"))  # r1's prompt is done: 5 there
        await until(lambda: router.placement("r1")[1] is not None, "r1 handed off")
        assert await route("r5", [*PROMPT[:4], 93]) == preferred  # 5 - 2 <= 10

    run(scenario, affinity_slack_tokens=10, prefix_routing="affinity")


def test_modes_route_whole_requests_where_they_should() -> None:
    async def conditional(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        await fakes.add("decode-0", "decode")
        short, long = Stream(router, "short", [1] * 8), Stream(router, "long", [1] * 9)
        gen = await fakes.op("decode-0")
        assert (gen.request_id, gen.hold) == ("short", False)
        gen = await fakes.op("prefill-0")
        assert (gen.request_id, gen.hold) == ("long", True)
        assert router.is_healthy()
        assert short.req.request_id == "short" and long.req.request_id == "long"

    run(conditional, mode="conditional", conditional_max_prompt_tokens=8)

    async def colocated(router: Router, fakes: FakeWorkers) -> None:
        assert not router.is_healthy()
        with pytest.raises(ClusterUnavailableError, match="no worker has registered"):
            router.model_info  # noqa: B018
        await fakes.add("colocated-0", "colocated", max_model_len=512)
        await fakes.add("colocated-1", "colocated", max_model_len=256)
        assert router.is_healthy() and router.model_info.max_model_len == 256
        for i in range(3):
            Stream(router, f"c{i}", PROMPT)
        ops = await fakes.ops("colocated-0", 2) + await fakes.ops("colocated-1", 1)
        assert [(op.request_id, op.hold) for op in ops] == [("c0", False), ("c2", False), ("c1", False)]

    run(colocated, mode="colocated")

    async def fallback(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")  # no decode pool: the prefill worker runs it whole
        assert router.is_healthy()
        Stream(router, "f", PROMPT)
        gen = await fakes.op("prefill-0")
        assert (gen.request_id, gen.hold) == ("f", False)

    run(fallback)

    async def no_fallback(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        assert not router.is_healthy()
        error = await Stream(router, "f", PROMPT).next()
        assert isinstance(error, ClusterUnavailableError)

    run(no_fallback, colocated_fallback=False)


def test_unhealthy_workers_are_not_routed_to_until_they_beat_again() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("colocated-0", "colocated")
        await fakes.add("colocated-1", "colocated")
        await fakes.beat("colocated-0", healthy=False)  # it reports a dead thread
        await until(lambda: not router.workers[0].healthy, "unhealthy")
        assert router.workers[0].why == "it reports a dead thread"
        for i in range(2):
            Stream(router, f"u{i}", PROMPT)
        assert [op.request_id for op in await fakes.ops("colocated-1", 2)] == ["u0", "u1"]
        await fakes.beat("colocated-0")
        await until(lambda: router.workers[0].healthy, "healthy again")
        Stream(router, "u2", PROMPT)
        assert (await fakes.op("colocated-0")).request_id == "u2"

    run(scenario, mode="colocated")


def test_a_silent_worker_turns_unhealthy_and_a_beat_brings_it_back() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("colocated-0", "colocated")
        await until(lambda: not router.workers[0].healthy, "stale")
        assert router.workers[0].why.startswith("no heartbeat for ") and not router.is_healthy()
        await fakes.beat("colocated-0")
        await until(lambda: router.workers[0].healthy, "healthy again")

    run(scenario, mode="colocated", health_timeout_s=0.5)


def test_a_new_incarnation_replaces_the_old_one_whose_requests_move_on() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("colocated-0", "colocated")
        await fakes.add("colocated-1", "colocated")
        s = Stream(router, "r", PROMPT)
        assert (await fakes.op("colocated-0")).request_id == "r"
        await fakes.send(Deltas("colocated-0", [delta("r", 4)]))
        assert (await s.next()).token_ids == [4]  # type: ignore[union-attr]
        await fakes.add("colocated-0", "colocated", incarnation="i1")  # Ray restarted it
        peer_dead, gen = await fakes.ops("colocated-1", 2)
        assert peer_dead == PeerDead("colocated-0", "i0")
        assert gen == Generate("r~1", PROMPT, s.req.params, gen.deadline, False, [4])
        assert [(w.worker_id, w.info.incarnation, w.state) for w in router.workers] == [
            ("colocated-1", "i0", WorkerState.HEALTHY),
            ("colocated-0", "i1", WorkerState.HEALTHY),
        ]
        await fakes.send(Deltas("colocated-1", [delta("r~1", 5, finish=FinishReason.STOP)]))
        assert [d.token_ids for d in await s.rest()] == [[5]]  # type: ignore[union-attr]
        assert_idle(router)

    run(scenario, mode="colocated")


def test_one_deltas_frame_feeds_each_of_its_requests_and_drops_deltas_not_its_senders() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("colocated-0", "colocated")
        a, b = Stream(router, "a", PROMPT), Stream(router, "b", PROMPT)
        assert [op.request_id for op in await fakes.ops("colocated-0", 2)] == ["a", "b"]
        await fakes.add("colocated-1", "colocated")
        c = Stream(router, "c", PROMPT)
        assert (await fakes.op("colocated-1")).request_id == "c"
        await fakes.send(
            Deltas(
                "colocated-0",
                [delta("a", 1), delta("c", 99), delta("ghost", 5), delta("b", 2, finish=FinishReason.LENGTH)],
            ),
            Deltas("colocated-1", [delta("c", 3, finish=FinishReason.STOP)]),
        )
        assert [d.token_ids for d in await b.rest()] == [[2]]  # type: ignore[union-attr]
        assert [d.token_ids for d in await c.rest()] == [[3]]  # type: ignore[union-attr]
        assert (await a.next()).token_ids == [1]  # type: ignore[union-attr]
        await fakes.send(Deltas("colocated-0", [delta("a", 4, finish=FinishReason.STOP)]))
        assert [d.token_ids for d in await a.rest()] == [[4]]  # type: ignore[union-attr]
        assert_idle(router)

    run(scenario, mode="colocated")


def test_admission_limits() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        none = await Stream(router, "early", PROMPT).next()
        assert isinstance(none, ClusterUnavailableError)
        await fakes.add("colocated-0", "colocated")
        first = Stream(router, "one", PROMPT)
        await fakes.op("colocated-0")
        duplicate = await Stream(router, "one", PROMPT).next()
        assert isinstance(duplicate, InvalidRequestError) and "already in flight" in str(duplicate)
        Stream(router, "two", PROMPT)
        await fakes.op("colocated-0")
        full = await Stream(router, "three", PROMPT).next()
        assert isinstance(full, QueueFullError) and str(full) == "2 requests in flight (max_pending_requests)"
        assert first.req.request_id == "one"

    run(scenario, mode="colocated", max_pending_requests=2)

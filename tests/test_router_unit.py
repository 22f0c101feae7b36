"""Router unit tests against fake workers (tests/fake_workers.py: the real wire protocol, no engine, no
Ray): worker choice, prefix affinity, the handoff, deadlines, aborts, migration and its bookkeeping (a
late event of an abandoned attempt is dropped: attempts have their own wire ids ``rid~n``), health."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from cluster.config import RouterConfig
from cluster.frames import new_secret
from cluster.protocol import (
    ClusterUnavailableError,
    DeadlineExceededError,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    InvalidRequestError,
    KVTransferFailedError,
    QueueFullError,
    RequestAbortedError,
    TokenDelta,
    WorkerFailedError,
)
from cluster.router import Router, WorkerState
from cluster.wire import (
    Abort,
    DecodeHandoff,
    Delta,
    ExtendLease,
    Generate,
    KeepAlive,
    PeerDead,
    Prefilled,
    RequestFailed,
    Transferred,
    WorkerFailed,
)
from tests.fake_workers import FakeWorkers, Stream, cancel_streams, until

PROMPT = [11, 12, 13, 14, 15, 16]  # 6 tokens, first block [11, 12, 13, 14]
Scenario = Callable[[Router, FakeWorkers], Awaitable[None]]


def run(scenario: Scenario, **config: Any) -> None:
    async def main() -> None:
        secret = new_secret()
        options: dict[str, Any] = {"health_interval_s": 0.02, "health_timeout_s": 60.0, **config}
        router = Router(RouterConfig(**options), secret)
        await router.start()
        fakes = FakeWorkers(router, secret)
        try:
            await scenario(router, fakes)
            assert router.dead_tasks() == [] and router.rejected_frames() == {}
        finally:
            await cancel_streams()
            fakes.close()
            await router.close()

    asyncio.run(main())


def delta(rid: str, *tokens: int, finish: FinishReason | None = None) -> TokenDelta:
    return TokenDelta(rid, list(tokens), finish_reason=finish)


def assert_idle(router: Router) -> None:
    """The router's per-worker bookkeeping is back to zero."""
    assert {w.worker_id: (w.num_assigned, w.num_prompt_tokens) for w in router.workers} == {
        w.worker_id: (0, 0) for w in router.workers
    }


async def prefilled(fakes: FakeWorkers, s: Stream, prefill: str, token: int) -> DecodeHandoff:
    """``s`` is on ``prefill``: it sends the first token; returns the handoff the router sends on."""
    gen = await fakes.op(prefill)
    assert gen == Generate(s.req.request_id, s.req.prompt_token_ids, s.req.params, gen.deadline, True, [])
    handoff = f"kv-{s.req.request_id}".encode()
    await fakes.send(Prefilled(prefill, delta(s.req.request_id, token), handoff))
    first = await s.next()
    assert isinstance(first, TokenDelta) and first.token_ids == [token]
    rid = s.req.request_id
    await until(lambda: fakes.router.placement(rid)[1] is not None, f"{rid} handed off")
    op = await fakes.op(decode_of(fakes.router, rid))
    assert op == DecodeHandoff(
        s.req.request_id, s.req.prompt_token_ids, token, s.req.params, handoff, gen.deadline
    )
    return op


def decode_of(router: Router, rid: str) -> str:
    decode = router.placement(rid)[1]
    assert decode is not None, f"{rid} has no decode worker"
    return decode


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
                Delta(w, delta(rid, 200 + i)),
                Delta(w, delta(rid, 300 + i, finish=FinishReason.LENGTH)),
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

    run(scenario, affinity_slack_tokens=10)


def test_a_deadline_ends_the_request_and_aborts_it_on_every_worker_holding_it() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        await fakes.add("decode-0", "decode")
        deadline = time.time() + 0.5
        s = Stream(router, "late", PROMPT, deadline=deadline)
        handoff = await prefilled(fakes, s, "prefill-0", 7)
        assert handoff.deadline == deadline
        error = await s.next()
        assert isinstance(error, DeadlineExceededError) and "'late' passed its deadline" in str(error)
        assert time.time() >= deadline
        assert await fakes.op("prefill-0") == Abort("late")
        assert await fakes.op("decode-0") == Abort("late")
        assert_idle(router)
        # no deadline given: the router's request_timeout_s
        t0 = time.time()
        Stream(router, "default", PROMPT)
        gen = await fakes.op("prefill-0")
        assert t0 + 300.0 <= gen.deadline <= time.time() + 300.0

    run(scenario, request_timeout_s=300.0)


def test_abort_and_disconnect_free_the_request_on_its_workers() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        await fakes.add("decode-0", "decode")
        s = Stream(router, "x", PROMPT)
        await prefilled(fakes, s, "prefill-0", 7)
        await router.abort("x")
        error = await s.next()
        assert isinstance(error, RequestAbortedError)
        # once from abort(), once more as the stream ends unfinished
        assert await fakes.ops("prefill-0", 2) == [Abort("x"), Abort("x")]
        assert await fakes.ops("decode-0", 2) == [Abort("x"), Abort("x")]
        await router.abort("x")  # over: a no-op, as for a request never seen
        await router.abort("nobody")
        assert_idle(router)

        # the caller goes away after the first token: the request is aborted on both workers
        agen = router.generate(GenerateRequest("y", PROMPT, s.req.params))
        first = asyncio.ensure_future(agen.__anext__())
        gen = await fakes.op("prefill-0")
        assert gen.request_id == "y"
        await fakes.send(Prefilled("prefill-0", delta("y", 9), b"kv"))
        assert (await first).token_ids == [9]
        assert isinstance(await fakes.op("decode-0"), DecodeHandoff)
        await agen.aclose()
        assert await fakes.op("prefill-0") == Abort("y")
        assert await fakes.op("decode-0") == Abort("y")
        assert_idle(router)

    run(scenario)


@pytest.mark.parametrize("max_migrations", [1, 0])
def test_a_dead_decode_worker_migrates_its_requests_and_late_events_of_the_old_attempt_are_dropped(
    max_migrations: int,
) -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        await fakes.add("decode-0", "decode", num_free_blocks=90)
        await fakes.add("decode-1", "decode", num_free_blocks=10)
        s = Stream(router, "m", PROMPT)
        await prefilled(fakes, s, "prefill-0", 7)
        assert decode_of(router, "m") == "decode-0"
        await fakes.send(Delta("decode-0", delta("m", 8)), Delta("decode-0", delta("m", 9)))
        assert [(await s.next()).token_ids for _ in range(2)] == [[8], [9]]  # type: ignore[union-attr]
        await fakes.send(WorkerFailed("decode-0", "step thread died"))
        if max_migrations == 0:
            error = await s.next()
            assert isinstance(error, WorkerFailedError)
            assert "worker decode-0 failed" in str(error) and "max_migrations 0" in str(error)
            return
        # peers stop waiting on the dead worker, then the request goes on whole: prompt + its 3 tokens
        assert await fakes.ops("prefill-0", 2) == [PeerDead("decode-0", "i0"), Abort("m")]
        peer_dead, gen = await fakes.ops("decode-1", 2)
        assert peer_dead == PeerDead("decode-0", "i0")
        assert gen == Generate("m~1", PROMPT, s.req.params, gen.deadline, False, [7, 8, 9])
        assert router.placement("m") == (None, "decode-1")
        await fakes.send(
            Delta("decode-0", delta("m", 66)),  # late, from the dead worker, old attempt
            Delta("decode-1", delta("m", 67)),  # the old attempt's id from the new worker
            Delta("decode-0", delta("m~1", 68)),  # the new id from a worker that does not hold it
            Delta("decode-1", delta("m~1", 10)),
            Delta("decode-1", delta("m~1", 11, finish=FinishReason.LENGTH)),
        )
        rest = await s.rest()
        assert [(d.request_id, d.token_ids) for d in rest] == [("m", [10]), ("m", [11])]  # type: ignore[union-attr]
        assert rest[-1].timings is not None and rest[-1].timings.num_migrations == 1  # type: ignore[union-attr]
        assert_idle(router)
        assert [w.state for w in router.workers] == [
            WorkerState.HEALTHY,
            WorkerState.DEAD,
            WorkerState.HEALTHY,
        ]

    run(scenario, max_migrations=max_migrations)


def test_a_dead_prefill_worker_migrates_and_its_late_prefilled_is_let_go() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        await fakes.add("prefill-1", "prefill")
        await fakes.add("decode-0", "decode")
        s = Stream(router, "p", PROMPT)
        await until(lambda: router.placement("p")[0] is not None, "placed")
        first_id = router.placement("p")[0]
        assert first_id is not None
        other = "prefill-1" if first_id == "prefill-0" else "prefill-0"
        assert (await fakes.op(first_id)).request_id == "p"
        await fakes.send(WorkerFailed(first_id, "killed"))
        peer_dead, gen = await fakes.ops(other, 2)
        assert peer_dead == PeerDead(first_id, "i0")
        assert gen == Generate(
            "p~1", PROMPT, s.req.params, gen.deadline, True, []
        )  # no token yet: prefill again
        # the dead worker's Prefilled arrives late: dropped, and the worker told to let the KV go
        await fakes.send(Prefilled(first_id, delta("p", 5), b"old"))
        assert await fakes.op(first_id) == Abort("p")
        await fakes.send(Prefilled(other, delta("p~1", 6), b"new"))
        first = await s.next()
        assert isinstance(first, TokenDelta) and (first.request_id, first.token_ids) == ("p", [6])
        peer_dead, handoff = await fakes.ops("decode-0", 2)
        assert peer_dead == PeerDead(first_id, "i0")
        assert (handoff.request_id, handoff.first_token_id, handoff.handoff) == ("p~1", 6, b"new")
        await fakes.send(Delta("decode-0", delta("p~1", 8, finish=FinishReason.LENGTH)))
        assert [d.token_ids for d in await s.rest()] == [[8]]  # type: ignore[union-attr]
        assert_idle(router)

    run(scenario)


def test_worker_failures_of_a_request_map_to_errors_or_a_migration() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        await fakes.add("prefill-1", "prefill")
        await fakes.add("decode-0", "decode")
        bad = Stream(router, "bad", [1])  # shorter than a block: the least loaded, prefill-0
        assert (await fakes.op("prefill-0")).request_id == "bad"
        await fakes.send(
            RequestFailed("prefill-0", "bad", ErrorCode.INVALID_REQUEST, "token 999 out of vocab")
        )
        error = await bad.next()
        assert isinstance(error, InvalidRequestError) and str(error) == "token 999 out of vocab"
        assert await fakes.op("prefill-0") == Abort("bad")

        kv = Stream(router, "kv", [2])
        await prefilled(fakes, kv, "prefill-0", 7)
        await fakes.send(RequestFailed("decode-0", "kv", ErrorCode.KV_TRANSFER_FAILED, "checksum"))
        error = await kv.next()
        assert isinstance(error, KVTransferFailedError) and str(error) == "checksum"
        assert await fakes.op("prefill-0") == Abort("kv")
        assert await fakes.op("decode-0") == Abort("kv")

        # the KV's owner died mid-transfer: not the request's fault, it goes on whole on a decode worker
        moved = Stream(router, "moved", [3])
        await prefilled(fakes, moved, "prefill-0", 7)
        await fakes.send(WorkerFailed("prefill-0", "gone"))
        # the decode worker still holds the request (its KV was arriving): prefill-0's death moves nothing
        await fakes.send(RequestFailed("decode-0", "moved", ErrorCode.KV_TRANSFER_FAILED, "peer lost"))
        ops = [await fakes.op("decode-0") for _ in range(3)]
        assert ops[:2] == [PeerDead("prefill-0", "i0"), Abort("moved")]
        assert ops[2] == Generate("moved~1", [3], moved.req.params, ops[2].deadline, False, [7])
        await fakes.send(Delta("decode-0", delta("moved~1", 9, finish=FinishReason.LENGTH)))
        assert [d.token_ids for d in await moved.rest()] == [[9]]  # type: ignore[union-attr]
        assert_idle(router)

    run(scenario)


def test_keep_alive_from_the_decode_worker_extends_the_prefill_lease() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        await fakes.add("decode-0", "decode", num_free_blocks=90)
        await fakes.add("decode-1", "decode", num_free_blocks=10)
        a, b = Stream(router, "a", [1]), Stream(router, "b", [2])
        await prefilled(fakes, a, "prefill-0", 7)
        await prefilled(fakes, b, "prefill-0", 8)
        assert [decode_of(router, rid) for rid in "ab"] == ["decode-0", "decode-1"]
        # from a worker that does not hold "a": ignored; the next op prefill-0 sees is b's
        await fakes.send(KeepAlive("decode-1", "a"), KeepAlive("decode-1", "b"))
        assert await fakes.op("prefill-0") == ExtendLease("b")
        await fakes.send(KeepAlive("decode-0", "a"))
        assert await fakes.op("prefill-0") == ExtendLease("a")

    run(scenario)


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
        await fakes.send(Delta("colocated-0", delta("r", 4)))
        assert (await s.next()).token_ids == [4]  # type: ignore[union-attr]
        await fakes.add("colocated-0", "colocated", incarnation="i1")  # Ray restarted it
        peer_dead, gen = await fakes.ops("colocated-1", 2)
        assert peer_dead == PeerDead("colocated-0", "i0")
        assert gen == Generate("r~1", PROMPT, s.req.params, gen.deadline, False, [4])
        assert [(w.worker_id, w.info.incarnation, w.state) for w in router.workers] == [
            ("colocated-1", "i0", WorkerState.HEALTHY),
            ("colocated-0", "i1", WorkerState.HEALTHY),
        ]
        await fakes.send(Delta("colocated-1", delta("r~1", 5, finish=FinishReason.STOP)))
        assert [d.token_ids for d in await s.rest()] == [[5]]  # type: ignore[union-attr]
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

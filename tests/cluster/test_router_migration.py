"""Router unit tests against fake workers (tests/support/fake_workers.py): deadlines, aborts and disconnects,
failures, and migration off a dead worker, whose late events (of the abandoned attempt: each attempt has
its own wire id ``rid~n``) are dropped."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.protocol import (
    DeadlineExceededError,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    InvalidRequestError,
    KVTransferFailedError,
    RequestAbortedError,
    SamplingParams,
    TokenDelta,
    WorkerFailedError,
)
from cluster.router.membership import WorkerState
from cluster.router.router import Router
from cluster.wire import (
    Abort,
    DecodeHandoff,
    Deltas,
    ExtendLease,
    Generate,
    KeepAlive,
    PeerDead,
    Prefilled,
    RequestFailed,
    WorkerFailed,
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
        # once each (the stream ended with the abort: its close sends no second one)
        assert await fakes.op("prefill-0") == Abort("x") and await fakes.op("decode-0") == Abort("x")
        assert await fakes.pending_ops("prefill-0") == [] and await fakes.pending_ops("decode-0") == []
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
        await fakes.send(Deltas("decode-0", [delta("m", 8)]), Deltas("decode-0", [delta("m", 9)]))
        assert [(await s.next()).token_ids for _ in range(2)] == [[8], [9]]  # type: ignore[union-attr]
        await fakes.send(WorkerFailed("decode-0", "step thread died"))
        if max_migrations == 0:
            error = await s.next()
            assert isinstance(error, WorkerFailedError)
            assert "worker decode-0 failed" in str(error) and "max_migrations 0" in str(error)
            assert await fakes.ops("prefill-0", 2) == [PeerDead("decode-0", "i0"), Abort("m")]
            # it was not dispatched again: decode-1's next op after the news is the next request's
            z = Stream(router, "z", PROMPT)
            assert (await fakes.op("prefill-0")).request_id == "z"
            await fakes.send(Prefilled("prefill-0", delta("z", 5), b"kv"))
            assert (await z.next()).token_ids == [5]  # type: ignore[union-attr]
            peer_dead, handoff = await fakes.ops("decode-1", 2)
            assert peer_dead == PeerDead("decode-0", "i0") and handoff.request_id == "z"
            return
        # peers stop waiting on the dead worker, then the request goes on whole: prompt + its 3 tokens
        assert await fakes.ops("prefill-0", 2) == [PeerDead("decode-0", "i0"), Abort("m")]
        peer_dead, gen = await fakes.ops("decode-1", 2)
        assert peer_dead == PeerDead("decode-0", "i0")
        assert gen == Generate("m~1", PROMPT, s.req.params, gen.deadline, False, [7, 8, 9])
        assert router.placement("m") == (None, "decode-1")
        await fakes.send(
            Deltas("decode-0", [delta("m", 66)]),  # late, from the dead worker, old attempt
            Deltas("decode-1", [delta("m", 67)]),  # the old attempt's id from the new worker
            Deltas("decode-0", [delta("m~1", 68)]),  # the new id from a worker that does not hold it
            Deltas("decode-1", [delta("m~1", 10)]),
            Deltas("decode-1", [delta("m~1", 11, finish=FinishReason.LENGTH)]),
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


def test_a_finished_request_whose_worker_dies_before_the_caller_read_the_end_is_not_migrated() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("colocated-0", "colocated")
        await fakes.add("colocated-1", "colocated")
        params = SamplingParams(max_tokens=2, temperature=0.0)
        agen = router.generate(GenerateRequest("done", PROMPT, params))
        first = asyncio.ensure_future(agen.__anext__())
        assert (await fakes.op("colocated-0")).request_id == "done"
        await fakes.send(Deltas("colocated-0", [delta("done", 3)]))
        assert (await first).token_ids == [3]
        # the caller has not asked for more: the final delta waits in the router when the worker dies
        await fakes.send(
            Deltas("colocated-0", [delta("done", 4, finish=FinishReason.LENGTH)]),
            WorkerFailed("colocated-0", "exited"),
        )
        await until(lambda: router.workers[0].state == WorkerState.DEAD, "colocated-0 dead")
        last = await agen.__anext__()
        assert (last.token_ids, last.finish_reason) == ([4], FinishReason.LENGTH)
        assert last.timings is not None and last.timings.num_migrations == 0
        await agen.aclose()
        assert_idle(router)
        # colocated-1 was never asked to finish it: its next op is the next request
        Stream(router, "next", PROMPT)
        peer_dead, gen = await fakes.ops("colocated-1", 2)
        assert peer_dead == PeerDead("colocated-0", "i0") and (gen.request_id, gen.output_token_ids) == (
            "next",
            [],
        )

    run(scenario, mode="colocated")


def test_a_request_not_yet_handed_off_survives_the_death_of_a_decode_worker() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        await fakes.add("decode-0", "decode", num_free_blocks=90)
        await fakes.add("decode-1", "decode", num_free_blocks=10)
        s = Stream(router, "a", PROMPT)
        gen = await fakes.op("prefill-0")
        await fakes.send(WorkerFailed("decode-0", "exited"))  # a is still on prefill-0 alone
        assert await fakes.op("prefill-0") == PeerDead("decode-0", "i0")
        await fakes.send(Prefilled("prefill-0", delta(gen.request_id, 7), b"kv"))
        assert (await s.next()).token_ids == [7]  # type: ignore[union-attr]
        peer_dead, handoff = await fakes.ops("decode-1", 2)
        assert peer_dead == PeerDead("decode-0", "i0")
        assert (handoff.request_id, handoff.first_token_id) == ("a", 7)  # the first attempt, unmoved

    run(scenario)


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
        await fakes.send(Deltas("decode-0", [delta("p~1", 8, finish=FinishReason.LENGTH)]))
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
        # NOTE: its source beats twice after the failure: alive, so the failure is the request's
        await fakes.beat("prefill-0")
        await fakes.beat("prefill-0")
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
        await fakes.send(Deltas("decode-0", [delta("moved~1", 9, finish=FinishReason.LENGTH)]))
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

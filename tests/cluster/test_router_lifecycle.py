"""Router unit tests against fake workers (tests/support/fake_workers.py) and fake Ray actors: admission and
the lifecycle watch, health verdicts, a worker whose queue is full, migrations with nowhere to go,
and the per-request timings."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import zmq

from cluster.config import RouterConfig
from cluster.frames import new_secret
from cluster.protocol import (
    ClusterUnavailableError,
    FinishReason,
    RequestAbortedError,
    TokenDelta,
)
from cluster.router.events import MAX_FRAMES_PER_TURN
from cluster.router.membership import WorkerState
from cluster.router.router import Router
from cluster.wire import Abort, Deltas, Generate, PeerDead, Prefilled, WorkerFailed, WorkerGone
from tests.support.fake_workers import TIMEOUT_S, FakeWorkers, Stream, assert_idle, delta, run, until

PROMPT = [11, 12, 13, 14, 15, 16]


class FakeActor:
    """What the router's lifecycle watch calls (``actor.ping.remote()``); ping n returns or raises
    what the test puts in ``answers[n]``, when it does."""

    def __init__(self) -> None:
        self.answers: list[asyncio.Future[None]] = []

    @property
    def ping(self) -> FakeActor:
        return self

    def remote(self) -> asyncio.Future[None]:
        self.answers.append(asyncio.get_running_loop().create_future())
        return self.answers[-1]


def state(router: Router, worker_id: str) -> tuple[str, WorkerState]:
    (w,) = [w for w in router.workers if w.worker_id == worker_id]
    return w.info.incarnation, w.state


async def watched_pair(router: Router, fakes: FakeWorkers) -> FakeActor:
    """colocated-0 and -1 admitted, colocated-0 watched through a fake actor whose first ping is out."""
    await fakes.add("colocated-0", "colocated")
    await fakes.add("colocated-1", "colocated")
    actor = FakeActor()
    router.watch("colocated-0", actor)
    await until(lambda: len(actor.answers) == 1, "first ping")
    return actor


def test_a_relayed_word_of_ray_kills_only_the_process_that_answered_last() -> None:
    """Front-end replicas run no Ray: their supervisor relays Ray's word (``WorkerGone``, with the pid that
    answered Ray last). News of another process (pid 9) changes nothing; news of colocated-0's (pid 1)
    kills it (after the bounded wait for its own last words) and its request moves to colocated-1."""

    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("colocated-0", "colocated", pid=1)
        await fakes.add("colocated-1", "colocated", pid=2)
        s = Stream(router, "r", PROMPT)
        assert (await fakes.op("colocated-0")).request_id == "r"
        await fakes.send(WorkerGone("colocated-0", 9, "RayActorError: a process of long ago"))
        await fakes.send(WorkerGone("colocated-9", 1, "RayActorError: nobody here"))
        await fakes.beat("colocated-1")  # NOTE: after both on the same socket: they were taken
        await until(lambda: router.rejected_frames().get("unknown_worker") == 1, "the unknown one refused")
        assert state(router, "colocated-0")[1] == WorkerState.HEALTHY
        await fakes.send(WorkerGone("colocated-0", 1, "RayActorError: The actor died unexpectedly"))
        await until(lambda: state(router, "colocated-0")[1] == WorkerState.DEAD, "dead", timeout_s=5)
        (w,) = [w for w in router.workers if w.worker_id == "colocated-0"]
        assert w.why == "RayActorError: The actor died unexpectedly"
        ops = await fakes.ops("colocated-1", 2)
        assert ops[0] == PeerDead("colocated-0", "i0")
        assert ops[1] == Generate("r~1", PROMPT, s.req.params, ops[1].deadline, False, [])
        await fakes.send(Deltas("colocated-1", [delta("r~1", 5, finish=FinishReason.LENGTH)]))
        assert [d.token_ids for d in await s.rest()] == [[5]]  # type: ignore[union-attr]

    run(scenario, mode="colocated", rejected={"unknown_worker": 1})


def test_wait_admitted_returns_on_registration_and_names_the_missing_on_timeout() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        waiting = asyncio.create_task(router.wait_admitted(["colocated-0"], 5.0))
        await fakes.add("colocated-0", "colocated")
        await asyncio.wait_for(waiting, 5.0)
        with pytest.raises(TimeoutError, match=r"workers not admitted within 0 s: \['colocated-9'\]"):
            await router.wait_admitted(["colocated-0", "colocated-9"], 0.2)
        await fakes.beat("colocated-0", healthy=False)
        await until(lambda: state(router, "colocated-0")[1] == WorkerState.UNHEALTHY, "unhealthy")
        with pytest.raises(TimeoutError, match=r"within 0 s: \[\]"):  # registered, not healthy
            await router.wait_admitted(["colocated-0"], 0.2)

    run(scenario, mode="colocated")


def test_a_failed_ping_kills_only_the_process_that_answered_the_last_one() -> None:
    """Ray restarts colocated-0: its new process (pid 2) registers while Ray still fails pings, both
    one sent before the restart and one sent after the new process joined ("the actor is restarting"):
    news of the old process (pid 1), so the new one stays. Once Ray reached it, a failed ping kills it."""

    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        actor = await watched_pair(router, fakes)
        actor.answers[0].set_result(1)  # pid 1 answers
        await until(lambda: len(actor.answers) == 2, "second ping")
        await fakes.add("colocated-0", "colocated", incarnation="i1", pid=2)  # restarted while ping 2 is out
        actor.answers[1].set_exception(RuntimeError("the old process is gone"))
        await until(lambda: len(actor.answers) == 3, "third ping")
        actor.answers[2].set_exception(RuntimeError("ActorUnavailableError: The actor is restarting."))
        await until(lambda: len(actor.answers) == 4, "fourth ping")
        assert state(router, "colocated-0") == ("i1", WorkerState.HEALTHY)
        s = Stream(router, "r", PROMPT)
        assert (await fakes.op("colocated-0")).request_id == "r"
        actor.answers[3].set_result(2)  # Ray reaches the new process
        await until(lambda: len(actor.answers) == 5, "fifth ping")
        actor.answers[4].set_exception(RuntimeError("actor died\nwith a traceback"))
        await until(lambda: state(router, "colocated-0")[1] == WorkerState.DEAD, "dead")
        (w,) = [w for w in router.workers if w.worker_id == "colocated-0"]
        assert w.why == "RuntimeError: actor died"
        # its request moves on to the other worker
        ops = await fakes.ops("colocated-1", 3)
        assert ops[:2] == [PeerDead("colocated-0", "i0"), PeerDead("colocated-0", "i1")]
        assert ops[2] == Generate("r~1", PROMPT, s.req.params, ops[2].deadline, False, [])
        router.unwatch("colocated-0")
        n = len(actor.answers)
        await asyncio.sleep(0.1)  # NOTE: several watch intervals: no ping after unwatch
        assert len(actor.answers) == n

    run(scenario, mode="colocated")


def test_a_process_ray_never_reached_dies_of_a_failed_ping_once_it_is_silent_too() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        actor = await watched_pair(router, fakes)
        actor.answers[0].set_result(1)
        await until(lambda: len(actor.answers) == 2, "second ping")
        await fakes.add("colocated-0", "colocated", incarnation="i1", pid=2)
        # NOTE: no more beats from pid 2: it died before Ray reached it. Ping 2 times out (0.3 s); ping 3
        # fails once pid 2 has been silent past the health timeout.
        await until(lambda: len(actor.answers) == 3, "third ping")
        await asyncio.sleep(0.1)
        actor.answers[2].set_exception(RuntimeError("ActorDiedError: no restarts left"))
        await until(lambda: state(router, "colocated-0")[1] == WorkerState.DEAD, "dead")
        (w,) = [w for w in router.workers if w.worker_id == "colocated-0"]
        assert w.why == "RuntimeError: ActorDiedError: no restarts left"
        router.unwatch("colocated-0")

    run(scenario, mode="colocated", health_timeout_s=0.3)


def test_what_a_dying_worker_said_last_wins_over_rays_word_that_came_first() -> None:
    """Ray's failed ping wakes the watch before the worker's own ``WorkerFailed`` (sent as it died) is
    handled, the order a busy host often gives: the worker is routed nothing new at once, and its request
    fails (here: migrates) with the worker's reason, not Ray's, the tokens it sent first kept."""

    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        actor = await watched_pair(router, fakes)
        s = Stream(router, "r", PROMPT)
        assert (await fakes.op("colocated-0")).request_id == "r"
        await fakes.send(Deltas("colocated-0", [delta("r", 7)]))
        assert (await s.next()).token_ids == [7]  # type: ignore[union-attr]
        actor.answers[0].set_result(1)  # pid 1 answers
        await until(lambda: len(actor.answers) == 2, "second ping")
        actor.answers[1].set_exception(RuntimeError("ActorUnavailableError: RpcError: Socket closed"))
        await until(lambda: state(router, "colocated-0")[1] == WorkerState.UNHEALTHY, "not routed to")
        (w,) = [w for w in router.workers if w.worker_id == "colocated-0"]
        assert w.why == (
            "Ray reports it gone (RuntimeError: ActorUnavailableError: RpcError: Socket closed); "
            "waiting for its last words"
        )
        await fakes.send(WorkerFailed("colocated-0", "step thread died: RuntimeError: boom"))
        await until(lambda: state(router, "colocated-0")[1] == WorkerState.DEAD, "dead")
        assert w.why == "it reported: step thread died: RuntimeError: boom"
        ops = await fakes.ops("colocated-1", 2)
        assert ops[0] == PeerDead("colocated-0", "i0")
        assert ops[1] == Generate("r~1", PROMPT, s.req.params, ops[1].deadline, False, [7])
        router.unwatch("colocated-0")

    run(scenario, mode="colocated")


def test_health_verdicts() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        assert not router.is_healthy()  # no fallback: a whole path needs both pools
        await fakes.add("decode-0", "decode")
        assert router.is_healthy()
        assert router.model_info.name == "served-name" and router.model_info.model_dir == "/m"

    run(scenario, served_model_name="served-name", colocated_fallback=False)

    async def colocated(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")  # the wrong pool for this mode
        assert not router.is_healthy()
        assert router.model_info.name == "m"  # no served name: the model directory's

    run(colocated, mode="colocated")

    async def stale(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("colocated-0", "colocated")
        await until(lambda: state(router, "colocated-0")[1] == WorkerState.UNHEALTHY, "stale")
        (stats,) = router.worker_stats()
        assert (stats.worker_id, stats.healthy) == ("colocated-0", False)  # it said healthy

    run(stale, mode="colocated", health_timeout_s=0.3)


def test_a_closed_router_is_not_healthy() -> None:
    async def main() -> None:
        router = Router(RouterConfig(mode="colocated"), new_secret())
        assert not router.is_healthy()  # not started
        await router.start()
        assert router.dead_tasks() == []
        await router.close()
        assert sorted(router.dead_tasks()) == ["router-heartbeats", "router-receive"]
        assert not router.is_healthy()

    asyncio.run(main())


class FullQueue:
    """A worker socket whose queue is full (ZMQ's high-water mark)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.dropped: list[bytes] = []

    def send(self, frame: bytes, flags: int = 0) -> None:
        self.dropped.append(frame)
        raise zmq.Again()

    def close(self, linger: int | None = None) -> None:
        self.inner.close(linger=linger)


def test_a_worker_whose_queue_is_full_takes_no_new_request_and_aborts_are_dropped() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("colocated-0", "colocated")
        s = Stream(router, "r", PROMPT)
        await fakes.op("colocated-0")
        (w,) = router.workers
        full = FullQueue(w.socket)
        w.socket = full  # type: ignore[assignment]
        await router.abort("r")  # the Abort is dropped, not raised
        assert isinstance(await s.next(), RequestAbortedError)
        error = await Stream(router, "new", PROMPT).next()
        assert isinstance(error, ClusterUnavailableError)
        assert str(error) == "worker colocated-0 is not taking work"
        # abort() (once: the stream ended with it, so its close sends no second one), Generate, its abort
        assert len(full.dropped) == 3
        assert_idle(router)

    run(scenario, mode="colocated")


def test_migrations_with_nowhere_to_go() -> None:
    async def colocated(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("colocated-0", "colocated")
        s = Stream(router, "r", PROMPT)
        await fakes.op("colocated-0")
        await fakes.send(WorkerFailed("colocated-0", "exited"))
        error = await s.next()
        assert isinstance(error, ClusterUnavailableError)
        assert str(error) == "worker colocated-0 failed: it reported: exited; no healthy colocated worker"
        assert_idle(router)

    run(colocated, mode="colocated")

    async def no_decode(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("prefill-0", "prefill")
        await fakes.add("decode-0", "decode")
        s = Stream(router, "r", PROMPT)
        gen = await fakes.op("prefill-0")
        await fakes.beat("decode-0", healthy=False)
        await until(lambda: state(router, "decode-0")[1] == WorkerState.UNHEALTHY, "decode-0 unhealthy")
        await fakes.send(Prefilled("prefill-0", delta(gen.request_id, 7), b"kv"))
        assert (await s.next()).token_ids == [7]  # type: ignore[union-attr]
        # no decode worker for the handoff: the request goes on whole, on the prefill worker
        assert await fakes.ops("prefill-0", 2) == [
            Abort("r"),
            Generate("r~1", PROMPT, s.req.params, gen.deadline, False, [7]),
        ]
        await fakes.send(Deltas("prefill-0", [delta("r~1", 8, finish=FinishReason.LENGTH)]))
        assert [d.token_ids for d in await s.rest()] == [[8]]  # type: ignore[union-attr]
        assert_idle(router)

    run(no_decode)


def test_timings_split_the_request_at_its_scheduling_and_first_token() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("colocated-0", "colocated")
        t0 = time.time()
        s = Stream(router, "r", PROMPT)
        await fakes.op("colocated-0")
        scheduled = time.time()
        first = TokenDelta("r", [3], scheduled_time=scheduled)
        await fakes.send(Deltas("colocated-0", [first]))
        assert (await s.next()).token_ids == [3]  # type: ignore[union-attr]
        await fakes.send(Deltas("colocated-0", [delta("r", 4, finish=FinishReason.LENGTH)]))
        (last,) = await s.rest()
        t1 = time.time()
        timings = last.timings  # type: ignore[union-attr]
        assert timings is not None and timings.transfer_s == 0.0 and timings.num_migrations == 0
        parts = (timings.queue_s, timings.prefill_s, timings.decode_s)
        assert all(0.0 < x < t1 - t0 for x in parts), timings
        assert timings.queue_s + timings.prefill_s == pytest.approx(timings.ttft_s, abs=1e-6)
        assert timings.ttft_s + timings.decode_s == pytest.approx(timings.e2e_s, abs=1e-6)
        assert timings.e2e_s <= t1 - t0 and scheduled - t0 >= timings.queue_s

    run(scenario, mode="colocated")


def test_drain_waits_for_the_workers_requests_then_migrates_the_rest_and_forgets_it() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        for wid in ("colocated-0", "colocated-1", "colocated-2"):
            await fakes.add(wid, "colocated")
        actor = FakeActor()
        router.watch("colocated-0", actor)
        fast, slow = Stream(router, "fast", PROMPT), Stream(router, "slow", PROMPT)
        assert [op.request_id for op in await fakes.ops("colocated-0", 1)] == ["fast"]
        assert (await fakes.op("colocated-1")).request_id == "slow"
        draining = asyncio.create_task(router.drain("colocated-0", timeout_s=5.0))
        await until(lambda: state(router, "colocated-0")[1] == WorkerState.DRAINING, "draining")
        await fakes.beat("colocated-0")  # a draining worker's beat does not make it healthy
        Stream(router, "new", PROMPT)  # routed elsewhere meanwhile
        assert (await fakes.op("colocated-2")).request_id == "new"
        assert not draining.done()
        await fakes.send(Deltas("colocated-0", [delta("fast", 5, finish=FinishReason.LENGTH)]))
        assert [d.token_ids for d in await fast.rest()] == [[5]]  # type: ignore[union-attr]
        await asyncio.wait_for(draining, 5.0)
        assert [w.worker_id for w in router.workers] == ["colocated-1", "colocated-2"]
        for peer in ("colocated-1", "colocated-2"):
            assert await fakes.op(peer) == PeerDead("colocated-0", "i0")
        n = len(actor.answers)
        await asyncio.sleep(0.1)  # NOTE: several watch intervals: the drained worker is not watched
        assert len(actor.answers) == n

        # past its timeout, what is left moves on
        await fakes.send(Deltas("colocated-1", [delta("slow", 6)]))
        assert (await slow.next()).token_ids == [6]  # type: ignore[union-attr]
        await router.drain("colocated-1", timeout_s=0.1)
        assert await fakes.op("colocated-1") == Abort("slow")
        ops = await fakes.ops("colocated-2", 2)
        assert ops[0] == Generate("slow~1", PROMPT, slow.req.params, ops[0].deadline, False, [6])
        assert ops[1] == PeerDead("colocated-1", "i0")
        with pytest.raises(ValueError, match="no worker 'colocated-1'"):
            await router.drain("colocated-1", timeout_s=0.1)

    run(scenario, mode="colocated")


def test_a_worker_of_another_model_is_refused_and_events_of_unknown_workers_dropped() -> None:
    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("colocated-0", "colocated")
        await fakes.add("colocated-1", "colocated", model_dir="/other", wait=False)
        s = Stream(router, "r", PROMPT)
        assert (await fakes.op("colocated-0")).request_id == "r"
        await fakes.send(
            Deltas("colocated-1", [delta("r", 9)]),  # never admitted
            Deltas("nobody", [delta("r", 9)]),
        )
        await fakes.push.send(b"not a frame")
        await fakes.send(Deltas("colocated-0", [delta("r", 3, finish=FinishReason.LENGTH)]))
        assert [d.token_ids for d in await s.rest()] == [[3]]  # type: ignore[union-attr]
        assert [w.worker_id for w in router.workers] == ["colocated-0"]

    run(scenario, rejected={"refused_worker": 1, "unknown_worker": 2, "malformed": 1}, mode="colocated")


def test_a_stream_cancelled_as_its_next_delta_arrives_still_aborts_its_request() -> None:
    """A client that goes away cancels its stream's task. When a delta lands in that same loop iteration
    the cancel must still win: ``asyncio.wait_for`` (Python 3.11) handed the delta back instead, and the
    request ran on to its end on the worker, counted as finished."""

    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("colocated-0", "colocated")
        s = Stream(router, "r", PROMPT)
        assert isinstance(await fakes.op("colocated-0"), Generate)
        # NOTE: no public way to land a delta in a chosen loop iteration; a fake worker's frame arrives later
        router._flights.by_request["r"].stream.put(delta("r", 7))
        await asyncio.sleep(0)  # NOTE: one loop iteration (not a wait): the delta wakes the stream's wait
        s.task.cancel()
        await asyncio.wait({s.task}, timeout=TIMEOUT_S)
        assert s.task.cancelled()
        assert await fakes.op("colocated-0") == Abort("r")
        assert_idle(router)

    run(scenario, mode="colocated")


def test_a_burst_of_more_frames_than_one_turn_takes_is_handled_whole_and_in_order() -> None:
    """The event socket is read from the loop's selector, MAX_FRAMES_PER_TURN frames a turn: the frames
    left after a turn are taken in the next ones (ZMQ's descriptor does not signal them again)."""

    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        await fakes.add("colocated-0", "colocated")
        s = Stream(router, "r", PROMPT)
        assert (await fakes.op("colocated-0")).request_id == "r"
        num = 3 * MAX_FRAMES_PER_TURN + 5
        await fakes.send(*[Deltas("colocated-0", [delta("r", 100 + i)]) for i in range(num)])
        await fakes.send(Deltas("colocated-0", [delta("r", 7, finish=FinishReason.LENGTH)]))
        got = [d.token_ids for d in await s.rest()]  # type: ignore[union-attr]
        assert got == [[100 + i] for i in range(num)] + [[7]]

    run(scenario, mode="colocated")


def test_a_frame_whose_handling_fails_is_logged_and_the_frames_after_it_are_still_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An exception while one frame is handled must not leave the frames already at hand unread: the
    descriptor signals edges, so nothing would read them until another frame came."""

    async def scenario(router: Router, fakes: FakeWorkers) -> None:
        on_delta = router._on_delta

        def failing(w: Any, event: TokenDelta) -> None:
            if event.token_ids == [666]:
                raise RuntimeError("a bug in one event's handling")
            on_delta(w, event)

        router._on_delta = failing  # type: ignore[method-assign]
        await fakes.add("colocated-0", "colocated")
        s = Stream(router, "r", PROMPT)
        assert (await fakes.op("colocated-0")).request_id == "r"
        await fakes.send(
            Deltas("colocated-0", [delta("r", 5)]),
            Deltas("colocated-0", [delta("r", 666)]),
            Deltas("colocated-0", [delta("r", 6)]),
            Deltas("colocated-0", [delta("r", 7, finish=FinishReason.LENGTH)]),
        )
        assert [d.token_ids for d in await s.rest()] == [[5], [6], [7]]  # type: ignore[union-attr]

    with caplog.at_level("ERROR", logger="cluster.router.events"):
        run(scenario, mode="colocated")
    assert [r.getMessage() for r in caplog.records if r.name == "cluster.router.events"] == [
        "router: failed to handle an event frame"
    ]

"""A worker's links to several routers (front-end replicas): each request's events reach its owner only,
heartbeats reach every router, an owner whose lease runs out (or whose slot a new incarnation takes) has
its requests freed, and an op from an owner without a lease is refused."""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq

from cluster.config import EngineConfig, TransferConfig
from cluster.frames import new_secret
from cluster.protocol import ErrorCode, SamplingParams, TokenDelta, WorkerStats
from cluster.wire import (
    EVENTS,
    Deltas,
    Generate,
    Heartbeat,
    Prefilled,
    RequestFailed,
    RouterLease,
    WireDecoder,
    WireEncoder,
    WorkerControl,
    WorkerInfo,
    router_recipient,
)
from tests.support.cluster_utils import wait_for
from tests.workers.test_worker import PROMPT, Delta, FakeRouter
from workers import router_links
from workers.llm import LLM
from workers.router_links import RouterLinks
from workers.worker import EngineWorker

SECRET = new_secret()


def _delta(rid: str, token: int) -> TokenDelta:
    return TokenDelta(rid, [token])


class _Routers:
    """Two routers' event sockets and a RouterLinks to them."""

    def __init__(self, n: int = 2) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.pulls = []
        for _ in range(n):
            pull = self.ctx.socket(zmq.PULL)
            pull.bind("tcp://127.0.0.1:*")
            self.pulls.append(pull)
        endpoints = [p.getsockopt_string(zmq.LAST_ENDPOINT) for p in self.pulls]
        self.decoders = [WireDecoder(SECRET, router_recipient(i), EVENTS) for i in range(n)]
        self.links = RouterLinks(endpoints, WireEncoder(SECRET), self.ctx)

    def take(self, replica: int, timeout_ms: int = 5000) -> Any:
        assert self.pulls[replica].poll(timeout_ms), f"router {replica} got nothing"
        event = self.decoders[replica].decode(self.pulls[replica].recv())
        assert event is not None, self.decoders[replica].rejected()
        return event

    def idle(self, replica: int) -> bool:
        return not self.pulls[replica].poll(200)

    def close(self) -> None:
        self.links.close()
        for p in self.pulls:
            p.close(linger=0)
        self.ctx.term()


@pytest.fixture
def routers() -> Any:
    r = _Routers()
    yield r
    r.close()


def test_each_request_s_events_reach_its_owner_and_heartbeats_reach_every_router(routers: _Routers) -> None:
    links = routers.links
    assert links.on_lease(RouterLease("aaaa", 0, 10.0)) == []
    assert links.on_lease(RouterLease("bbbb", 1, 10.0)) == []
    assert links.admit("a", "aaaa") and links.admit("b", "bbbb") and links.admit("x", "")
    assert links.send(Deltas("w", [_delta("a", 1), _delta("b", 2), _delta("a", 3), _delta("x", 4)])) == []
    assert routers.take(0) == Deltas("w", [_delta("a", 1), _delta("a", 3), _delta("x", 4)])
    assert routers.take(1) == Deltas("w", [_delta("b", 2)])
    assert links.send(Prefilled("w", _delta("b", 5), b"h")) == []
    assert routers.take(1) == Prefilled("w", _delta("b", 5), b"h")
    assert links.send(RequestFailed("w", "a", ErrorCode.INTERNAL, "m")) == []
    assert routers.take(0) == RequestFailed("w", "a", ErrorCode.INTERNAL, "m")
    info = WorkerInfo("w", "decode", "inc", "tcp://x:1", "127.0.0.1", 4, 8, 64, 512, "/m", "cpu", 1)
    beat = Heartbeat(info, WorkerStats("w", "decode"))
    assert links.send(beat) == []
    assert routers.take(0) == beat and routers.take(1) == beat
    assert routers.idle(0) and routers.idle(1)


def test_an_owner_s_requests_are_freed_when_its_lease_runs_out_or_a_new_incarnation_takes_its_slot(
    routers: _Routers,
) -> None:
    links = routers.links
    now = 1000.0
    links.on_lease(RouterLease("aaaa", 0, 10.0), now)
    links.on_lease(RouterLease("bbbb", 1, 2.0), now)
    for rid, owner in (("a1", "aaaa"), ("b1", "bbbb"), ("b2", "bbbb")):
        assert links.admit(rid, owner)
    links.on_lease(RouterLease("bbbb", 1, 2.0), now + 1.5)  # renewed: expires at now + 3.5
    assert links.expired(now + 3.4) == []
    [(owner, freed)] = links.expired(now + 3.5)
    assert (owner.incarnation, owner.replica, sorted(freed)) == ("bbbb", 1, ["b1", "b2"])
    assert not links.admit("b3", "bbbb")  # NOTE: no lease: its late ops are refused
    assert links.owners() == {"aaaa": 0}
    # a restarted replica 0 (a new incarnation in its slot): the old one's requests go at once
    assert links.on_lease(RouterLease("cccc", 0, 10.0), now + 4) == ["a1"]
    assert links.owners() == {"cccc": 0} and not links.admit("a2", "aaaa")
    # a lease naming a replica this worker has no socket for, or a replica another owner holds, is refused
    assert links.on_lease(RouterLease("dddd", 2, 10.0)) is None
    assert links.on_lease(RouterLease("cccc", 1, 10.0)) is None
    assert links.on_lease(RouterLease("eeee", 1, 0.0)) is None


def test_requests_that_left_are_forgotten_after_two_sweeps(routers: _Routers) -> None:
    links = routers.links
    links.on_lease(RouterLease("aaaa", 0, 10.0), 0.0)
    links.admit("gone", "aaaa")
    links.admit("live", "aaaa")
    live = {"live"}
    links.sweep(live.__contains__, 10.0)
    assert links.num_owned == 2  # NOTE: its last events may still be on their way out
    links.sweep(live.__contains__, 11.0)  # too soon for another sweep
    assert links.num_owned == 2
    links.sweep(live.__contains__, 13.0)
    assert links.num_owned == 1
    [(_, freed)] = links.expired(100.0)
    assert freed == ["live"]


def test_a_frame_its_router_cannot_take_is_dropped_and_names_its_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(router_links, "_SEND_HWM", 1)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        with zmq.Context() as probe_ctx, probe_ctx.socket(zmq.PULL) as probe:
            port = probe.bind_to_random_port("tcp://127.0.0.1")
        links = RouterLinks([f"tcp://127.0.0.1:{port}"], WireEncoder(SECRET), ctx)  # nobody listens
        links.on_lease(RouterLease("aaaa", 0, 10.0))
        links.admit("a", "aaaa")
        dropped: list[str] = []
        for i in range(5):  # NOTE: libzmq's pipe takes the HWM on both of its ends
            dropped += links.send(Deltas("w", [_delta("a", i)]))
        assert dropped and set(dropped) == {"a"} and links.num_dropped == len(dropped)
        links.close()
    finally:
        ctx.term()


def test_a_worker_frees_the_requests_of_a_router_whose_lease_ran_out_and_keeps_serving_the_other() -> None:
    """Two routers (front-end replicas) over one worker: replica 1 stops renewing its lease mid-stream;
    its request is freed (it is told, should it be only slow), its late op is refused, and replica 0's
    request streams to its end, all of its deltas to replica 0 only."""
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # NOTE: before the worker's engine steps: two engines must not step at once in one process
    expected = LLM(device="cpu", block_size=4).generate([PROMPT], short)[0].token_ids
    r0, r1 = FakeRouter(SECRET, 0), FakeRouter(SECRET, 1)
    control = WorkerControl((r0.endpoint, r1.endpoint), heartbeat_interval_s=0.05)
    engine = EngineConfig.from_options(device="cpu", block_size=4, num_kv_blocks=1024, max_num_seqs=8)
    fatal: list[str] = []  # NOTE: a dead thread must fail the test, not end the test process
    worker = EngineWorker(
        "colocated-0", "colocated", engine, TransferConfig(), SECRET, control, on_fatal=fatal.append
    )
    try:
        r0.connect(worker)
        r1.connect(worker)
        for r in (r0, r1):  # every router hears the heartbeats
            assert r.next((Heartbeat,)).info.worker_id == "colocated-0"
        r0.send(RouterLease("aaaa", 0, 60.0))
        r1.send(RouterLease("bbbb", 1, 1.0))
        # NOTE: ~2,000 tokens: seconds of steps, far past replica 1's 1 s lease
        endless = SamplingParams(max_tokens=worker.info.max_model_len - len(PROMPT), ignore_eos=True)
        r1.send(Generate("b", PROMPT, endless, time.time() + 120, owner="bbbb"))
        r0.send(Generate("a", PROMPT, short, time.time() + 120, owner="aaaa"))
        tokens: list[int] = []
        while True:
            d = r0.next((Delta, RequestFailed)).delta  # NOTE: a RequestFailed here has no .delta: fails
            assert d.request_id == "a"
            tokens += d.token_ids
            if d.finish_reason is not None:
                break
        assert tokens == expected
        failed = r1.next((RequestFailed,), timeout_s=60)  # NOTE: skips b's deltas
        assert (failed.request_id, failed.code) == ("b", ErrorCode.UNAVAILABLE)
        assert "lease" in failed.message
        wait_for(lambda: worker.stats().num_freed_for_router == 1, 10, "b counted as freed for its router")
        r1.send(Generate("late", PROMPT, short, time.time() + 60, owner="bbbb"))
        wait_for(lambda: worker.stats().rejected_frames.get("stale_owner") == 1, 10, "the late op refused")
        assert worker.check_leaks() is None and fatal == []
    finally:
        worker.shutdown()
        r0.close()
        r1.close()

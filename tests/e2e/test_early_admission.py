"""Early decode admission on one decode worker, driven directly (no Ray): this test plays the router and
the prefill worker (an Engine holding the prompt's KV and a real KVSender over a gloo pair).

The decode worker reserves blocks and posts its fetch on ``PrepareDecode``; the KV moves the moment the
prefill side offers it, before the decode worker knows the first token; ``DecodeHandoff`` then commits.
An abort, a withdrawn offer or a dead prefill worker while the decode side is reserved frees everything
on both sides, and a worker that cannot reserve waits for its handoff as before (keeping the lease).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from cluster.config import EngineConfig, TransferConfig
from cluster.frames import new_secret
from cluster.protocol import ErrorCode, SamplingParams
from cluster.wire import (
    Abort,
    DecodeHandoff,
    Generate,
    KeepAlive,
    PeerDead,
    PrepareDecode,
    RequestFailed,
    Transferred,
    WorkerControl,
)
from tests.support.cluster_utils import wait_for
from tests.workers.test_worker import Delta, FakeRouter
from transfer.connector import KVSender
from transfer.pairs import PairChannel
from transfer.peers import PeerId
from workers.engine import Engine
from workers.llm import LLM
from workers.worker import EngineWorker

PROMPT = [3, 40, 99, 7, 250, 18, 5, 77, 301, 12, 64]  # 11 tokens: 3 blocks of 4, the last one partial
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PREFILL = PeerId("prefill-0", "p0")
FAR = 1e12  # a deadline that never passes


def engine_config(**options: Any) -> EngineConfig:
    return EngineConfig.from_options(**{"device": "cpu", "block_size": 4, "num_kv_blocks": 64, **options})


@dataclass
class Harness:
    """The decode worker under test, the router's end of it, and a prefill side: an engine and its
    KV sender (``sent``: each request's on_sent outcome)."""

    worker: EngineWorker
    router: FakeRouter
    prefill: Engine
    sender: KVSender
    channel: PairChannel
    fatal: list[str]  # why the worker would have exited (a dead thread)
    sent: dict[str, bool] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def prepare(self, rid: str) -> None:
        p = PREFILL
        self.router.send(
            PrepareDecode(rid, PROMPT, PARAMS, FAR, p.worker_id, p.incarnation, self.sender.endpoint)
        )

    def run_prefill(self, rid: str) -> int:
        """Prefill to the first token (held). NOTE: the forward context is the process's, so this runs
        only while the decode worker (same process) runs no forward of its own."""
        self.prefill.add_request(rid, PROMPT, PARAMS, hold_after_prefill=True)
        deltas = [d for d in self.prefill.step() if d.request_id == rid]
        assert len(deltas) == 1
        return deltas[0].token_ids[0]

    def offer(self, rid: str) -> bytes:
        block_ids = self.prefill.held_block_ids(rid)
        assert block_ids is not None
        return self.sender.offer(rid, block_ids, num_tokens=len(PROMPT)).to_bytes()

    def prefill_first_token(self, rid: str) -> tuple[int, bytes]:
        """Run the prefill to its first token and offer the KV; (first token, handoff bytes)."""
        first = self.run_prefill(rid)
        return first, self.offer(rid)

    def outcome(self, rid: str) -> bool | None:
        with self.lock:
            return self.sent.get(rid)

    def num_free_blocks(self) -> int:
        return self.worker.engine.scheduler.kv.pool.num_free

    def decode_tokens(self) -> list[int]:
        tokens: list[int] = []
        while True:
            event = self.router.next((Delta, RequestFailed))
            assert isinstance(event, Delta), event
            tokens += event.delta.token_ids
            if event.delta.finish_reason is not None:
                return tokens


def start(transfer: TransferConfig, engine: EngineConfig) -> Harness:
    fatal: list[str] = []
    secret = new_secret()
    router = FakeRouter(secret)
    control = WorkerControl((router.endpoint,), heartbeat_interval_s=0.05, moves_kv=True)
    # NOTE: a dead thread must fail the test, not end the test process (the default on_fatal exits)
    worker = EngineWorker("decode-0", "decode", engine, transfer, secret, control, on_fatal=fatal.append)
    router.connect(worker)
    prefill = Engine(engine_config())
    channel = PairChannel("127.0.0.1", "gloo", group_timeout_s=60.0)
    sent: dict[str, bool] = {}
    lock = threading.Lock()

    def on_sent(rid: str, ok: bool) -> None:
        with lock:
            sent[rid] = ok

    kv = prefill.runner.kv_cache
    # NOTE: the integrity the decode worker's config asks for (a receiver refuses a weaker one)
    sender = KVSender(kv, me=PREFILL, channel=channel, secret=secret, on_sent=on_sent, timeout_s=10.0,
                      integrity=TransferConfig().integrity)  # fmt: skip
    sender.start()
    return Harness(worker, router, prefill, sender, channel, fatal, sent, lock)


def stop(h: Harness) -> None:
    assert h.fatal == []
    h.worker.shutdown()
    h.sender.close()
    h.channel.close()
    h.router.close()


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return LLM(device="cpu", block_size=4).generate([PROMPT], PARAMS)[0].token_ids


@pytest.fixture
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    policy = getattr(request, "param", "fail")
    h = start(TransferConfig(backend="gloo", timeout_s=10.0, failure_policy=policy), engine_config())
    yield h
    stop(h)


def assert_clean(h: Harness, rid: str) -> None:
    """Leak invariant on both sides."""
    wait_for(lambda: h.worker.check_leaks() is None, 10, f"decode worker clean after {rid}")
    wait_for(lambda: h.sender.num_parked() == 0, 10, "no fetch parked at the sender")
    assert h.sender.num_held() == 0
    h.prefill.check_no_leaks()


def test_the_kv_moves_before_the_first_token_reaches_the_decode_worker(
    harness: Harness, reference: list[int]
) -> None:
    h, rid = harness, "early-0"
    num_free = h.num_free_blocks()
    h.prepare(rid)
    wait_for(lambda: h.sender.num_parked() == 1, 10, "the decode worker's fetch parked at the sender")
    assert h.num_free_blocks() == num_free - 3  # the prompt's blocks, reserved before any prefill
    first, handoff = h.prefill_first_token(rid)
    assert wait_for(lambda: h.outcome(rid), 10, "the KV sent on the offer") is True
    h.prefill.release(rid)
    h.router.send(DecodeHandoff(rid, PROMPT, first, PARAMS, handoff, FAR))
    moved = h.router.next((Transferred, RequestFailed))
    assert isinstance(moved, Transferred) and moved.nbytes > 0 and moved.recomputed is None
    assert [first, *h.decode_tokens()] == reference
    assert_clean(h, rid)


def test_abort_while_reserved_and_prefilling_frees_both_sides(harness: Harness, reference: list[int]) -> None:
    h, rid = harness, "early-abort"
    num_free = h.num_free_blocks()
    h.prepare(rid)
    wait_for(lambda: h.sender.num_parked() == 1, 10, "fetch parked")
    h.router.send(Abort(rid))
    # the receiver gave up on its fetch and told the sender; the blocks went back
    wait_for(lambda: h.sender.num_parked() == 0, 10, "the sender forgot the fetch")
    wait_for(lambda: h.num_free_blocks() == num_free, 10, "reservation freed")
    # the prefill side ends too (the router aborts it there): its offer, if made, is withdrawn
    first, _ = h.prefill_first_token(rid)
    assert h.sender.abort(rid) is True and h.prefill.abort(rid)
    assert_clean(h, rid)
    # the worker serves on: the same request id again, the usual (late) handoff
    rid = "after-abort"
    first, handoff = h.prefill_first_token(rid)
    h.router.send(DecodeHandoff(rid, PROMPT, first, PARAMS, handoff, FAR))
    assert [first, *h.decode_tokens()] == reference
    wait_for(lambda: h.outcome(rid) is True, 10, "sent")
    h.prefill.release(rid)
    assert_clean(h, rid)


@pytest.mark.parametrize("harness", ["fail", "recompute"], indirect=True)
def test_an_offer_withdrawn_while_reserved_frees_the_blocks_and_the_handoff_applies_the_policy(
    harness: Harness, reference: list[int], request: pytest.FixtureRequest
) -> None:
    h, rid = harness, "early-withdrawn"
    num_free = h.num_free_blocks()
    h.prepare(rid)
    wait_for(lambda: h.sender.num_parked() == 1, 10, "fetch parked")
    assert h.sender.abort(rid) is False  # nothing offered yet: only the parked fetch is refused
    wait_for(lambda: h.num_free_blocks() == num_free, 10, "reservation freed on the refusal")
    assert "early ['early-withdrawn']" in str(h.worker.check_leaks())  # the error waits for its handoff
    first = reference[0]
    h.router.send(DecodeHandoff(rid, PROMPT, first, PARAMS, b"", FAR))
    if request.node.callspec.params["harness"] == "fail":
        failed = h.router.next((RequestFailed,))
        assert failed.code == ErrorCode.KV_TRANSFER_FAILED and "withdrew" in failed.message
    else:
        recomputed = h.router.next((Transferred,))
        assert recomputed.recomputed is not None and "TransferRejectedError" in recomputed.recomputed
        assert [first, *h.decode_tokens()] == reference
    assert_clean(h, rid)


def test_a_dead_prefill_worker_while_reserved_leaves_nothing(harness: Harness) -> None:
    """The router says the prefill worker died (PeerDead), then aborts the attempt it migrates."""
    h, rid = harness, "early-orphan"
    num_free = h.num_free_blocks()
    h.prepare(rid)
    wait_for(lambda: h.sender.num_parked() == 1, 10, "fetch parked")
    h.router.send(PeerDead(PREFILL.worker_id, PREFILL.incarnation))
    wait_for(lambda: h.num_free_blocks() == num_free, 10, "reservation freed")
    h.router.send(Abort(rid))
    wait_for(lambda: h.worker.check_leaks() is None, 10, "decode worker clean")
    assert h.sender.abort(rid) is False  # (the "dead" sender forgets what it parked)
    assert_clean(h, rid)


def test_a_worker_that_cannot_reserve_waits_for_the_handoff_and_keeps_the_lease(reference: list[int]) -> None:
    """One seat, taken by a running request: the early request cannot reserve, so its handoff waits as
    before (KeepAlive every lease_s / 4) and starts once the seat frees."""
    h = start(TransferConfig(backend="gloo", timeout_s=10.0, lease_s=0.4), engine_config(max_num_seqs=1))
    try:
        num_free = h.num_free_blocks()
        rid = "early-waits"
        first = h.run_prefill(rid)
        h.router.send(Generate("seat", PROMPT, SamplingParams(max_tokens=120, ignore_eos=True), FAR))
        h.router.next((Delta,))
        h.prepare(rid)
        h.router.send(DecodeHandoff(rid, PROMPT, first, PARAMS, h.offer(rid), FAR))
        assert h.router.next((KeepAlive,)).request_id == rid
        assert h.sender.extend_lease(rid, 0.4)  # what the router's ExtendLease does
        moved = h.router.next((Transferred,))
        assert moved.request_id == rid and moved.nbytes > 0
        wait_for(lambda: h.outcome(rid) is True, 10, "sent")
        h.prefill.release(rid)
        tokens = [first]
        while len(tokens) < len(reference):
            event = h.router.next((Delta,))
            if event.delta.request_id == rid:
                tokens += event.delta.token_ids
        assert tokens == reference
        wait_for(lambda: h.num_free_blocks() == num_free, 30, "the seat's request finished")
        assert_clean(h, rid)
    finally:
        stop(h)

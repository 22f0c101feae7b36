"""KVReceiver's own checks, without a peer (a channel that moves nothing): it refuses fetches it cannot
run (not started or closed, bad block ids), drops frames not of the transfer it runs, fails a fetch
whose header did not come before its deadline, fails every fetch from a dropped peer while it goes on
with the others, and fails what is posted or queued when closed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch
import zmq

from cluster.frames import new_secret
from tests.cluster_utils import wait_for
from transfer.channel import Channel, OpLane, PendingOp
from transfer.handshake import HandshakeFrames, MessageKind
from transfer.peers import PairKey, PeerId
from transfer.protocol import (
    KVHandoff,
    KVLayout,
    TransferError,
    TransferPeerLostError,
    TransferRejectedError,
    TransferResult,
    TransferTimeoutError,
)
from transfer.receiver import KVReceiver

NUM_BLOCKS = 8


class IdleChannel(Channel):
    """A channel no transfer in these tests reaches past the handshake."""

    backend = "gloo"

    def staging_device(self, kv_device: torch.device) -> torch.device:
        return kv_device

    def generation(self, prefill: PeerId, decode: PeerId) -> int:
        return 0

    def isend(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp:
        raise AssertionError("no bytes move in these tests")

    def irecv(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp:
        raise AssertionError("no bytes move in these tests")


def make_receiver(secret: bytes | None = None, timeout_s: float = 5.0) -> KVReceiver:
    kv = torch.zeros(2, NUM_BLOCKS, 2, 4, 2, 8)
    me = PeerId("decode-0", "d0")
    return KVReceiver(kv, me=me, channel=IdleChannel(), secret=secret or new_secret(), timeout_s=timeout_s)


def handoff(rid: str, endpoint: str = "tcp://127.0.0.1:1") -> KVHandoff:
    return KVHandoff(rid, "prefill-0", "p0", endpoint, KVLayout(2, 4, 2, 8, "float32"), 10, 3, 0.0)


@pytest.fixture
def sender() -> Iterator[zmq.Socket[bytes]]:
    """A fake prefill side's handshake socket (ROUTER, bound on loopback); it answers only what the
    test sends."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    yield sock
    sock.close(linger=0)
    ctx.term()


def test_fetches_it_cannot_run_are_refused() -> None:
    receiver = make_receiver()
    with pytest.raises(TransferError, match="not running"):
        receiver.submit(handoff("early"), [1, 2, 3])
    receiver.start()
    try:
        for ids, skip in (([0, 1, 2], 0), ([1, 2, NUM_BLOCKS], 0), ([1, 2, 2], 0), ([1, 2, 3], -1)):
            with pytest.raises(ValueError):
                receiver.submit(handoff("bad"), ids, skip_first_n_blocks=skip)
        assert receiver.stats().num_failed == 0 and receiver.results() == []
    finally:
        receiver.close()
    with pytest.raises(TransferError, match="not running"):
        receiver.submit(handoff("late"), [1, 2, 3])


def test_a_fetch_past_its_deadline_fails_with_a_timeout_and_is_counted(sender: zmq.Socket[bytes]) -> None:
    receiver = make_receiver()
    receiver.start()
    try:
        future = receiver.submit(
            handoff("stale", sender.getsockopt_string(zmq.LAST_ENDPOINT)), [1, 2, 3], deadline=0.0
        )
        # NOTE: every fetch's request goes out at once (early decode admission); no header came in time
        with pytest.raises(TransferTimeoutError, match="no header for 'stale' before its deadline"):
            future.result(timeout=10)
        (result,) = receiver.results()
        assert (result.request_id, result.ok, result.num_blocks, result.error_type) == (
            "stale",
            False,
            3,
            "TransferTimeoutError",
        )
        assert receiver.stats().num_failed == 1
    finally:
        receiver.close()


def test_dropping_a_peer_fails_its_fetches_and_the_receiver_goes_on_with_the_others(
    sender: zmq.Socket[bytes],
) -> None:
    endpoint = sender.getsockopt_string(zmq.LAST_ENDPOINT)
    receiver = make_receiver()
    receiver.start()

    def fetch(rid: str, src: str) -> Future[TransferResult]:
        h = KVHandoff(rid, src, "p0", endpoint, KVLayout(2, 4, 2, 8, "float32"), 10, 3, 0.0)
        return receiver.submit(h, [1, 2, 3])

    def asked() -> int:
        n = 0
        while sender.poll(200):
            sender.recv_multipart()
            n += 1
        return n

    try:
        a, b, c = fetch("a", "prefill-0"), fetch("b", "prefill-1"), fetch("c", "prefill-2")
        # NOTE: every fetch's request goes out at once (early decode admission); no answer comes
        assert asked() == 3
        receiver.drop_peer("prefill-1")
        with pytest.raises(TransferPeerLostError, match="peer prefill-1/p0 was dropped"):
            b.result(timeout=5)
        assert not a.done() and not c.done()
        receiver.drop_peer("prefill-0")
        with pytest.raises(TransferPeerLostError, match="peer prefill-0/p0 was dropped"):
            a.result(timeout=5)
        assert not c.done()
        receiver.drop_peer("prefill-2")
        with pytest.raises(TransferPeerLostError):
            c.result(timeout=5)
        with pytest.raises(TransferPeerLostError):
            fetch("late", "prefill-1").result(timeout=5)  # a dropped peer is never asked again
        assert receiver.thread.is_alive()
        assert [(r.request_id, r.error_type) for r in receiver.results()] == [
            ("b", "TransferPeerLostError"),
            ("a", "TransferPeerLostError"),
            ("c", "TransferPeerLostError"),
            ("late", "TransferPeerLostError"),
        ]
        assert receiver.stats().num_failed == 4 and asked() == 0
    finally:
        receiver.close()


def test_frames_that_are_not_this_transfers_are_dropped_and_an_abort_fails_it(
    sender: zmq.Socket[bytes],
) -> None:
    """While it waits for the header: junk is counted and dropped, a signed frame of another transfer
    (a late one) is ignored, the sender's signed abort fails the fetch with the sender's error."""
    secret = new_secret()
    frames = HandshakeFrames(secret, "prefill-0/p0")
    receiver = make_receiver(secret)
    receiver.start()
    try:
        future = receiver.submit(handoff("r", sender.getsockopt_string(zmq.LAST_ENDPOINT)), [1, 2, 3])
        assert sender.poll(5000)
        peer, request = sender.recv_multipart()
        message = frames.decode(request)
        assert message is not None and message[0] is MessageKind.REQUEST
        nonce, to = message[1], "decode-0/d0"
        late_abort = frames.encode(to, MessageKind.ABORT, nonce + 1, error_type="X", message="x")
        sender.send_multipart([peer, late_abort])
        sender.send_multipart([peer, b"junk"])  # (after the late frame: counted means both were read)
        wait_for(lambda: receiver.rejected_frames() == {"malformed": 1}, 5, "junk counted")
        assert not future.done()
        abort = frames.encode(
            to, MessageKind.ABORT, nonce, error_type="TransferRejectedError", message="not held"
        )
        sender.send_multipart([peer, abort])
        with pytest.raises(TransferRejectedError, match="peer: not held"):
            future.result(timeout=5)
        assert not sender.poll(200)  # no abort goes back for the sender's own
        assert receiver.thread.is_alive()
    finally:
        receiver.close()


def test_closing_fails_the_fetches_posted_and_still_queued(sender: zmq.Socket[bytes]) -> None:
    receiver = make_receiver()
    receiver.start()
    try:
        endpoint = sender.getsockopt_string(zmq.LAST_ENDPOINT)
        first = receiver.submit(handoff("first", endpoint), [1, 2, 3])
        assert sender.poll(5000)
        queued = receiver.submit(handoff("queued", endpoint), [4, 5, 6])
        receiver.close()
        for future in (first, queued):
            with pytest.raises(TransferError, match="receiver closed"):
                future.result(timeout=0)
        assert not receiver.thread.is_alive()
    finally:
        receiver.close()


def test_a_far_deadline_does_not_lift_the_transfer_timeout_unless_the_fetch_waits_for_its_offer(
    sender: zmq.Socket[bytes],
) -> None:
    endpoint = sender.getsockopt_string(zmq.LAST_ENDPOINT)
    receiver = make_receiver(timeout_s=0.3)
    receiver.start()
    try:
        far = time.time() + 600
        plain = receiver.submit(handoff("plain", endpoint), [1, 2, 3], deadline=far)
        early = receiver.submit(handoff("early", endpoint), [4, 5, 6], deadline=far, wait_for_offer=True)
        with pytest.raises(TransferTimeoutError, match="no header for 'plain'"):
            plain.result(timeout=10)  # timeout_s (0.3 s), not the deadline
        assert not early.done()  # it waits for its offer up to the deadline
        receiver.cancel("early")
        with pytest.raises(TransferError, match="cancelled"):
            early.result(timeout=10)
    finally:
        receiver.close()


def test_a_fetch_it_cannot_even_ask_for_fails_alone_and_the_thread_goes_on(sender: zmq.Socket[bytes]) -> None:
    """A handoff whose endpoint ZMQ refuses fails that fetch (TransferError); the transfer thread lives
    on and asks for the next one."""
    receiver = make_receiver()
    receiver.start()
    try:
        bad = receiver.submit(handoff("bad", "not-an-endpoint"), [1, 2, 3])
        with pytest.raises(TransferError):
            bad.result(timeout=10)
        assert receiver.thread.is_alive()
        good = receiver.submit(handoff("good", sender.getsockopt_string(zmq.LAST_ENDPOINT)), [4, 5, 6])
        assert sender.poll(5000)  # asked
        receiver.cancel("good")
        with pytest.raises(TransferError, match="cancelled"):
            good.result(timeout=10)
        assert [r.request_id for r in receiver.results()] == ["bad", "good"]
    finally:
        receiver.close()
    assert receiver._dealers and all(sock.closed for sock in receiver._dealers.values())

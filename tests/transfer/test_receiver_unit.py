"""KVReceiver's own checks, against a sender the test plays frame by frame over a channel that moves
nothing: it refuses fetches it cannot run (not started or closed, bad block ids), drops frames not of
the transfer it runs, fails a fetch whose header did not come before its deadline, fails every fetch
from a dropped peer while it goes on with the others, and fails what is posted or queued when closed.
Past the header: the sender's abort or a header that does not match fails the fetch under its own
error (and abandons the recvs it posted), a fetch that waited for its offer gets the usual timeout
once the sender answers (or offers: it is asked for again under a new nonce), a frame kind the fetch
does not expect fails it, the transfer after a failed one gets fresh staging, and cancelling takes only
that request's queued fetch."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch
import zmq

from cluster.frames import new_secret
from tests.support.cluster_utils import wait_for
from transfer.channel import Channel, OpLane, PendingOp
from transfer.handshake import HandshakeFrames, MessageKind
from transfer.peers import PairKey, PeerId
from transfer.protocol import (
    CHECKSUM_SCHEME,
    KVHandoff,
    KVLayout,
    TransferError,
    TransferHeader,
    TransferMismatchError,
    TransferPeerLostError,
    TransferRejectedError,
    TransferResult,
    TransferTimeoutError,
    row_bytes_of,
    tag_for_nonce,
)
from transfer.receiver import KVReceiver
from transfer.staging import ChunkPlan

NUM_BLOCKS = 8
LAYOUT = KVLayout(2, 4, 2, 8, "float32")
PREFILL, DECODE = PeerId("prefill-0", "p0"), PeerId("decode-0", "d0")


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


class StalledOp(PendingOp):
    """A recv whose bytes never come."""

    def __init__(self) -> None:
        self._never = threading.Event()

    def is_done(self) -> bool:
        return False

    def wait(self, timeout_s: float) -> None:
        self._never.wait(timeout_s)
        raise TransferTimeoutError("stalled")


class StallChannel(IdleChannel):
    """Joins every pair at once; the recvs it posts never complete; records what a failed transfer
    abandons."""

    def __init__(self) -> None:
        self.posted: list[PendingOp] = []
        self.buffers: list[
            torch.Tensor
        ] = []  # what each recv would write into (kept alive, as a stalled op would)
        self.abandoned: list[tuple[PairKey, list[PendingOp]]] = []

    def irecv(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp:
        op = StalledOp()
        self.posted.append(op)
        self.buffers.append(buf)
        return op

    def abandon(self, key: PairKey, ops: list[PendingOp]) -> None:
        self.abandoned.append((key, list(ops)))


def make_receiver(
    secret: bytes | None = None, timeout_s: float = 5.0, channel: Channel | None = None
) -> KVReceiver:
    kv = torch.zeros(
        LAYOUT.num_layers, NUM_BLOCKS, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim
    )
    return KVReceiver(
        kv, me=DECODE, channel=channel or IdleChannel(), secret=secret or new_secret(), timeout_s=timeout_s
    )


def handoff(rid: str, endpoint: str = "tcp://127.0.0.1:1") -> KVHandoff:
    return KVHandoff(rid, "prefill-0", "p0", endpoint, LAYOUT, 10, 3, 0.0)


class PlayedSender:
    """The prefill side of the handshake, played by the test: real signed frames on `sock`."""

    def __init__(self, sock: zmq.Socket[bytes], secret: bytes) -> None:
        self.sock = sock
        self.frames = HandshakeFrames(secret, PREFILL.name)

    def next(self, kind: MessageKind) -> tuple[bytes, int, dict[str, Any]]:
        """The receiver's next frame (within 5 s), which must be a `kind`: (its socket id, nonce, body)."""
        assert self.sock.poll(5000), f"no {kind.value} came"
        ident, frame = self.sock.recv_multipart()
        message = self.frames.decode(frame)
        assert message is not None
        got, nonce, body = message
        assert got is kind, (got, body)
        return ident, nonce, body

    def send(self, ident: bytes, kind: MessageKind, nonce: int, **fields: object) -> None:
        self.sock.send_multipart([ident, self.frames.encode(DECODE.name, kind, nonce, **fields)])

    def header(self, ident: bytes, nonce: int, rid: str, num_blocks: int = 3) -> ChunkPlan:
        """Answer a request with the header of `num_blocks` blocks, one block row per chunk."""
        row_bytes = row_bytes_of(LAYOUT)
        plan = ChunkPlan.create(LAYOUT.num_layers, num_blocks, row_bytes, row_bytes)
        header = TransferHeader(
            request_id=rid,
            nonce=nonce,
            src_worker_id=PREFILL.worker_id,
            dst_worker_id=DECODE.worker_id,
            generation=0,
            backend="gloo",
            layout=LAYOUT,
            dtype=LAYOUT.dtype,
            shape=LAYOUT.layer_shape(num_blocks),
            num_blocks=num_blocks,
            nbytes=plan.nbytes,
            num_chunks=plan.num_chunks,
            chunk_bytes=plan.chunk_bytes,
            checksum=CHECKSUM_SCHEME,
            tag=tag_for_nonce(nonce),
        )
        self.send(ident, MessageKind.HEADER, nonce, header=header)
        return plan


def moving_fetch(
    receiver: KVReceiver, peer: PlayedSender, endpoint: str
) -> tuple[Future[TransferResult], bytes, int]:
    """Fetch "moving" (blocks 1-3) up to the sender's header and the receiver's ack; its bytes never
    come (StallChannel), so the transfer thread now waits on it. Returns (future, sender ident, nonce)."""
    future = receiver.submit(handoff("moving", endpoint), [1, 2, 3])
    ident, nonce, _ = peer.next(MessageKind.REQUEST)
    peer.header(ident, nonce, "moving")
    peer.next(MessageKind.ACK)
    return future, ident, nonce


def waiting_fetch(
    receiver: KVReceiver, peer: PlayedSender, endpoint: str
) -> tuple[Future[TransferResult], bytes, int]:
    """Fetch "early" (blocks 1-3) that waits for its offer up to a deadline 600 s out, up to its REQUEST
    (which says it would wait). Returns (future, sender ident, nonce)."""
    future = receiver.submit(
        handoff("early", endpoint), [1, 2, 3], deadline=time.time() + 600, wait_for_offer=True
    )
    ident, nonce, body = peer.next(MessageKind.REQUEST)
    assert body["request"].offer_wait_until > 0
    return future, ident, nonce


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


def test_a_fetch_whose_header_misses_its_deadline_fails_with_a_timeout_and_is_counted(
    sender: zmq.Socket[bytes],
) -> None:
    receiver = make_receiver(timeout_s=60.0)  # NOTE: the deadline, far sooner, is what ends it
    receiver.start()
    try:
        future = receiver.submit(
            handoff("stale", sender.getsockopt_string(zmq.LAST_ENDPOINT)),
            [1, 2, 3],
            deadline=time.time() + 0.2,
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
    receiver = make_receiver(timeout_s=0.5)
    receiver.start()
    try:
        bad = receiver.submit(handoff("bad", "not-an-endpoint"), [1, 2, 3])
        with pytest.raises(TransferError):
            bad.result(timeout=10)
        assert receiver.thread.is_alive()
        good = receiver.submit(handoff("good", sender.getsockopt_string(zmq.LAST_ENDPOINT)), [4, 5, 6])
        assert sender.poll(5000)  # asked
        # NOTE: unanswered, it times out after the bad fetch's own bound passed: that fetch is not left
        # posted to fail (and kill the thread) a second time
        with pytest.raises(TransferTimeoutError, match="no header for 'good'"):
            good.result(timeout=10)
        assert receiver.thread.is_alive()
        assert [r.request_id for r in receiver.results()] == ["bad", "good"]
    finally:
        receiver.close()
    assert receiver._dealers and all(sock.closed for sock in receiver._dealers.values())


def test_a_senders_abort_after_its_header_fails_the_fetch_with_its_error_and_abandons_the_recvs(
    sender: zmq.Socket[bytes],
) -> None:
    secret, channel = new_secret(), StallChannel()
    receiver = make_receiver(secret, timeout_s=60.0, channel=channel)  # NOTE: only the abort ends it soon
    receiver.start()
    try:
        peer = PlayedSender(sender, secret)
        future = receiver.submit(handoff("r", sender.getsockopt_string(zmq.LAST_ENDPOINT)), [1, 2, 3])
        ident, nonce, _ = peer.next(MessageKind.REQUEST)
        plan = peer.header(ident, nonce, "r")
        peer.next(MessageKind.ACK)  # every chunk's recv is posted
        peer.send(
            ident, MessageKind.ABORT, nonce, error_type="TransferRejectedError", message="worker stopping"
        )
        with pytest.raises(TransferRejectedError, match="peer: worker stopping"):
            future.result(timeout=10)
        (result,) = receiver.results()
        assert (result.ok, result.error_type, result.error, result.nbytes) == (
            False,
            "TransferRejectedError",
            "peer: worker stopping",
            plan.nbytes,
        )
        assert 0.0 < result.seconds < 10.0  # from the header to the abort, not a clock reading
        assert len(channel.posted) == plan.num_chunks == 6
        assert channel.abandoned == [(PairKey(PREFILL, DECODE, 0), channel.posted)]
        assert not sender.poll(200)  # no abort goes back for the sender's own
        assert receiver.thread.is_alive()
    finally:
        receiver.close()


def test_a_header_that_does_not_match_fails_the_fetch_and_the_sender_is_told(
    sender: zmq.Socket[bytes],
) -> None:
    secret, channel = new_secret(), StallChannel()
    receiver = make_receiver(secret, channel=channel)
    receiver.start()
    try:
        peer = PlayedSender(sender, secret)
        future = receiver.submit(handoff("r", sender.getsockopt_string(zmq.LAST_ENDPOINT)), [1, 2, 3])
        ident, nonce, _ = peer.next(MessageKind.REQUEST)
        peer.header(ident, nonce, "r", num_blocks=2)
        why = "transfer header mismatch for request 'r': num_blocks is 2, expected 3"
        with pytest.raises(TransferMismatchError, match=why):
            future.result(timeout=10)
        (result,) = receiver.results()
        assert (result.ok, result.error_type, result.error) == (False, "TransferMismatchError", why)
        _, told, abort = peer.next(MessageKind.ABORT)
        assert (told, abort["error_type"], abort["message"]) == (nonce, "TransferMismatchError", why)
        assert channel.posted == [] and channel.abandoned == []  # no pair was joined
    finally:
        receiver.close()


def test_once_the_sender_answers_a_fetch_that_waited_for_its_offer_has_the_usual_timeout(
    sender: zmq.Socket[bytes],
) -> None:
    secret, channel = new_secret(), StallChannel()
    receiver = make_receiver(secret, timeout_s=0.3, channel=channel)
    receiver.start()
    try:
        peer = PlayedSender(sender, secret)
        future, ident, nonce = waiting_fetch(receiver, peer, sender.getsockopt_string(zmq.LAST_ENDPOINT))
        peer.header(ident, nonce, "early")  # the sender held it already: it answers at once
        peer.next(MessageKind.ACK)
        # the bytes never come: timeout_s (0.3 s) from the answer ends it, not the deadline 600 s out
        with pytest.raises(TransferTimeoutError, match=r"channel op did not complete within 0\.300s"):
            future.result(timeout=10)
        _, told, abort = peer.next(MessageKind.ABORT)
        assert (told, abort["error_type"]) == (nonce, "TransferTimeoutError")
        assert channel.abandoned == [(PairKey(PREFILL, DECODE, 0), channel.posted)]
    finally:
        receiver.close()


def test_cancel_takes_only_that_requests_fetch_from_those_queued_behind_a_moving_one(
    sender: zmq.Socket[bytes],
) -> None:
    secret = new_secret()
    receiver = make_receiver(secret, timeout_s=60.0, channel=StallChannel())
    receiver.start()
    try:
        peer = PlayedSender(sender, secret)
        endpoint = sender.getsockopt_string(zmq.LAST_ENDPOINT)
        moving, ident, nonce = moving_fetch(receiver, peer, endpoint)  # the next fetches queue behind it
        b, c = (
            receiver.submit(handoff("b", endpoint), [4, 5, 6]),
            receiver.submit(handoff("c", endpoint), [7]),
        )
        receiver.cancel("b")
        assert b.done() and not c.done()
        with pytest.raises(TransferError, match="fetch of 'b' cancelled by decode-0/d0"):
            b.result(timeout=0)
        peer.send(ident, MessageKind.ABORT, nonce, error_type="TransferRejectedError", message="stopping")
        with pytest.raises(TransferRejectedError):
            moving.result(timeout=10)
        _, _, body = peer.next(MessageKind.REQUEST)  # the thread goes on with c; b is never asked for
        assert body["request"].request_id == "c"
        assert not sender.poll(200) and not c.done()
    finally:
        receiver.close()


def test_receive_asks_for_every_block_and_raises_the_fetchs_error(sender: zmq.Socket[bytes]) -> None:
    """The blocking `receive` is `submit` and wait: the request names every block (none skipped), and the
    sender's abort comes back as the error it raises."""
    secret = new_secret()
    receiver = make_receiver(secret)
    receiver.start()
    outcome: list[BaseException] = []

    def receive() -> None:
        try:
            receiver.receive(handoff("r", sender.getsockopt_string(zmq.LAST_ENDPOINT)), [1, 2, 3])
        except BaseException as e:  # noqa: BLE001 (the test reads it)
            outcome.append(e)

    caller = threading.Thread(target=receive)
    caller.start()
    try:
        peer = PlayedSender(sender, secret)
        ident, nonce, body = peer.next(MessageKind.REQUEST)
        assert (body["request"].skip_first_n_blocks, body["request"].num_dst_blocks) == (0, 3)
        peer.send(ident, MessageKind.ABORT, nonce, error_type="TransferRejectedError", message="not held")
        caller.join(10)
        assert not caller.is_alive()
        assert [(type(e), str(e)) for e in outcome] == [(TransferRejectedError, "peer: not held")]
    finally:
        receiver.close()
        caller.join(10)


def test_dropping_a_peer_fails_its_fetch_queued_behind_a_moving_one_at_once(
    sender: zmq.Socket[bytes],
) -> None:
    secret = new_secret()
    receiver = make_receiver(secret, timeout_s=60.0, channel=StallChannel())
    receiver.start()
    try:
        peer = PlayedSender(sender, secret)
        endpoint = sender.getsockopt_string(zmq.LAST_ENDPOINT)
        moving, ident, nonce = moving_fetch(receiver, peer, endpoint)  # a fetch from another peer queues
        other = KVHandoff("queued", "prefill-1", "p1", endpoint, LAYOUT, 10, 3, 0.0)
        queued = receiver.submit(other, [4, 5, 6])
        given_up = receiver.submit(
            KVHandoff("given-up", "prefill-1", "p1", endpoint, LAYOUT, 10, 1, 0.0), [7]
        )
        assert given_up.cancel()  # the caller's own cancel of a queued future
        receiver.drop_peer("prefill-1")  # fails what is queued, and leaves the cancelled one cancelled
        assert queued.done() and given_up.cancelled()
        with pytest.raises(TransferPeerLostError, match="peer prefill-1/p1 was dropped"):
            queued.result(timeout=0)
        peer.send(ident, MessageKind.ABORT, nonce, error_type="TransferRejectedError", message="stopping")
        with pytest.raises(TransferRejectedError):
            moving.result(timeout=10)
        assert not sender.poll(300)  # the dropped peer's fetch is never asked for
        assert receiver.thread.is_alive()
        assert [r.request_id for r in receiver.results()] == ["queued", "given-up", "moving"]
    finally:
        receiver.close()


def _thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds (user + system) `thread` used so far (Linux)."""
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_transfer_thread_sleeps_after_a_wakeup(sender: zmq.Socket[bytes]) -> None:
    """After a fetch woke the transfer thread and ended, the thread waits on its poller again instead of
    spinning (a wake-up left set, or a zero poll timeout, would burn a core)."""
    secret = new_secret()
    receiver = make_receiver(secret)
    receiver.start()
    try:
        peer = PlayedSender(sender, secret)
        fetch = receiver.submit(handoff("r", sender.getsockopt_string(zmq.LAST_ENDPOINT)), [1, 2, 3])
        peer.next(MessageKind.REQUEST)
        receiver.cancel("r")
        with pytest.raises(TransferError, match="cancelled"):
            fetch.result(timeout=10)
        peer.next(MessageKind.ABORT)  # the sender is told
        before = _thread_cpu_s(receiver.thread)
        assert not sender.poll(1000)  # an idle receiver asks nothing for a second (the interval measured)
        used = _thread_cpu_s(receiver.thread) - before
        assert used < 0.25, f"the idle transfer thread used {used:.2f} s of CPU in 1 s"
    finally:
        receiver.close()


def test_an_offer_to_a_fetch_that_waits_for_it_is_asked_for_again_under_the_usual_timeout(
    sender: zmq.Socket[bytes],
) -> None:
    """READY (the sender now holds the request the fetch waited for): the fetch is asked for again, under
    a new nonce and no longer waiting for an offer, and from then on `timeout_s` bounds it, not the far
    deadline it waited under."""
    secret = new_secret()
    receiver = make_receiver(secret, timeout_s=0.3)
    receiver.start()
    try:
        peer = PlayedSender(sender, secret)
        future, ident, first = waiting_fetch(receiver, peer, sender.getsockopt_string(zmq.LAST_ENDPOINT))
        peer.send(ident, MessageKind.READY, first)
        _, again, body = peer.next(MessageKind.REQUEST)
        assert again != first and body["request"].offer_wait_until == 0.0
        with pytest.raises(TransferTimeoutError, match="no header for 'early' before its deadline"):
            future.result(timeout=10)
        _, told, _ = peer.next(MessageKind.ABORT)
        assert told == again
    finally:
        receiver.close()


def test_a_frame_other_than_header_or_abort_fails_a_fetch_that_did_not_wait_for_an_offer(
    sender: zmq.Socket[bytes],
) -> None:
    secret = new_secret()
    receiver = make_receiver(secret, timeout_s=60.0)  # NOTE: only the unexpected frame ends it soon
    receiver.start()
    try:
        peer = PlayedSender(sender, secret)
        future = receiver.submit(handoff("plain", sender.getsockopt_string(zmq.LAST_ENDPOINT)), [1, 2, 3])
        ident, nonce, body = peer.next(MessageKind.REQUEST)
        assert body["request"].offer_wait_until == 0.0
        peer.send(ident, MessageKind.READY, nonce)
        with pytest.raises(TransferError, match="expected header from the sender, got ready"):
            future.result(timeout=10)
        _, told, abort = peer.next(MessageKind.ABORT)
        assert (told, abort["error_type"]) == (nonce, "TransferError")
        assert not sender.poll(200)  # not asked again
    finally:
        receiver.close()


def test_a_near_deadline_bounds_a_fetch_under_a_long_transfer_timeout(sender: zmq.Socket[bytes]) -> None:
    receiver = make_receiver(timeout_s=60.0)
    receiver.start()
    try:
        endpoint = sender.getsockopt_string(zmq.LAST_ENDPOINT)
        future = receiver.submit(handoff("soon", endpoint), [1, 2, 3], deadline=time.time() + 0.3)
        with pytest.raises(TransferTimeoutError, match="no header for 'soon' before its deadline"):
            future.result(timeout=10)
    finally:
        receiver.close()


def test_the_transfer_after_a_failed_one_gets_fresh_staging(sender: zmq.Socket[bytes]) -> None:
    """A failed transfer's abandoned recvs may still write into its staging: the next transfer's recvs
    must land elsewhere."""
    secret, channel = new_secret(), StallChannel()
    receiver = make_receiver(secret, timeout_s=60.0, channel=channel)
    receiver.start()
    try:
        peer = PlayedSender(sender, secret)
        endpoint = sender.getsockopt_string(zmq.LAST_ENDPOINT)
        first, ident, nonce = moving_fetch(receiver, peer, endpoint)
        peer.send(ident, MessageKind.ABORT, nonce, error_type="TransferRejectedError", message="stopping")
        with pytest.raises(TransferRejectedError):
            first.result(timeout=10)
        abandoned = {b.untyped_storage().data_ptr() for b in channel.buffers}
        num_first = len(channel.buffers)
        second = receiver.submit(handoff("second", endpoint), [4, 5, 6])
        ident, nonce, _ = peer.next(MessageKind.REQUEST)
        peer.header(ident, nonce, "second")
        peer.next(MessageKind.ACK)
        fresh = {b.untyped_storage().data_ptr() for b in channel.buffers[num_first:]}
        assert len(channel.buffers) == 2 * num_first and not fresh & abandoned
        receiver.cancel("second")  # not stopped: it is moving; close() ends it
        assert not second.done()
    finally:
        receiver.close()


def test_a_receiver_closed_without_being_started_closes_its_wakeup_pipe() -> None:
    receiver = make_receiver()
    receiver.close()
    # NOTE: the flag, not /proc/self/fd: other tests' threads may open and close descriptors meanwhile
    assert receiver._wakeup._is_closed and not receiver.thread.is_alive()

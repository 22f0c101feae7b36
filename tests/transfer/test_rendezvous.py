"""issue 41 item 4: a pair's group rendezvouses over the pair's signed handshake link, never a shared store.

Each end's `LinkStore` ships what the group sets as a signed ``rendezvous`` handshake frame and returns
only what came from the other end in one; a frame that does not verify never reaches a store and is
counted (``rendezvous_bad_tag`` when it claims to carry a rendezvous value), a verified value misbound to
another pair or generation is refused and counted, and every wait is bounded. (issue 31 row 2, the
signed values on the router's TCPStore, is gone with that store: the cluster hosts none any more, so
there is nowhere shared for a stranger to write.)
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import msgpack
import pytest
import torch
import zmq

from cluster.frames import MAC_BYTES, MAGIC, FrameSigner, new_secret
from tests.support.cluster_utils import wait_for
from transfer.handshake import HandshakeFrames, MessageKind
from transfer.pairs import PairChannel
from transfer.peers import DECODE_RANK, PREFILL_RANK, PairKey, PeerId
from transfer.protocol import (
    CHECKSUM_SCHEME,
    KVHandoff,
    KVLayout,
    TransferError,
    TransferHeader,
    TransferPairError,
    TransferRequest,
    tag_for_nonce,
)
from transfer.receiver import KVReceiver
from transfer.rendezvous import (
    MAX_PENDING_VALUES,
    MAX_VALUE_BYTES,
    REASON_BAD_TAG,
    REASON_MISBOUND,
    REASON_OVERFLOW,
    REASON_STALE,
    REASON_TOO_LARGE,
    RendezvousLink,
)
from transfer.sender import KVSender

P, D = PeerId("prefill-0", "p0"), PeerId("decode-0", "d0")
KEY = PairKey(P, D, 3)
TIMEOUT_S = 20.0
SHAPE = (2, 16, 2, 4, 2, 8)  # [L, blocks, 2, block_size, heads, dim] float32
FORGED = b"127.0.0.1:1 a stranger's gloo address"


class Wire:
    """Two sides' links joined the way their transfer threads join them: every value is signed by one
    side's HandshakeFrames and verified by the other's before it is delivered."""

    def __init__(self, secret: bytes) -> None:
        self.wakes = {P: 0, D: 0}
        self.links = {
            P: RendezvousLink(P, PREFILL_RANK, lambda: self._woke(P)),
            D: RendezvousLink(D, DECODE_RANK, lambda: self._woke(D)),
        }
        self.frames = {me: HandshakeFrames(secret, me.name) for me in (P, D)}

    def _woke(self, me: PeerId) -> None:
        self.wakes[me] += 1

    def pump(self, src: PeerId) -> list[bytes]:
        """Carry `src`'s queued values to the other end; returns the frames that crossed."""
        sent = []
        for to, fields in self.links[src].take_outbox():
            frame = self.frames[src].encode(to.name, MessageKind.RENDEZVOUS, 0, **fields)
            sent.append(frame)
            self.receive(to, frame)
        return sent

    def receive(self, me: PeerId, frame: bytes) -> None:
        message = self.frames[me].decode(frame)
        if message is not None and message[0] is MessageKind.RENDEZVOUS:
            self.links[me].deliver(message[2])


def fields(key: PairKey, name: str, value: bytes) -> dict[str, Any]:
    return {"prefill": key.prefill.name, "decode": key.decode.name, "generation": key.generation,
            "key": name, "value": value}  # fmt: skip


def test_issue41_a_value_reaches_the_other_end_only_in_a_signed_frame() -> None:
    wire = Wire(new_secret())
    mine, theirs = wire.links[P].open(KEY, TIMEOUT_S), wire.links[D].open(KEY, TIMEOUT_S)
    mine.set("0/0", b"prefill address")
    assert (mine.check(["0/0"]), theirs.check(["0/0"])) == (True, False)  # nothing crossed yet
    assert wire.wakes == {P: 1, D: 0}  # the set woke the sender's transfer thread
    [frame] = wire.pump(P)
    assert theirs.get("0/0") == b"prefill address"
    wire.receive(D, frame)  # the same frame again (a replay): refused by the frame verifier
    theirs.set("0/1", b"decode address")
    wire.pump(D)
    assert mine.get("0/1") == b"decode address"
    assert wire.frames[D].rejected() == {"replayed": 1}
    assert wire.links[P].rejected() == wire.links[D].rejected() == {}
    for link, store in ((wire.links[P], mine), (wire.links[D], theirs)):
        link.close(store)
    mine.set("dump", b"1")  # NOTE: after the build (NCCL's watchdog signals): stays here
    assert wire.links[P].take_outbox() == []


def test_issue41_a_forged_rendezvous_frame_is_counted_as_a_bad_tag_and_reaches_no_store() -> None:
    secret = new_secret()
    wire = Wire(secret)
    theirs = wire.links[P].open(KEY, 0.2)
    body = {"nonce": 0, **fields(KEY, "0/1", FORGED)}
    envelope = msgpack.packb([7, 1, time.time(), P.name, "rendezvous", body], use_bin_type=True)
    for frame in (
        FrameSigner(new_secret()).sign(P.name, "rendezvous", body),  # signed with another secret
        MAGIC + b"\0" * MAC_BYTES + envelope,  # unsigned
        FrameSigner(new_secret()).sign(P.name, "credit", {"nonce": 0, "chunk": 1}),  # not a rendezvous
    ):
        wire.receive(P, frame)
    assert wire.frames[P].rejected() == {REASON_BAD_TAG: 2, "bad_mac": 1}
    with pytest.raises(
        TimeoutError, match=r"no rendezvous value for \['0/1'\] from decode-0/d0 within 0\.2s"
    ):
        theirs.get("0/1")


def test_issue41_a_misbound_stale_or_oversized_value_is_refused_and_counted() -> None:
    link = RendezvousLink(D, DECODE_RANK, lambda: None)
    store = link.open(KEY, 0.2)
    other = PeerId("decode-1", "d1")
    link.deliver(fields(PairKey(P, other, 3), "0/0", FORGED))  # another decode peer's pair
    link.deliver(fields(PairKey(D, D, 3), "0/0", FORGED))  # D at both ends
    link.deliver(fields(PairKey(P, D, 2), "0/0", FORGED))  # an older generation
    link.deliver(fields(KEY, "0/0", b"x" * (MAX_VALUE_BYTES + 1)))
    assert link.rejected() == {REASON_MISBOUND: 2, REASON_STALE: 1, REASON_TOO_LARGE: 1}
    assert store.check(["0/0"]) is False
    link.deliver(fields(PairKey(P, D, 4), "0/0", b"next"))  # the peer is a generation ahead: kept
    link.deliver(fields(KEY, "0/0", b"this"))
    assert store.get("0/0") == b"this"
    assert link.open(PairKey(P, D, 4), 0.2).get("0/0") == b"next"
    with pytest.raises(RuntimeError, match="superseded by generation 4"):
        store.get("0/1")  # the older generation's build ends at once
    assert link.rejected() == {REASON_MISBOUND: 2, REASON_STALE: 1, REASON_TOO_LARGE: 1}


def test_issue41_values_for_pairs_not_opened_yet_are_bounded() -> None:
    link = RendezvousLink(D, DECODE_RANK, lambda: None)
    prefills = [PeerId(f"prefill-{i}", "p") for i in range(MAX_PENDING_VALUES + 3)]
    for prefill in prefills:
        link.deliver(fields(PairKey(prefill, D, 0), "0/0", prefill.name.encode()))
    assert link.rejected() == {REASON_OVERFLOW: 3}  # the 3 oldest went
    assert not link.open(PairKey(prefills[2], D, 0), 0.05).check(["0/0"])
    assert link.open(PairKey(prefills[3], D, 0), 0.05).get("0/0") == b"prefill-3/p"


def test_issue41_every_wait_is_bounded_and_a_dropped_peer_ends_it_at_once() -> None:
    link = RendezvousLink(D, DECODE_RANK, lambda: None)
    store = link.open(KEY, 0.2)
    with pytest.raises(TimeoutError, match=r"within 0\.2s"):
        store.get("0/0")
    with pytest.raises(TimeoutError, match=r"within 0\.1s"):
        store.wait(["0/0"], datetime.timedelta(seconds=0.1))
    with pytest.raises(NotImplementedError):
        store.add("n", 1)
    waiting = link.open(PairKey(P, D, 4), TIMEOUT_S)
    errors: list[str] = []

    def get() -> None:
        try:
            waiting.get("0/0")
        except RuntimeError as e:
            errors.append(str(e))

    getter = threading.Thread(target=get)
    getter.start()
    wait_for(lambda: getter.is_alive(), 5, "the get waiting")
    link.drop(P)
    getter.join(5)
    assert errors == [f"rendezvous of pair {PairKey(P, D, 4)} abandoned: peer prefill-0/p0 was dropped"]


def test_issue41_a_side_without_a_link_cannot_build_a_pair() -> None:
    channel = PairChannel("127.0.0.1")
    with pytest.raises(TransferPairError, match=r"prefill-0/p0 has no rendezvous link as rank 0"):
        channel.connect(KEY, PREFILL_RANK).wait(5)
    assert channel.broken_pairs() == [KEY]


def test_issue41_a_peer_that_never_answers_breaks_the_pair_at_the_group_timeout() -> None:
    """No value from the other end: the build fails at the group's timeout, the next one is generation +1."""
    channel = PairChannel("127.0.0.1", group_timeout_s=0.5)
    link = RendezvousLink(D, DECODE_RANK, lambda: None)
    channel.use_link(link)
    with pytest.raises(TransferPairError, match="no rendezvous value for"):
        channel.connect(KEY, DECODE_RANK).wait(TIMEOUT_S)
    assert [fields["key"] for _, fields in link.take_outbox()] == ["0/1"]  # ours was queued
    assert channel.generation(P, D) == KEY.generation + 1


class Stranger:
    """A process without the secret: forges rendezvous values into the sender's handshake socket (signed
    with a secret of its own), before and during a pair's build, until `stop`."""

    def __init__(self, endpoint: str, key: PairKey) -> None:
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 5000)
        self._sock.connect(endpoint)
        self._signer = FrameSigner(new_secret())
        self._key = key
        self.num_frames = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def forge(self) -> None:
        for generation in range(3):
            key = PairKey(self._key.prefill, self._key.decode, generation)
            for name in ("0/0", "0/1", "0:1"):  # gloo's two addresses, NCCL's unique id
                body = {"nonce": 0, **fields(key, name, FORGED)}
                self._sock.send(self._signer.sign(key.prefill.name, "rendezvous", body))
                self.num_frames += 1

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.forge()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT_S)
        self._sock.close()
        self._ctx.term()


def test_issue41_a_pair_forms_and_moves_bytes_intact_while_a_stranger_forges_its_rendezvous() -> None:
    """The stranger forges every value of the pair's first generations, before the pair exists and all
    through its build, on the sender's handshake socket. The pair forms at generation 0, the bytes land
    intact, and every forged frame is counted as a bad tag."""
    secret = new_secret()
    src, dst = torch.randn(*SHAPE), torch.zeros(*SHAPE)
    sent: list[bool] = []
    sender = KVSender(src, me=P, channel=PairChannel("127.0.0.1"), secret=secret,
                      on_sent=lambda r, ok: sent.append(ok), integrity="mac", timeout_s=TIMEOUT_S)  # fmt: skip
    receiver = KVReceiver(dst, me=D, channel=PairChannel("127.0.0.1"), secret=secret,
                          integrity="mac", timeout_s=TIMEOUT_S)  # fmt: skip
    stranger = Stranger(sender.endpoint, PairKey(P, D, 0))
    sender.start()
    receiver.start()
    try:
        stranger.forge()  # before the pair exists
        stranger.start()  # and all through its build
        result = receiver.receive(sender.offer("r", [3, 4, 5], num_tokens=12), [7, 8, 9])
        stranger.stop()
        wait_for(lambda: sender.rejected_frames().get(REASON_BAD_TAG) == stranger.num_frames, TIMEOUT_S,
                 "every forged frame counted")  # fmt: skip
        wait_for(lambda: sent == [True], TIMEOUT_S, "the sender's done")
        assert (result.ok, result.generation) == (True, 0)
        assert torch.equal(dst[:, 7:10], src[:, 3:6])
        assert torch.equal(dst[:, :7], torch.zeros(SHAPE[0], 7, *SHAPE[2:]))
        assert sender.rejected_frames() == {REASON_BAD_TAG: stranger.num_frames}
        assert receiver.rejected_frames() == {}
        assert sender.broken_peers() == receiver.broken_peers() == []
    finally:
        stranger.stop() if stranger._thread.is_alive() else None
        sender.close()
        receiver.close()


class Played:
    """One end of a pair's handshake link, played by the test: real signed frames on a real socket."""

    def __init__(self, ctx: zmq.Context[Any], kind: int, secret: bytes, me: PeerId) -> None:
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.frames = HandshakeFrames(secret, me.name)

    def recv(self) -> tuple[list[bytes], tuple[MessageKind, int, dict[str, Any]]]:
        assert self.sock.poll(int(TIMEOUT_S * 1000)), "nothing came"
        parts = self.sock.recv_multipart()
        message = self.frames.decode(parts[-1])
        assert message is not None
        return parts[:-1], message


def test_issue41_the_prefill_side_takes_a_value_only_from_the_named_peers_connection() -> None:
    """A signed value naming decode D counts as misbound unless it comes over the connection D's last
    verified transfer request came on."""
    secret = new_secret()
    ctx: zmq.Context[Any] = zmq.Context()
    sender = KVSender(torch.zeros(*SHAPE), me=P, channel=PairChannel("127.0.0.1"), secret=secret,
                      on_sent=lambda r, ok: None, timeout_s=TIMEOUT_S)  # fmt: skip
    sender.start()
    d, other = Played(ctx, zmq.DEALER, secret, D), Played(ctx, zmq.DEALER, secret, D)
    try:
        for played in (d, other):
            played.sock.connect(sender.endpoint)

        def value(played: Played, key: PairKey) -> None:
            played.sock.send(
                played.frames.encode(P.name, MessageKind.RENDEZVOUS, 0, **fields(key, "0/1", FORGED))
            )

        value(d, PairKey(P, D, 0))  # before D asked for anything: no connection of D's is known
        request = TransferRequest("unknown", 11, D.worker_id, D.incarnation, 0, 0, 1)
        d.sock.send(d.frames.encode(P.name, MessageKind.REQUEST, 11, request=request))
        _, (kind, nonce, _) = d.recv()
        assert (kind, nonce) == (MessageKind.ABORT, 11)  # refused (never offered), and D's connection known
        value(d, PairKey(P, D, 0))  # taken: kept for the pair until it is built
        value(d, PairKey(P, PeerId("decode-1", "d1"), 0))  # names another decode peer
        wait_for(lambda: sender.rejected_frames() == {REASON_MISBOUND: 2}, TIMEOUT_S, "two counted")
        value(other, PairKey(P, D, 0))  # signed, but over another connection
        wait_for(lambda: sender.rejected_frames() == {REASON_MISBOUND: 3}, TIMEOUT_S, "three counted")
    finally:
        sender.close()
        ctx.destroy(linger=0)


def test_issue41_the_decode_side_ships_its_value_to_the_sender_and_takes_one_only_from_it() -> None:
    """The receiver joins the header's pair: its group's value goes to the sender's socket as a signed
    rendezvous frame bound to the pair and generation; a value naming another prefill peer is refused."""
    secret = new_secret()
    ctx: zmq.Context[Any] = zmq.Context()
    p = Played(ctx, zmq.ROUTER, secret, P)
    p.sock.bind("tcp://127.0.0.1:*")
    endpoint = p.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    layout = KVLayout(SHAPE[0], SHAPE[3], SHAPE[4], SHAPE[5], "float32")
    receiver = KVReceiver(torch.zeros(*SHAPE), me=D, channel=PairChannel("127.0.0.1", group_timeout_s=2.0),
                          secret=secret, timeout_s=TIMEOUT_S)  # fmt: skip
    receiver.start()
    try:
        future = receiver.submit(KVHandoff("r", P.worker_id, P.incarnation, endpoint, layout, 4, 1, 0.0), [1])
        (ident,), (kind, nonce, _) = p.recv()
        assert kind is MessageKind.REQUEST

        def send(kind: MessageKind, **body: Any) -> None:
            p.sock.send_multipart([ident, p.frames.encode(D.name, kind, nonce, **body)])

        send(MessageKind.RENDEZVOUS, **fields(PairKey(PeerId("prefill-1", "p1"), D, 0), "0/0", FORGED))
        row_bytes = layout.bytes_per_block // layout.num_layers
        header = TransferHeader("r", nonce, P.worker_id, D.worker_id, 0, "gloo", layout, "float32",
                                layout.layer_shape(1), 1, layout.bytes_per_block, layout.num_layers,
                                row_bytes, CHECKSUM_SCHEME, tag_for_nonce(nonce))  # fmt: skip
        send(MessageKind.HEADER, header=header)
        _, (kind, _, shipped) = p.recv()
        assert kind is MessageKind.RENDEZVOUS
        assert {k: v for k, v in shipped.items() if k != "value"} == {
            "prefill": P.name, "decode": D.name, "generation": 0, "key": "0/1"
        }  # fmt: skip
        assert shipped["value"]  # gloo's address of the decode rank
        send(MessageKind.ABORT, error_type="TransferError", message="played sender gives up")
        with pytest.raises(TransferError, match="played sender gives up"):
            future.result(TIMEOUT_S)
        assert receiver.rejected_frames() == {REASON_MISBOUND: 1}
    finally:
        receiver.close()
        ctx.destroy(linger=0)

"""The KV-transfer handshake's messages and its authenticated frames.

Every frame on a KVSender's ROUTER socket and a KVReceiver's DEALER sockets is signed with the cluster's
secret (cluster/frames.py: MAC, recipient, freshness, replay guard, size caps) and checked before any
byte of its body is decoded; the body is then rebuilt strictly (`parse_body`). The recipient is the
peer process's name (`peer_name(worker id, incarnation)`), so a frame captured on its way to one worker
cannot be replayed into another one, nor into a restarted process of the same worker. A rejected frame
is counted by reason and dropped: nothing a peer sends can end a transfer thread.

The same link carries the pairs' rendezvous values (``rendezvous`` frames, transfer/rendezvous.py). A frame
whose MAC does not verify and whose (unverified) tag says ``rendezvous`` is counted ``rendezvous_bad_tag``
instead of ``bad_mac``: what a stranger without the secret sends to steer or stall a pair's build.
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Any

import msgpack

from cluster.frames import (
    MAC_BYTES,
    MAGIC,
    REASON_BAD_FIELD,
    REASON_BAD_MAC,
    REASON_UNKNOWN_TAG,
    FrameRejected,
    FrameSigner,
    FrameVerifier,
)
from transfer.protocol import TransferError, header_from_dict, request_from_dict, to_dict
from transfer.rendezvous import REASON_BAD_TAG

logger = logging.getLogger(__name__)

# NOTE: handshake bodies are a few hundred bytes; nothing larger has a reason to reach a transfer socket.
# It is also each handshake socket's ZMQ_MAXMSGSIZE: libzmq drops a larger frame as it reads its length
# (closing that connection) instead of buffering it whole for the verifier to refuse.
MAX_HANDSHAKE_FRAME_BYTES = 64 << 10


class MessageKind(str, enum.Enum):
    REQUEST = "request"
    HEADER = "header"
    ACK = "ack"
    CREDIT = "credit"
    DONE = "done"
    ABORT = "abort"
    READY = "ready"  # a parked request was offered: ask again (early decode admission)
    RENDEZVOUS = "rendezvous"  # a value a pair's group set while it is built (transfer/rendezvous.py)


_BODY_FIELDS: dict[MessageKind, dict[str, type]] = {
    MessageKind.REQUEST: {"request": dict},
    MessageKind.HEADER: {"header": dict},
    MessageKind.ACK: {"num_slots": int},
    MessageKind.CREDIT: {"chunk": int},
    MessageKind.DONE: {},
    MessageKind.ABORT: {"error_type": str, "message": str},
    MessageKind.READY: {},
    MessageKind.RENDEZVOUS: {"prefill": str, "decode": str, "generation": int, "key": str, "value": bytes},
}

Message = tuple[MessageKind, int, dict[str, Any]]  # (kind, nonce, fields)


def message_body(nonce: int, **fields: Any) -> dict[str, Any]:
    """The body of one handshake message (its kind is the frame's tag). Dataclass values become maps."""
    return {"nonce": nonce, **{k: to_dict(v) for k, v in fields.items()}}


def parse_body(kind: MessageKind, body: Any) -> tuple[int, dict[str, Any]]:
    """(nonce, fields) of a `kind` message, rebuilt strictly: exactly the kind's fields, of their types;
    a request's and a header's map become a TransferRequest / TransferHeader. Raises TransferError."""
    if not isinstance(body, dict):
        raise TransferError(f"{kind.value} body is not a map")
    want = {"nonce": int, **_BODY_FIELDS[kind]}
    if set(body) != set(want):
        got = sorted(map(str, body))[:8]
        raise TransferError(f"{kind.value} body has fields {got}, expected {sorted(want)}")
    for name, tp in want.items():
        if type(body[name]) is not tp:
            raise TransferError(f"{kind.value}.{name} must be {tp.__name__}, got {type(body[name]).__name__}")
    fields = {k: v for k, v in body.items() if k != "nonce"}
    if kind is MessageKind.REQUEST:
        fields["request"] = request_from_dict(fields["request"])
    elif kind is MessageKind.HEADER:
        fields["header"] = header_from_dict(fields["header"])
    return body["nonce"], fields


def _claims_rendezvous(frame: bytes) -> bool:
    """Whether an (unverified) frame's envelope names the ``rendezvous`` tag; reads the envelope's first
    five items only, never its body."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(frame), max_str_len=256, max_bin_len=0)
    unpacker.feed(frame[len(MAGIC) + MAC_BYTES :])
    try:
        if unpacker.read_array_header() != 6:
            return False
        for _ in range(4):  # session, counter, sent_at, recipient
            unpacker.skip()
        return bool(unpacker.unpack() == MessageKind.RENDEZVOUS.value)
    except Exception:  # noqa: BLE001 (NOTE: anything a stranger sent: it claims nothing)
        return False


class HandshakeFrames:
    """Signs the frames one side sends and verifies the frames it receives (``me``: its peer name).

    ``decode`` returns (kind, nonce, fields) or None for a rejected frame (counted by reason, logged at
    a bounded rate); it never raises. Used by the side's transfer thread; ``rejected`` from any thread.
    """

    def __init__(self, secret: bytes, me: str) -> None:
        self.me = me
        self._signer = FrameSigner(secret)
        self._verifier = FrameVerifier(secret, me, max_frame_bytes=MAX_HANDSHAKE_FRAME_BYTES)
        self._num_logged = 0
        # NOTE: `bad_mac` frames that claimed a rendezvous value: counted as `rendezvous_bad_tag` instead.
        # Under the lock with the verify that counted them, so `rejected` never sees one counted twice.
        self._lock = threading.Lock()
        self._num_bad_tags = 0

    def encode(self, to: str, kind: MessageKind, nonce: int, **fields: Any) -> bytes:
        return self._signer.sign(to, kind.value, message_body(nonce, **fields))

    def decode(self, frame: bytes) -> Message | None:
        try:
            tag, body = self._verify(frame)
            try:
                kind = MessageKind(tag)
            except ValueError:
                raise FrameRejected(REASON_UNKNOWN_TAG, f"{tag!r}"[:100]) from None
            try:
                nonce, fields = parse_body(kind, body)
            except TransferError as e:
                raise FrameRejected(REASON_BAD_FIELD, str(e)[:200]) from None
        except FrameRejected as e:
            if e.reason in (REASON_UNKNOWN_TAG, REASON_BAD_FIELD):
                self._verifier.reject(e.reason)
            self._log(e)
            return None
        return kind, nonce, fields

    def reject(self, reason: str) -> None:
        """Count a frame dropped before it reached `decode` (e.g. a multipart message of the wrong shape)."""
        self._verifier.reject(reason)

    def rejected(self) -> dict[str, int]:
        with self._lock:
            counts = self._verifier.rejected_snapshot()
            num_bad_tags = self._num_bad_tags
        if num_bad_tags:
            counts[REASON_BAD_MAC] -= num_bad_tags
            counts[REASON_BAD_TAG] = num_bad_tags
        return {reason: n for reason, n in counts.items() if n}

    def _verify(self, frame: bytes) -> tuple[str, dict[str, Any]]:
        with self._lock:
            try:
                return self._verifier.verify(frame)
            except FrameRejected as e:
                if e.reason != REASON_BAD_MAC or not _claims_rendezvous(frame):
                    raise
                self._num_bad_tags += 1
        raise FrameRejected(REASON_BAD_TAG, "a rendezvous value whose MAC does not verify")

    def _log(self, e: FrameRejected) -> None:
        self._num_logged += 1
        # NOTE: a flood of bad frames must not become a flood of log lines: the first 10, then 1 in 1000.
        if self._num_logged <= 10 or self._num_logged % 1000 == 0:
            logger.warning("%s: dropped KV handshake frame #%d (%s)", self.me, self._num_logged, e)

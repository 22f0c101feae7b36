"""Authenticated control-plane frames: every ZMQ frame between router and workers (and the KV-transfer
handshake) is signed with the cluster's secret and checked before anything decodes its body.

    frame    = MAGIC (4 B) | mac (16 B) | envelope
    envelope = msgpack [session: int, counter: int, sent_at: float, recipient: str, tag: str, body: map]
    mac      = blake2b-128 keyed with the cluster secret, over the envelope bytes

Envelopes are encoded with msgspec (a body is a map, or a msgspec Struct: cluster/wire.py's messages).
``verify`` returns the body unpacked (the KV-transfer handshake's); ``verify_body`` hands its msgpack
bytes to a typed decoder (the control plane's: one pass from bytes to message, no dict in between).

``session`` is random per sending socket and ``counter`` grows by one per frame, so a receiver rejects
a frame it has seen (or an older one of the same session); ``sent_at`` must lie within
``replay_window_s`` of the receiver's clock, which bounds how long a session must be remembered;
``recipient`` names the intended receiver, so a frame captured on its way to one worker cannot be
replayed into another. Frames are decoded with caps on every size (msgpack ``max_*_len``) and
``strict_map_key``; nothing here can raise anything but :class:`FrameRejected`. ``verify_body`` rejects
exactly the frames ``verify`` does, for the same reasons, in the same order (see ``_verify_body``).

Trust boundary: a process that knows the secret is trusted (the secret is made at launch and handed to
actors through Ray). There is no torch.distributed store: each KV-transfer pair rendezvous over its
own handshake link, whose frames are signed with a key derived from the secret (transfer/rendezvous.py).
The gloo/NCCL connections cannot authenticate their peers (by design of those libraries); they bind the
node's own address, never every interface. What travels over them is checked instead: KV chunks carry a
MAC keyed from the secret (transfer.integrity `mac`, transfer/staging.py). Nothing is encrypted. Every
receiving ZMQ socket has ZMQ_MAXMSGSIZE set to its verifier's cap, so libzmq drops an oversized frame
unread.
This module imports nothing of the project.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgpack
import msgspec

MAGIC = b"PDC1"
MAC_BYTES = 16
SECRET_BYTES = 32
DEFAULT_MAX_FRAME_BYTES = 32 << 20  # a 128k-token prompt with its sampling params is ~1 MiB
DEFAULT_REPLAY_WINDOW_S = 60.0
MAX_SESSIONS = 4096  # sessions remembered per receiver (only signed frames create one)
MAX_MAP_ENTRIES = 4096  # entries of any one map in a frame (msgpack's max_map_len; a wire form's dict too)

# Reasons a frame is rejected; each is a label of pdserve_control_messages_rejected_total.
REASON_TOO_LARGE = "too_large"
REASON_BAD_MAC = "bad_mac"
REASON_MALFORMED = "malformed"
REASON_REPLAYED = "replayed"
REASON_STALE = "stale"
REASON_MISADDRESSED = "misaddressed"
REASON_UNKNOWN_TAG = "unknown_tag"
REASON_BAD_FIELD = "bad_field"


_ENCODER = msgspec.msgpack.Encoder()
_MAP_HEADS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])  # the first byte of a msgpack map
T = TypeVar("T")


def new_secret() -> bytes:
    """A fresh per-cluster secret (made once at launch)."""
    return secrets.token_bytes(SECRET_BYTES)


class FrameRejected(Exception):
    """A frame that failed a check; ``reason`` is one of the REASON_* labels."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _mac(secret: bytes, envelope: bytes) -> bytes:
    return hashlib.blake2b(envelope, key=secret, digest_size=MAC_BYTES).digest()


class FrameSigner:
    """Signs the frames one sending socket emits (one session, one counter). Thread-safe."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError(f"the cluster secret must be >= 16 bytes, got {len(secret)}")
        self._secret = secret
        self.session = secrets.randbits(63)
        self._counter = itertools.count(1)
        self._lock = threading.Lock()

    def sign(self, recipient: str, tag: str, body: Mapping[str, Any] | msgspec.Struct) -> bytes:
        """One frame of ``body`` (a map of builtins, or a Struct: encoded as the map of its fields)."""
        with self._lock:
            counter = next(self._counter)
        if not isinstance(body, (dict, msgspec.Struct)):
            body = dict(body)
        envelope = _ENCODER.encode((self.session, counter, time.time(), recipient, tag, body))
        return MAGIC + _mac(self._secret, envelope) + envelope


class FrameVerifier:
    """Checks the frames one receiving socket gets: size, MAC, shape, recipient, freshness, replay.

    ``verify`` returns (tag, body) or raises FrameRejected; ``rejected`` counts rejections by reason.
    Used from one thread (the socket's reader); ``rejected_snapshot`` may be read from any thread.
    """

    def __init__(
        self,
        secret: bytes,
        recipient: str,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        replay_window_s: float = DEFAULT_REPLAY_WINDOW_S,
    ) -> None:
        self._secret = secret
        self.recipient = recipient
        self.max_frame_bytes = max_frame_bytes
        self.replay_window_s = replay_window_s
        self._sessions: OrderedDict[int, tuple[int, float]] = OrderedDict()  # session -> (counter, seen)
        self.rejected: Counter[str] = Counter()
        self._lock = threading.Lock()

    def verify(self, frame: bytes) -> tuple[str, dict[str, Any]]:
        try:
            return self._verify(frame)
        except FrameRejected as e:
            with self._lock:
                self.rejected[e.reason] += 1
            raise

    def reject(self, reason: str) -> None:
        """Count a frame whose body the caller rejected after ``verify`` (unknown tag, bad field)."""
        with self._lock:
            self.rejected[reason] += 1

    def rejected_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.rejected)

    def verify_body(self, frame: bytes, decode: Callable[[str, memoryview], T]) -> T:
        """What ``decode`` makes of a verified frame's tag and body (its msgpack bytes); ``decode`` raises
        FrameRejected (unknown tag, bad field) for a body it refuses. Rejections are counted by reason,
        exactly as ``verify`` and a decoder of its unpacked body would count them."""
        try:
            return self._verify_body(frame, decode)
        except FrameRejected as e:
            with self._lock:
                self.rejected[e.reason] += 1
            raise

    def _verify(self, frame: bytes) -> tuple[str, dict[str, Any]]:
        envelope = self._authenticate(frame)
        session, counter, sent_at, recipient, tag, body = _unpack_envelope(envelope, self.max_frame_bytes)
        self._check_fresh(session, counter, sent_at, recipient)
        self._remember(session, counter)
        return tag, body

    def _verify_body(self, frame: bytes, decode: Callable[[str, memoryview], T]) -> T:
        envelope = self._authenticate(frame)
        session, counter, sent_at, recipient, tag, body_at = _unpack_head(envelope, self.max_frame_bytes)
        try:
            self._check_fresh(session, counter, sent_at, recipient)
            message = decode(tag, memoryview(envelope)[body_at:])
            if len(envelope) > self.max_frame_bytes // 2:
                # NOTE: only a frame this large can hold a list past _unpack_envelope's max_array_len
                _unpack_envelope(envelope, self.max_frame_bytes)
        except FrameRejected as e:
            # NOTE: ``verify`` unpacks the whole envelope (every map's keys str, no ext, every size capped)
            # before it checks anything else: a frame that unpack refuses is malformed, whatever else is
            # wrong with it. A typed body's decoder refuses every such body too (for a reason of its
            # own), so the unpack has the last word on a refused frame; only a refused one is unpacked.
            _unpack_envelope(envelope, self.max_frame_bytes)
            if e.reason in (REASON_UNKNOWN_TAG, REASON_BAD_FIELD):
                self._remember(session, counter)  # NOTE: its body was refused after the replay check
            raise
        self._remember(session, counter)
        return message

    def _authenticate(self, frame: bytes) -> bytes:
        """The envelope of a frame of the right size, shape and MAC."""
        if len(frame) > self.max_frame_bytes:
            raise FrameRejected(REASON_TOO_LARGE, f"{len(frame)} B > max_frame_bytes {self.max_frame_bytes}")
        head = len(MAGIC) + MAC_BYTES
        if len(frame) <= head or not frame.startswith(MAGIC):
            raise FrameRejected(REASON_MALFORMED, "not a pdserve control frame")
        envelope = frame[head:]
        if not hmac.compare_digest(frame[len(MAGIC) : head], _mac(self._secret, envelope)):
            raise FrameRejected(REASON_BAD_MAC, "wrong key or altered frame")
        return envelope

    def _check_fresh(self, session: int, counter: int, sent_at: float, recipient: str) -> None:
        """Recipient, freshness and replay (nothing remembered: ``_remember`` does that)."""
        if recipient != self.recipient:
            raise FrameRejected(REASON_MISADDRESSED, f"frame for {recipient!r} reached {self.recipient!r}")
        now = time.time()
        if abs(now - sent_at) > self.replay_window_s:
            raise FrameRejected(
                REASON_STALE, f"sent {now - sent_at:.1f} s ago (window {self.replay_window_s} s)"
            )
        last = self._sessions.get(session)
        if last is not None and counter <= last[0]:
            raise FrameRejected(REASON_REPLAYED, f"session {session:x} counter {counter} <= {last[0]}")

    def _remember(self, session: int, counter: int) -> None:
        """A frame of ``session`` numbered ``counter`` was taken: older ones of it are replays."""
        now = time.monotonic()
        self._sessions[session] = (counter, now)
        self._sessions.move_to_end(session)
        # NOTE: a session silent for longer than the window can only send stale frames, so forgetting
        # it cannot admit a replay; the size bound only guards memory.
        while self._sessions:
            oldest, (_, seen) = next(iter(self._sessions.items()))
            if now - seen <= 2 * self.replay_window_s and len(self._sessions) <= MAX_SESSIONS:
                break
            del self._sessions[oldest]


def _unpack_head(envelope: bytes, max_bytes: int) -> tuple[int, int, float, str, str, int]:
    """The envelope's first five items, checked as ``_unpack_envelope`` checks them, and where its body
    starts: a map, left unread (a typed decoder reads it, and nothing else walks it)."""
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=True,
        max_buffer_size=len(envelope),
        max_str_len=max_bytes,
        max_bin_len=max_bytes,
        max_array_len=max_bytes // 2,
        max_map_len=MAX_MAP_ENTRIES,
        max_ext_len=0,
    )
    unpacker.feed(envelope)
    try:
        if unpacker.read_array_header() != 6:
            raise FrameRejected(REASON_MALFORMED, "envelope is not a 6-item array")
        unpack = unpacker.unpack
        session, counter, sent_at, recipient, tag = unpack(), unpack(), unpack(), unpack(), unpack()
    except (ValueError, msgpack.UnpackException) as e:  # OutOfData, ExtraData, FormatError, StackError, ...
        raise FrameRejected(REASON_MALFORMED, f"envelope is not valid msgpack: {type(e).__name__}") from None
    body_at = unpacker.tell()
    if not (
        type(session) is int
        and type(counter) is int
        and type(sent_at) is float
        and isinstance(recipient, str)
        and isinstance(tag, str)
        and body_at < len(envelope)
        and envelope[body_at] in _MAP_HEADS
    ):
        raise FrameRejected(REASON_MALFORMED, "envelope fields have the wrong types")
    return session, counter, sent_at, recipient, tag, body_at


def _unpack_envelope(envelope: bytes, max_bytes: int) -> tuple[int, int, float, str, str, dict[str, Any]]:
    try:
        obj = msgpack.unpackb(
            envelope,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=max_bytes // 2,
            max_map_len=MAX_MAP_ENTRIES,
            max_ext_len=0,
        )
    except (ValueError, msgpack.UnpackException) as e:  # ExtraData, FormatError, StackError, ...
        raise FrameRejected(REASON_MALFORMED, f"envelope is not valid msgpack: {type(e).__name__}") from None
    if not (isinstance(obj, list) and len(obj) == 6):
        raise FrameRejected(REASON_MALFORMED, "envelope is not a 6-item array")
    session, counter, sent_at, recipient, tag, body = obj
    if not (
        type(session) is int
        and type(counter) is int
        and type(sent_at) is float
        and isinstance(recipient, str)
        and isinstance(tag, str)
        and isinstance(body, dict)
    ):
        raise FrameRejected(REASON_MALFORMED, "envelope fields have the wrong types")
    return session, counter, sent_at, recipient, tag, body

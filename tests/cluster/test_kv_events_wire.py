"""``KvEvents`` on the wire (cluster/wire.py): a batch split into frames under the cap, numbered without
a gap, and strict decoding: a tier other than 0 or 1, a hash of any other length than 16 bytes, a list
past the cap, a negative sequence number are each refused as a bad field, counted, never raised."""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.frames import MAGIC, FrameSigner, _mac
from cluster.protocol import KvEventBatch
from cluster.wire import (
    EVENTS,
    KV_HASH_BYTES,
    MAX_KV_EVENTS_PER_FRAME,
    OPS,
    ROUTER_ID,
    KvEvents,
    KvResync,
    WireDecoder,
    WireEncoder,
    kv_event_frames,
)

SECRET = b"s" * 32
GOOD = {"worker_id": "prefill-0", "incarnation": "ab12", "seq": 0, "stored": [[0, b"\x01" * 16]]}


def digest(i: int) -> bytes:
    return i.to_bytes(KV_HASH_BYTES, "big")


def decode(body: dict[str, Any]) -> tuple[KvEvents | None, dict[str, int]]:
    decoder = WireDecoder(SECRET, ROUTER_ID, EVENTS)
    message = decoder.decode(FrameSigner(SECRET).sign(ROUTER_ID, KvEvents.TAG, body))
    assert message is None or isinstance(message, KvEvents)
    return message, decoder.rejected()


def test_a_batch_is_split_into_numbered_frames_under_the_cap() -> None:
    cap = MAX_KV_EVENTS_PER_FRAME
    stored = [(i % 2, digest(i)) for i in range(cap + 10)]
    removed = [(0, digest(10**6 + i)) for i in range(cap)]
    frames = kv_event_frames("w", "inc", 7, KvEventBatch(stored, removed))
    shape = [(f.seq, len(f.stored), len(f.removed)) for f in frames]
    assert shape == [(7, cap, 0), (8, 10, cap - 10), (9, 0, 10)]
    assert [p for f in frames for p in f.stored] == stored
    assert [p for f in frames for p in f.removed] == removed
    assert {(f.worker_id, f.incarnation) for f in frames} == {("w", "inc")}
    assert kv_event_frames("w", "inc", 3, KvEventBatch()) == []


def test_a_snapshot_marks_its_first_frame_only_and_an_empty_one_is_a_frame() -> None:
    cap = MAX_KV_EVENTS_PER_FRAME
    stored = [(i % 2, digest(i)) for i in range(cap + 1)]
    frames = kv_event_frames("w", "inc", 4, KvEventBatch(stored), reset=True)
    assert [(f.seq, len(f.stored), f.reset) for f in frames] == [(4, cap, True), (5, 1, False)]
    assert kv_event_frames("w", "inc", 2, KvEventBatch(), reset=True) == [KvEvents("w", "inc", 2, reset=True)]
    decoder = WireDecoder(SECRET, ROUTER_ID, EVENTS)
    for frame in frames:
        assert decoder.decode(WireEncoder(SECRET).encode(ROUTER_ID, frame)) == frame


def test_the_resync_op_roundtrips_and_takes_no_field() -> None:
    decoder = WireDecoder(SECRET, "prefill-0", OPS)
    assert decoder.decode(WireEncoder(SECRET).encode("prefill-0", KvResync())) == KvResync()
    bad = FrameSigner(SECRET).sign("prefill-0", KvResync.TAG, {"snapshot": True})
    assert decoder.decode(bad) is None and decoder.rejected() == {"bad_field": 1}


def test_every_frame_of_a_split_batch_roundtrips() -> None:
    batch = KvEventBatch([(1, digest(i)) for i in range(MAX_KV_EVENTS_PER_FRAME + 1)], [(0, digest(1))])
    decoder = WireDecoder(SECRET, ROUTER_ID, EVENTS)
    for frame in kv_event_frames("w", "inc", 0, batch):
        assert decoder.decode(WireEncoder(SECRET).encode(ROUTER_ID, frame)) == frame
    assert decoder.rejected() == {}


def test_the_good_body_is_taken() -> None:
    message, rejected = decode(GOOD)
    assert message == KvEvents("prefill-0", "ab12", 0, [(0, b"\x01" * 16)], [])
    assert rejected == {}


BAD = [
    {**GOOD, "stored": [[2, b"\x01" * 16]]},  # no tier 2
    {**GOOD, "stored": [[-1, b"\x01" * 16]]},
    {**GOOD, "stored": [[True, b"\x01" * 16]]},  # a bool is not a tier
    {**GOOD, "removed": [[0, b"\x01" * 15]]},  # a hash is 16 bytes
    {**GOOD, "removed": [[0, b"\x01" * 17]]},
    {**GOOD, "removed": [[0, "x" * 16]]},  # bytes, not text
    {**GOOD, "stored": [[0, b"\x01" * 16, 0]]},  # a pair
    {**GOOD, "stored": [[0, b"\x01" * 16]] * (MAX_KV_EVENTS_PER_FRAME + 1)},
    {**GOOD, "seq": -1},
    {**GOOD, "seq": 1.0},
    {k: v for k, v in GOOD.items() if k != "seq"},
    {**GOOD, "extra": 1},
]


def test_each_bad_field_is_refused_and_counted() -> None:
    for body in BAD:
        assert decode(body) == (None, {"bad_field": 1}), body


_PAIRS = st.lists(
    st.tuples(st.integers(-3, 4), st.binary(min_size=14, max_size=18)) | st.just((0, b"\x00" * 16)),
    max_size=8,
)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(_PAIRS, _PAIRS, st.integers(-2, 2**64 - 1))
def test_a_random_body_is_taken_only_when_every_pair_is_sound(
    stored: list[tuple[int, bytes]], removed: list[tuple[int, bytes]], seq: int
) -> None:
    body = {"worker_id": "w", "incarnation": "i", "seq": seq, "stored": stored, "removed": removed}
    sound = seq >= 0 and all(0 <= t <= 1 and len(h) == KV_HASH_BYTES for t, h in stored + removed)
    message, rejected = decode(body)
    if sound:
        assert rejected == {} and message == KvEvents("w", "i", seq, stored, removed)
    else:
        assert (message, rejected) == (None, {"bad_field": 1})


_COUNTER = itertools.count(1)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.binary(max_size=200))
def test_random_body_bytes_under_a_valid_head_never_raise(body: bytes) -> None:
    head = (9, next(_COUNTER), time.time(), ROUTER_ID, KvEvents.TAG)
    envelope = b"\x96" + b"".join(msgpack.packb(x) for x in head) + body
    decoder = WireDecoder(SECRET, ROUTER_ID, EVENTS)
    message = decoder.decode(MAGIC + _mac(SECRET, envelope) + envelope)
    assert message is None or isinstance(message, KvEvents)
    assert sum(decoder.rejected().values()) == (message is None)

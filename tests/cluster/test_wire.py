"""The control-plane codec and frame authentication: every message round-trips exactly, and every kind of
bad frame is rejected with its reason, counted, and never raises."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.frames import (
    MAGIC,
    FrameRejected,
    FrameSigner,
    FrameVerifier,
    _mac,
    new_secret,
)
from cluster.protocol import (
    EngineStats,
    ErrorCode,
    FinishReason,
    RequestTimings,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
    TransferStats,
    WorkerStats,
)
from cluster.wire import (
    EVENTS,
    OPS,
    ROUTER_ID,
    Abort,
    DecodeHandoff,
    Deltas,
    ExtendLease,
    FetchPrefix,
    Generate,
    Heartbeat,
    KeepAlive,
    KvEvents,
    KvResync,
    OfferPrefix,
    PeerDead,
    Prefilled,
    PrefixFetched,
    PrefixOffered,
    PrepareDecode,
    RequestFailed,
    RouterLease,
    Transferred,
    WireDecoder,
    WireEncoder,
    WorkerFailed,
    WorkerGone,
    WorkerInfo,
)

SECRET = b"k" * 32
PARAMS = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=11, stop=["\n\n"], logprobs=2)
DELTA = TokenDelta(
    "r1",
    [5, 6],
    "hi",
    logprobs=[TokenLogprobs(5, -0.5, [5, 9], [-0.5, -1.25])],
    finish_reason=FinishReason.LENGTH,
    num_cached_tokens=4,
    timings=RequestTimings(queue_s=0.25),
    scheduled_time=123.5,
)
STATS = WorkerStats(
    "decode-0",
    "decode",
    healthy=True,
    num_waiting_for_kv=2,
    engine=EngineStats(num_steps=9, num_free_blocks=3, num_total_blocks=8, forward_time_s=0.125),
    transfer=TransferStats(num_ok=1, bytes_total=4096, seconds_total=0.5),
    rejected_frames={"bad_mac": 2},
)
INFO = WorkerInfo(
    "decode-0", "decode", "ab12", "tcp://127.0.0.1:5000", "127.0.0.1", 16, 64, 1024, 512, "/m", "cpu", 7, [0]
)
ALL_OPS = [
    Generate("r1", [1, 2, 3], PARAMS, 1e9, hold=True),
    Generate("r1~1", [1, 2, 3], PARAMS, 1e9, output_token_ids=[9, 8], owner="0a1b2c3d4e5f6a7b"),
    DecodeHandoff("r1", [1, 2, 3], 4, PARAMS, b"\x81\xa1a\x01", 1e9, owner="0a1b2c3d4e5f6a7b"),
    PrepareDecode("r1~2", [1, 2, 3], PARAMS, 1e9, "prefill-0", "ab12", "tcp://127.0.0.1:5001"),
    Abort("r1"),
    PeerDead("prefill-0", "3f2a9c0d1b7e4a55"),
    PeerDead("prefill-0"),
    ExtendLease("r1"),
    RouterLease("0a1b2c3d4e5f6a7b", 1, 10.0),
    OfferPrefix("pull-1", [1, 2, 3, 4], 1e9),
    FetchPrefix("pull-1", [1, 2, 3, 4], b"\x81\xa1a\x01", 1e9),
    KvResync(),
]
ALL_EVENTS = [
    Heartbeat(INFO, STATS),
    KeepAlive("decode-0", "r1"),
    Deltas("decode-0", [DELTA, TokenDelta("r2", [7], finish_reason=FinishReason.LENGTH)]),
    Prefilled("prefill-0", DELTA, b"handoff"),
    Transferred("decode-0", "r1", 0.5, 1024, recomputed=None),
    RequestFailed("decode-0", "r1", ErrorCode.KV_TRANSFER_FAILED, "boom"),
    WorkerFailed("decode-0", "step thread died"),
    WorkerGone("decode-0", 4242, "RayActorError: The actor died unexpectedly"),
    KvEvents("decode-0", "ab12", 3, [(0, b"\x01" * 16), (1, b"\x02" * 16)], [(0, b"\x03" * 16)]),
    KvEvents("decode-0", "ab12", 4, [(1, b"\x04" * 16)], reset=True),
    PrefixOffered("decode-0", "pull-1", 3, b"handoff"),
    PrefixFetched("prefill-0", "pull-1", 0, error="blocks short"),
]


def roundtrip(message: Any, accept: tuple[type, ...], recipient: str = "w") -> Any:
    frame = WireEncoder(SECRET).encode(recipient, message)
    return WireDecoder(SECRET, recipient, accept).decode(frame)


@pytest.mark.parametrize("message", ALL_OPS, ids=lambda m: type(m).__name__)
def test_every_op_roundtrips_exactly(message: Any) -> None:
    assert roundtrip(message, OPS) == message


@pytest.mark.parametrize("message", ALL_EVENTS, ids=lambda m: type(m).__name__)
def test_every_event_roundtrips_exactly(message: Any) -> None:
    assert roundtrip(message, EVENTS, ROUTER_ID) == message


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in ALL_OPS} == set(OPS)
    assert {type(m) for m in ALL_EVENTS} == set(EVENTS)


def signed(tag: str, body: dict[str, Any], recipient: str = "w", secret: bytes = SECRET) -> bytes:
    return FrameSigner(secret).sign(recipient, tag, body)


def body_of(message: Any) -> dict[str, Any]:
    frame = WireEncoder(SECRET).encode("w", message)
    return dict(msgpack.unpackb(frame[len(MAGIC) + 16 :], raw=False)[5])


def rejected(frames: list[bytes], accept: tuple[type, ...] = OPS) -> dict[str, int]:
    decoder = WireDecoder(SECRET, "w", accept)
    assert [decoder.decode(f) for f in frames] == [None] * len(frames)
    return decoder.rejected()


def test_the_four_byte_frame_that_killed_a_worker_is_rejected() -> None:
    # 0x81 0x91 0x01 0x02: a map whose key is a list (killed the inbound thread before v2)
    assert rejected([bytes.fromhex("81910102")]) == {"malformed": 1}


def test_each_bad_field_is_rejected_with_its_reason() -> None:
    good = body_of(ALL_OPS[0])
    cases = [
        {**good, "request_id": 5},  # wrong type
        {**good, "prompt_token_ids": [1, True]},  # bool is not an int
        {**good, "prompt_token_ids": [1, 2.0]},
        {**good, "deadline": float("nan")},  # non-finite float
        {**good, "deadline": float("inf")},
        {k: v for k, v in good.items() if k != "params"},  # missing field
        {**good, "surprise": 1},  # unknown field
        {**good, "params": {**good["params"], "top_k": "3"}},  # nested wrong type
        {**good, "params": {**good["params"], "nope": 1}},  # nested unknown field
        {**good, "params": [1, 2]},  # nested wrong shape
    ]
    assert rejected([signed("generate", c) for c in cases]) == {"bad_field": len(cases)}
    enum_case = {**body_of(ALL_EVENTS[5]), "code": "not_a_code"}
    assert rejected([signed("request_failed", enum_case)], EVENTS) == {"bad_field": 1}


def test_unknown_tags_and_events_sent_to_a_worker_are_rejected() -> None:
    frames = [signed("launch_missiles", {}), signed(Deltas.TAG, body_of(ALL_EVENTS[2]))]
    assert rejected(frames) == {"unknown_tag": 2}


def test_wrong_key_altered_frame_and_garbage_are_rejected_before_decoding() -> None:
    good = signed("abort", {"request_id": "r"})
    altered = good[:-1] + bytes([good[-1] ^ 1])
    frames = [
        signed("abort", {"request_id": "r"}, secret=new_secret()),  # wrong key
        altered,
        b"",
        b"PDC1",
        b"\x00" * 64,
        MAGIC + b"\x00" * 16 + b"\x81\x91\x01\x02",
    ]
    assert rejected(frames) == {"bad_mac": 3, "malformed": 3}


def test_replayed_misaddressed_stale_and_oversized_frames_are_rejected() -> None:
    signer = FrameSigner(SECRET)
    first = signer.sign("w", "abort", {"request_id": "a"})
    second = signer.sign("w", "abort", {"request_id": "b"})
    decoder = WireDecoder(SECRET, "w", OPS)
    assert decoder.decode(first) == Abort("a")
    assert decoder.decode(second) == Abort("b")
    assert decoder.decode(first) is None  # replay of an older frame of the session
    assert decoder.decode(second) is None  # replay of the latest frame
    assert decoder.decode(signer.sign("other-worker", "abort", {"request_id": "c"})) is None
    envelope = msgpack.packb([7, 1, time.time() - 3600, "w", "abort", {"request_id": "d"}])
    assert decoder.decode(MAGIC + _mac(SECRET, envelope) + envelope) is None
    small = WireDecoder(SECRET, "w", OPS, max_frame_bytes=256)
    assert small.decode(signer.sign("w", "generate", {"pad": "x" * 300})) is None
    assert decoder.rejected() == {"replayed": 2, "misaddressed": 1, "stale": 1}
    assert small.rejected() == {"too_large": 1}


def test_a_new_session_of_the_same_sender_is_accepted() -> None:
    decoder = WireDecoder(SECRET, "w", OPS)
    # NOTE: a restarted worker signs with a fresh session whose counter starts at 1 again
    for _ in range(3):
        assert decoder.decode(FrameSigner(SECRET).sign("w", "abort", {"request_id": "r"})) == Abort("r")
    assert decoder.rejected() == {}


def test_verifier_raises_only_frame_rejected() -> None:
    verifier = FrameVerifier(SECRET, "w")
    with pytest.raises(FrameRejected) as e:
        verifier.verify(b"\xff" * 10)
    assert e.value.reason == "malformed"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_raise(data: bytes) -> None:
    decoder = WireDecoder(SECRET, "w", OPS)
    assert decoder.decode(data) is None
    assert decoder.decode(MAGIC + data) is None
    assert sum(decoder.rejected().values()) == 2


_json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([cls.TAG for cls in OPS]), st.dictionaries(st.text(max_size=20), _json_like, max_size=8)
)
def test_signed_frames_of_random_shape_never_raise(tag: str, body: dict[str, Any]) -> None:
    decoder = WireDecoder(SECRET, "w", OPS)
    message = decoder.decode(signed(tag, body))
    if message is None:
        assert sum(decoder.rejected().values()) == 1
    else:  # NOTE: a random body that happens to be valid must decode to its own fields
        assert {f.name for f in msgspec.structs.fields(message)} >= body.keys()


def _first_delta_on_the_wire(frame: bytes) -> object:
    """What a Deltas frame carries for its first delta (the envelope unpacked, not checked)."""
    return msgpack.unpackb(frame[len(MAGIC) + 16 :], raw=False)[5]["deltas"][0]


def test_a_delta_travels_as_its_fields_off_their_defaults_and_decodes_to_the_same_delta() -> None:
    encoder, decoder = WireEncoder(SECRET), WireDecoder(SECRET, ROUTER_ID, EVENTS)
    plain = TokenDelta("a", [5], " hi")
    assert _first_delta_on_the_wire(encoder.encode(ROUTER_ID, Deltas("w", [plain]))) == {
        "request_id": "a",
        "token_ids": [5],
        "text": " hi",
    }
    first = TokenDelta("d", [3], "", scheduled_time=0.0, num_cached_tokens=16)  # 0.0 is not None: sent
    assert _first_delta_on_the_wire(encoder.encode(ROUTER_ID, Deltas("w", [first]))) == {
        "request_id": "d",
        "token_ids": [3],
        "num_cached_tokens": 16,
        "scheduled_time": 0.0,
    }
    deltas = [
        plain,
        TokenDelta("b", [], ""),
        TokenDelta("c", [1, 2], "x", num_cached_tokens=16),
        first,
        TokenDelta(
            "e", [4], "y", [TokenLogprobs(4, -0.5, [4], [-0.5])], FinishReason.STOP, 3, None, None, 1.5
        ),
        TokenDelta("f", [], "", error="boom", finish_reason=FinishReason.ERROR),
        DELTA,
    ]
    event = decoder.decode(encoder.encode(ROUTER_ID, Deltas("w", deltas)))
    assert isinstance(event, Deltas) and event.deltas == deltas
    assert all(type(d) is TokenDelta for d in event.deltas)


@pytest.mark.parametrize(
    "bad",
    [
        {"request_id": "a", "token_ids": [True]},
        {"request_id": "a", "token_ids": ["5"]},
        {"request_id": 1, "token_ids": [5]},
        {"token_ids": [5]},
        {"request_id": "a", "token_ids": [5], "text": b"x"},
        {"request_id": "a", "token_ids": [5], "num_cached_tokens": 1.0},
        {"request_id": "a", "token_ids": [5], "surprise": 1},
        {"request_id": "a", "token_ids": [5], "logprobs": [{"token_id": 5, "logprob": -0.5, "nope": 1}]},
        {"request_id": "a", "token_ids": [5], "scheduled_time": float("nan")},
        {"request_id": "a", "token_ids": [5], "finish_reason": "done"},
    ],
)
def test_a_bad_delta_is_rejected(bad: dict[str, object]) -> None:
    decoder = WireDecoder(SECRET, ROUTER_ID, EVENTS)
    frame = FrameSigner(SECRET).sign(ROUTER_ID, Deltas.TAG, {"worker_id": "w", "deltas": [bad]})
    assert decoder.decode(frame) is None
    assert decoder.rejected() == {"bad_field": 1}


def test_int_keyed_maps_travel_as_pairs_and_an_empty_one_as_either() -> None:
    op = Generate("r", [1], SamplingParams(logit_bias={7: -1.5, 3: 100.0}), 1e9)
    body = body_of(op)
    assert body["params"]["logit_bias"] == [[7, -1.5], [3, 100.0]]
    assert roundtrip(op, OPS) == op
    params = body["params"]
    for logit_bias in ({}, []):
        assert rejected_or_decoded({**body, "params": {**params, "logit_bias": logit_bias}}) == Generate(
            "r", [1], SamplingParams(), 1e9
        )
    for logit_bias in ({"7": 1.0}, [[7]], [[True, 1.0]], [[7, "1"]], [[7, 1.0, 2]], [7, 1.0]):
        assert rejected_or_decoded({**body, "params": {**params, "logit_bias": logit_bias}}) == "bad_field"


def rejected_or_decoded(body: dict[str, Any], tag: str = "generate") -> Any:
    """The op a signed frame of ``body`` decodes to, or the reason it was rejected."""
    decoder = WireDecoder(SECRET, "w", OPS)
    message = decoder.decode(signed(tag, body))
    if message is None:
        (reason,) = decoder.rejected()
        return reason
    return message


def test_a_map_past_the_cap_is_malformed_as_before_at_any_depth() -> None:
    good = body_of(ALL_EVENTS[0])
    stats = good["stats"]
    big = {f"r{i}": i for i in range(4097)}
    frames = [
        signed("heartbeat", {**good, "stats": {**stats, "rejected_frames": big}}, recipient=ROUTER_ID),
        signed("heartbeat", {**good, **big}, recipient=ROUTER_ID),
    ]
    decoder = WireDecoder(SECRET, ROUTER_ID, EVENTS)
    assert [decoder.decode(f) for f in frames] == [None, None]
    assert decoder.rejected() == {"malformed": 2}
    at_cap = {f"r{i}": i for i in range(4096)}
    message = decoder.decode(
        signed("heartbeat", {**good, "stats": {**stats, "rejected_frames": at_cap}}, recipient=ROUTER_ID)
    )
    assert isinstance(message, Heartbeat) and message.stats.rejected_frames == at_cap

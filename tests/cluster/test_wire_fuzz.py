"""issue 41: the wire's msgspec decoder refuses exactly what the reflective decoder it replaced refused.

The oracle is that decoder itself (tests/support/legacy_wire.py, cluster/wire.py as it was). Every frame
here goes to both: each must take it or refuse it alike, a refusal counted once under the same reason,
a taking giving the same message, field by field (types of the leaves included). Frames: random bytes;
random bytes behind a valid MAC; a valid head with a random body; and valid messages (both encoders')
with one thing wrong: a field's value of another type, an extra field, a missing field, a non-finite
float, a bool where an int belongs, an int where a float belongs (taken), an unknown tag, at any depth.

Known differences, both in maps whose keys repeat (no encoder here writes one; only a sender holding the
secret and writing msgpack by hand could): the new decoder reads every copy of a repeated field, so it
refuses one whose earlier copy has the wrong type (the old one kept the last copy only), and it takes a
map whose copies put it past 4096 entries (the old unpack called it malformed).

Messages newer than the oracle (``KvEvents``, ``KvResync``, the prefix pulls') have no twin there: both decoders
here leave them out, and their own strict decoding is checked in tests/cluster/test_kv_events_wire.py.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import itertools
import time
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import tests.support.legacy_wire as legacy
from cluster import wire
from cluster.frames import MAC_BYTES, MAGIC, FrameSigner, _mac
from cluster.protocol import (
    FinishReason,
    RequestTimings,
    RouteInfo,
    SamplingParams,
    StructuredOutput,
    TokenDelta,
    TokenLogprobs,
)
from cluster.wire import (
    ROUTER_ID,
    Deltas,
    FetchPrefix,
    Generate,
    KvEvents,
    KvResync,
    OfferPrefix,
    Prefilled,
    PrefixFetched,
    PrefixOffered,
    WireDecoder,
    WireEncoder,
)
from tests.cluster.test_wire import ALL_EVENTS, ALL_OPS, SECRET

NEWER_THAN_THE_ORACLE: tuple[type, ...] = (
    KvEvents,
    KvResync,
    OfferPrefix,
    FetchPrefix,
    PrefixOffered,
    PrefixFetched,
)
OPS = tuple(cls for cls in wire.OPS if cls not in NEWER_THAN_THE_ORACLE)
EVENTS = tuple(cls for cls in wire.EVENTS if cls not in NEWER_THAN_THE_ORACLE)

# NOTE: CI has 2 cores and a budget: a few hundred examples a test, the same ones every run
FUZZ = settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
RECIPIENT = "w"
MORE_MESSAGES = [
    Generate(
        "r2",
        [1],
        SamplingParams(
            logit_bias={5: -2.5, 9: 1.0},
            structured=StructuredOutput("choice", choices=["a", "b"]),
            allowed_token_ids=[1, 2],
            bad_words_token_ids=[[3, 4]],
            seed=None,
            prompt_logprobs=2,
        ),
        2e9,
        hold=True,
    ),
    Prefilled(
        "prefill-0",
        TokenDelta(
            "r3",
            [8],
            "z",
            [TokenLogprobs(8, -0.25)],
            prompt_logprobs=[None, TokenLogprobs(2, -1.0, [2, 3], [-1.0, -2.0])],
            timings=RequestTimings(
                ttft_s=0.5, route=RouteInfo("disaggregated", "short", "p", "d", 4, 0, 0.1)
            ),
        ),
        b"",
    ),
    Deltas("w", [TokenDelta("a", [1], "x"), TokenDelta("b", [2, 3], "", finish_reason=FinishReason.STOP)]),
]
MESSAGES = (
    [m for m in ALL_OPS if type(m) in OPS] + [m for m in ALL_EVENTS if type(m) in EVENTS] + MORE_MESSAGES
)


def plain(value: Any) -> Any:
    """A decoded value as builtins, whichever decoder made it (a Struct and a dataclass alike)."""
    if isinstance(value, msgspec.Struct):
        return {name: plain(getattr(value, name)) for name in value.__struct_fields__}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


class Both:
    """The new decoder and the oracle, for ops or for events, fed the same frames."""

    def __init__(self, events: bool) -> None:
        recipient = ROUTER_ID if events else RECIPIENT
        self.recipient = recipient
        self.new = WireDecoder(SECRET, recipient, EVENTS if events else OPS)
        self.old = legacy.WireDecoder(SECRET, recipient, legacy.EVENTS if events else legacy.OPS)

    def verdicts(self, frame: bytes) -> tuple[Any, Any]:
        return _verdict(self.new, frame), _verdict(self.old, frame)

    def agree(self, frame: bytes) -> Any:
        """Both decoders' verdict on ``frame``, which must be the same; returns it."""
        new, old = self.verdicts(frame)
        assert new == old
        return new


def _verdict(decoder: Any, frame: bytes) -> tuple[str, Any]:
    before = decoder.rejected()
    message = decoder.decode(frame)
    after = decoder.rejected()
    counted = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    if message is None:
        assert sum(counted.values()) == 1, counted
        (reason,) = counted
        return "refused", reason
    assert counted == {}
    return type(message).__name__, repr(plain(message))


OPS_BOTH, EVENTS_BOTH = Both(events=False), Both(events=True)
SIGNER = FrameSigner(SECRET)  # NOTE: one session, its counter always growing: no frame here is a replay


def both_for(message: Any) -> Both:
    return EVENTS_BOTH if type(message) in EVENTS else OPS_BOTH


def sign(both: Both, tag: str, body: Any) -> bytes:
    return SIGNER.sign(both.recipient, tag, body)


def envelope_of(frame: bytes) -> list[Any]:
    return list(msgpack.unpackb(frame[len(MAGIC) + MAC_BYTES :], raw=False))


def bodies(message: Any) -> list[dict[str, Any]]:
    """``message``'s body as the new encoder writes it (defaults left out) and as the old one did."""
    new = envelope_of(WireEncoder(SECRET).encode(RECIPIENT, message))[5]
    twin = getattr(legacy, type(message).__name__)(
        **{name: _legacy_value(getattr(message, name)) for name in message.__struct_fields__}
    )
    old = envelope_of(legacy.WireEncoder(SECRET).encode(RECIPIENT, twin))[5]
    return [new, old]


def _legacy_value(value: Any) -> Any:
    if isinstance(value, msgspec.Struct):  # WorkerInfo, inside a Heartbeat
        return getattr(legacy, type(value).__name__)(
            **{n: getattr(value, n) for n in value.__struct_fields__}
        )
    return value


def test_both_take_every_valid_message_alike_from_either_encoder() -> None:
    for message in MESSAGES:
        both = both_for(message)
        for body in bodies(message):
            verdict = both.agree(sign(both, message.TAG, body))
            assert verdict[0] == type(message).__name__


# ---- random bytes --------------------------------------------------------------------------------------
@FUZZ
@given(st.binary(max_size=512), st.booleans())
@example(bytes.fromhex("81910102"), False)
@example(b"", True)
def test_random_bytes_are_refused_alike(data: bytes, events: bool) -> None:
    both = EVENTS_BOTH if events else OPS_BOTH
    for frame in (data, MAGIC + data, MAGIC + data[:MAC_BYTES] + data):
        verdict = both.agree(frame)
        assert verdict[0] == "refused"


@FUZZ
@given(st.binary(min_size=1, max_size=512), st.booleans())
@example(b"\x80", False)
@example(bytes.fromhex("81910102"), False)
def test_random_bytes_behind_a_valid_mac_are_refused_alike(envelope: bytes, events: bool) -> None:
    both = EVENTS_BOTH if events else OPS_BOTH
    assert both.agree(MAGIC + _mac(SECRET, envelope) + envelope)[0] == "refused"


_TAGS = st.sampled_from([cls.TAG for cls in OPS + EVENTS] + ["", "launch_missiles"])


_HEAD_SESSION, _head_counter = 7, itertools.count(1)


def _head(both: Both, tag: str) -> bytes:
    """A valid envelope's first bytes: the 6-item array's head and its first five items (fresh)."""
    items = (_HEAD_SESSION, next(_head_counter), time.time(), both.recipient, tag)
    return b"\x96" + b"".join(msgpack.packb(x) for x in items)


_NESTED = b"\x81\xa1a" + b"\x91" * 1010 + b"\x00"  # NOTE: where msgspec's and msgpack's stacks end apart


@FUZZ
@given(st.binary(max_size=256), _TAGS, st.booleans())
@example(b"\x81\x01\x02", "abort", False)  # an int key
@example(b"\x81\xaarequest_id\xd4\x01\x01", "abort", False)  # an ext value
@example(b"\x81\xaarequest_id\xa1r\x00", "abort", False)  # trailing bytes
@example(b"\x81\xaarequest_id\xa1\xff", "abort", False)  # not UTF-8
@example(b"\x91\xa1r", "abort", False)  # not a map
@example(b"\x80", "abort", False)  # a field missing
@example(b"\x81\xaarequest_id\xa1r", "abort", False)  # valid
@example(_NESTED, "abort", False)
@example(b"\x81\xa1a" + b"\x91" * 1100 + b"\x00", "abort", False)
def test_a_valid_head_with_a_random_body_is_taken_or_refused_alike(
    body: bytes, tag: str, events: bool
) -> None:
    both = EVENTS_BOTH if events else OPS_BOTH
    envelope = _head(both, tag) + body
    both.agree(MAGIC + _mac(SECRET, envelope) + envelope)


# ---- well-typed but wrong --------------------------------------------------------------------------------
_INTS = st.integers(-(2**63), 2**64 - 1)
_LEAVES = (
    st.none()
    | st.booleans()
    | _INTS
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=6)
    | st.sampled_from(["stop", "length", "internal_error", "json"])
)
_VALUES = st.recursive(
    _LEAVES,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(max_size=6), children, max_size=3)
        | st.dictionaries(st.integers(0, 9), children, min_size=1, max_size=2)  # NOTE: int keys: malformed
    ),
    max_leaves=8,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a body: each map entry and each list item, at any depth."""
    out: list[tuple[Any, ...]] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        out.append((*prefix, key))
        out += _paths(value, (*prefix, key))
    return out


def _at(body: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        body = body[key]
    return body


def _mutate(data: st.DataObject, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``body`` with one thing wrong, and whether it is still right for sure (an int where a float
    belongs, or nothing of the kind drawn to change)."""
    body = copy.deepcopy(body)
    paths = _paths(body)
    kind = data.draw(
        st.sampled_from(["replace", "extra", "missing", "non_finite", "bool_for_int", "int_for_float"])
    )
    if kind == "extra":
        maps = [()] + [p for p in paths if isinstance(_at(body, p), dict)]
        where = _at(body, data.draw(st.sampled_from(maps)))
        where[data.draw(st.text(max_size=12))] = data.draw(_VALUES)
        return body, False
    wanted = {
        "replace": lambda v: True,
        "missing": lambda v: True,
        "non_finite": lambda v: type(v) is float,
        "bool_for_int": lambda v: type(v) is int,
        "int_for_float": lambda v: type(v) is float and v == int(v),
    }[kind]
    candidates = [p for p in paths if wanted(_at(body, p))]
    if not candidates:
        return body, True
    path = data.draw(st.sampled_from(candidates))
    parent, key = _at(body, path[:-1]), path[-1]
    if kind == "missing":
        del parent[key]
    elif kind == "replace":
        parent[key] = data.draw(_VALUES)
    elif kind == "non_finite":
        parent[key] = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    elif kind == "bool_for_int":
        parent[key] = data.draw(st.booleans())
    else:
        parent[key] = int(parent[key])
    return body, kind == "int_for_float"


@FUZZ
@given(st.data())
def test_a_valid_message_with_one_thing_wrong_is_refused_alike(data: st.DataObject) -> None:
    message = data.draw(st.sampled_from(MESSAGES))
    body = data.draw(st.sampled_from(bodies(message)))
    both = both_for(message)
    mutated, is_valid = _mutate(data, body)
    verdict = both.agree(sign(both, message.TAG, mutated))
    if is_valid:
        assert verdict[0] == type(message).__name__


@FUZZ
@given(st.data())
def test_a_body_under_another_or_an_unknown_tag_is_refused_alike(data: st.DataObject) -> None:
    message = data.draw(st.sampled_from(MESSAGES))
    both = data.draw(st.sampled_from([OPS_BOTH, EVENTS_BOTH]))
    tag = data.draw(_TAGS | st.text(max_size=20))
    both.agree(sign(both, tag, data.draw(st.sampled_from(bodies(message)))))


@FUZZ
@given(st.data())
def test_a_body_of_random_shape_is_taken_or_refused_alike(data: st.DataObject) -> None:
    message = data.draw(st.sampled_from(MESSAGES))
    names = list(bodies(message)[1])  # NOTE: the old encoder wrote every field
    keys = st.sampled_from(names) | st.text(max_size=8)
    body = data.draw(st.dictionaries(keys, _VALUES, max_size=len(names) + 1))
    both = both_for(message)
    both.agree(sign(both, message.TAG, body))


@pytest.mark.parametrize("events", [False, True])
def test_the_oracle_sees_what_the_new_decoder_counts(events: bool) -> None:
    """The agreement above is not two decoders refusing everything: each reason comes up."""
    both = EVENTS_BOTH if events else OPS_BOTH
    message = ALL_EVENTS[1] if events else ALL_OPS[4]
    body = bodies(message)[0]
    frames = {
        "bad_mac": MAGIC + b"\x00" * MAC_BYTES + b"\x90",
        "malformed": b"junk",
        "unknown_tag": sign(both, "nope", body),
        "bad_field": sign(both, message.TAG, {**body, "extra": 1}),
        "misaddressed": SIGNER.sign("someone-else", message.TAG, body),
    }
    for reason, frame in frames.items():
        assert both.verdicts(frame) == (("refused", reason), ("refused", reason))
    replayed = sign(both, message.TAG, body)
    assert both.agree(replayed)[0] == type(message).__name__
    assert both.agree(replayed) == ("refused", "replayed")
    # NOTE: a frame whose body is refused was remembered (its body is read after the replay check);
    # one that is malformed was not (nothing after the unpack is checked)
    bad_field, malformed = (
        sign(both, message.TAG, {**body, "extra": 1}),
        sign(both, message.TAG, {**body, 1: 2}),
    )
    assert [both.agree(bad_field), both.agree(bad_field)] == [
        ("refused", "bad_field"),
        ("refused", "replayed"),
    ]
    assert [both.agree(malformed), both.agree(malformed)] == [("refused", "malformed")] * 2


def test_the_known_difference_a_repeated_field_with_a_wrong_copy() -> None:
    both = OPS_BOTH
    body = b"\x82\xaarequest_id\x01\xaarequest_id\xa1r"  # {"request_id": 1, "request_id": "r"}
    envelope = _head(both, "abort") + body
    new, old = both.verdicts(MAGIC + _mac(SECRET, envelope) + envelope)
    assert (new, old) == (("refused", "bad_field"), ("Abort", repr({"request_id": "r"})))

"""The control plane's codec as it was before its messages became msgspec Structs (cluster/wire.py at
f1cc927): frozen dataclasses, decoded by a reflective walk of their type hints. Kept, unchanged but for
``to_dict`` (then in cluster/protocol.py) moved in here, as the oracle tests/cluster/test_wire_fuzz.py
holds the new decoder to: both must take and refuse the same frames, for the same reasons.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar, Union

from cluster.frames import REASON_BAD_FIELD, REASON_UNKNOWN_TAG, FrameRejected, FrameSigner, FrameVerifier
from cluster.protocol import ErrorCode, SamplingParams, TokenDelta, WorkerStats

logger = logging.getLogger(__name__)


_PLAIN_TYPES = frozenset({str, int, float, bool, bytes, type(None)})
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}  # a dataclass's field names, gathered once per class


def to_dict(obj: Any) -> Any:
    """Turn a protocol dataclass (nested) into msgpack-able builtins."""
    cls = type(obj)
    if cls in _PLAIN_TYPES:
        return obj
    names = _FIELD_NAMES.get(cls)
    if names is None and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(obj))
    if names is not None:
        return {name: to_dict(getattr(obj, name)) for name in names}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        if obj and all(type(k) is int for k in obj):
            return [[k, to_dict(v)] for k, v in obj.items()]
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


ROUTER_ID = "router"  # the recipient name of frames addressed to the router (front-end replica 0)


def router_recipient(replica: int) -> str:
    """The recipient name of frames addressed to front-end replica ``replica``'s router: a frame caught
    on its way to one replica cannot be replayed into another."""
    return ROUTER_ID if replica == 0 else f"{ROUTER_ID}-{replica}"


@dataclass(frozen=True)
class WorkerControl:
    """How a worker reaches the control plane (constructor argument of every worker actor).

    router_endpoints: the event sockets of the routers (one per front-end replica, by replica index).
    bind: "loopback" binds 127.0.0.1; "node" binds (and advertises) the node's own address, for clusters
    that span hosts. store: where the launcher hosts the torch.distributed store for KV-transfer pairs.
    """

    router_endpoints: tuple[str, ...]
    heartbeat_interval_s: float
    bind: str = "loopback"
    store: tuple[str, int] | None = None


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's static facts, sent with every heartbeat (so the first one registers it)."""

    worker_id: str
    pool: str
    incarnation: str  # random per process: a restarted worker has a new one
    request_endpoint: str
    node_ip: str
    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    model_dir: str
    device: str
    pid: int
    cpu_cores: list[int] = dataclasses.field(default_factory=list)  # the process's CPU affinity
    kv_endpoint: str = ""  # a prefill worker's KV-sender handshake socket (ZMQ ROUTER); "" elsewhere
    pull_endpoint: str = ""  # the KV sender that serves prefix pulls (newer than the oracle; a plain field)
    model_fingerprint: str = ""  # cluster.hub.model_fingerprint: the checkpoint, whatever its path here
    kv_events: bool = False  # it publishes KvEvents (newer than the oracle; a plain field)
    gc_frozen_objects: int = 0  # objects the start-up moved out of the collector's scans (gc.freeze)


# ---- ops: router -> worker ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Generate:
    """Run a request on this worker. hold: stop after the first token and keep the KV for a handoff.
    output_token_ids: tokens already generated elsewhere (a migrated request): computed, not re-sampled."""

    TAG: ClassVar[str] = "generate"
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float  # time.time() seconds
    hold: bool = False
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    owner: str = ""  # the router that owns the request (its incarnation); "" the first router, unleased


@dataclass(frozen=True)
class PrepareDecode:
    """Early decode admission: the request is being prefilled on the worker whose KV sender listens on
    ``src_endpoint``; reserve blocks for its prompt and post the KV fetch now. Its DecodeHandoff (the
    first token) follows once the prefill is done; an Abort may come instead."""

    TAG: ClassVar[str] = "prepare_decode"
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float  # time.time() seconds
    src_worker_id: str
    src_incarnation: str
    src_endpoint: str
    owner: str = ""  # as Generate.owner


@dataclass(frozen=True)
class DecodeHandoff:
    """Decode a request prefilled elsewhere: reserve blocks, fetch its KV (``handoff``: the prefill
    side's msgpack KVHandoff, opaque to the router), then decode from ``first_token_id``."""

    TAG: ClassVar[str] = "decode"
    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    params: SamplingParams
    handoff: bytes
    deadline: float
    owner: str = ""  # as Generate.owner


@dataclass(frozen=True)
class Abort:
    TAG: ClassVar[str] = "abort"
    request_id: str


@dataclass(frozen=True)
class PeerDead:
    """A KV-transfer peer died: stop waiting on it at once. ``incarnation``: which process of the worker
    ("" means every one the recipient has seen)."""

    TAG: ClassVar[str] = "peer_dead"
    worker_id: str
    incarnation: str = ""


@dataclass(frozen=True)
class ExtendLease:
    """Keep holding a prefilled request's KV: its decode worker is waiting for blocks, not gone."""

    TAG: ClassVar[str] = "extend_lease"
    request_id: str


@dataclass(frozen=True)
class RouterLease:
    """A router (front-end replica ``replica``, process ``incarnation``) is alive: keep its requests for
    ``lease_s`` more seconds. Sent when the router admits the worker, before any request, and then every
    health interval. A worker frees the requests of an owner whose lease runs out (the replica died or
    was cut off) and, at once, those of the incarnation a new one replaces in the same replica slot."""

    TAG: ClassVar[str] = "router_lease"
    incarnation: str
    replica: int
    lease_s: float


# ---- events: worker -> router ------------------------------------------------------------------------
@dataclass(frozen=True)
class Heartbeat:
    """The step thread's progress beat (also sent while idle): who it is, and its latest stats."""

    TAG: ClassVar[str] = "heartbeat"
    info: WorkerInfo
    stats: WorkerStats


@dataclass(frozen=True)
class Deltas:
    """The token deltas of one engine step, all of its requests in one frame rather than a frame each
    (``python -m bench.wire_deltas``: at 256 running, 0.7 ms of the worker's step thread per step
    instead of 3.6 ms, and 1.0 ms of the router's instead of 3.0)."""

    TAG: ClassVar[str] = "deltas"
    worker_id: str
    deltas: list[TokenDelta]


@dataclass(frozen=True)
class Prefilled:
    """The first token of a held request; its KV waits on this worker (``handoff``)."""

    TAG: ClassVar[str] = "prefilled"
    worker_id: str
    delta: TokenDelta
    handoff: bytes


@dataclass(frozen=True)
class Transferred:
    """The decode side has the request's KV (``recomputed``: why it was recomputed instead)."""

    TAG: ClassVar[str] = "transferred"
    worker_id: str
    request_id: str
    seconds: float
    nbytes: int
    recomputed: str | None = None


@dataclass(frozen=True)
class RequestFailed:
    TAG: ClassVar[str] = "request_failed"
    worker_id: str
    request_id: str
    code: ErrorCode
    message: str


@dataclass(frozen=True)
class WorkerFailed:
    """Sent once by a worker whose thread died, just before the process exits (Ray may restart it)."""

    TAG: ClassVar[str] = "worker_failed"
    worker_id: str
    reason: str


@dataclass(frozen=True)
class KeepAlive:
    """A decode worker still wants a handoff it is waiting to start (blocks or seats are short)."""

    TAG: ClassVar[str] = "keep_alive"
    worker_id: str
    request_id: str


@dataclass(frozen=True)
class WorkerGone:
    """The lifecycle plane's word on a worker (sent by the supervisor of front-end replicas, which runs
    Ray; a single router watches Ray itself): Ray cannot reach its actor any more, and ``pid`` is the
    process that answered Ray last (0: none ever did)."""

    TAG: ClassVar[str] = "worker_gone"
    worker_id: str
    pid: int
    why: str


# NOTE: every signature that carries a message names one of these unions (what a handler receives is a
# union it can match on exhaustively), never Any.
Op = Generate | PrepareDecode | DecodeHandoff | Abort | PeerDead | ExtendLease | RouterLease
Event = Heartbeat | Deltas | Prefilled | Transferred | RequestFailed | WorkerFailed | KeepAlive | WorkerGone
OPS: tuple[type[Op], ...] = (
    Generate,
    PrepareDecode,
    DecodeHandoff,
    Abort,
    PeerDead,
    ExtendLease,
    RouterLease,
)
EVENTS: tuple[type[Event], ...] = (
    Heartbeat,
    Deltas,
    Prefilled,
    Transferred,
    RequestFailed,
    WorkerFailed,
    KeepAlive,
    WorkerGone,
)


# ---- strict decoding from type hints -----------------------------------------------------------------
Decoder = Callable[[Any, str], Any]


def _bad(path: str, what: str) -> FrameRejected:
    return FrameRejected(REASON_BAD_FIELD, f"{path}: {what}")


def _decode_int(v: Any, path: str) -> int:
    if type(v) is not int:
        raise _bad(path, f"expected an int, got {type(v).__name__}")
    return v


def _decode_float(v: Any, path: str) -> float:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise _bad(path, f"expected a finite number, got {v!r}"[:200])
    return float(v)


def _simple(expected: type) -> Decoder:
    def decode(v: Any, path: str) -> Any:
        if type(v) is not expected:
            raise _bad(path, f"expected {expected.__name__}, got {type(v).__name__}")
        return v

    return decode


_decoders: dict[Any, Decoder] = {
    int: _decode_int,
    float: _decode_float,
    str: _simple(str),
    bool: _simple(bool),
    bytes: _simple(bytes),
}


def _decoder_for(tp: Any) -> Decoder:
    cached = _decoders.get(tp)
    if cached is not None:
        return cached
    decoder = _build_decoder(tp)
    _decoders[tp] = decoder
    return decoder


def _build_decoder(tp: Any) -> Decoder:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"unsupported union {tp!r}")
        item = _decoder_for(inner[0])
        return lambda v, path: None if v is None else item(v, path)
    if origin is list:
        (arg,) = typing.get_args(tp)
        if arg is int:  # NOTE: the hot case (token ids): one pass, no per-item call
            return _decode_int_list
        item = _decoder_for(arg)

        def decode_list(v: Any, path: str) -> list[Any]:
            if type(v) is not list:
                raise _bad(path, f"expected a list, got {type(v).__name__}")
            return [item(x, path) for x in v]

        return decode_list
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        key, value = _decoder_for(key_tp), _decoder_for(value_tp)
        if key_tp is int:
            return _int_keyed(value)

        def decode_dict(v: Any, path: str) -> dict[Any, Any]:
            if type(v) is not dict:
                raise _bad(path, f"expected a map, got {type(v).__name__}")
            return {key(k, path): value(x, path) for k, x in v.items()}

        return decode_dict
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        members = {m.value: m for m in tp}

        def decode_enum(v: Any, path: str) -> Any:
            if not isinstance(v, (str, int)) or v not in members:
                raise _bad(path, f"not a {tp.__name__}: {v!r}"[:200])
            return members[v]

        return decode_enum
    if tp is TokenDelta:
        return _token_delta_decoder(_dataclass_decoder(tp))
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_decoder(tp)
    raise TypeError(f"no wire decoder for {tp!r}")


# NOTE: on the wire a TokenDelta leaves out its fields at their defaults (``_delta_body``): a decode
# step's delta is then {request_id, token_ids, text}, a third of the bytes to pack, sign and unpack
_DELTA_DEFAULTS = tuple(
    (f.name, f.default) for f in dataclasses.fields(TokenDelta) if f.default is not dataclasses.MISSING
)
_PLAIN_DELTA_KEYS = frozenset({"request_id", "token_ids", "text", "num_cached_tokens"})


def _delta_body(delta: TokenDelta) -> dict[str, Any]:
    body: dict[str, Any] = {"request_id": delta.request_id, "token_ids": delta.token_ids}
    for name, default in _DELTA_DEFAULTS:
        value = getattr(delta, name)
        if value != default or type(value) is not type(default):
            body[name] = to_dict(value)
    return body


def _token_delta_decoder(generic: Decoder) -> Decoder:
    """TokenDelta's decoder. NOTE: the router decodes one per token per stream: a decode step's plain
    delta (no field beyond request id, token ids, text and cached count) is checked and built here
    directly; any other goes through ``generic``, with the same checks and the same result."""

    def decode(v: Any, path: str) -> Any:
        if type(v) is dict and v.keys() <= _PLAIN_DELTA_KEYS:
            request_id, token_ids = v.get("request_id"), v.get("token_ids")
            text, num_cached = v.get("text", ""), v.get("num_cached_tokens", 0)
            if (
                type(request_id) is str
                and type(token_ids) is list
                and type(text) is str
                and type(num_cached) is int
                and (
                    (len(token_ids) == 1 and type(token_ids[0]) is int)  # NOTE: a decode step's; no generator
                    or all(type(x) is int for x in token_ids)
                )
            ):
                return TokenDelta(request_id, token_ids, text, num_cached_tokens=num_cached)
        return generic(v, path)

    return decode


def _int_keyed(value: Decoder) -> Decoder:
    """dict[int, V] arrives as [key, value] pairs (``protocol.to_dict``; msgpack maps here take str keys
    only); an empty one may also arrive as an empty map."""

    def decode(v: Any, path: str) -> dict[int, Any]:
        if type(v) is dict and not v:
            return {}
        if type(v) is not list or not all(type(p) is list and len(p) == 2 and type(p[0]) is int for p in v):
            raise _bad(path, "expected a list of [int, value] pairs")
        return {k: value(x, path) for k, x in v}

    return decode


def _decode_int_list(v: Any, path: str) -> list[int]:
    if type(v) is not list or not all(type(x) is int for x in v):
        raise _bad(path, "expected a list of ints")
    return v


def _dataclass_decoder(cls: type) -> Decoder:
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls)]
    required = {
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    # NOTE: built lazily so self-referencing or forward types resolve once every class exists.
    field_decoders: dict[str, Decoder] = {}
    # NOTE: each field's error path, made once per parent path: a list's items share their list's path,
    # so a frame of 256 deltas builds 9 paths, not 9 per delta (the paths come from the type's shape
    # and the field names, a finite set).
    field_paths: dict[str, dict[str, str]] = {}

    def decode(v: Any, path: str) -> Any:
        if type(v) is not dict:
            raise _bad(path, f"expected a {cls.__name__} map, got {type(v).__name__}")
        if not field_decoders:
            field_decoders.update({f.name: _decoder_for(hints[f.name]) for f in fields})
        keys = v.keys()
        if not keys <= field_decoders.keys():
            unknown = [k for k in v if k not in field_decoders]
            raise _bad(path, f"unknown {cls.__name__} field(s) {sorted(map(str, unknown))[:5]}")
        if not required <= keys:
            raise _bad(path, f"missing {cls.__name__} field(s) {sorted(required - keys)}")
        paths = field_paths.get(path)
        if paths is None:
            paths = field_paths[path] = {name: f"{path}.{name}" for name in field_decoders}
        kwargs = {k: field_decoders[k](x, paths[k]) for k, x in v.items()}
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise _bad(path, f"{cls.__name__}: {e}") from None

    return decode


# ---- endpoints ---------------------------------------------------------------------------------------
class WireEncoder:
    """Signs typed messages for one sending socket."""

    def __init__(self, secret: bytes) -> None:
        self._signer = FrameSigner(secret)

    def encode(self, recipient: str, message: Op | Event) -> bytes:
        if isinstance(message, Deltas):
            body: dict[str, Any] = {
                "worker_id": message.worker_id,
                "deltas": [_delta_body(d) for d in message.deltas],
            }
        else:
            body = {
                name: value if is_int_list else to_dict(value)
                for name, is_int_list in _body_fields(type(message))
                for value in (getattr(message, name),)
            }
        return self._signer.sign(recipient, message.TAG, body)


_BODY_FIELDS: dict[type, tuple[tuple[str, bool], ...]] = {}


def _body_fields(cls: type) -> tuple[tuple[str, bool], ...]:
    """A message class's fields, each with whether its type is ``list[int]``: such a value (a prompt's
    token ids) goes on the wire as it is, since ``to_dict`` would copy it item by item to the same list."""
    fields = _BODY_FIELDS.get(cls)
    if fields is None:
        hints = typing.get_type_hints(cls)
        fields = _BODY_FIELDS[cls] = tuple(
            (f.name, hints[f.name] == list[int]) for f in dataclasses.fields(cls)
        )
    return fields


# NOTE: a decoder takes ops (a worker's, ``WireDecoder[Op]``) or events (the router's, ``WireDecoder[Event]``)
M = TypeVar("M", Op, Event)


class WireDecoder(Generic[M]):
    """Verifies and decodes frames arriving on one receiving socket into the accepted message types.

    ``decode`` returns the message, or None for a rejected frame (counted by reason in
    ``verifier.rejected``, logged at a bounded rate). It never raises.
    """

    def __init__(
        self, secret: bytes, recipient: str, accept: tuple[type[M], ...], **verifier_options: Any
    ) -> None:
        self.verifier = FrameVerifier(secret, recipient, **verifier_options)
        self._decoders: dict[str, Callable[[Any, str], M]] = {
            cls.TAG: _dataclass_decoder(cls) for cls in accept
        }
        self._num_logged = 0

    def decode(self, frame: bytes) -> M | None:
        try:
            tag, body = self.verifier.verify(frame)
            decoder = self._decoders.get(tag)
            if decoder is None:
                raise FrameRejected(REASON_UNKNOWN_TAG, f"{tag!r}"[:100])
            return decoder(body, tag)
        except FrameRejected as e:
            if e.reason in (REASON_UNKNOWN_TAG, REASON_BAD_FIELD):
                self.verifier.reject(e.reason)
            self._log(e)
            return None

    def _log(self, e: FrameRejected) -> None:
        self._num_logged += 1
        # NOTE: a flood of bad frames must not become a flood of log lines: the first 10, then 1 in 1000.
        if self._num_logged <= 10 or self._num_logged % 1000 == 0:
            logger.warning("%s: dropped control frame #%d (%s)", self.verifier.recipient, self._num_logged, e)

    def rejected(self) -> dict[str, int]:
        return self.verifier.rejected_snapshot()

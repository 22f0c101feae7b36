"""The control-plane protocol between the router and the workers: every message a frozen msgspec Struct,
one tagged codec, strict decoding.

Ops (``Op``, router -> worker): Generate, PrepareDecode, DecodeHandoff, Abort, PeerDead, ExtendLease,
RouterLease, OfferPrefix, FetchPrefix.
Events (``Event``, worker -> router): Heartbeat, Deltas, Prefilled, Transferred, RequestFailed,
WorkerFailed, KeepAlive, KvEvents, PrefixOffered, PrefixFetched; and WorkerGone (the lifecycle plane's word on a worker, from the supervisor of
front-end replicas).

Membership is by heartbeat: a worker's first Heartbeat (it carries the worker's static ``WorkerInfo``)
registers it with the router, and one from a new ``incarnation`` (a process Ray restarted) re-admits it.
Request ids on the wire are the router's per-attempt ids (a migrated request gets a new one).

Front-end replicas (``server.replicas``): a worker sends its events to every router endpoint it was
given, each request's to the router that owns it (the ``owner`` of the op that brought the request, a
router process's incarnation). A router renews a lease on each worker (``RouterLease``); a worker frees
every request of an owner whose lease ran out, or whose replica slot a new incarnation took.

On the wire a message is ``(TAG, {field: value})`` inside an authenticated frame (cluster/frames.py): the
tag in the signed envelope, the body a msgpack map of the message's fields, those at their defaults left
out. Every message is a frozen msgspec Struct that forbids unknown fields; a decoder takes the tags it
accepts and decodes each body with a strict msgspec decoder of that message's wire form
(cluster/wire_forms.py: the boundary dataclasses it carries as strict Structs). Unknown tags and unknown,
missing or mistyped fields (bool is not an int; an int is taken as a float; floats must be finite) are
rejected with a reason, counted, never a KeyError or TypeError deep in a handler. Senders and receivers
dispatch on the message's type (``match`` on the ``Op`` / ``Event`` union).

NOTE: the tag travels in the envelope, not in the body (msgspec's ``tag=``): the envelope is shared with
the KV-transfer handshake (transfer/handshake.py), which has tags of its own, and a tag in the body too
would be sent twice; a dict from tag to decoder is what a tagged union's decoder would do.
This module imports only leaves of the control plane (cluster/protocol.py, cluster/frames.py,
cluster/wire_forms.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Generic, TypeVar

import msgspec

from cluster.frames import REASON_BAD_FIELD, REASON_UNKNOWN_TAG, FrameRejected, FrameSigner, FrameVerifier
from cluster.protocol import ErrorCode, KvEventBatch, SamplingParams, TokenDelta, WorkerStats
from cluster.wire_forms import FiniteFloat, form_of

logger = logging.getLogger(__name__)

# NOTE: a KvEvents frame's (tier, block hash) pairs, stored and removed together: ~20 bytes each on the
# wire, so a full frame is ~80 KiB, far below the frame cap; a larger batch goes out in several frames
MAX_KV_EVENTS_PER_FRAME = 4096
KV_HASH_BYTES = 16  # cluster/block_hash.py's digest size
KV_TIERS = 2  # tier 0: device, 1: host (workers/kv_events.py)

ROUTER_ID = "router"  # the recipient name of frames addressed to the router (front-end replica 0)


def router_recipient(replica: int) -> str:
    """The recipient name of frames addressed to front-end replica ``replica``'s router: a frame caught
    on its way to one replica cannot be replayed into another."""
    return ROUTER_ID if replica == 0 else f"{ROUTER_ID}-{replica}"


class WireMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Every wire message (and ``WorkerInfo``): immutable, strict; fields at their defaults are left out
    of its frame."""


@dataclass(frozen=True)
class WorkerControl:
    """How a worker reaches the control plane (constructor argument of every worker actor).

    router_endpoints: the event sockets of the routers (one per front-end replica, by replica index).
    bind: "loopback" binds 127.0.0.1; "node" binds (and advertises) the node's own address, for clusters
    that span hosts. moves_kv: the worker's pool hands KV over (a prefill or decode worker of a
    disaggregated or conditional cluster): its role builds a channel for its KV-transfer pairs, each of
    which rendezvous over its own signed handshake link (transfer/rendezvous.py); False (colocated): none.
    """

    router_endpoints: tuple[str, ...]
    heartbeat_interval_s: float
    bind: str = "loopback"
    moves_kv: bool = False


class WorkerInfo(WireMessage, frozen=True):
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
    cpu_cores: list[int] = []  # the process's CPU affinity
    kv_endpoint: str = ""  # a prefill worker's KV-sender handshake socket (ZMQ ROUTER); "" elsewhere
    pull_endpoint: str = ""  # the handshake socket of the KV sender that serves prefix pulls; "" none
    model_fingerprint: str = ""  # cluster.hub.model_fingerprint: the checkpoint, whatever its path here
    kv_events: bool = False  # it publishes KvEvents (prefix caching on) and answers KvResync
    gc_frozen_objects: int = 0  # objects the start-up moved out of the collector's scans (gc.freeze)


# ---- ops: router -> worker ---------------------------------------------------------------------------
class Generate(WireMessage, frozen=True):
    """Run a request on this worker. hold: stop after the first token and keep the KV for a handoff.
    output_token_ids: tokens already generated elsewhere (a migrated request): computed, not re-sampled."""

    TAG: ClassVar[str] = "generate"
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: FiniteFloat  # time.time() seconds
    hold: bool = False
    output_token_ids: list[int] = []
    owner: str = ""  # the router that owns the request (its incarnation); "" the first router, unleased


class PrepareDecode(WireMessage, frozen=True):
    """Early decode admission: the request is being prefilled on the worker whose KV sender listens on
    ``src_endpoint``; reserve blocks for its prompt and post the KV fetch now. Its DecodeHandoff (the
    first token) follows once the prefill is done; an Abort may come instead."""

    TAG: ClassVar[str] = "prepare_decode"
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: FiniteFloat  # time.time() seconds
    src_worker_id: str
    src_incarnation: str
    src_endpoint: str
    owner: str = ""  # as Generate.owner


class DecodeHandoff(WireMessage, frozen=True):
    """Decode a request prefilled elsewhere: reserve blocks, fetch its KV (``handoff``: the prefill
    side's msgpack KVHandoff, opaque to the router), then decode from ``first_token_id``."""

    TAG: ClassVar[str] = "decode"
    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    params: SamplingParams
    handoff: bytes
    deadline: FiniteFloat
    owner: str = ""  # as Generate.owner


class Abort(WireMessage, frozen=True):
    TAG: ClassVar[str] = "abort"
    request_id: str


class PeerDead(WireMessage, frozen=True):
    """A KV-transfer peer died: stop waiting on it at once. ``incarnation``: which process of the worker
    ("" means every one the recipient has seen)."""

    TAG: ClassVar[str] = "peer_dead"
    worker_id: str
    incarnation: str = ""


class ExtendLease(WireMessage, frozen=True):
    """Keep holding a prefilled request's KV: its decode worker is waiting for blocks, not gone."""

    TAG: ClassVar[str] = "extend_lease"
    request_id: str


class RouterLease(WireMessage, frozen=True):
    """A router (front-end replica ``replica``, process ``incarnation``) is alive: keep its requests for
    ``lease_s`` more seconds. Sent when the router admits the worker, before any request, and then every
    health interval. A worker frees the requests of an owner whose lease runs out (the replica died or
    was cut off) and, at once, those of the incarnation a new one replaces in the same replica slot."""

    TAG: ClassVar[str] = "router_lease"
    incarnation: str
    replica: int
    lease_s: FiniteFloat


class KvResync(WireMessage, frozen=True):
    """This router lost track of what the worker's KV tiers hold (a KvEvents frame lost, frames left out
    while the worker was not healthy or not admitted yet): send a snapshot (``KvEvents.reset``). A worker
    sends at most one snapshot a ``workers.worker_vitals.KV_SNAPSHOT_INTERVAL_S``; requests in between
    are met by the next one."""

    TAG: ClassVar[str] = "kv_resync"


class OfferPrefix(WireMessage, frozen=True):
    """Prefix pull, holder side (workers/prefix_pulls.py): hold the device blocks of the longest cached
    full-block prefix of ``token_ids`` and offer them to the pull sender; answered by PrefixOffered. An
    Abort of ``pull_id`` lets go of an offer not fetched; the offer's lease (to ``deadline``) bounds it."""

    TAG: ClassVar[str] = "offer_prefix"
    pull_id: str
    token_ids: list[int]
    deadline: FiniteFloat  # time.time() seconds


class FetchPrefix(WireMessage, frozen=True):
    """Prefix pull, puller side: reserve blocks for the offered prefix blocks this worker lacks, fetch
    them (``handoff``: the holder's KVHandoff) and cache them; answered by PrefixFetched."""

    TAG: ClassVar[str] = "fetch_prefix"
    pull_id: str
    token_ids: list[int]
    handoff: bytes
    deadline: FiniteFloat


# ---- events: worker -> router ------------------------------------------------------------------------
class Heartbeat(WireMessage, frozen=True):
    """The step thread's progress beat (also sent while idle): who it is, and its latest stats."""

    TAG: ClassVar[str] = "heartbeat"
    info: WorkerInfo
    stats: WorkerStats


class Deltas(WireMessage, frozen=True):
    """The token deltas of one engine step, all of its requests in one frame rather than a frame each
    (``python -m bench.wire_deltas``, 2 cores: at 256 running, 0.16 ms of the worker's detokenizer
    thread and 0.23 ms of the router per step, against 1.7-3 ms and 2.5 ms with a frame per delta).

    NOTE: of the router's 0.23 ms, ~0.12 ms builds the 256 ``TokenDelta`` dataclasses from their wire
    forms (cluster/wire_forms.py); were TokenDelta a Struct, decoded as it is, the step would cost
    ~0.1 ms."""

    TAG: ClassVar[str] = "deltas"
    worker_id: str
    deltas: list[TokenDelta]


class Prefilled(WireMessage, frozen=True):
    """The first token of a held request; its KV waits on this worker (``handoff``)."""

    TAG: ClassVar[str] = "prefilled"
    worker_id: str
    delta: TokenDelta
    handoff: bytes


class Transferred(WireMessage, frozen=True):
    """The decode side has the request's KV (``recomputed``: why it was recomputed instead)."""

    TAG: ClassVar[str] = "transferred"
    worker_id: str
    request_id: str
    seconds: FiniteFloat
    nbytes: int
    recomputed: str | None = None


class RequestFailed(WireMessage, frozen=True):
    TAG: ClassVar[str] = "request_failed"
    worker_id: str
    request_id: str
    code: ErrorCode
    message: str


class WorkerFailed(WireMessage, frozen=True):
    """Sent once by a worker whose thread died, just before the process exits (Ray may restart it)."""

    TAG: ClassVar[str] = "worker_failed"
    worker_id: str
    reason: str


class KeepAlive(WireMessage, frozen=True):
    """A decode worker still wants a handoff it is waiting to start (blocks or seats are short)."""

    TAG: ClassVar[str] = "keep_alive"
    worker_id: str
    request_id: str


KvTier = Annotated[int, msgspec.Meta(ge=0, le=KV_TIERS - 1)]
KvHash = Annotated[bytes, msgspec.Meta(min_length=KV_HASH_BYTES, max_length=KV_HASH_BYTES)]
KvBlocks = Annotated[list[tuple[KvTier, KvHash]], msgspec.Meta(max_length=MAX_KV_EVENTS_PER_FRAME)]


class KvEvents(WireMessage, frozen=True):
    """What a worker's KV tiers stored and removed (``(tier, block hash)`` pairs, the net change since
    its previous frame: workers/kv_events.py), for the router's exact prefix index
    (cluster/router/kv_index.py). ``seq`` counts this incarnation's KvEvents frames from 0 with no gap, so
    a router sees a lost frame (and then drops what it holds of the worker: it can no longer trust it).
    ``reset``: the frame starts a snapshot of everything the tiers hold (the worker's answer to
    KvResync; its other frames follow with the next seqs): a router drops what it holds of the worker and
    takes the snapshot instead, whatever it had lost before. Sent to every router. Decoding refuses a tier other than 0 or 1, a hash of any length but 16 bytes,
    and more than ``MAX_KV_EVENTS_PER_FRAME`` pairs in either list (``kv_event_frames`` splits a batch)."""

    TAG: ClassVar[str] = "kv_events"
    worker_id: str
    incarnation: str
    seq: Annotated[int, msgspec.Meta(ge=0)]
    stored: KvBlocks = []
    removed: KvBlocks = []
    reset: bool = False


def kv_event_frames(
    worker_id: str, incarnation: str, first_seq: int, batch: KvEventBatch, reset: bool = False
) -> list[KvEvents]:
    """``batch`` as KvEvents frames of at most MAX_KV_EVENTS_PER_FRAME pairs (stored and removed
    together), numbered from ``first_seq``; none for an empty batch. A batch's pairs are distinct (a net
    change), so how they are split changes nothing a router ends up holding. ``reset``: ``batch`` is a
    snapshot (stored pairs only): its first frame says so, and an empty snapshot is one frame."""
    pairs = [(True, p) for p in batch.stored] + [(False, p) for p in batch.removed]
    frames: list[KvEvents] = []
    for start in range(0, max(len(pairs), int(reset)), MAX_KV_EVENTS_PER_FRAME):
        chunk = pairs[start : start + MAX_KV_EVENTS_PER_FRAME]
        stored = [p for is_stored, p in chunk if is_stored]
        removed = [p for is_stored, p in chunk if not is_stored]
        first = reset and not frames
        frames.append(KvEvents(worker_id, incarnation, first_seq + len(frames), stored, removed, first))
    return frames


class PrefixOffered(WireMessage, frozen=True):
    """The holder's answer to OfferPrefix: ``num_blocks`` held and offered (``handoff``), or ``error``."""

    TAG: ClassVar[str] = "prefix_offered"
    worker_id: str
    pull_id: str
    num_blocks: Annotated[int, msgspec.Meta(ge=0)]
    handoff: bytes = b""
    error: str = ""


class PrefixFetched(WireMessage, frozen=True):
    """The puller's answer to FetchPrefix: ``num_blocks`` pulled (``nbytes``) and cached, or ``error``."""

    TAG: ClassVar[str] = "prefix_fetched"
    worker_id: str
    pull_id: str
    num_blocks: Annotated[int, msgspec.Meta(ge=0)]
    nbytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    error: str = ""


class WorkerGone(WireMessage, frozen=True):
    """The lifecycle plane's word on a worker (sent by the supervisor of front-end replicas, which runs
    Ray; a single router watches Ray itself): Ray cannot reach its actor any more, and ``pid`` is the
    process that answered Ray last (0: none ever did)."""

    TAG: ClassVar[str] = "worker_gone"
    worker_id: str
    pid: int
    why: str


# NOTE: every signature that carries a message names one of these unions (what a handler receives is a
# union it can match on exhaustively), never Any.
Op = (
    Generate
    | PrepareDecode
    | DecodeHandoff
    | Abort
    | PeerDead
    | ExtendLease
    | RouterLease
    | OfferPrefix
    | FetchPrefix
    | KvResync
)
Event = (
    Heartbeat
    | Deltas
    | Prefilled
    | Transferred
    | RequestFailed
    | WorkerFailed
    | KeepAlive
    | KvEvents
    | WorkerGone
    | PrefixOffered
    | PrefixFetched
)
OPS: tuple[type[Op], ...] = (
    Generate,
    PrepareDecode,
    DecodeHandoff,
    Abort,
    PeerDead,
    ExtendLease,
    RouterLease,
    OfferPrefix,
    FetchPrefix,
    KvResync,
)
EVENTS: tuple[type[Event], ...] = (
    Heartbeat,
    Deltas,
    Prefilled,
    Transferred,
    RequestFailed,
    WorkerFailed,
    KeepAlive,
    KvEvents,
    WorkerGone,
    PrefixOffered,
    PrefixFetched,
)


for _cls in (*OPS, *EVENTS):
    form_of(_cls)  # NOTE: every message's form made at import, once, not by whichever thread sends first


# ---- endpoints ---------------------------------------------------------------------------------------
class WireEncoder:
    """Signs typed messages for one sending socket."""

    def __init__(self, secret: bytes) -> None:
        self._signer = FrameSigner(secret)

    def encode(self, recipient: str, message: Op | Event) -> bytes:
        to_wire = form_of(type(message)).to_wire
        return self._signer.sign(recipient, message.TAG, message if to_wire is None else to_wire(message))


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
        self._bodies: dict[str, tuple[msgspec.msgpack.Decoder[Any], Callable[[Any], Any] | None]] = {}
        for cls in accept:
            form = form_of(cls)
            self._bodies[cls.TAG] = (msgspec.msgpack.Decoder(form.wire_type), form.from_wire)
        self._num_logged = 0

    def decode(self, frame: bytes) -> M | None:
        try:
            message: M = self.verifier.verify_body(frame, self._decode_body)
            return message
        except FrameRejected as e:
            self._log(e)
            return None

    def _decode_body(self, tag: str, body: memoryview) -> Any:
        """The message of one verified frame (its tag and its body's msgpack bytes); raises FrameRejected."""
        codec = self._bodies.get(tag)
        if codec is None:
            raise FrameRejected(REASON_UNKNOWN_TAG, f"{tag!r}"[:100])
        decoder, from_wire = codec
        try:
            wire = decoder.decode(body)
            return wire if from_wire is None else from_wire(wire)
        except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as e:  # NOTE: ValidationError too
            raise FrameRejected(REASON_BAD_FIELD, f"{tag}: {e}"[:300]) from None

    def _log(self, e: FrameRejected) -> None:
        self._num_logged += 1
        # NOTE: a flood of bad frames must not become a flood of log lines: the first 10, then 1 in 1000.
        if self._num_logged <= 10 or self._num_logged % 1000 == 0:
            logger.warning("%s: dropped control frame #%d (%s)", self.verifier.recipient, self._num_logged, e)

    def rejected(self) -> dict[str, int]:
        return self.verifier.rejected_snapshot()

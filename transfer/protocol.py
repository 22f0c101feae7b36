"""KV-transfer boundary messages: msgpack-able dataclasses, the handshake messages and their checks.

This module imports nothing of the project and not torch, so the router can carry a `KVHandoff`.
A handshake message is a kind (the frame's tag) and a body ``{"nonce": int, ...}``, carried in a frame
signed with the cluster's secret (transfer/handshake.py, cluster/frames.py); never pickle. Bodies are
rebuilt strictly (`parse_body`): unknown or missing fields and wrong types are refused.

Peers are worker processes, named by worker id and incarnation; the bytes move over the pair's own
two-rank process group (transfer/pairs.py), rank 0 the prefill side, built on first use at the
pair's `generation` (a broken pair is rebuilt at the next one).

Handshake for one request (decode side D asks prefill side P; see transfer/connector.py):

    D -> P  request  {TransferRequest}       "send R into my blocks, skipping my first k" (D's id,
                                             incarnation, and the least pair generation D accepts)
    P -> D  header   {TransferHeader}        what P will send (layout, shape, bytes, chunking, checksum)
                                             and the pair generation both now use (P joins that pair)
    D -> P  ack      {num_slots}             header matches what D expects; D joined the pair; all D's
                                             chunk recvs are posted
    P => D  <num_chunks chunks over the channel, chunk i on tag chunk_tag(tag, i)>
    D -> P  credit   {chunk}                 chunks up to i verified and scattered: their slots may take
                                             chunks up to i + num_slots (P sends a chunk only once the
                                             chunk num_slots before it is credited; D credits every few)
    D -> P  done                             every chunk verified and scattered; P may free its blocks
    either  abort    {error_type, message}   the transfer failed on the sender of this frame
    either  rendezvous {prefill, decode, generation, key, value}
                                             while the pair at `generation` is built (after the header):
                                             a value its group set (transfer/rendezvous.py)

Early decode admission: D may send its request before P holds R (``offer_wait_until`` > 0, while R is
still being prefilled). P keeps such a request parked and answers ``ready`` the moment it offers R (D then
asks again, as above), or ``abort`` once ``offer_wait_until`` passes or R is withdrawn; D may abort it
meanwhile. NOTE: P never sends a header to a request that waited: D may have stopped in the meantime,
and P would sit out its transfer timeout waiting for the ack, with every other transfer queued behind.

Both sides stage through a small ring of chunk slots, so a transfer of any size needs a few chunks of
memory and the bytes stay in cache between the channel and the copies. D posts the recv of every chunk
into its slot before acking (chunk i into slot i % num_slots): posting a recv while the channel reads
another chunk of the pair would wait for that read (gloo locks the pair), so D never calls into the
channel mid-transfer; the credits keep P from overwriting a slot D still drains. Once D has acked, P posts
all `num_chunks` sends whatever happens (junk that fails the digest when it cannot send the real bytes),
so no recv D posted is left without its send; only a dropped (dead) peer is exempt.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import msgpack

DTYPE_ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}
MAX_TAG = (1 << 31) - 1
# NOTE: each chunk carries its own digest in an 8-byte trailer, computed while the previous chunk is on
# the wire (a whole-transfer digest in the header would have to be computed before any byte moves). The
# digest is XXH3-64 seeded with the transfer's nonce over (chunk index, payload); see transfer/staging.py.
# Chunks staged on a GPU use a digest computed there instead (transfer/digest.py); the header names which.
CHECKSUM_SCHEME = "xxh3_64-nonce-v2"
# NOTE: the keyed MACs (integrity `mac`): Poly1305 on host bytes with a one-time key per chunk derived
# from the cluster secret and the nonce (transfer/staging.py), and a polynomial Wegman-Carter MAC where
# GPU-staged bytes are (transfer/digest.py). A nonce seen on the wire does not let anyone forge them.
HOST_MAC_SCHEME = "poly1305-chunk-v1"
DEVICE_MAC_SCHEME = "poly31x4-mac-v1"
NO_CHECKSUM_SCHEME = "none"  # integrity `off`: chunks are not checked at all
DEVICE_CHECKSUM_SCHEME = "poly31x2-nonce-v1"
# transfer.integrity (cluster/config.py): off < digest < mac. A receiver refuses a weaker one than its own.
INTEGRITY_MODES = ("off", "digest", "mac")
SCHEME_INTEGRITY = {
    NO_CHECKSUM_SCHEME: "off",
    CHECKSUM_SCHEME: "digest",
    DEVICE_CHECKSUM_SCHEME: "digest",
    HOST_MAC_SCHEME: "mac",
    DEVICE_MAC_SCHEME: "mac",
}
MAX_CHUNK_BYTES = 1 << 30


def integrity_rank(mode: str) -> int:
    return INTEGRITY_MODES.index(mode)


class TransferError(RuntimeError):
    """A KV transfer failed; the caller picks the policy (fail the request or recompute)."""


class TransferMismatchError(TransferError, ValueError):
    """The two sides disagree on what is moved (layout, dtype, shape, bytes, nonce, block count)."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A bounded wait (handshake frame or channel op) ran past its timeout or the request deadline."""


class TransferChecksumError(TransferError):
    """A received chunk does not match the digest the sender sealed it with (corrupt, reordered, or a
    chunk of another transfer: the digest is keyed by the transfer's nonce)."""


class TransferRejectedError(TransferError):
    """The sender does not hold the request (unknown, aborted, lease expired) or refused it."""


class TransferPeerLostError(TransferError):
    """The peer was dropped (`drop_peer`: marked dead); nothing more is sent to or awaited from it."""


class TransferPairError(TransferError):
    """The pair's process group could not be built, or its connection broke (it is rebuilt, at the next
    generation, on the pair's next use)."""


_ERROR_TYPES: dict[str, type[TransferError]] = {
    cls.__name__: cls
    for cls in (
        TransferError,
        TransferMismatchError,
        TransferTimeoutError,
        TransferChecksumError,
        TransferRejectedError,
        TransferPeerLostError,
        TransferPairError,
    )
}


def error_from_remote(error_type: str, message: str) -> TransferError:
    """Rebuild the exception the peer reported in an `abort` frame (unknown names -> TransferError)."""
    return _ERROR_TYPES.get(error_type, TransferError)(f"peer: {message}")


@dataclass(frozen=True)
class KVLayout:
    """Shape of one worker's KV cache: ``[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]``."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVLayout.{name} must be an integer >= 1, got {value!r}")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPE_ITEMSIZE)}, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id across all layers (K and V)."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    def layer_shape(self, num_blocks: int) -> list[int]:
        """Per-layer shape of `num_blocks` gathered blocks."""
        return [num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim]

    def staging_shape(self, num_blocks: int) -> list[int]:
        return [self.num_layers, *self.layer_shape(num_blocks)]


@dataclass
class KVHandoff:
    """What a prefill worker returns after prefill: where and how to fetch request R's KV.

    The prefill side keeps R's blocks until the decode side's `done`, an abort, or `lease_expiry`
    (time.time() seconds), whichever comes first. `block_hashes` are the chained hashes of R's full
    blocks (may be empty); the decode side uses them to find its own prefix-cache hit. The prefill side
    is the process (`src_worker_id`, `src_incarnation`) whose handshake socket is `src_endpoint`.
    """

    request_id: str
    src_worker_id: str
    src_incarnation: str
    src_endpoint: str
    layout: KVLayout
    num_tokens: int
    num_blocks: int
    lease_expiry: float
    block_hashes: list[str | bytes] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        return _pack(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> KVHandoff:
        return handoff_from_dict(_unpack(data))


@dataclass
class TransferRequest:
    """The decode side's ask: send `request_id` minus the first `skip_first_n_blocks` blocks to the
    process (`dst_worker_id`, `dst_incarnation`), over the pair at `generation` or a later one.
    `offer_wait_until` > 0 (time.time() seconds): the request may come before the prefill side offers
    R (early decode admission); the prefill side keeps it until the offer, or refuses it at that time."""

    request_id: str
    nonce: int
    dst_worker_id: str
    dst_incarnation: str
    generation: int
    skip_first_n_blocks: int
    num_dst_blocks: int
    offer_wait_until: float = 0.0


@dataclass
class TransferHeader:
    """What the prefill side is about to send; checked by the decode side before any byte moves.

    `shape` is the per-layer shape of the gathered blocks. The bytes (layer-major ``[L, n, 2, bs, h, d]``)
    move in `num_chunks` chunks of `chunk_bytes` payload bytes (the last one shorter), a whole number of
    one-layer block rows each; chunk i goes on tag ``chunk_tag(tag, i)`` and ends with its checksum
    (`checksum` names the scheme; see transfer/staging.py). `tag` derives from the nonce. The bytes move
    over the pair of the two workers at `generation` (never below the request's), a `backend` group.
    `sample_bytes` > 0: a mock engine's paced handoff (transfer/paced_link.py): of each block's K and of
    its V in each layer only the first `sample_bytes` move, so a block row is `moved_row_bytes`.
    """

    request_id: str
    nonce: int
    src_worker_id: str
    dst_worker_id: str
    generation: int
    backend: str
    layout: KVLayout
    dtype: str
    shape: list[int]
    num_blocks: int
    nbytes: int
    num_chunks: int
    chunk_bytes: int
    checksum: str
    tag: int
    sample_bytes: int = 0

    def to_bytes(self) -> bytes:
        return _pack(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> TransferHeader:
        return header_from_dict(_unpack(data))


@dataclass
class TransferResult:
    """One transfer as either side saw it (ok or not), for callers and metrics."""

    request_id: str
    ok: bool
    num_blocks: int = 0
    nbytes: int = 0
    seconds: float = 0.0  # handshake start to final frame
    wire_seconds: float = 0.0  # first chunk posted (sender) / ack (receiver) to the last chunk through
    # NOTE: where the transfer thread spent `wire_seconds`: copying blocks into staging (sender), hashing
    # chunks (both), copying staging into blocks (receiver), and blocked on the channel (both).
    gather_seconds: float = 0.0
    hash_seconds: float = 0.0
    scatter_seconds: float = 0.0
    blocked_seconds: float = 0.0
    generation: int = -1  # of the pair that carried it (-1: no pair was agreed)
    # NOTE: a paced handoff (a mock engine's, transfer/paced_link.py; receiver only): `nbytes` is what
    # moved, `link_nbytes` the KV the modelled link carried, `link_seconds` the time it predicts for them
    # (from the header on), `paced_seconds` how long the receiver waited for it after the last chunk.
    link_nbytes: int = 0
    link_seconds: float = 0.0
    paced_seconds: float = 0.0
    is_between_nodes: bool = False
    error: str | None = None
    error_type: str | None = None

    @property
    def bytes_per_second(self) -> float:
        return self.nbytes / self.wire_seconds if self.wire_seconds > 0 else 0.0


def tag_for_nonce(nonce: int) -> int:
    # NOTE: a unique tag per transfer means a late send from an abandoned (timed-out) transfer can only
    # match that transfer's abandoned recv, never the next transfer's.
    return nonce % MAX_TAG


def chunk_tag(tag: int, chunk: int) -> int:
    return (tag + chunk) % MAX_TAG


def row_bytes_of(layout: KVLayout) -> int:
    """Bytes of one block in one layer (K and V): the unit chunks are cut in."""
    return layout.bytes_per_block // layout.num_layers


def half_row_bytes(layout: KVLayout) -> int:
    """Bytes of one block's K (or its V) in one layer: every slot's heads."""
    return layout.block_size * layout.num_kv_heads * layout.head_dim * layout.itemsize


def moved_row_bytes(layout: KVLayout, sample_bytes: int = 0) -> int:
    """Bytes of one block in one layer that a transfer moves: all of them (`sample_bytes` 0), or the first
    `sample_bytes` of its K and of its V (a paced handoff, transfer/paced_link.py)."""
    if sample_bytes == 0:
        return row_bytes_of(layout)
    return 2 * sample_bytes


def validate_header(
    header: TransferHeader,
    *,
    request_id: str,
    nonce: int,
    src_worker_id: str,
    dst_worker_id: str,
    min_generation: int,
    backend: str,
    layout: KVLayout,
    num_blocks: int,
    checksum: str = CHECKSUM_SCHEME,
    sample_bytes: int = 0,
) -> None:
    """Raise TransferMismatchError naming the first field that differs from what the receiver expects
    (`checksum`: the digest scheme it verifies with; `sample_bytes`: the part of each block's K and V it
    takes, 0 for all of it)."""
    if header.generation < min_generation:
        raise TransferMismatchError(
            f"transfer header mismatch for request {header.request_id!r}: generation is "
            f"{header.generation}, expected >= {min_generation}"
        )
    expected: dict[str, Any] = {
        "request_id": request_id,
        "nonce": nonce,
        "src_worker_id": src_worker_id,
        "dst_worker_id": dst_worker_id,
        "backend": backend,
        "layout": layout,
        "dtype": layout.dtype,
        "num_blocks": num_blocks,
        "shape": layout.layer_shape(num_blocks),
        "sample_bytes": sample_bytes,
        "nbytes": layout.num_layers * moved_row_bytes(layout, sample_bytes) * num_blocks,
        "checksum": checksum,
        "tag": tag_for_nonce(nonce),
    }
    for name, want in expected.items():
        got = getattr(header, name)
        if got != want:
            raise TransferMismatchError(
                f"transfer header mismatch for request {header.request_id!r}: {name} is {got!r}, "
                f"expected {want!r}"
            )
    row_bytes = moved_row_bytes(layout, sample_bytes)
    chunk_bytes = header.chunk_bytes
    if not (
        isinstance(chunk_bytes, int) and 0 < chunk_bytes <= MAX_CHUNK_BYTES and chunk_bytes % row_bytes == 0
    ):
        raise TransferMismatchError(
            f"transfer header mismatch for request {header.request_id!r}: chunk_bytes is {chunk_bytes!r}, "
            f"expected a multiple of {row_bytes} in (0, {MAX_CHUNK_BYTES}]"
        )
    num_chunks = -(-header.nbytes // chunk_bytes)
    if header.num_chunks != num_chunks:
        raise TransferMismatchError(
            f"transfer header mismatch for request {header.request_id!r}: num_chunks is "
            f"{header.num_chunks!r}, expected {num_chunks} for {header.nbytes} B in {chunk_bytes} B chunks"
        )


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    return obj


def layout_from_dict(d: Any) -> KVLayout:
    return _build(KVLayout, d)


def handoff_from_dict(d: Any) -> KVHandoff:
    return _build(KVHandoff, d)


def request_from_dict(d: Any) -> TransferRequest:
    return _build(TransferRequest, d)


def header_from_dict(d: Any) -> TransferHeader:
    return _build(TransferHeader, d)


def _check(tp: Any, value: Any, path: str) -> Any:
    """`value` as type `tp` (one of the field types used above), or TransferError naming `path`."""
    if tp is KVLayout:
        return _build(KVLayout, value)
    if tp in (int, str, bool, bytes):
        if type(value) is not tp:
            raise TransferError(f"{path} must be {tp.__name__}, got {type(value).__name__}")
        return value
    if tp is float:
        if type(value) not in (int, float) or value != value or value in (float("inf"), float("-inf")):
            raise TransferError(f"{path} must be a finite number, got {value!r}"[:200])
        return float(value)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        if type(value) is not list:
            raise TransferError(f"{path} must be a list, got {type(value).__name__}")
        return [_check(args[0], x, path) for x in value]
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if type(value) is arg:
                return value
        raise TransferError(f"{path} must be one of {[a.__name__ for a in args]}, got {type(value).__name__}")
    raise TypeError(f"no check for {tp!r}")


def _build(cls: Any, d: Any) -> Any:
    if not isinstance(d, dict):
        raise TransferError(f"{cls.__name__} must be a map, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    unknown = sorted(str(k) for k in d if k not in hints)
    if unknown:
        raise TransferError(f"unknown {cls.__name__} field(s) {unknown[:8]}")
    missing = sorted(
        f.name
        for f in fields
        if f.name not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    if missing:
        raise TransferError(f"missing {cls.__name__} field(s) {missing}")
    kwargs = {k: _check(hints[k], v, f"{cls.__name__}.{k}") for k, v in d.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise TransferError(f"bad {cls.__name__}: {e}") from e


def _pack(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(to_dict(obj), use_bin_type=True)
    return packed


def _unpack(data: bytes) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise TransferError(f"not a msgpack map: {type(e).__name__}: {e}"[:200]) from None
    if not isinstance(obj, dict):
        raise TransferError(f"expected a msgpack map, got {type(obj).__name__}")
    return obj

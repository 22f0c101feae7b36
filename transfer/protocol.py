"""KV-transfer boundary messages: msgpack-able dataclasses, the handshake frames and their checks.

This module imports nothing of the project and not torch, so the router can carry a `KVHandoff`.
Every frame on a transfer socket is one msgpack map ``{"kind": <MessageKind>, "nonce": int, ...}``;
never pickle.

Handshake for one request (decode side D asks prefill side P; see transfer/connector.py):

    D -> P  request  {TransferRequest}       "send R into my blocks, skipping my first k"
    P -> D  header   {TransferHeader}        what P will send (layout, shape, bytes, chunking, checksum)
    D -> P  ack      {num_slots}             header matches what D expects; all D's chunk recvs are posted
    P => D  <num_chunks chunks over the channel, chunk i on tag chunk_tag(tag, i)>
    D -> P  credit   {chunk}                 chunks up to i verified and scattered: their slots may take
                                             chunks up to i + num_slots (P sends a chunk only once the
                                             chunk num_slots before it is credited; D credits every few)
    D -> P  done                             every chunk verified and scattered; P may free its blocks
    either  abort    {error_type, message}   the transfer failed on the sender of this frame

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
import enum
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
CHECKSUM_SCHEME = "xxh3_64-nonce-v2"
MAX_CHUNK_BYTES = 1 << 30


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
    """The peer rank was dropped (`drop_peer`: marked dead); nothing more is sent to or awaited from it."""


_ERROR_TYPES: dict[str, type[TransferError]] = {
    cls.__name__: cls
    for cls in (
        TransferError,
        TransferMismatchError,
        TransferTimeoutError,
        TransferChecksumError,
        TransferRejectedError,
        TransferPeerLostError,
    )
}


def error_from_remote(error_type: str, message: str) -> TransferError:
    """Rebuild the exception the peer reported in an `abort` frame (unknown names -> TransferError)."""
    return _ERROR_TYPES.get(error_type, TransferError)(f"peer: {message}")


class MessageKind(str, enum.Enum):
    REQUEST = "request"
    HEADER = "header"
    ACK = "ack"
    CREDIT = "credit"
    DONE = "done"
    ABORT = "abort"


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
    blocks (may be empty); the decode side uses them to find its own prefix-cache hit.
    """

    request_id: str
    src_rank: int
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
    """The decode side's ask: send `request_id` minus the first `skip_first_n_blocks` blocks."""

    request_id: str
    nonce: int
    dst_rank: int
    skip_first_n_blocks: int
    num_dst_blocks: int


@dataclass
class TransferHeader:
    """What the prefill side is about to send; checked by the decode side before any byte moves.

    `shape` is the per-layer shape of the gathered blocks. The bytes (layer-major ``[L, n, 2, bs, h, d]``)
    move in `num_chunks` chunks of `chunk_bytes` payload bytes (the last one shorter), a whole number of
    one-layer block rows each; chunk i goes on tag ``chunk_tag(tag, i)`` and ends with its checksum
    (`checksum` names the scheme; see transfer/staging.py). `tag` derives from the nonce.
    """

    request_id: str
    nonce: int
    src_rank: int
    dst_rank: int
    layout: KVLayout
    dtype: str
    shape: list[int]
    num_blocks: int
    nbytes: int
    num_chunks: int
    chunk_bytes: int
    checksum: str
    tag: int

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


def validate_header(
    header: TransferHeader,
    *,
    request_id: str,
    nonce: int,
    src_rank: int,
    dst_rank: int,
    layout: KVLayout,
    num_blocks: int,
) -> None:
    """Raise TransferMismatchError naming the first field that differs from what the receiver expects."""
    expected: dict[str, Any] = {
        "request_id": request_id,
        "nonce": nonce,
        "src_rank": src_rank,
        "dst_rank": dst_rank,
        "layout": layout,
        "dtype": layout.dtype,
        "num_blocks": num_blocks,
        "shape": layout.layer_shape(num_blocks),
        "nbytes": layout.bytes_per_block * num_blocks,
        "checksum": CHECKSUM_SCHEME,
        "tag": tag_for_nonce(nonce),
    }
    for name, want in expected.items():
        got = getattr(header, name)
        if got != want:
            raise TransferMismatchError(
                f"transfer header mismatch for request {header.request_id!r}: {name} is {got!r}, "
                f"expected {want!r}"
            )
    row_bytes = row_bytes_of(layout)
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


def encode_message(kind: MessageKind, nonce: int, **body: Any) -> bytes:
    """One handshake frame. Dataclass values are flattened to dicts."""
    payload = {k: to_dict(v) for k, v in body.items()}
    packed: bytes = msgpack.packb({"kind": kind.value, "nonce": nonce, **payload}, use_bin_type=True)
    return packed


def decode_message(data: bytes) -> tuple[MessageKind, int, dict[str, Any]]:
    """Inverse of `encode_message`; malformed frames raise TransferError (never a KeyError deep inside)."""
    try:
        msg = _unpack(data)
        kind = MessageKind(msg.pop("kind"))
        nonce = msg.pop("nonce")
    except (ValueError, KeyError, TypeError, TransferError, msgpack.UnpackException) as e:
        raise TransferError(f"malformed transfer frame: {e}") from e
    if not isinstance(nonce, int):
        raise TransferError(f"malformed transfer frame: nonce {nonce!r} is not an int")
    return kind, nonce, msg


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    return obj


def layout_from_dict(d: dict[str, Any]) -> KVLayout:
    return _build(KVLayout, d)


def handoff_from_dict(d: dict[str, Any]) -> KVHandoff:
    return _build(KVHandoff, {**d, "layout": layout_from_dict(d["layout"])})


def request_from_dict(d: dict[str, Any]) -> TransferRequest:
    return _build(TransferRequest, d)


def header_from_dict(d: dict[str, Any]) -> TransferHeader:
    return _build(TransferHeader, {**d, "layout": layout_from_dict(d["layout"])})


def _build(cls: Any, d: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise TransferError(f"unknown {cls.__name__} field(s) {unknown}")
    try:
        return cls(**d)
    except TypeError as e:
        raise TransferError(f"bad {cls.__name__}: {e}") from e


def _pack(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(to_dict(obj), use_bin_type=True)
    return packed


def _unpack(data: bytes) -> dict[str, Any]:
    obj = msgpack.unpackb(data, raw=False)
    if not isinstance(obj, dict):
        raise TransferError(f"expected a msgpack map, got {type(obj).__name__}")
    return obj

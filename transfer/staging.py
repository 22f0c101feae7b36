"""Chunked staging: cut a transfer into chunks; gather, seal, verify and scatter one chunk.

The gathered blocks are laid out layer-major, ``[L, n, 2, bs, h, d]``: row ``u = layer * n + j`` is block
``block_ids[j]`` of that layer (K and V, `row_bytes`). A chunk is a run of whole rows (it may span a
layer boundary) followed by an 8-byte trailer holding its digest, so the sender can seal chunk i right
after gathering it, while chunk i-1 is on the wire, and the receiver can verify chunk i and scatter it
while chunk i+1 arrives. Each chunk sits at a 64-byte aligned offset of its buffer so every chunk can be
viewed as machine words.

Digest (scheme `CHECKSUM_SCHEME`): XXH3-64 from the `xxhash` package, seeded with the transfer's nonce,
over the chunk index (8 bytes, little-endian) followed by the chunk's payload bytes; the trailer holds it
little-endian. A chunk with any byte changed (K and V swapped, two tokens swapped, one bit flipped), a
chunk at another position, or a chunk of another transfer (another nonce) fails it, except with
probability 2**-64. It is not a MAC: it catches accidents and stale or misrouted chunks, not an attacker
(the nonce travels in the clear). The all-ones value is never produced, so a junk chunk (every byte
0xFF, see `junk_chunk`) never verifies.

NOTE: XXH3 was picked by speed measured on the 2-core CPU box (bench/bench_chunk_hash.py): ~20 GB/s on
cache-resident chunks, like crc32c and ~5x blake3, with a 64-bit seed that keys it by the nonce for free;
it releases the GIL, so it overlaps the channel's own threads.

That digest needs host bytes. Chunks staged on a GPU (nccl, CUDA IPC) are sealed and checked where they
are with `DeviceDigest` instead (scheme `DEVICE_CHECKSUM_SCHEME`, transfer/digest.py): pass one to
`seal_chunk` / `verify_chunk`. The header names the scheme, so both ends agree on it before a byte moves.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import xxhash

from transfer.digest import DEVICE_CHECKSUM_SCHEME, DeviceDigest
from transfer.protocol import CHECKSUM_SCHEME, TransferChecksumError

TRAILER_BYTES = 8
_ALIGN = 64
_MASK64 = (1 << 64) - 1
CHECKSUM_SCHEMES = (CHECKSUM_SCHEME, DEVICE_CHECKSUM_SCHEME)


def default_checksum(staging_device: torch.device) -> str:
    """The scheme for chunks staged on `staging_device`: on a GPU the device digest (the bytes never go
    to the host), else XXH3 on the host bytes."""
    return DEVICE_CHECKSUM_SCHEME if staging_device.type == "cuda" else CHECKSUM_SCHEME


def chunk_digester(scheme: str, nonce: int) -> DeviceDigest | None:
    """What `seal_chunk` / `verify_chunk` take for `scheme`: a DeviceDigest, or None (XXH3, host bytes)."""
    if scheme not in CHECKSUM_SCHEMES:
        raise ValueError(f"checksum must be one of {CHECKSUM_SCHEMES}, got {scheme!r}")
    return DeviceDigest(nonce) if scheme == DEVICE_CHECKSUM_SCHEME else None


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _word_dtype(row_bytes: int) -> torch.dtype:
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row_bytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8


def kv_rows(kv: torch.Tensor) -> torch.Tensor:
    """A ``[L, num_blocks, 2, bs, h, d]`` KV cache as ``[L, num_blocks, words]`` of an integer type.

    NOTE: index ops on an integer row view run ~3x faster on CPU than on the 6-d float view.
    """
    row_bytes = kv[0, 0].numel() * kv.element_size()
    flat = kv.view(kv.shape[0], kv.shape[1], -1).view(torch.uint8)
    return flat.view(_word_dtype(row_bytes))


@dataclass(frozen=True)
class ChunkPlan:
    """How `num_blocks` blocks of `num_layers` layers are cut into chunks of `chunk_rows` rows."""

    num_layers: int
    num_blocks: int
    row_bytes: int
    chunk_rows: int

    @classmethod
    def create(cls, num_layers: int, num_blocks: int, row_bytes: int, chunk_bytes: int) -> ChunkPlan:
        return cls(num_layers, num_blocks, row_bytes, max(1, chunk_bytes // row_bytes))

    @property
    def num_rows(self) -> int:
        return self.num_layers * self.num_blocks

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_rows * self.row_bytes

    @property
    def num_chunks(self) -> int:
        return -(-self.num_rows // self.chunk_rows)

    @property
    def stride(self) -> int:
        """Bytes one chunk (payload + trailer) takes in a buffer, aligned."""
        return _round_up(self.chunk_bytes + TRAILER_BYTES, _ALIGN)

    def rows(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_rows
        return start, min(start + self.chunk_rows, self.num_rows)

    def wire_bytes(self, chunk: int) -> int:
        """Bytes chunk `chunk` takes on the wire: its rows and the trailer."""
        start, end = self.rows(chunk)
        return (end - start) * self.row_bytes + TRAILER_BYTES

    def segments(self, chunk: int) -> Iterator[tuple[int, int, int, int]]:
        """(layer, first block index, end block index, first row in the chunk) for each layer it spans."""
        start, end = self.rows(chunk)
        row = start
        while row < end:
            layer, first = divmod(row, self.num_blocks)
            last = min(self.num_blocks, first + end - row)
            yield layer, first, last, row - start
            row += last - first


def chunk_view(buf: torch.Tensor, plan: ChunkPlan, chunk: int, offset: int = 0) -> torch.Tensor:
    """The wire bytes of `chunk` in the uint8 buffer `buf`, starting at byte `offset` (aligned)."""
    return buf[offset : offset + plan.wire_bytes(chunk)]


def payload_rows(wire: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """The payload of a chunk's wire bytes as ``[rows, words]`` (the dtype of `kv_rows`)."""
    payload = wire[: wire.numel() - TRAILER_BYTES]
    return payload.view(payload.numel() // plan.row_bytes, plan.row_bytes).view(_word_dtype(plan.row_bytes))


def gather_rows(
    rows: torch.Tensor, index: torch.Tensor, plan: ChunkPlan, chunk: int, out: torch.Tensor
) -> None:
    """Copy the KV rows of `chunk` (`rows` = `kv_rows(kv)`, `index` = block ids) into `out` (its payload
    rows, on the KV cache's device): one index_select per layer the chunk spans."""
    for layer, first, last, row in plan.segments(chunk):
        torch.index_select(rows[layer], 0, index[first:last], out=out[row : row + last - first])


def scatter_rows(
    rows: torch.Tensor, index: torch.Tensor, plan: ChunkPlan, chunk: int, src: torch.Tensor
) -> None:
    """Write the payload rows `src` of `chunk` (already verified) into the KV rows of its blocks."""
    for layer, first, last, row in plan.segments(chunk):
        rows[layer].index_copy_(0, index[first:last], src[row : row + last - first])


def chunk_digest(wire: torch.Tensor, nonce: int, chunk: int) -> int:
    """The digest of the payload of `chunk` (its wire bytes `wire`, a CPU uint8 tensor; trailer excluded)."""
    payload = wire[: wire.numel() - TRAILER_BYTES]
    state = xxhash.xxh3_64(seed=nonce & _MASK64)
    state.update(chunk.to_bytes(8, "little"))
    state.update(payload.numpy().data)
    digest: int = state.intdigest()
    return digest - 1 if digest == _MASK64 else digest  # NOTE: all-ones is the junk trailer


def _trailer(wire: torch.Tensor) -> torch.Tensor:
    return wire[wire.numel() - TRAILER_BYTES :]


def write_trailer(wire: torch.Tensor, digest: int) -> None:
    raw = bytearray(digest.to_bytes(TRAILER_BYTES, "little"))
    _trailer(wire).copy_(torch.frombuffer(raw, dtype=torch.uint8))


def read_trailer(wire: torch.Tensor) -> int:
    return int.from_bytes(_trailer(wire).numpy().tobytes(), "little")


def seal_chunk(wire: torch.Tensor, nonce: int, chunk: int, device_digest: DeviceDigest | None = None) -> None:
    """Write the digest of `chunk`'s payload into its trailer: XXH3 (CPU wire bytes), or `device_digest`'s
    where the bytes are (queued on the current stream; nothing waits)."""
    if device_digest is None:
        write_trailer(wire, chunk_digest(wire, nonce, chunk))
        return
    digest = device_digest(wire[: wire.numel() - TRAILER_BYTES], chunk)
    _trailer(wire).copy_(digest.view(1).view(torch.uint8))


def verify_chunk(
    wire: torch.Tensor,
    plan: ChunkPlan,
    nonce: int,
    chunk: int,
    what: str,
    device_digest: DeviceDigest | None = None,
) -> None:
    """Raise TransferChecksumError unless `chunk`'s trailer is its digest under `nonce` (XXH3 on CPU wire
    bytes, or `device_digest` where they are: then only the 16 bytes of the two digests are copied to the
    host, which waits for the current stream)."""
    if device_digest is None:
        digest, expected = chunk_digest(wire, nonce, chunk), read_trailer(wire)
    else:
        computed = device_digest(wire[: wire.numel() - TRAILER_BYTES], chunk).view(1).view(torch.uint8)
        both = torch.cat([computed, _trailer(wire)]).cpu().numpy().tobytes()
        digest, expected = int.from_bytes(both[:8], "little"), int.from_bytes(both[8:], "little")
    if digest != expected:
        raise TransferChecksumError(
            f"digest of chunk {chunk}/{plan.num_chunks} ({wire.numel()} B) of {what} is {digest:#018x}, "
            f"the sender's is {expected:#018x} (corrupt, reordered, or of another transfer)"
        )


def block_index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(block_ids), dtype=torch.long, device=device)


def gather_chunk(
    rows: torch.Tensor, index: torch.Tensor, plan: ChunkPlan, chunk: int, wire: torch.Tensor, nonce: int
) -> None:
    """Gather `chunk` into the CPU wire bytes `wire` and seal it (CPU KV cache; tests, tools)."""
    gather_rows(rows, index, plan, chunk, payload_rows(wire, plan))
    seal_chunk(wire, nonce, chunk)


def scatter_chunk(
    rows: torch.Tensor, index: torch.Tensor, plan: ChunkPlan, chunk: int, wire: torch.Tensor
) -> None:
    """Write the payload of `chunk` (CPU wire bytes, already verified) into its KV rows, in place."""
    scatter_rows(rows, index, plan, chunk, payload_rows(wire, plan).to(rows.device))


def junk_chunk(wire: torch.Tensor) -> None:
    """Fill `wire` with bytes whose trailer never matches a digest (fed to a recv that must not hang)."""
    wire.fill_(0xFF)


def gather_blocks(kv: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """`kv[:, block_ids]` as a new contiguous ``[L, n, 2, bs, h, d]`` tensor (tests, debugging)."""
    return torch.index_select(kv, 1, block_index(block_ids, kv.device))

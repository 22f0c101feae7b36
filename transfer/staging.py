"""Chunked staging: cut a transfer into chunks; gather, seal, verify and scatter one chunk.

The gathered blocks are laid out layer-major, ``[L, n, 2, bs, h, d]``: row ``u = layer * n + j`` is block
``block_ids[j]`` of that layer (K and V, `row_bytes`). A chunk is a run of whole rows (it may span a
layer boundary) followed by a 16-byte trailer holding its digest or MAC tag, so the sender can seal chunk i right
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

Integrity `mac` (transfer.integrity, the config's default) seals with a keyed MAC instead, so a peer that
saw the nonce (or even chose it) cannot make a chunk that verifies without the cluster secret:
`HostMac` (scheme `HOST_MAC_SCHEME`): Poly1305 over the payload with a one-time key per chunk, BLAKE2b
keyed with the KV MAC key (`kv_mac_key(secret)`) over (nonce, chunk index); its 16-byte tag fills the
trailer. Poly1305 under a one-time key forges with probability at most 8 * ceil(len / 16) / 2**106 per
try (about 2**-85 for 4 MiB chunks). On a GPU: `DeviceMac` (transfer/digest.py). Integrity `off`
(`NO_CHECKSUM_SCHEME`) writes a zero trailer and checks nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import xxhash

from transfer.digest import DeviceDigest, DeviceMac
from transfer.protocol import (
    CHECKSUM_SCHEME,
    DEVICE_CHECKSUM_SCHEME,
    DEVICE_MAC_SCHEME,
    HOST_MAC_SCHEME,
    NO_CHECKSUM_SCHEME,
    SCHEME_INTEGRITY,
    TransferChecksumError,
)

TRAILER_BYTES = 16
DIGEST_BYTES = 8  # of a `digest` scheme's trailer (zero-extended); a MAC tag takes all 16
_ALIGN = 64
_MASK64 = (1 << 64) - 1
CHECKSUM_SCHEMES = (
    CHECKSUM_SCHEME,
    DEVICE_CHECKSUM_SCHEME,
    HOST_MAC_SCHEME,
    DEVICE_MAC_SCHEME,
    NO_CHECKSUM_SCHEME,
)
DEVICE_SCHEMES = (DEVICE_CHECKSUM_SCHEME, DEVICE_MAC_SCHEME, NO_CHECKSUM_SCHEME)  # usable on GPU staging


def kv_mac_key(secret: bytes) -> bytes:
    """The key KV chunk MACs derive from (never the cluster secret itself: the control plane's MAC is
    keyed with that)."""
    return hashlib.blake2b(b"pdserve-kv-mac-v1", key=secret, digest_size=32).digest()


def default_checksum(staging_device: torch.device, integrity: str = "digest") -> str:
    """The scheme for chunks staged on `staging_device` at `integrity` (off | digest | mac): on a GPU the
    device digest or MAC (the bytes never go to the host), else XXH3 or Poly1305 on the host bytes."""
    on_gpu = staging_device.type == "cuda"
    if integrity == "off":
        return NO_CHECKSUM_SCHEME
    if integrity == "mac":
        return DEVICE_MAC_SCHEME if on_gpu else HOST_MAC_SCHEME
    if integrity == "digest":
        return DEVICE_CHECKSUM_SCHEME if on_gpu else CHECKSUM_SCHEME
    raise ValueError(f"integrity must be one of off, digest, mac; got {integrity!r}")


def accepted_checksums(staging_device: torch.device, integrity: str) -> tuple[str, ...]:
    """The schemes a receiver staging on `staging_device` verifies at `integrity` or stronger."""
    usable = DEVICE_SCHEMES if staging_device.type == "cuda" else CHECKSUM_SCHEMES
    floor = ("off", "digest", "mac").index(integrity)
    return tuple(s for s in usable if ("off", "digest", "mac").index(SCHEME_INTEGRITY[s]) >= floor)


class HostMac:
    """Poly1305 tags of one transfer's chunks on host bytes (scheme HOST_MAC_SCHEME): chunk i's one-time
    key is BLAKE2b keyed with the KV MAC key over (nonce, i), so no two chunks, of any transfer, share one."""

    def __init__(self, mac_key: bytes, nonce: int) -> None:
        # NOTE: imported here: only host-staged chunks need it, and a bare GPU machine (GPU-staged chunks,
        # the device MAC) may not have the package: a GPU run found every module importing transfer/ failing.
        from cryptography.hazmat.primitives.poly1305 import Poly1305

        self._poly1305 = Poly1305
        nonce_bytes = (nonce & _MASK64).to_bytes(8, "little")
        self._key = hashlib.blake2b(b"poly1305-transfer" + nonce_bytes, key=mac_key, digest_size=32).digest()

    def tag(self, payload: torch.Tensor, chunk: int) -> bytes:
        one_time = hashlib.blake2b(chunk.to_bytes(8, "little"), key=self._key, digest_size=32).digest()
        return self._poly1305.generate_tag(one_time, payload.numpy().data)


class NoCheck:
    """Integrity `off`: a zero trailer, never checked."""


Sealer = DeviceDigest | DeviceMac | HostMac | NoCheck | None  # None: XXH3 on host bytes


def chunk_digester(scheme: str, nonce: int, mac_key: bytes | None = None) -> Sealer:
    """What `seal_chunk` / `verify_chunk` take for `scheme`: a DeviceDigest, DeviceMac, HostMac (both
    need `mac_key`), NoCheck, or None (XXH3, host bytes)."""
    if scheme not in CHECKSUM_SCHEMES:
        raise ValueError(f"checksum must be one of {CHECKSUM_SCHEMES}, got {scheme!r}")
    if scheme in (HOST_MAC_SCHEME, DEVICE_MAC_SCHEME):
        if mac_key is None:
            raise ValueError(f"checksum {scheme!r} is a keyed MAC: it needs the KV MAC key")
        return HostMac(mac_key, nonce) if scheme == HOST_MAC_SCHEME else DeviceMac(mac_key, nonce)
    if scheme == NO_CHECKSUM_SCHEME:
        return NoCheck()
    return DeviceDigest(nonce) if scheme == DEVICE_CHECKSUM_SCHEME else None


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _word_dtype(row_bytes: int) -> torch.dtype:
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row_bytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8


def kv_rows(kv: torch.Tensor, sample_bytes: int = 0) -> torch.Tensor:
    """A ``[L, num_blocks, 2, bs, h, d]`` KV cache as ``[L, num_blocks, words]`` of an integer type; with
    `sample_bytes` > 0 (a paced handoff's, transfer/paced_link.py) as ``[L, num_blocks, 2, words]``: the
    first `sample_bytes` of each block's K and of its V, a strided view (a multiple of 8 bytes, shorter
    than a block's K, as the paced link picks).

    NOTE: index ops on an integer row view run ~3x faster on CPU than on the 6-d float view.
    """
    if sample_bytes:
        halves = kv.view(kv.shape[0], kv.shape[1], 2, -1).view(torch.uint8)
        words = halves.view(_word_dtype(math.gcd(sample_bytes, halves.shape[-1])))
        return words[..., : sample_bytes // words.element_size()]
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
        dst = out[row : row + last - first].view(last - first, *rows.shape[2:])
        torch.index_select(rows[layer], 0, index[first:last], out=dst)


def scatter_rows(
    rows: torch.Tensor, index: torch.Tensor, plan: ChunkPlan, chunk: int, src: torch.Tensor
) -> None:
    """Write the payload rows `src` of `chunk` (already verified) into the KV rows of its blocks."""
    for layer, first, last, row in plan.segments(chunk):
        part = src[row : row + last - first].view(last - first, *rows.shape[2:])
        rows[layer].index_copy_(0, index[first:last], part)


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
    """The 64-bit digest in the trailer's first 8 bytes (a MAC tag fills all 16)."""
    return int.from_bytes(_trailer(wire)[:DIGEST_BYTES].numpy().tobytes(), "little")


def _device_tag(sealer: DeviceDigest | DeviceMac, payload: torch.Tensor, chunk: int) -> torch.Tensor:
    """The trailer's 16 bytes for `payload` on its device (the 8-byte digest is zero-extended)."""
    tag = sealer(payload, chunk)
    if isinstance(sealer, DeviceMac):
        return tag
    return torch.cat([tag.view(1).view(torch.uint8), torch.zeros(8, dtype=torch.uint8, device=tag.device)])


def seal_chunk(wire: torch.Tensor, nonce: int, chunk: int, device_digest: Sealer = None) -> None:
    """Write the digest or MAC tag of `chunk`'s payload into its trailer: XXH3 / HostMac (CPU wire bytes),
    or a DeviceDigest / DeviceMac where the bytes are (queued on the current stream; nothing waits)."""
    payload = wire[: wire.numel() - TRAILER_BYTES]
    if device_digest is None:
        write_trailer(wire, chunk_digest(wire, nonce, chunk))
    elif isinstance(device_digest, HostMac):
        _trailer(wire).copy_(
            torch.frombuffer(bytearray(device_digest.tag(payload, chunk)), dtype=torch.uint8)
        )
    elif isinstance(device_digest, NoCheck):
        _trailer(wire).zero_()
    else:
        _trailer(wire).copy_(_device_tag(device_digest, payload, chunk))


def verify_chunk(
    wire: torch.Tensor,
    plan: ChunkPlan,
    nonce: int,
    chunk: int,
    what: str,
    device_digest: Sealer = None,
) -> None:
    """Raise TransferChecksumError unless `chunk`'s trailer is its digest or MAC tag (XXH3 / HostMac on
    CPU wire bytes, or a DeviceDigest / DeviceMac where they are: then only the 32 bytes of the two tags
    are copied to the host, which waits for the current stream). NoCheck: nothing is checked."""
    payload = wire[: wire.numel() - TRAILER_BYTES]
    if isinstance(device_digest, NoCheck):
        return
    if isinstance(device_digest, HostMac | DeviceMac):
        if isinstance(device_digest, HostMac):
            is_valid = hmac.compare_digest(device_digest.tag(payload, chunk), bytes(_trailer(wire).numpy()))
        else:
            both = torch.cat([device_digest(payload, chunk), _trailer(wire)]).cpu().numpy().tobytes()
            is_valid = hmac.compare_digest(both[:TRAILER_BYTES], both[TRAILER_BYTES:])
        if not is_valid:
            raise TransferChecksumError(
                f"MAC of chunk {chunk}/{plan.num_chunks} ({wire.numel()} B) of {what} does not verify "
                "(forged without the cluster secret, corrupt, reordered, or of another transfer)"
            )
        return
    if device_digest is None:
        digest, expected = chunk_digest(wire, nonce, chunk), read_trailer(wire)
    else:
        computed = device_digest(payload, chunk).view(1).view(torch.uint8)
        both = torch.cat([computed, _trailer(wire)[:DIGEST_BYTES]]).cpu().numpy().tobytes()
        digest = int.from_bytes(both[:DIGEST_BYTES], "little")
        expected = int.from_bytes(both[DIGEST_BYTES:], "little")
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

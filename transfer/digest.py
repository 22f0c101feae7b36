"""DeviceDigest: a chunk's keyed digest computed by torch ops where its bytes are (GPU or CPU).

Scheme `DEVICE_CHECKSUM_SCHEME`, used when the staging slots live on a GPU (nccl, CUDA IPC), so a chunk
is sealed and checked without its bytes leaving the device: only the 8-byte digest comes to the host, on
the receiving side. The same code runs on CPU tensors, where it is tested.

The payload is read as words: little-endian 32-bit words, then each of the last ``len % 4`` bytes as a
word of its own. Each of two lanes is a polynomial over the prime ``P = 2**31 - 1``::

    lane = (sum_i word_i * r**i + (chunk + 1) * k) mod P

with ``r`` and ``k`` derived from the transfer's nonce and the lane (``r`` a primitive root of P, so
``r**i`` differ for every position of a chunk up to P - 1 words). The digest is ``lane0 | lane1 << 32``
(top bit clear: never the all-ones junk trailer). What that guarantees, for any key: a chunk with one
byte changed, or any bytes of one word changed (unless by a multiple of P), or two words exchanged
(unless equal mod P) never verifies, nor do the same bytes sealed for another chunk index. Other
changes escape with probability about 2**-62 over the keys (at most (words/P)**2 for a chosen pair).

NOTE: not a MAC and not cryptographic: it is linear in the bytes, so whoever knows the nonce (it travels
in the clear) can forge it. It catches accidents and stale or misrouted chunks, like XXH3 on the host path
(integrity `digest`). `DeviceMac` below is the keyed MAC (integrity `mac`) of GPU-staged chunks.

NOTE: every product stays below 2**63 (a word < 2**32 times a power < 2**31), and sums of reduced terms
stay far below it, so int64 math is exact on every device and both ends agree bit for bit. Powers are
tabled as ``r**(h*B + l) = (r**B)**h * r**l`` (two small tables per lane and device, kept per transfer).
"""

from __future__ import annotations

import hashlib
import math

import torch

from transfer.protocol import DEVICE_CHECKSUM_SCHEME

__all__ = ["DEVICE_CHECKSUM_SCHEME", "DeviceDigest", "DeviceMac", "lane_keys"]
P = (1 << 31) - 1
PRIMITIVE_ROOT = 7  # of P
_BLOCK = 1024  # words per row of the power table
_NUM_LANES = 2
_MASK32 = (1 << 32) - 1


def lane_keys(nonce: int, lane: int) -> tuple[int, int]:
    """(r, k) of `lane` for `nonce`: r a primitive root of P, k in [1, P)."""
    seed = hashlib.blake2b((nonce & ((1 << 64) - 1)).to_bytes(8, "little") + bytes([lane]), digest_size=16)
    raw = int.from_bytes(seed.digest(), "little")
    exponent = raw % (P - 1)
    while math.gcd(exponent, P - 1) != 1:  # NOTE: r = 7**e is primitive iff e is coprime with P - 1
        exponent += 1
    return pow(PRIMITIVE_ROOT, exponent, P), 1 + (raw >> 64) % (P - 1)


def _powers(base: int, count: int) -> list[int]:
    out, value = [], 1
    for _ in range(count):
        out.append(value)
        value = value * base % P
    return out


class DeviceDigest:
    """The digests of one transfer's chunks (keyed by its `nonce`), on whatever device they are.

    Keeps two small power tables per lane and device (grown to the longest chunk seen): one instance per
    transfer (a staging ring's), used from one thread.
    """

    def __init__(self, nonce: int) -> None:
        self.nonce = nonce
        self._keys = [lane_keys(nonce, lane) for lane in range(_NUM_LANES)]
        self._tables: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, lane: int, num_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(r**l for l < _BLOCK, r**(h*_BLOCK) for h < num_rows) of `lane`, as int64 on `device`."""
        cached = self._tables.get((lane, device))
        if cached is None or cached[1].numel() < num_rows:
            r = self._keys[lane][0]
            low = torch.tensor(_powers(r, _BLOCK), dtype=torch.int64, device=device)
            high = torch.tensor(_powers(pow(r, _BLOCK, P), num_rows), dtype=torch.int64, device=device)
            cached = self._tables[(lane, device)] = (low, high)
        return cached[0], cached[1][:num_rows]

    def prepare(self, nbytes: int, device: torch.device) -> None:
        """Make the tables for chunks of up to `nbytes` on `device` now (their upload waits for the current
        stream: do it before that stream waits for the engine's work)."""
        num_rows = max(1, -(-(nbytes // 4 + nbytes % 4) // _BLOCK))
        for lane in range(_NUM_LANES):
            self._table(lane, num_rows, device)

    def __call__(self, payload: torch.Tensor, chunk: int) -> torch.Tensor:
        """The digest of `payload` (uint8, 1-d) as chunk `chunk`: an int64 0-d tensor on its device, queued
        on the current stream (nothing waits for it)."""
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(f"payload must be a 1-d uint8 tensor, got {payload.dtype} {list(payload.shape)}")
        nbytes = payload.numel()
        main = nbytes - nbytes % 4
        if payload.storage_offset() % 4:  # NOTE: a word view needs an aligned start; slots are 64-aligned
            payload = payload.clone()
        num_words = main // 4 + nbytes % 4
        num_rows = max(1, -(-num_words // _BLOCK))
        words = torch.zeros(num_rows * _BLOCK, dtype=torch.int64, device=payload.device)
        words[: main // 4].copy_(payload[:main].view(torch.int32))
        words[main // 4 : num_words].copy_(payload[main:])
        words.bitwise_and_(_MASK32)  # NOTE: int32 words sign-extend; the polynomial takes them unsigned
        grid = words.view(num_rows, _BLOCK)
        digest = torch.zeros((), dtype=torch.int64, device=payload.device)
        for lane in range(_NUM_LANES):
            low, high = self._table(lane, num_rows, payload.device)
            rows = (grid * low).remainder_(P).sum(dim=1)  # each < _BLOCK * P
            rows.remainder_(P).mul_(high).remainder_(P)
            chunk_term = (chunk + 1) * self._keys[lane][1] % P
            value = (rows.sum() + chunk_term).remainder_(P)
            digest.bitwise_or_(value.bitwise_left_shift_(32 * lane))
        return digest


_MAC_LANES = 4
_MAC_ROW = 1024  # 16-bit words per row of the inner polynomial
_HALF = 1 << 16


def _field_elements(raw: bytes, count: int) -> list[int]:
    """`count` elements of [1, P) from `raw` (8 bytes each; the bias of 2**64 mod P is below 2**-32)."""
    return [1 + int.from_bytes(raw[8 * i : 8 * i + 8], "little") % (P - 1) for i in range(count)]


class DeviceMac:
    """A keyed MAC of one transfer's chunks (scheme DEVICE_MAC_SCHEME), computed by torch ops where the
    bytes are: the tag of a GPU-staged chunk never needs its bytes on the host.

    Construction (Wegman-Carter): the payload is read as little-endian signed 16-bit words (a word maps
    to a field element injectively: |w| < P / 2), padded with zeros to rows of 1024. Each of 4 lanes is a
    two-level polynomial over P = 2**31 - 1 with its own keys ``r1, r2`` (derived with BLAKE2b from the
    MAC key and the nonce, so per transfer)::

        row_h = sum_l w_{h,l} * r1**(l + 1)      lane = sum_h row_h * r2**(h + 1) + pad(chunk)   (mod P)

    and ``pad`` is a BLAKE2b output keyed with the MAC key over (nonce, chunk, lane): a one-time pad per
    chunk. The tag is the 4 lanes as little-endian 32-bit words (16 bytes; top bits clear, so never the
    all-ones junk trailer).

    What is claimed: for chunks of H rows, one lane's hash is (1024 + H) / P almost-Delta-universal (the
    hashes of two different payloads of the same length differ by any given value with probability at
    most (1024 + H) / P over r1, r2: the inner differences all vanish with probability <= 1024 / P, else
    the outer polynomial, with no constant term, takes the value with probability <= H / P), so with the pads from a PRF, an attacker who saw any
    number of tagged chunks forges one (other bytes, or the same bytes at another index or in another
    transfer) with probability at most ((1024 + H) / P)**4 per try: about 2**-77 for 4 MiB chunks and
    2**-71 for 16 MiB ones, plus BLAKE2b's PRF advantage. Chunk lengths are fixed by the signed header.

    NOTE: exact arithmetic on every device: the inner sums run as one float64 matmul against the powers
    split in 16-bit halves (every partial sum stays below 2**42 < 2**53, so the result is exact whatever
    the order of the additions), then int64 math (each product below 2**63). Both ends agree bit for bit.
    """

    def __init__(self, mac_key: bytes, nonce: int) -> None:
        self.nonce = nonce
        self._key = mac_key
        nonce_bytes = (nonce & ((1 << 64) - 1)).to_bytes(8, "little")
        raw = hashlib.blake2b(b"poly31x4-keys" + nonce_bytes, key=mac_key, digest_size=64).digest()
        keys = _field_elements(raw, 2 * _MAC_LANES)
        self._r1, self._r2 = keys[:_MAC_LANES], keys[_MAC_LANES:]
        self._nonce_bytes = nonce_bytes
        self._inner: dict[torch.device, torch.Tensor] = {}
        self._outer: dict[torch.device, torch.Tensor] = {}
        self._pads: dict[torch.device, torch.Tensor] = {}

    def _pad_values(self, chunk: int) -> list[int]:
        raw = hashlib.blake2b(
            b"poly31x4-pad" + self._nonce_bytes + chunk.to_bytes(8, "little"), key=self._key, digest_size=32
        ).digest()
        return [v - 1 for v in _field_elements(raw, _MAC_LANES)]

    def _inner_table(self, device: torch.device) -> torch.Tensor:
        """[1024, 8] float64: for each lane, the high and low 16 bits of r1**(l + 1)."""
        table = self._inner.get(device)
        if table is None:
            columns = []
            for r in self._r1:
                powers = [pow(r, i + 1, P) for i in range(_MAC_ROW)]
                columns += [[p >> 16 for p in powers], [p & (_HALF - 1) for p in powers]]
            table = self._inner[device] = torch.tensor(columns, dtype=torch.float64).T.contiguous().to(device)
        return table

    def _outer_table(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """[num_rows, 4] int64: r2**(h + 1) per lane."""
        table = self._outer.get(device)
        if table is None or table.shape[0] < num_rows:
            rows = [[pow(r, h + 1, P) for r in self._r2] for h in range(num_rows)]
            table = self._outer[device] = torch.tensor(rows, dtype=torch.int64).to(device)
        return table[:num_rows]

    def _pad(self, chunk: int, device: torch.device) -> torch.Tensor:
        pads = self._pads.get(device)
        if pads is None or pads.shape[0] <= chunk:
            self.prepare(0, device, chunk + 1)
            pads = self._pads[device]
        return pads[chunk]

    def prepare(self, nbytes: int, device: torch.device, num_chunks: int = 0) -> None:
        """Make the tables for chunks of up to `nbytes` and the pads of `num_chunks` chunks on `device`
        now (their upload waits for the current stream: do it before that stream waits for the engine)."""
        self._inner_table(device)
        num_words = (nbytes + 1) // 2
        self._outer_table(max(1, -(-num_words // _MAC_ROW)), device)
        if num_chunks and (device not in self._pads or self._pads[device].shape[0] < num_chunks):
            pads = [self._pad_values(c) for c in range(num_chunks)]
            self._pads[device] = torch.tensor(pads, dtype=torch.int64).to(device)

    def __call__(self, payload: torch.Tensor, chunk: int) -> torch.Tensor:
        """The 16-byte tag of `payload` (uint8, 1-d) as chunk `chunk`: a uint8 tensor on its device,
        queued on the current stream (nothing waits for it)."""
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(f"payload must be a 1-d uint8 tensor, got {payload.dtype} {list(payload.shape)}")
        nbytes, device = payload.numel(), payload.device
        main = nbytes - nbytes % 2
        if payload.storage_offset() % 2:  # NOTE: a word view needs an aligned start; slots are 64-aligned
            payload = payload.clone()
        num_words = main // 2 + nbytes % 2
        num_rows = max(1, -(-num_words // _MAC_ROW))
        words = torch.zeros(num_rows * _MAC_ROW, dtype=torch.float64, device=device)
        words[: main // 2].copy_(payload[:main].view(torch.int16))
        words[main // 2 : num_words].copy_(payload[main:])
        halves = (words.view(num_rows, _MAC_ROW) @ self._inner_table(device)).to(torch.int64)
        high, low = halves[:, 0::2], halves[:, 1::2]  # [rows, lanes] each
        rows = high.remainder_(P).mul_(_HALF).add_(low).remainder_(P)
        lanes = rows.mul_(self._outer_table(num_rows, device)).remainder_(P).sum(dim=0)
        tag = lanes.add_(self._pad(chunk, device)).remainder_(P)
        return tag.to(torch.int32).view(torch.uint8)

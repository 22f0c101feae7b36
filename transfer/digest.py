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
in the clear) can forge it. It catches accidents and stale or misrouted chunks, like XXH3 on the host path.
Keying a MAC on KV bytes is a separate issue.

NOTE: every product stays below 2**63 (a word < 2**32 times a power < 2**31), and sums of reduced terms
stay far below it, so int64 math is exact on every device and both ends agree bit for bit. Powers are
tabled as ``r**(h*B + l) = (r**B)**h * r**l`` (two small tables per lane and device, kept per transfer).
"""

from __future__ import annotations

import hashlib
import math

import torch

DEVICE_CHECKSUM_SCHEME = "poly31x2-nonce-v1"
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

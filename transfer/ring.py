"""StagingRing: the few chunk slots one transfer stages through, and the copies between them and the KV
cache, queued on the side's own CUDA stream.

Chunk i lives in slot ``i % num_slots``. The sender fills a slot (gather + seal) while the chunks in the
other slots are on the wire; the receiver drains one slot (verify + scatter) while the others fill, and
credits the sender with each slot it drained (transfer/protocol.py). Staging is a few chunks whatever the
transfer's size (a transfer-sized receive buffer doubled a long prompt's KV footprint on the decode side),
small enough to stay in cache between the channel's copy and ours.

One code path for three cases; with a CPU KV cache every stream operation below is a no-op:

- CPU KV cache, CPU staging (gloo on CPU): a slot is gathered into, sealed and sent in place; received
  into, verified and scattered from in place.
- CUDA KV cache, CPU staging (gloo, cache on a GPU): the gather / scatter run on the GPU into / out of a
  device mirror of the slot and one async copy moves the chunk between the mirror and the pinned host
  slot. The host waits for the side's stream only, never behind the engine's forward on the default
  stream, and only where it must touch the bytes (digest, or reusing a slot an async copy still reads).
- CUDA KV cache, CUDA staging (nccl, CUDA IPC): the slot is on the GPU and so is its digest
  (`DeviceDigest`, transfer/digest.py): gather, seal, send, verify and scatter all stay on the device,
  queued on the stream. No byte of the chunk goes to the host; the receiver's host reads the two 8-byte
  digests to decide (it waits for the side's stream there, before the scatter, as it must).

The ring seals with the transfer's agreed `scheme` (XXH3 needs host bytes, so a GPU slot must use the
device digest; Side picks, the header carries it). With a CPU KV cache the device digest runs on CPU.

NOTE: the CUDA cases are checked on a GPU only by the gpu-marked tests and bench/bench_transfer.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from transfer.digest import DeviceDigest, DeviceMac
from transfer.kv_source import SourceRows
from transfer.protocol import CHECKSUM_SCHEME
from transfer.staging import (
    DEVICE_SCHEMES,
    TRAILER_BYTES,
    ChunkPlan,
    chunk_digester,
    chunk_view,
    gather_rows,
    payload_rows,
    scatter_rows,
    seal_chunk,
    verify_chunk,
)


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Make `stream` current (channel ops posted inside are ordered after the work queued on it)."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


class StagingRing:
    """`num_slots` chunk slots of `plan` for one transfer keyed by `nonce`, sealed with `scheme` (a keyed
    MAC scheme also needs `mac_key`, transfer/staging.py's `kv_mac_key`).

    `wire_buf` is on the channel's staging device (what the channel moves); `mirror_buf` is the KV cache's
    device copy of a host slot (a CUDA KV cache staged on the host), else None. Both stay the caller's:
    after a failed transfer it must drop them, since an abandoned channel op may still use them.
    Counts the seconds spent per phase in `gather_seconds`, `hash_seconds`, `scatter_seconds`.
    """

    def __init__(
        self,
        plan: ChunkPlan,
        nonce: int,
        num_slots: int,
        wire_buf: torch.Tensor,
        mirror_buf: torch.Tensor | None,
        stream: torch.cuda.Stream | None,
        scheme: str = CHECKSUM_SCHEME,
        mac_key: bytes | None = None,
    ) -> None:
        self._digest = chunk_digester(scheme, nonce, mac_key)
        if wire_buf.is_cuda and scheme not in DEVICE_SCHEMES:
            raise ValueError(f"{scheme} hashes host bytes; chunks staged on a GPU need the device digest")
        if isinstance(self._digest, DeviceMac):
            self._digest.prepare(plan.chunk_bytes, wire_buf.device, plan.num_chunks)
        elif isinstance(self._digest, DeviceDigest):
            self._digest.prepare(plan.chunk_bytes, wire_buf.device)
        self.plan = plan
        self.nonce = nonce
        self.num_slots = num_slots
        self._wire_buf = wire_buf
        self._mirror_buf = mirror_buf
        self._stream = stream
        self._slot_events: list[Any] = [None] * num_slots
        self.gather_seconds = 0.0
        self.hash_seconds = 0.0
        self.scatter_seconds = 0.0

    @staticmethod
    def nbytes(plan: ChunkPlan, num_slots: int) -> int:
        return num_slots * plan.stride

    def start(self, ready: Any = None) -> None:
        """Order this ring's copies after `ready` (a CUDA event recorded when the KV bytes were final)."""
        if self._stream is not None and ready is not None:
            self._stream.wait_event(ready)

    def wire(self, chunk: int) -> torch.Tensor:
        """The wire bytes of `chunk` in its slot (what the channel sends / receives into)."""
        return chunk_view(self._wire_buf, self.plan, chunk, (chunk % self.num_slots) * self.plan.stride)

    def _mirror(self, chunk: int) -> torch.Tensor | None:
        if self._mirror_buf is None:
            return None
        return chunk_view(self._mirror_buf, self.plan, chunk, (chunk % self.num_slots) * self.plan.stride)

    def _wait_stream(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def fill(self, rows: torch.Tensor | SourceRows, index: torch.Tensor, chunk: int) -> torch.Tensor:
        """Gather `chunk` (`rows` = kv_rows(kv), `index` = block ids) into its slot and seal it; returns its
        wire bytes. The slot's previous send must have completed."""
        t0 = time.perf_counter()
        wire, mirror, plan = self.wire(chunk), self._mirror(chunk), self.plan
        if mirror is None:  # staged where the KV is: CPU, or the GPU (nothing goes to the host)
            _gather(rows, index, plan, chunk, payload_rows(wire, plan))
        else:  # host staging: gather on the device, one copy down
            _gather(rows, index, plan, chunk, payload_rows(mirror, plan))
            wire[:-TRAILER_BYTES].copy_(mirror[:-TRAILER_BYTES], non_blocking=True)
            self._wait_stream()
        t1 = time.perf_counter()
        seal_chunk(wire, self.nonce, chunk, self._digest)
        self.gather_seconds += t1 - t0
        self.hash_seconds += time.perf_counter() - t1
        return wire

    def release(self, chunk: int) -> None:
        """Wait until `chunk`'s slot, and those of the chunks drained before it (one stream), may take
        their next chunks: no queued copy still reads them."""
        slot = chunk % self.num_slots
        event, self._slot_events[slot] = self._slot_events[slot], None
        if event is not None:
            event.synchronize()

    def drain(self, rows: torch.Tensor | SourceRows, index: torch.Tensor, chunk: int, what: str) -> None:
        """Verify `chunk` (received into its slot) and scatter it into the blocks `index`. Raises
        TransferChecksumError, naming `what`, before anything of a bad chunk is written."""
        t0 = time.perf_counter()
        wire, mirror, plan = self.wire(chunk), self._mirror(chunk), self.plan
        verify_chunk(wire, plan, self.nonce, chunk, what, self._digest)
        t1 = time.perf_counter()
        if mirror is None:
            _scatter(rows, index, plan, chunk, payload_rows(wire, plan))
        else:  # host staging: one copy up, scatter on the device
            mirror[:-TRAILER_BYTES].copy_(wire[:-TRAILER_BYTES], non_blocking=True)
            _scatter(rows, index, plan, chunk, payload_rows(mirror, plan))
        if self._stream is not None:  # NOTE: the slot is busy until the queued copies out of it ran
            event = torch.cuda.Event()
            event.record(self._stream)
            self._slot_events[chunk % self.num_slots] = event
        self.hash_seconds += t1 - t0
        self.scatter_seconds += time.perf_counter() - t1

    def finish(self) -> None:
        """Wait for every copy queued on the side's stream (receiver: the KV blocks are written)."""
        self._wait_stream()


def _gather(
    rows: torch.Tensor | SourceRows, index: torch.Tensor, plan: ChunkPlan, chunk: int, out: torch.Tensor
) -> None:
    if isinstance(rows, SourceRows):
        rows.gather(index, plan, chunk, out)
    else:
        gather_rows(rows, index, plan, chunk, out)


def _scatter(
    rows: torch.Tensor | SourceRows, index: torch.Tensor, plan: ChunkPlan, chunk: int, src: torch.Tensor
) -> None:
    if isinstance(rows, SourceRows):
        rows.scatter(index, plan, chunk, src)
    else:
        scatter_rows(rows, index, plan, chunk, src)

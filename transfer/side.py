"""What KVSender and KVReceiver share: the KV view, channel, staging buffer, the transfer thread and its
wakeup, results, counters, signed handshake frames, the pairs' rendezvous link, dropped (dead) peers, and a
bounded, interruptible wait on a channel op."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import zmq

from cluster.protocol import TransferStats
from transfer.channel import Channel, PendingOp, layout_of
from transfer.handshake import HandshakeFrames, MessageKind
from transfer.kv_source import KvSource, SourceRows
from transfer.paced_link import PacedLink
from transfer.peers import PeerId
from transfer.protocol import (
    INTEGRITY_MODES,
    SCHEME_INTEGRITY,
    TransferError,
    TransferPeerLostError,
    TransferResult,
    TransferTimeoutError,
    moved_row_bytes,
)
from transfer.rendezvous import REASON_MISBOUND, RendezvousLink
from transfer.ring import StagingRing, on_stream
from transfer.staging import (
    CHECKSUM_SCHEMES,
    DEVICE_SCHEMES,
    ChunkPlan,
    accepted_checksums,
    default_checksum,
    kv_mac_key,
    kv_rows,
)
from transfer.wakeup import Wakeup

logger = logging.getLogger(__name__)

POLL_S = 0.05
# NOTE: 4 slots of 4 MiB bound staging to 16 MiB per side whatever the transfer's size. On the 2-core CPU box
# a gloo send cut into 1 MiB pieces took ~1.5x the CPU of 4-16 MiB pieces, and 2-16 MiB chunks measured
# alike within that shared box's noise (bench/bench_transfer.py --chunk-mib 2,4,8,16 --slots 3,4).
DEFAULT_CHUNK_BYTES = 4 << 20
NUM_SLOTS = 4


class PeerAbort(Exception):
    """The peer sent `abort`: fail locally without answering."""

    def __init__(self, error: TransferError) -> None:
        super().__init__(str(error))
        self.error = error


class Side:
    """Base of KVSender / KVReceiver: one transfer thread, reused staging buffers, its own CUDA stream,
    handshake frames signed with ``secret`` and addressed to ``me`` (this process), dropped peers.

    `integrity` (off | digest | mac; TransferConfig.integrity, whose default is mac) picks the chunk
    scheme by where chunks are staged (transfer/staging.py; on a GPU: computed there); a receiver accepts
    a header naming any scheme it can check at that integrity or stronger, and refuses a weaker one.
    None keeps `digest` (tools and tests). `checksum` names the scheme itself instead: then the receiver
    accepts exactly that one. MAC keys derive from `secret`, which also signs every handshake frame,
    the pairs' rendezvous values included: the side's `RendezvousLink` (transfer/rendezvous.py), attached
    to the channel (`Channel.use_link`), queues the values its pairs' builds set, and the transfer thread
    sends them (`_flush_rendezvous`) and hands over the ones it reads (`_take_rendezvous`).

    `link` (a mock engine's, transfer/paced_link.py): every transfer moves only the first
    `sample_bytes` of each K and V token row (``self.sample_bytes``, 0: all of them), and the receiver
    waits out the rest of the link's time; None moves every byte at the channel's own speed.
    """

    rank: ClassVar[int]  # this side's rank in each of its pairs' groups

    def __init__(
        self,
        kv: torch.Tensor | KvSource,
        me: PeerId,
        channel: Channel,
        secret: bytes,
        timeout_s: float,
        ctx: zmq.Context[Any] | None,
        num_slots: int,
        checksum: str | None = None,
        integrity: str | None = None,
        link: PacedLink | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._kv = kv
        self.layout = layout_of(kv)
        self.link = link
        self.sample_bytes = link.sample_bytes_for(self.layout) if link is not None else 0
        self._rows: torch.Tensor | SourceRows
        if isinstance(kv, torch.Tensor):
            self._rows = kv_rows(kv, self.sample_bytes)
        elif self.sample_bytes:
            # NOTE: a paced handoff's sample (the first words of each block's K and V) is the first
            # head's, which this process holds: moved from its own part, as at one rank
            self._rows = kv_rows(kv.local, self.sample_bytes)
        else:
            self._rows = SourceRows(kv)
        self._row_bytes = moved_row_bytes(self.layout, self.sample_bytes)
        self.me = me
        self._channel = channel
        self._frames = HandshakeFrames(secret, me.name)
        self._staging_device = channel.staging_device(kv.device)
        if integrity is not None and integrity not in INTEGRITY_MODES:
            raise ValueError(f"integrity must be one of {INTEGRITY_MODES}, got {integrity!r}")
        self.checksum = checksum or default_checksum(self._staging_device, integrity or "digest")
        on_gpu = self._staging_device.type == "cuda"
        if self.checksum not in CHECKSUM_SCHEMES or (on_gpu and self.checksum not in DEVICE_SCHEMES):
            raise ValueError(
                f"checksum {self.checksum!r} cannot seal chunks staged on {self._staging_device} "
                f"(one of {CHECKSUM_SCHEMES}; on a GPU only {DEVICE_SCHEMES})"
            )
        self.integrity = SCHEME_INTEGRITY[self.checksum]
        # NOTE: the schemes a receiver takes from a sender's header: exactly `checksum` if one was named
        self.accepted_checksums = (
            (self.checksum,) if checksum else accepted_checksums(self._staging_device, self.integrity)
        )
        self._mac_key = kv_mac_key(secret)
        self._wakeup = Wakeup()  # cuts the transfer thread's poll short (work from other threads)
        self._link = RendezvousLink(me, self.rank, self._wakeup.set)
        channel.use_link(self._link)
        self._buffers: dict[str, torch.Tensor] = {}
        # NOTE: the side's own stream: its copies never wait behind the engine's forward, and the host
        # waits on it alone (transfer/ring.py). None on CPU, where every stream operation is a no-op.
        self._stream = torch.cuda.Stream(kv.device) if kv.is_cuda else None
        self.timeout_s = timeout_s
        self._ctx = ctx or zmq.Context.instance()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._dropped: set[PeerId] = set()
        self._seen: set[PeerId] = set()  # every peer a transfer was asked with (drop_peer by worker id)
        self._history: deque[TransferResult] = deque(maxlen=1024)
        self._stats = TransferStats()
        name = f"{type(self).__name__}-{me.worker_id}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The transfer thread (its owner watches that it stays alive)."""
        return self._thread

    def drop_peer(self, worker_id: str, incarnation: str | None = None) -> set[PeerId]:
        """Mark a peer dead, from any thread: that process of the worker (``incarnation``), or every one
        this side has been asked to transfer with (None). The transfer with it in flight fails within one
        poll interval (TransferPeerLostError), queued work for it is dropped, it is never waited on again,
        and its pair is forgotten. A later incarnation of the worker is another peer. Returns the peers.

        NOTE: channel ops already posted towards it are abandoned, never waited on; their staging buffer
        is dropped with them (the op may still write into it) and their waiting thread (one per transfer,
        see OpLane) ends when gloo fails the op.
        """
        with self._lock:
            if incarnation is None:
                peers = {p for p in self._seen if p.worker_id == worker_id}
            else:
                peers = {PeerId(worker_id, incarnation)}
            self._dropped |= peers
        for peer in peers:
            self._channel.drop(peer)
            self._link.drop(peer)
        return peers

    def is_dropped(self, peer: PeerId) -> bool:
        with self._lock:
            return peer in self._dropped

    def _see(self, peer: PeerId) -> None:
        with self._lock:
            self._seen.add(peer)

    def _check_peer(self, peer: PeerId) -> None:
        if self.is_dropped(peer):
            raise TransferPeerLostError(f"peer {peer.name} was dropped (marked dead) by {self.me.name}")

    def broken_peers(self) -> list[str]:
        """Peers whose pair with this side is broken (rebuilt at the next generation on its next use)."""
        keys = self._channel.broken_pairs()
        return sorted(k.other(self.me).name for k in keys if self.me in k.ends)

    def rejected_frames(self) -> dict[str, int]:
        """Handshake frames this side dropped, by reason (cluster/frames.py; a forged rendezvous value:
        ``rendezvous_bad_tag``), and the signed rendezvous values it refused (transfer/rendezvous.py)."""
        return dict(Counter(self._frames.rejected()) + Counter(self._link.rejected()))

    def _flush_rendezvous(self) -> None:
        """Send the rendezvous values this side's pair builds set (transfer thread only)."""
        for peer, fields in self._link.take_outbox():
            frame = self._frames.encode(peer.name, MessageKind.RENDEZVOUS, 0, **fields)
            if not self._send_rendezvous(peer, frame):
                logger.warning("%s: no link to %s for a rendezvous value: dropped", self.me.name, peer.name)

    def _take_rendezvous(self, fields: dict[str, Any], is_from_named_peer: bool) -> None:
        """A verified rendezvous message; `is_from_named_peer`: it came over the connection of the peer it
        names (else it is refused as misbound)."""
        if is_from_named_peer:
            self._link.deliver(fields)
        else:
            self._link.reject(REASON_MISBOUND, f"{fields['prefill']}|{fields['decode']}|{fields['key']}")

    def _send_rendezvous(self, peer: PeerId, frame: bytes) -> bool:
        """Send a signed rendezvous frame to `peer`; False if this side has no connection to it."""
        raise NotImplementedError

    def _ring(self, plan: ChunkPlan, nonce: int, num_slots: int, scheme: str | None = None) -> StagingRing:
        """A staging ring for one transfer, carved from buffers reused across transfers.

        NOTE: on CPU a fresh buffer costs more in page faults than the copy itself, so the largest buffers
        are kept; after a failed transfer they are dropped (`_drop_staging`), because an abandoned channel
        op may still read or write them.
        """
        nbytes = StagingRing.nbytes(plan, num_slots)
        wire = self._buffer("wire", nbytes, self._staging_device)
        mirror = None
        if self._kv.is_cuda and self._staging_device.type == "cpu":  # NOTE: GPU staging needs no host copy
            mirror = self._buffer("mirror", nbytes, self._kv.device)
        scheme = scheme or self.checksum
        return StagingRing(plan, nonce, num_slots, wire, mirror, self._stream, scheme, self._mac_key)

    def _buffer(self, name: str, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            self._buffers.pop(name, None)  # NOTE: free the old one before allocating its successor
            pin = self._kv.is_cuda and device.type == "cpu"
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
            self._buffers[name] = buf
        return buf[:nbytes]

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """A fresh staging-device buffer for junk sends / unwanted recvs (never reused: ops may linger)."""
        pin = self._kv.is_cuda and self._staging_device.type == "cpu"
        return torch.empty(nbytes, dtype=torch.uint8, device=self._staging_device, pin_memory=pin)

    def _drop_staging(self) -> None:
        self._buffers.clear()

    def _on_stream(self) -> contextlib.AbstractContextManager[None]:
        return on_stream(self._stream)

    def _wait_op(self, op: PendingOp, deadline: float, check: Callable[[], None]) -> float:
        """Wait for `op` until `deadline`, calling `check` (raises to give up) every POLL_S at most;
        returns the seconds waited."""
        t0 = time.perf_counter()
        while True:
            check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(f"channel op did not complete within {self.timeout_s:.3f}s")
            with contextlib.suppress(TransferTimeoutError):
                op.wait(min(left, POLL_S))
                return time.perf_counter() - t0

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the transfer thread (after its current transfer) and close its sockets; pair builds still
        waiting for the other end's rendezvous values fail at once."""
        self._stop.set()
        self._link.close_all(f"{self.me.name} closed")
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._close_sockets()

    def results(self) -> list[TransferResult]:
        with self._lock:
            return list(self._history)

    def stats(self) -> TransferStats:
        with self._lock:
            return TransferStats(**vars(self._stats))

    def _count_rejected_chunk(self) -> None:
        """A received chunk failed its digest or MAC: counted (TransferStats.num_rejected_chunks)."""
        with self._lock:
            self._stats.num_rejected_chunks += 1

    def _record(self, result: TransferResult) -> None:
        if not result.ok:
            logger.warning(
                "%s %s: transfer of %r failed: %s: %s",
                type(self).__name__, self.me.name, result.request_id, result.error_type, result.error,
            )  # fmt: skip
        with self._lock:
            self._history.append(result)
            if result.ok:
                self._stats.num_ok += 1
                self._stats.bytes_total += result.nbytes
                self._stats.seconds_total += result.seconds
            else:
                self._stats.num_failed += 1

    def _run(self) -> None:
        raise NotImplementedError

    def _close_sockets(self) -> None:
        raise NotImplementedError


def as_transfer_error(e: Exception) -> TransferError:
    if isinstance(e, TransferError):
        return e
    error = TransferError(f"{type(e).__name__}: {e}")
    error.__cause__ = e
    return error


def abort_frame(frames: HandshakeFrames, to: PeerId, nonce: int, error: TransferError) -> bytes:
    return frames.encode(
        to.name, MessageKind.ABORT, nonce, error_type=type(error).__name__, message=str(error)[:2000]
    )


def fail(result: TransferResult, error: BaseException) -> None:
    result.ok = False
    result.error = str(error)
    result.error_type = type(error).__name__

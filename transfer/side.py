"""What KVSender and KVReceiver share: the KV view, channel, staging buffer, the transfer thread, results,
counters, dropped (dead) peers, and a bounded, interruptible wait on a channel op."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import zmq

from cluster.protocol import TransferStats
from transfer.channel import Channel, PendingOp, layout_of
from transfer.protocol import (
    MessageKind,
    TransferError,
    TransferPeerLostError,
    TransferResult,
    TransferTimeoutError,
    encode_message,
    row_bytes_of,
)
from transfer.staging import kv_rows

POLL_S = 0.05
DEFAULT_CHUNK_BYTES = 16 << 20


class PeerAbort(Exception):
    """The peer sent `abort`: fail locally without answering."""

    def __init__(self, error: TransferError) -> None:
        super().__init__(str(error))
        self.error = error


class Side:
    """Base of KVSender / KVReceiver: one transfer thread, one reused staging buffer, dropped peers."""

    def __init__(
        self, kv: torch.Tensor, rank: int, channel: Channel, timeout_s: float, ctx: zmq.Context[Any] | None
    ) -> None:
        self._kv = kv
        self.layout = layout_of(kv)
        self._rows = kv_rows(kv)
        self._row_bytes = row_bytes_of(self.layout)
        self.rank = rank
        self._channel = channel
        self._staging_device = channel.staging_device(kv.device)
        self._staging_buf: torch.Tensor | None = None
        self.timeout_s = timeout_s
        self._ctx = ctx or zmq.Context.instance()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._dropped: set[int] = set()
        self._history: deque[TransferResult] = deque(maxlen=1024)
        self._stats = TransferStats()
        self._thread = threading.Thread(target=self._run, name=f"{type(self).__name__}-{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The transfer thread (its owner watches that it stays alive)."""
        return self._thread

    def drop_peer(self, rank: int) -> None:
        """Mark `rank` dead, from any thread: the transfer with it in flight fails within one poll
        interval (TransferPeerLostError), queued work for it is dropped, and it is never waited on again.

        NOTE: channel ops already posted towards it are abandoned, never waited on; their staging buffer
        is dropped with them (the op may still write into it) and their waiting thread (one per transfer,
        see OpLane) ends when gloo fails the op.
        """
        with self._lock:
            self._dropped.add(rank)

    def is_dropped(self, rank: int) -> bool:
        with self._lock:
            return rank in self._dropped

    def _check_peer(self, rank: int) -> None:
        if self.is_dropped(rank):
            raise TransferPeerLostError(f"peer rank {rank} was dropped (marked dead) by rank {self.rank}")

    def _staging(self, nbytes: int) -> torch.Tensor:
        """A uint8 staging view of `nbytes`, carved from one reused buffer.

        NOTE: on CPU a fresh multi-GB buffer costs more in page faults than the copy itself, so the
        largest buffer is kept; after a failed transfer it is dropped (`_drop_staging`), because an
        abandoned channel op may still read or write it.
        """
        if self._staging_buf is None or self._staging_buf.numel() < nbytes:
            self._staging_buf = None
            pin = self._kv.is_cuda and self._staging_device.type == "cpu"
            self._staging_buf = torch.empty(
                nbytes, dtype=torch.uint8, device=self._staging_device, pin_memory=pin
            )
        return self._staging_buf[:nbytes]

    def _drop_staging(self) -> None:
        self._staging_buf = None

    def _wait_op(self, op: PendingOp, deadline: float, check: Callable[[], None]) -> None:
        """Wait for `op` until `deadline`, calling `check` (raises to give up) every POLL_S at most."""
        while True:
            check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(f"channel op did not complete within {self.timeout_s:.3f}s")
            with contextlib.suppress(TransferTimeoutError):
                op.wait(min(left, POLL_S))
                return

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the transfer thread (after its current transfer) and close its sockets."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._close_sockets()

    def results(self) -> list[TransferResult]:
        with self._lock:
            return list(self._history)

    def stats(self) -> TransferStats:
        with self._lock:
            return TransferStats(**vars(self._stats))

    def _record(self, result: TransferResult) -> None:
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

    def _sync(self) -> None:
        if self._kv.is_cuda:
            torch.cuda.current_stream(self._kv.device).synchronize()


def as_transfer_error(e: Exception) -> TransferError:
    if isinstance(e, TransferError):
        return e
    error = TransferError(f"{type(e).__name__}: {e}")
    error.__cause__ = e
    return error


def abort_frame(nonce: int, error: TransferError) -> bytes:
    return encode_message(MessageKind.ABORT, nonce, error_type=type(error).__name__, message=str(error))


def fail(result: TransferResult, error: BaseException) -> None:
    result.ok = False
    result.error = str(error)
    result.error_type = type(error).__name__

"""KVSender (prefill side) and KVReceiver (decode side): gather -> staging -> channel -> scatter.

Each side runs ONE transfer thread that owns its ZMQ sockets and does one transfer at a time, so between
a given pair the handshake strictly orders the channel ops (frames: transfer/protocol.py). Every wait is
bounded by `timeout_s` (and on the receiver by the request's deadline); a side that fails sends an
`abort` frame so its peer fails at once instead of waiting out its own timeout.

Block ownership: the sender never frees anything. For each request it `offer`ed, `on_sent(request_id, ok)`
runs exactly once, on the transfer thread: ok=True after the receiver's `done`, ok=False when a transfer
failed or the lease expired. The blocks' owner frees them then (keep the callback quick and thread-safe).
A request withdrawn with `abort()` while not in flight gets no callback.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from transfer.channel import Channel, gather_blocks, layout_of, scatter_blocks, staging_checksum
from transfer.protocol import (
    KVHandoff,
    MessageKind,
    TransferChecksumError,
    TransferError,
    TransferHeader,
    TransferMismatchError,
    TransferRejectedError,
    TransferRequest,
    TransferResult,
    TransferStats,
    TransferTimeoutError,
    decode_message,
    encode_message,
    error_from_remote,
    header_from_dict,
    request_from_dict,
    tag_for_nonce,
    validate_header,
)

_POLL_MS = 50
logger = logging.getLogger(__name__)


class _PeerAbort(Exception):
    """The peer sent `abort`: fail locally without answering."""

    def __init__(self, error: TransferError) -> None:
        super().__init__(str(error))
        self.error = error


class _Side:
    """What both sides share: KV view, channel, the transfer thread, result history and counters."""

    def __init__(
        self, kv: torch.Tensor, rank: int, channel: Channel, timeout_s: float, ctx: zmq.Context[Any] | None
    ) -> None:
        self._kv = kv
        self.layout = layout_of(kv)
        self.rank = rank
        self._channel = channel
        self._staging_device = channel.staging_device(kv.device)
        self._staging_buf: torch.Tensor | None = None
        self.timeout_s = timeout_s
        self._ctx = ctx or zmq.Context.instance()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._history: deque[TransferResult] = deque(maxlen=1024)
        self._stats = TransferStats()
        self._thread = threading.Thread(target=self._run, name=f"{type(self).__name__}-{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _staging(self, num_blocks: int) -> torch.Tensor:
        """A staging view for `num_blocks` blocks, carved from one reused buffer.

        NOTE: on CPU a fresh multi-GB buffer costs more in page faults than the copy itself, so the
        largest buffer is kept; after a failed transfer it is dropped (`_drop_staging`), because an
        abandoned channel op may still write into it.
        """
        nbytes = self.layout.bytes_per_block * num_blocks
        if self._staging_buf is None or self._staging_buf.numel() < nbytes:
            self._staging_buf = None
            pin = self._kv.is_cuda and self._staging_device.type == "cpu"
            self._staging_buf = torch.empty(
                nbytes, dtype=torch.uint8, device=self._staging_device, pin_memory=pin
            )
        return self._staging_buf[:nbytes].view(self._kv.dtype).view(self.layout.staging_shape(num_blocks))

    def _drop_staging(self) -> None:
        self._staging_buf = None

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


def _as_transfer_error(e: Exception) -> TransferError:
    if isinstance(e, TransferError):
        return e
    error = TransferError(f"{type(e).__name__}: {e}")
    error.__cause__ = e
    return error


def _abort_frame(nonce: int, error: TransferError) -> bytes:
    return encode_message(MessageKind.ABORT, nonce, error_type=type(error).__name__, message=str(error))


def _fail(result: TransferResult, error: BaseException) -> None:
    result.ok = False
    result.error = str(error)
    result.error_type = type(error).__name__


@dataclass
class _Lease:
    expiry: float  # time.monotonic()
    in_flight: bool = False


class KVSender(_Side):
    """Prefill side: serves transfer requests for the requests it `offer`ed, one at a time.

    `get_block_ids(request_id)` returns the request's block ids in order (None if the engine no longer
    holds it); it is called in `offer` and then on the transfer thread, so the table must not change
    while the request is offered. Bind `endpoint` (tcp://127.0.0.1:* picks a port; the
    resolved address is `self.endpoint`).
    """

    def __init__(
        self,
        kv: torch.Tensor,
        *,
        rank: int,
        channel: Channel,
        get_block_ids: Callable[[str], list[int] | None],
        on_sent: Callable[[str, bool], None],
        endpoint: str = "tcp://127.0.0.1:*",
        timeout_s: float = 30.0,
        lease_s: float = 60.0,
        zmq_context: zmq.Context[Any] | None = None,
    ) -> None:
        super().__init__(kv, rank, channel, timeout_s, zmq_context)
        self._get_block_ids = get_block_ids
        self._on_sent = on_sent
        self.lease_s = lease_s
        self._leases: dict[str, _Lease] = {}
        self._pending: deque[tuple[bytes, TransferRequest]] = deque()
        # (ident, nonce) -> (dst_rank, tag, nbytes) of transfers we gave up on while waiting for the ack
        self._abandoned: dict[tuple[bytes, int], tuple[int, int, int]] = {}
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def offer(
        self,
        request_id: str,
        num_tokens: int,
        block_hashes: Sequence[str | bytes] = (),
        lease_s: float | None = None,
    ) -> KVHandoff:
        """Start holding `request_id` for a transfer; its blocks stay the caller's until `on_sent`."""
        block_ids = self._get_block_ids(request_id)
        if block_ids is None:
            raise TransferRejectedError(f"cannot offer request {request_id!r}: no blocks for it")
        lease = self.lease_s if lease_s is None else lease_s
        with self._lock:
            if request_id in self._leases:
                raise TransferRejectedError(f"request {request_id!r} is already offered")
            self._leases[request_id] = _Lease(expiry=time.monotonic() + lease)
        return KVHandoff(
            request_id=request_id,
            src_rank=self.rank,
            src_endpoint=self.endpoint,
            layout=self.layout,
            num_tokens=num_tokens,
            num_blocks=len(block_ids),
            lease_expiry=time.time() + lease,
            block_hashes=list(block_hashes),
        )

    def abort(self, request_id: str) -> bool:
        """Withdraw an offer. True: withdrawn, no callback will come. False: in flight (its `on_sent`
        still comes) or unknown."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.in_flight:
                return False
            del self._leases[request_id]
            return True

    def num_held(self) -> int:
        with self._lock:
            return len(self._leases)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._expire_leases()
                    if self._pending:
                        self._serve(*self._pending.popleft())
                    elif self._sock.poll(_POLL_MS):
                        self._on_frame(self._sock.recv_multipart(), None)
                except Exception:  # NOTE: e.g. a raising on_sent callback must not stop all transfers
                    logger.exception("KVSender rank %d: transfer thread error", self.rank)
        finally:
            self._sock.close(linger=0)

    def _close_sockets(self) -> None:
        if not self._thread.is_alive():
            self._sock.close(linger=0)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [r for r, lease in self._leases.items() if not lease.in_flight and lease.expiry <= now]
            for request_id in expired:
                del self._leases[request_id]
        for request_id in expired:
            self._record(
                TransferResult(request_id, ok=False, error="lease expired", error_type="LeaseExpired")
            )
            self._on_sent(request_id, False)

    def _on_frame(
        self, frames: list[bytes], waiting: tuple[bytes, int] | None
    ) -> tuple[MessageKind, Any] | None:
        """Queue requests, drop stale frames; return (kind, body) if it answers `waiting` (ident, nonce)."""
        if len(frames) != 2:
            return None
        ident, data = frames
        try:
            kind, nonce, body = decode_message(data)
        except TransferError:
            return None
        if waiting == (ident, nonce):
            return kind, body
        if kind is MessageKind.REQUEST:
            try:
                self._pending.append((ident, request_from_dict(body["request"])))
            except (TransferError, KeyError) as e:
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.send_multipart(
                        [ident, _abort_frame(nonce, _as_transfer_error(e))], zmq.NOBLOCK
                    )
        elif kind is MessageKind.ACK and (ident, nonce) in self._abandoned:
            # NOTE: the receiver posted its recv before acking; feed it (zeros: its checksum fails) so
            # no recv stays pending forever, which would close the gloo pair at the group timeout.
            dst_rank, tag, nbytes = self._abandoned.pop((ident, nonce))
            try:
                self._channel.isend(
                    torch.zeros(nbytes, dtype=torch.uint8, device=self._staging_device), dst_rank, tag
                )
            except Exception:  # NOTE: must not fail the transfer this frame interrupted
                logger.exception("KVSender rank %d: could not feed an abandoned recv", self.rank)
        elif kind is MessageKind.ABORT:  # the receiver gave up before we served it
            for item in [p for p in self._pending if p[0] == ident and p[1].nonce == nonce]:
                self._pending.remove(item)
                self._finish_lease(item[1].request_id, False)
        return None

    def _finish_lease(self, request_id: str, ok: bool) -> None:
        with self._lock:
            lease = self._leases.pop(request_id, None)
        if lease is not None:
            self._on_sent(request_id, ok)

    def _await(self, ident: bytes, nonce: int, want: MessageKind, deadline: float) -> None:
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise TransferTimeoutError(f"no {want.value} from the receiver within {self.timeout_s:.3f}s")
            if not self._sock.poll(min(left_ms, _POLL_MS)):
                continue
            reply = self._on_frame(self._sock.recv_multipart(), (ident, nonce))
            if reply is None:
                continue
            kind, body = reply
            if kind is MessageKind.ABORT:
                raise _PeerAbort(error_from_remote(body.get("error_type", ""), body.get("message", "")))
            if kind is not want:
                raise TransferError(f"expected {want.value} from the receiver, got {kind.value}")
            return

    def _serve(self, ident: bytes, req: TransferRequest) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        result = TransferResult(req.request_id, ok=False)
        with self._lock:
            lease = self._leases.get(req.request_id)
            if lease is not None:
                lease.in_flight = True
        try:
            if lease is None:
                raise TransferRejectedError(
                    f"rank {self.rank} does not hold request {req.request_id!r} (unknown, aborted or expired)"
                )
            header, staging = self._prepare(req)
            result.num_blocks, result.nbytes = header.num_blocks, header.nbytes
            self._sock.send_multipart(
                [ident, encode_message(MessageKind.HEADER, req.nonce, header=header)], zmq.NOBLOCK
            )
            try:
                self._await(ident, req.nonce, MessageKind.ACK, deadline)
            except TransferTimeoutError:
                if header.nbytes:
                    if len(self._abandoned) >= 64:
                        self._abandoned.pop(next(iter(self._abandoned)))
                    self._abandoned[(ident, req.nonce)] = (req.dst_rank, header.tag, header.nbytes)
                raise
            if header.nbytes:
                t_wire = time.monotonic()
                self._channel.send(staging, req.dst_rank, header.tag, deadline - t_wire)
                result.wire_seconds = time.monotonic() - t_wire
            self._await(ident, req.nonce, MessageKind.DONE, deadline)
            result.ok = True
        except _PeerAbort as e:
            _fail(result, e.error)
        except Exception as e:  # noqa: BLE001 (NOTE: the transfer thread must outlive any one bad transfer)
            error = _as_transfer_error(e)
            _fail(result, error)
            with contextlib.suppress(zmq.ZMQError):  # best effort: the receiver times out anyway
                self._sock.send_multipart([ident, _abort_frame(req.nonce, error)], zmq.NOBLOCK)
        if not result.ok:
            self._drop_staging()
        result.seconds = time.monotonic() - t0
        self._record(result)
        if lease is not None:
            self._finish_lease(req.request_id, result.ok)

    def _prepare(self, req: TransferRequest) -> tuple[TransferHeader, torch.Tensor]:
        """Gather the tail the receiver lacks into staging and describe it."""
        block_ids = self._get_block_ids(req.request_id)
        if block_ids is None:
            raise TransferRejectedError(f"rank {self.rank} no longer has blocks for {req.request_id!r}")
        skip = req.skip_first_n_blocks
        if not 0 <= skip <= len(block_ids):
            raise TransferMismatchError(
                f"skip_first_n_blocks={skip} but request {req.request_id!r} has {len(block_ids)} blocks"
            )
        num_blocks = len(block_ids) - skip
        if num_blocks != req.num_dst_blocks:  # NOTE: checked before the gather; the header check repeats it
            raise TransferMismatchError(
                f"num_blocks: {req.request_id!r} has {num_blocks} blocks after skipping {skip}, "
                f"the receiver reserved {req.num_dst_blocks}"
            )
        staging = gather_blocks(self._kv, block_ids[skip:], self._staging(num_blocks))
        header = TransferHeader(
            request_id=req.request_id,
            nonce=req.nonce,
            src_rank=self.rank,
            dst_rank=req.dst_rank,
            layout=self.layout,
            dtype=self.layout.dtype,
            shape=self.layout.layer_shape(num_blocks),
            num_blocks=num_blocks,
            nbytes=staging.numel() * staging.element_size(),
            checksum=staging_checksum(staging),
            tag=tag_for_nonce(req.nonce),
        )
        return header, staging


@dataclass
class _Job:
    handoff: KVHandoff
    dst_block_ids: list[int]
    skip_first_n_blocks: int
    deadline: float  # time.monotonic()
    future: Future[TransferResult]


class KVReceiver(_Side):
    """Decode side: fetches a handoff's KV into blocks the caller reserved, one transfer at a time."""

    def __init__(
        self,
        kv: torch.Tensor,
        *,
        rank: int,
        channel: Channel,
        timeout_s: float = 30.0,
        zmq_context: zmq.Context[Any] | None = None,
    ) -> None:
        super().__init__(kv, rank, channel, timeout_s, zmq_context)
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._dealers: dict[str, zmq.Socket[Any]] = {}

    def submit(
        self,
        handoff: KVHandoff,
        dst_block_ids: Sequence[int],
        skip_first_n_blocks: int = 0,
        deadline: float | None = None,
    ) -> Future[TransferResult]:
        """Queue a fetch of `handoff` minus its first `skip_first_n_blocks` blocks into `dst_block_ids`.

        The future resolves to a TransferResult or raises a TransferError, either way within `timeout_s`
        of this call (or by `deadline`, time.time() seconds, if sooner; queueing behind other transfers
        counts). On success the blocks are written and visible (device synchronized); on failure they
        may hold partial data and stay the caller's to free or reuse. Raises ValueError on bad block ids.
        """
        if not self._thread.is_alive():
            raise TransferError("KVReceiver is not running: call start() (or it was closed)")
        num_blocks = int(self._kv.shape[1])
        ids = list(dst_block_ids)
        if any(not 1 <= b < num_blocks for b in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"dst_block_ids must be distinct ids in [1, {num_blocks}), got {ids}")
        if skip_first_n_blocks < 0:
            raise ValueError(f"skip_first_n_blocks must be >= 0, got {skip_first_n_blocks}")
        budget = self.timeout_s if deadline is None else min(self.timeout_s, deadline - time.time())
        future: Future[TransferResult] = Future()
        self._jobs.put(_Job(handoff, ids, skip_first_n_blocks, time.monotonic() + budget, future))
        return future

    def receive(
        self,
        handoff: KVHandoff,
        dst_block_ids: Sequence[int],
        skip_first_n_blocks: int = 0,
        deadline: float | None = None,
    ) -> TransferResult:
        """Blocking `submit`: returns the result or raises the TransferError."""
        return self.submit(handoff, dst_block_ids, skip_first_n_blocks, deadline).result()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    job = self._jobs.get(timeout=_POLL_MS / 1000)
                except queue.Empty:
                    continue
                if not job.future.set_running_or_notify_cancel():
                    continue  # cancelled by the caller before it started
                result, error = self._serve(job)
                if error is None:
                    job.future.set_result(result)
                else:
                    job.future.set_exception(error)
            while not self._jobs.empty():
                future = self._jobs.get().future
                if future.set_running_or_notify_cancel():
                    future.set_exception(TransferError("receiver closed"))
        finally:
            for sock in self._dealers.values():
                sock.close(linger=0)

    def _close_sockets(self) -> None:
        pass  # owned and closed by the transfer thread

    def _dealer(self, endpoint: str) -> zmq.Socket[Any]:
        sock = self._dealers.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._dealers[endpoint] = sock
        return sock

    def _await(self, sock: zmq.Socket[Any], nonce: int, want: MessageKind, deadline: float) -> dict[str, Any]:
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise TransferTimeoutError(f"no {want.value} from the sender before the transfer deadline")
            if not sock.poll(min(left_ms, _POLL_MS)):
                continue
            try:
                kind, got_nonce, body = decode_message(sock.recv())
            except TransferError:
                continue
            if got_nonce != nonce:
                continue  # a late frame of an abandoned transfer
            if kind is MessageKind.ABORT:
                raise _PeerAbort(error_from_remote(body.get("error_type", ""), body.get("message", "")))
            if kind is not want:
                raise TransferError(f"expected {want.value} from the sender, got {kind.value}")
            return body

    def _serve(self, job: _Job) -> tuple[TransferResult, TransferError | None]:
        t0 = time.monotonic()
        error: TransferError | None = None
        handoff, dst_ids = job.handoff, job.dst_block_ids
        result = TransferResult(handoff.request_id, ok=False, num_blocks=len(dst_ids))
        sock = self._dealer(handoff.src_endpoint)
        nonce = secrets.randbits(63)
        request = TransferRequest(handoff.request_id, nonce, self.rank, job.skip_first_n_blocks, len(dst_ids))
        try:
            sock.send(encode_message(MessageKind.REQUEST, nonce, request=request), zmq.NOBLOCK)
            body = self._await(sock, nonce, MessageKind.HEADER, job.deadline)
            header = header_from_dict(body["header"])
            validate_header(
                header,
                request_id=handoff.request_id,
                nonce=nonce,
                src_rank=handoff.src_rank,
                dst_rank=self.rank,
                layout=self.layout,
                num_blocks=len(dst_ids),
            )
            result.nbytes = header.nbytes
            staging = self._staging(header.num_blocks)
            op = self._channel.irecv(staging, handoff.src_rank, header.tag) if header.nbytes else None
            sock.send(encode_message(MessageKind.ACK, nonce), zmq.NOBLOCK)
            if op is not None:
                t_wire = time.monotonic()
                op.wait(job.deadline - t_wire)
                result.wire_seconds = time.monotonic() - t_wire
                checksum = staging_checksum(staging)
                if checksum != header.checksum:
                    raise TransferChecksumError(
                        f"checksum of {header.nbytes} B for {handoff.request_id!r} is {checksum}, "
                        f"header says {header.checksum}"
                    )
                scatter_blocks(self._kv, dst_ids, staging)
                self._sync()
            sock.send(encode_message(MessageKind.DONE, nonce), zmq.NOBLOCK)
            result.ok = True
        except _PeerAbort as e:
            error = e.error
            _fail(result, error)
        except Exception as e:  # noqa: BLE001 (NOTE: the transfer thread must outlive any one bad transfer)
            error = _as_transfer_error(e)
            _fail(result, error)
            with contextlib.suppress(zmq.ZMQError):  # best effort: the sender times out anyway
                sock.send(_abort_frame(nonce, error), zmq.NOBLOCK)
        if not result.ok:
            self._drop_staging()
        result.seconds = time.monotonic() - t0
        self._record(result)
        return result, error

"""KVReceiver (decode side): fetches a handoff's KV into blocks the caller reserved, one transfer at a time.

Per transfer: REQUEST (with the least pair generation this side accepts) -> sender's HEADER (validated)
-> join the pair at the header's generation (built and warmed up if new) -> post the recv of every chunk
into its slot of a staging ring -> ACK -> verify and scatter chunk i while the next chunks arrive, then CREDIT its slot ->
sync the side's stream -> DONE. See transfer/protocol.py and transfer/ring.py.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from transfer.channel import Channel, OpLane, PendingOp
from transfer.handshake import MessageKind
from transfer.peers import DECODE_RANK, PairKey, PeerId
from transfer.protocol import (
    KVHandoff,
    TransferError,
    TransferPeerLostError,
    TransferRequest,
    TransferResult,
    TransferTimeoutError,
    chunk_tag,
    error_from_remote,
    tag_for_nonce,
    validate_header,
)
from transfer.side import NUM_SLOTS, POLL_S, PeerAbort, Side, abort_frame, as_transfer_error, fail
from transfer.staging import ChunkPlan, block_index


@dataclass
class _Job:
    handoff: KVHandoff
    dst_block_ids: list[int]
    skip_first_n_blocks: int
    deadline: float  # time.monotonic()
    future: Future[TransferResult]


class KVReceiver(Side):
    """Decode side: fetches a handoff's KV into blocks the caller reserved, one transfer at a time.

    Staging holds `num_slots` chunks (of the sender's chunk size) whatever the transfer's size; the
    sender runs up to `num_slots` chunks ahead of the scatter. `me` is this process (the sender addresses
    its frames to it); every frame is checked against `secret` (transfer/handshake.py).
    """

    def __init__(
        self,
        kv: torch.Tensor,
        *,
        me: PeerId,
        channel: Channel,
        secret: bytes,
        timeout_s: float = 30.0,
        zmq_context: zmq.Context[Any] | None = None,
        num_slots: int = NUM_SLOTS,
    ) -> None:
        super().__init__(kv, me, channel, secret, timeout_s, zmq_context, num_slots)
        self._jobs: deque[_Job] = deque()
        self._jobs_cond = threading.Condition(self._lock)
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
        counts), and at once (TransferPeerLostError) if the handoff's peer is or gets dropped. On success
        the blocks are written and visible (device synchronized); on failure they may hold partial data
        (chunks verified before the failure; a sender failing mid-transfer may also land junk in a slot
        between its digest check and its scatter) and stay the caller's to free or reuse: never use
        them. Raises ValueError on bad block ids.
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
        job = _Job(handoff, ids, skip_first_n_blocks, time.monotonic() + budget, Future())
        with self._jobs_cond:
            self._seen.add(_src(handoff))
            is_dropped = _src(handoff) in self._dropped
            if not is_dropped:
                self._jobs.append(job)
                self._jobs_cond.notify()
        if is_dropped:
            self._fail_job(job)
        return job.future

    def receive(
        self,
        handoff: KVHandoff,
        dst_block_ids: Sequence[int],
        skip_first_n_blocks: int = 0,
        deadline: float | None = None,
    ) -> TransferResult:
        """Blocking `submit`: returns the result or raises the TransferError."""
        return self.submit(handoff, dst_block_ids, skip_first_n_blocks, deadline).result()

    def drop_peer(self, worker_id: str, incarnation: str | None = None) -> set[PeerId]:
        """Side.drop_peer, and the queued fetches from it fail at once (TransferPeerLostError)."""
        peers = super().drop_peer(worker_id, incarnation)
        with self._jobs_cond:
            dropped_jobs = [j for j in self._jobs if _src(j.handoff) in peers]
            for job in dropped_jobs:
                self._jobs.remove(job)
        for job in dropped_jobs:
            self._fail_job(job)
        return peers

    def _fail_job(self, job: _Job) -> None:
        error = TransferPeerLostError(
            f"peer {_src(job.handoff).name} was dropped (marked dead) by {self.me.name}: "
            f"not fetching {job.handoff.request_id!r}"
        )
        result = TransferResult(job.handoff.request_id, ok=False, num_blocks=len(job.dst_block_ids))
        fail(result, error)
        self._record(result)
        if job.future.set_running_or_notify_cancel():
            job.future.set_exception(error)

    def _next_job(self) -> _Job | None:
        with self._jobs_cond:
            if not self._jobs:
                self._jobs_cond.wait(POLL_S)
            return self._jobs.popleft() if self._jobs else None

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                job = self._next_job()
                if job is None or not job.future.set_running_or_notify_cancel():
                    continue  # nothing queued, or cancelled by the caller before it started
                result, error = self._serve(job)
                if error is None:
                    job.future.set_result(result)
                else:
                    job.future.set_exception(error)
            with self._jobs_cond:
                left, self._jobs = list(self._jobs), deque()
            for job in left:
                if job.future.set_running_or_notify_cancel():
                    job.future.set_exception(TransferError("receiver closed"))
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

    def _poll(
        self, sock: zmq.Socket[Any], nonce: int, timeout_ms: int
    ) -> tuple[MessageKind, dict[str, Any]] | None:
        """One frame of this transfer if it comes within `timeout_ms`; raises PeerAbort on `abort`.
        Frames that fail a check are counted and dropped (transfer/handshake.py)."""
        if not sock.poll(timeout_ms):
            return None
        message = self._frames.decode(sock.recv())
        if message is None:
            return None
        kind, got_nonce, body = message
        if got_nonce != nonce:
            return None  # a late frame of an abandoned transfer
        if kind is MessageKind.ABORT:
            raise PeerAbort(error_from_remote(body["error_type"], body["message"]))
        return kind, body

    def _await(
        self, sock: zmq.Socket[Any], job: _Job, nonce: int, want: MessageKind, deadline: float
    ) -> dict[str, Any]:
        while True:
            self._check_peer(_src(job.handoff))
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise TransferTimeoutError(f"no {want.value} from the sender before the transfer deadline")
            reply = self._poll(sock, nonce, min(left_ms, int(POLL_S * 1000)))
            if reply is None:
                continue
            if reply[0] is not want:
                raise TransferError(f"expected {want.value} from the sender, got {reply[0].value}")
            body: dict[str, Any] = reply[1]
            return body

    def _serve(self, job: _Job) -> tuple[TransferResult, TransferError | None]:
        t0 = time.monotonic()
        error: TransferError | None = None
        handoff, dst_ids = job.handoff, job.dst_block_ids
        src = _src(handoff)
        result = TransferResult(handoff.request_id, ok=False, num_blocks=len(dst_ids))
        sock = self._dealer(handoff.src_endpoint)
        nonce = secrets.randbits(63)
        generation = self._channel.generation(src, self.me)
        request = TransferRequest(
            handoff.request_id,
            nonce,
            self.me.worker_id,
            self.me.incarnation,
            generation,
            job.skip_first_n_blocks,
            len(dst_ids),
        )
        key: PairKey | None = None
        ops: list[PendingOp] = []
        is_sent = False
        try:
            self._check_peer(src)
            if time.monotonic() >= job.deadline:
                raise TransferTimeoutError(f"deadline passed while {handoff.request_id!r} was queued")
            self._send(sock, src, MessageKind.REQUEST, nonce, request=request)
            is_sent = True
            header = self._await(sock, job, nonce, MessageKind.HEADER, job.deadline)["header"]
            validate_header(
                header,
                request_id=handoff.request_id,
                nonce=nonce,
                src_worker_id=src.worker_id,
                dst_worker_id=self.me.worker_id,
                min_generation=generation,
                backend=self._channel.backend,
                layout=self.layout,
                num_blocks=len(dst_ids),
            )
            result.nbytes, result.generation = header.nbytes, header.generation
            key = PairKey(src, self.me, header.generation)
            joined = self._channel.connect(key, DECODE_RANK)
            self._wait_op(joined, job.deadline, lambda: self._check_and_poll(sock, src, nonce))
            plan = ChunkPlan.create(self.layout.num_layers, len(dst_ids), self._row_bytes, header.chunk_bytes)
            with self._on_stream():
                self._receive_chunks(sock, job, key, nonce, plan, result, ops)
            self._send(sock, src, MessageKind.DONE, nonce)
            result.ok = True
        except PeerAbort as e:
            error = e.error
            fail(result, error)
        except Exception as e:  # noqa: BLE001 (NOTE: the transfer thread must outlive any one bad transfer)
            error = as_transfer_error(e)
            fail(result, error)
            if is_sent and not isinstance(error, TransferPeerLostError):
                with contextlib.suppress(zmq.ZMQError):  # best effort: the sender times out anyway
                    sock.send(abort_frame(self._frames, src, nonce, error), zmq.NOBLOCK)
        if not result.ok:
            self._drop_staging()
            if key is not None:
                self._channel.abandon(key, ops)
        result.seconds = time.monotonic() - t0
        self._record(result)
        return result, error

    def _send(self, sock: zmq.Socket[Any], to: PeerId, kind: MessageKind, nonce: int, **fields: Any) -> None:
        sock.send(self._frames.encode(to.name, kind, nonce, **fields), zmq.NOBLOCK)

    def _check_and_poll(self, sock: zmq.Socket[Any], src: PeerId, nonce: int) -> None:
        """Give up on a dropped peer or on its `abort` (PeerAbort); other frames of this transfer wait."""
        self._check_peer(src)
        self._poll(sock, nonce, 0)

    def _receive_chunks(
        self,
        sock: zmq.Socket[Any],
        job: _Job,
        key: PairKey,
        nonce: int,
        plan: ChunkPlan,
        result: TransferResult,
        ops: list[PendingOp],
    ) -> None:
        """Post the recv of every chunk into its ring slot (into `ops`), ack, then verify and scatter each
        chunk as it lands and credit the sender with its slot. Counts the phases' seconds in `result`.
        Runs on the side's stream."""
        src = key.prefill
        num_slots = min(self.num_slots, plan.num_chunks)
        ring = self._ring(plan, nonce, num_slots)
        index = block_index(job.dst_block_ids, self._kv.device)
        tag = tag_for_nonce(nonce)
        lane = OpLane(f"recv-{src.worker_id}")
        what = f"{job.handoff.request_id!r} from {src.name}"
        for c in range(plan.num_chunks):
            ops.append(self._channel.irecv(ring.wire(c), key, chunk_tag(tag, c), lane))
        self._send(sock, src, MessageKind.ACK, nonce, num_slots=self.num_slots)
        t_wire = time.monotonic()

        def check() -> None:
            self._check_and_poll(sock, src, nonce)

        # NOTE: a credit every few chunks (each covers every chunk drained so far): every frame costs a
        # wakeup of both sides' ZMQ threads, and the sender still has `num_slots - credit_every` chunks in
        # flight. The sender needs chunks 0..last_needed credited (chunk i's slot takes chunk i + num_slots).
        credit_every = max(1, num_slots // 2)
        last_needed = plan.num_chunks - num_slots - 1
        try:
            for chunk in range(plan.num_chunks):
                result.blocked_seconds += self._wait_op(ops[chunk], job.deadline, check)
                ring.drain(self._rows, index, chunk, what)
                if chunk <= last_needed and ((chunk + 1) % credit_every == 0 or chunk == last_needed):
                    ring.release(chunk)
                    self._send(sock, src, MessageKind.CREDIT, nonce, chunk=chunk)
            ring.finish()
        finally:
            result.hash_seconds, result.scatter_seconds = ring.hash_seconds, ring.scatter_seconds
        result.wire_seconds = time.monotonic() - t_wire


def _src(handoff: KVHandoff) -> PeerId:
    return PeerId(handoff.src_worker_id, handoff.src_incarnation)

"""KVReceiver (decode side): fetches a handoff's KV into blocks the caller reserved, one transfer at a time.

Per transfer: REQUEST (with the least pair generation this side accepts) -> sender's HEADER (validated)
-> join the pair at the header's generation (built and warmed up if new) -> post the recv of every chunk
into its slot of a staging ring -> ACK -> verify and scatter chunk i while the next chunks arrive, then CREDIT its slot ->
sync the side's stream -> DONE. See transfer/protocol.py and transfer/ring.py.

Every fetch is *posted*: its REQUEST goes out as soon as the thread takes it, and the thread serves
whichever posted fetch's HEADER comes first, so it never sits waiting for one sender's answer while
another sender waits for its ACK. A fetch submitted with ``wait_for_offer`` (early decode admission) may
be posted before the sender holds the request: the sender parks it and answers READY when it offers
it, and the fetch is posted again, as a usual one.

The pair's rendezvous values (transfer/rendezvous.py) travel on the dealer of the sender they belong to:
while it joins a pair the thread reads that dealer and sends its own values as they are set.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from transfer.channel import Channel, OpLane, PendingOp
from transfer.handshake import MAX_HANDSHAKE_FRAME_BYTES, MessageKind
from transfer.kv_source import KvSource
from transfer.paced_link import PacedLink
from transfer.peers import DECODE_RANK, PairKey, PeerId
from transfer.protocol import (
    KVHandoff,
    TransferChecksumError,
    TransferError,
    TransferMismatchError,
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

logger = logging.getLogger(__name__)

MAX_ENDPOINTS = 4096  # senders' handshake endpoints remembered, by peer name


@dataclass
class _Job:
    handoff: KVHandoff
    dst_block_ids: list[int]
    skip_first_n_blocks: int
    deadline: float  # time.monotonic()
    future: Future[TransferResult]
    offer_wait_until: float = 0.0  # time.time(); > 0: posted before the offer (see the module docstring)
    nonce: int = 0  # of a posted fetch's REQUEST
    generation: int = 0
    inbox: list[tuple[MessageKind, dict[str, Any]]] = field(default_factory=list)  # a posted fetch's frames


class KVReceiver(Side):
    """Decode side: fetches a handoff's KV into blocks the caller reserved, one transfer at a time.

    Staging holds `num_slots` chunks (of the sender's chunk size) whatever the transfer's size; the
    sender runs up to `num_slots` chunks ahead of the scatter. `me` is this process (the sender addresses
    its frames to it); every frame is checked against `secret` (transfer/handshake.py). `integrity` /
    `checksum`: what it verifies chunks with (see Side); a header naming a weaker scheme is refused, and
    a chunk that fails its digest or MAC is counted (TransferStats.num_rejected_chunks), never scattered.
    `link`: a mock engine's paced handoffs (transfer/paced_link.py): part of each K/V row moves, and
    `_pace` waits out the rest of the link's time before the transfer is done.
    """

    rank = DECODE_RANK

    def __init__(
        self,
        kv: torch.Tensor | KvSource,
        *,
        me: PeerId,
        channel: Channel,
        secret: bytes,
        timeout_s: float = 30.0,
        zmq_context: zmq.Context[Any] | None = None,
        num_slots: int = NUM_SLOTS,
        checksum: str | None = None,
        integrity: str | None = None,
        link: PacedLink | None = None,
    ) -> None:
        super().__init__(
            kv, me, channel, secret, timeout_s, zmq_context, num_slots, checksum, integrity, link
        )
        self._jobs: deque[_Job] = deque()
        self._dealers: dict[str, zmq.Socket[Any]] = {}
        self._posted: dict[int, _Job] = {}  # by nonce; the transfer thread's own
        self._cancelled: set[str] = set()  # request ids, under the lock
        # NOTE: each prefill peer's handshake endpoint, by peer name (the transfer thread's): its dealer
        # carries the pairs' rendezvous values both ways (transfer/rendezvous.py)
        self._endpoints: OrderedDict[str, str] = OrderedDict()
        self._poller = zmq.Poller()  # the transfer thread's: every dealer and the wakeup
        self._wakeup.register(self._poller)
        self._is_paced_logged = False  # the first paced handoff is logged (transfer thread)

    def submit(
        self,
        handoff: KVHandoff,
        dst_block_ids: Sequence[int],
        skip_first_n_blocks: int = 0,
        deadline: float | None = None,
        wait_for_offer: bool = False,
    ) -> Future[TransferResult]:
        """Queue a fetch of `handoff` minus its first `skip_first_n_blocks` blocks into `dst_block_ids`.

        The future resolves to a TransferResult or raises a TransferError, either way within `timeout_s`
        of this call (or by `deadline`, time.time() seconds, if sooner; queueing behind other transfers
        counts), and at once (TransferPeerLostError) if the handoff's peer is or gets dropped. On success
        the blocks are written and visible (device synchronized); on failure they may hold partial data
        (chunks verified before the failure; a sender failing mid-transfer may also land junk in a slot
        between its digest check and its scatter) and stay the caller's to free or reuse: never use
        them. Raises ValueError on bad block ids.

        `wait_for_offer` (early decode admission): the sender may not hold the request yet; it keeps the
        fetch until it does, up to `deadline` (else `timeout_s`) from now, and the transfer gets its
        `timeout_s` from the moment the sender answers. `cancel` gives up on it before that.
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
        if wait_for_offer and deadline is not None:
            budget = deadline - time.time()
        job = _Job(handoff, ids, skip_first_n_blocks, time.monotonic() + budget, Future())
        if wait_for_offer:
            job.offer_wait_until = time.time() + budget
        with self._lock:
            self._seen.add(_src(handoff))
            is_dropped = _src(handoff) in self._dropped
            if not is_dropped:
                self._jobs.append(job)
        if is_dropped:
            self._fail_job(job)
        else:
            self._wakeup.set()
        return job.future

    def cancel(self, request_id: str) -> None:
        """Give up on the fetches of `request_id` that are queued, or posted and not answered yet (their
        futures fail with TransferError; the sender is told). A fetch already moving bytes is not
        stopped: it ends as it would have (its blocks are written until its future resolves)."""
        with self._lock:
            queued = [j for j in self._jobs if j.handoff.request_id == request_id]
            for job in queued:
                self._jobs.remove(job)
            self._cancelled.add(request_id)
        for job in queued:
            self._fail_job(job, TransferError(f"fetch of {request_id!r} cancelled by {self.me.name}"))
        self._wakeup.set()

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
        with self._lock:
            dropped_jobs = [j for j in self._jobs if _src(j.handoff) in peers]
            for job in dropped_jobs:
                self._jobs.remove(job)
        for job in dropped_jobs:
            self._fail_job(job)
        self._wakeup.set()  # NOTE: its posted fetches fail on the transfer thread
        return peers

    def _fail_job(self, job: _Job, error: TransferError | None = None, is_running: bool = False) -> None:
        if error is None:
            error = TransferPeerLostError(
                f"peer {_src(job.handoff).name} was dropped (marked dead) by {self.me.name}: "
                f"not fetching {job.handoff.request_id!r}"
            )
        result = TransferResult(job.handoff.request_id, ok=False, num_blocks=len(job.dst_block_ids))
        fail(result, error)
        self._record(result)
        if is_running or job.future.set_running_or_notify_cancel():
            job.future.set_exception(error)

    def _next_job(self) -> _Job | None:
        """The next queued fetch; when none, wait (bounded) for one or for a frame of a posted one."""
        with self._lock:
            if self._jobs:
                return self._jobs.popleft()
        if self._wakeup.is_set(dict(self._poller.poll(int(POLL_S * 1000)))):
            self._wakeup.drain()
        return None

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._flush_rendezvous()
                self._check_posted()
                job = self._next_job()
                if job is None or not job.future.set_running_or_notify_cancel():
                    continue  # nothing queued, or cancelled by the caller before it started
                self._post(job)
            with self._lock:
                left, self._jobs = list(self._jobs), deque()
            for job in left:
                if job.future.set_running_or_notify_cancel():
                    job.future.set_exception(TransferError("receiver closed"))
            for job in self._posted.values():
                job.future.set_exception(TransferError("receiver closed"))
        finally:
            for sock in self._dealers.values():
                sock.close(linger=0)
            self._wakeup.close()

    def _close_sockets(self) -> None:
        if not self._thread.is_alive():
            self._wakeup.close()  # NOTE: else owned and closed by the transfer thread, with the dealers

    @staticmethod
    def _resolve(job: _Job, result: TransferResult, error: TransferError | None) -> None:
        if error is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(error)

    def _post(self, job: _Job) -> None:
        """Send a fetch's REQUEST; `_check_posted` serves it when the sender's HEADER comes (at once if
        it holds the request; with the offer if it parked a request that waits for it)."""
        src = _src(job.handoff)
        job.nonce = secrets.randbits(63)
        job.generation = self._channel.generation(src, self.me)
        try:
            self._check_peer(src)
            sock = self._dealer(job.handoff.src_endpoint)
            self._remember(src, job.handoff.src_endpoint)
            self._send(sock, src, MessageKind.REQUEST, job.nonce, request=self._request(job))
        except Exception as e:  # noqa: BLE001 (NOTE: the transfer thread must outlive any one bad fetch)
            self._fail_job(job, as_transfer_error(e), is_running=True)
            return
        self._posted[job.nonce] = job

    def _check_posted(self) -> None:
        """Serve the posted fetches whose HEADER came; fail those refused, cancelled, from dropped
        peers or past their deadline (telling the sender when it still waits on us)."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
        for sock in self._dealers.values():
            while sock.poll(0):  # NOTE: files the frames of posted fetches in their inboxes, drops the rest
                self._poll(sock, -1, 0)
        for job in list(self._posted.values()):
            if job.nonce not in self._posted:
                continue
            src, error, tell = _src(job.handoff), None, True
            if job.handoff.request_id in cancelled:
                error = TransferError(f"fetch of {job.handoff.request_id!r} cancelled by {self.me.name}")
            elif self.is_dropped(src):
                error, tell = TransferPeerLostError(f"peer {src.name} was dropped by {self.me.name}"), False
            elif job.inbox:
                kind, body = job.inbox.pop(0)
                if kind is MessageKind.HEADER:
                    del self._posted[job.nonce]
                    self._resolve(job, *self._serve(job, body["header"]))
                    continue
                if kind is MessageKind.READY and job.offer_wait_until > 0:
                    del self._posted[job.nonce]  # NOTE: offered now: ask again, with the usual bound
                    job.offer_wait_until, job.inbox = 0.0, []
                    job.deadline = min(job.deadline, time.monotonic() + self.timeout_s)
                    self._post(job)
                    continue
                if kind is MessageKind.ABORT:
                    error, tell = error_from_remote(body["error_type"], body["message"]), False
                else:
                    error = TransferError(f"expected header from the sender, got {kind.value}")
            elif time.monotonic() >= job.deadline:
                error = TransferTimeoutError(f"no header for {job.handoff.request_id!r} before its deadline")
            if error is not None:
                del self._posted[job.nonce]
                if tell:
                    with contextlib.suppress(zmq.ZMQError):  # best effort: the sender's bound ends it anyway
                        self._dealer(job.handoff.src_endpoint).send(
                            abort_frame(self._frames, src, job.nonce, error), zmq.NOBLOCK
                        )
                self._fail_job(job, error, is_running=True)

    def _request(self, job: _Job) -> TransferRequest:
        return TransferRequest(
            job.handoff.request_id,
            job.nonce,
            self.me.worker_id,
            self.me.incarnation,
            job.generation,
            job.skip_first_n_blocks,
            len(job.dst_block_ids),
            job.offer_wait_until,
        )

    def _remember(self, peer: PeerId, endpoint: str) -> None:
        self._endpoints[peer.name] = endpoint
        self._endpoints.move_to_end(peer.name)
        if len(self._endpoints) > MAX_ENDPOINTS:
            self._endpoints.popitem(last=False)

    def _send_rendezvous(self, peer: PeerId, frame: bytes) -> bool:
        endpoint = self._endpoints.get(peer.name)
        if endpoint is None:
            return False
        with contextlib.suppress(zmq.ZMQError):  # NOTE: best effort: the pair's build is bounded anyway
            self._dealer(endpoint).send(frame, zmq.NOBLOCK)
        return True

    def _dealer(self, endpoint: str) -> zmq.Socket[Any]:
        sock = self._dealers.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_HANDSHAKE_FRAME_BYTES)  # NOTE: libzmq drops larger unread
            sock.connect(endpoint)
            self._dealers[endpoint] = sock
            self._poller.register(sock, zmq.POLLIN)
        return sock

    def _poll(self, sock: zmq.Socket[Any], nonce: int, timeout_ms: int) -> None:
        """Read one frame if it comes within `timeout_ms`: the `abort` of transfer `nonce` raises
        PeerAbort, a rendezvous value goes to the link, a posted fetch's frame goes to its inbox, the rest
        is dropped (a late frame of an abandoned transfer; one that fails a check is counted,
        transfer/handshake.py). The sender sends nothing else once its header is out."""
        if not sock.poll(timeout_ms):
            return
        message = self._frames.decode(sock.recv())
        if message is None:
            return
        kind, got_nonce, body = message
        if kind is MessageKind.RENDEZVOUS:
            named = self._dealers.get(self._endpoints.get(body["prefill"], ""))
            self._take_rendezvous(body, named is sock)
        elif got_nonce != nonce:
            posted = self._posted.get(got_nonce)
            if posted is not None:
                posted.inbox.append((kind, body))
        elif kind is MessageKind.ABORT:
            raise PeerAbort(error_from_remote(body["error_type"], body["message"]))

    def _serve(self, job: _Job, header: Any) -> tuple[TransferResult, TransferError | None]:
        """The rest of a posted fetch, from the sender's `header` on."""
        t0 = time.monotonic()
        error: TransferError | None = None
        handoff, dst_ids = job.handoff, job.dst_block_ids
        src = _src(handoff)
        result = TransferResult(handoff.request_id, ok=False, num_blocks=len(dst_ids))
        sock = self._dealer(handoff.src_endpoint)
        # NOTE: from the sender's answer on, a fetch that waited for the offer has the usual bound too
        job.deadline = min(job.deadline, t0 + self.timeout_s)
        nonce, generation = job.nonce, job.generation
        key: PairKey | None = None
        ops: list[PendingOp] = []
        try:
            self._check_peer(src)
            if header.checksum not in self.accepted_checksums:
                raise TransferMismatchError(
                    f"transfer header mismatch for request {header.request_id!r}: checksum is "
                    f"{header.checksum!r}, expected {self.checksum!r} (integrity {self.integrity}: this "
                    f"receiver accepts {list(self.accepted_checksums)})"
                )
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
                checksum=header.checksum,
                sample_bytes=self.sample_bytes,
            )
            result.nbytes, result.generation = header.nbytes, header.generation
            key = PairKey(src, self.me, header.generation)
            self._wait_joined(self._channel.connect(key, DECODE_RANK), job.deadline, sock, src, nonce)
            plan = ChunkPlan.create(self.layout.num_layers, len(dst_ids), self._row_bytes, header.chunk_bytes)
            with self._on_stream():
                self._receive_chunks(sock, job, key, nonce, plan, header.checksum, result, ops)
            if self.link is not None:
                self._pace(self.link, t0, job, result, lambda: self._check_and_poll(sock, src, nonce))
            self._send(sock, src, MessageKind.DONE, nonce)
            result.ok = True
        except PeerAbort as e:
            error = e.error
            fail(result, error)
        except Exception as e:  # noqa: BLE001 (NOTE: the transfer thread must outlive any one bad transfer)
            error = as_transfer_error(e)
            fail(result, error)
            if isinstance(error, TransferChecksumError):
                self._count_rejected_chunk()
            if not isinstance(error, TransferPeerLostError):
                with contextlib.suppress(zmq.ZMQError):  # best effort: the sender times out anyway
                    sock.send(abort_frame(self._frames, src, nonce, error), zmq.NOBLOCK)
        if not result.ok:
            self._drop_staging()
            if key is not None:
                self._channel.abandon(key, ops)
        result.seconds = time.monotonic() - t0
        self._record(result)
        return result, error

    def _pace(
        self, link: PacedLink, t0: float, job: _Job, result: TransferResult, check: Callable[[], None]
    ) -> None:
        """A paced handoff's last part: wait (bounded by the fetch's deadline, `check`ing the sender every
        POLL_S at most) until `t0` (the header's arrival) + what `link` predicts for the whole KV of the
        fetched blocks, inside one node or between two; the figures go into `result`."""
        between = link.is_between_nodes(job.handoff.src_endpoint)
        result.link_nbytes = self.layout.bytes_per_block * len(job.dst_block_ids)
        result.link_seconds = link.link_s(result.link_nbytes, between)
        result.is_between_nodes = between
        until = min(t0 + result.link_seconds, job.deadline)
        t_wait = time.monotonic()
        while (left := until - time.monotonic()) > 0:
            check()
            time.sleep(min(left, POLL_S))
        result.paced_seconds = max(0.0, time.monotonic() - t_wait)
        if not self._is_paced_logged:
            self._is_paced_logged = True
            logger.info(
                "%s: first paced KV handoff (%s): moved %d of %d B (%s of each block), the link predicts "
                "%.2f ms (%s), the real part took %.2f ms, waited %.2f ms",
                self.me.name, job.handoff.request_id, result.nbytes, result.link_nbytes,
                link.fraction(self.layout), result.link_seconds * 1e3,
                "between nodes" if between else "inside a node", (t_wait - t0) * 1e3,
                result.paced_seconds * 1e3,
            )  # fmt: skip

    def _wait_joined(
        self, joined: PendingOp, deadline: float, sock: zmq.Socket[Any], src: PeerId, nonce: int
    ) -> None:
        """Wait (until `deadline`) for the pair's build: read the sender's frames (its rendezvous values,
        its `abort`: PeerAbort) as they come and send ours as the build sets them (it wakes the thread,
        also when it ended)."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        self._wakeup.register(poller)
        while not joined.is_done():
            self._check_peer(src)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(f"pair with {src.name} not joined within {self.timeout_s:.3f}s")
            events = dict(poller.poll(max(1, int(min(left, POLL_S) * 1000))))
            if self._wakeup.is_set(events):
                self._wakeup.drain()  # NOTE: queued fetches and cancellations are looked at each turn
            self._flush_rendezvous()
            while sock.poll(0):
                self._poll(sock, nonce, 0)
        joined.wait(0.0)

    def _send(self, sock: zmq.Socket[Any], to: PeerId, kind: MessageKind, nonce: int, **fields: Any) -> None:
        sock.send(self._frames.encode(to.name, kind, nonce, **fields), zmq.NOBLOCK)

    def _check_and_poll(self, sock: zmq.Socket[Any], src: PeerId, nonce: int) -> None:
        """Give up on a dropped peer or on its `abort` (PeerAbort); its other frames are dropped."""
        self._check_peer(src)
        self._poll(sock, nonce, 0)

    def _receive_chunks(
        self,
        sock: zmq.Socket[Any],
        job: _Job,
        key: PairKey,
        nonce: int,
        plan: ChunkPlan,
        scheme: str,
        result: TransferResult,
        ops: list[PendingOp],
    ) -> None:
        """Post the recv of every chunk into its ring slot (into `ops`), ack, then verify and scatter each
        chunk as it lands and credit the sender with its slot. Counts the phases' seconds in `result`.
        Runs on the side's stream."""
        src = key.prefill
        num_slots = min(self.num_slots, plan.num_chunks)
        ring = self._ring(plan, nonce, num_slots, scheme)
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

"""KVSender (prefill side): serves transfer requests for the requests it `offer`ed, one at a time.

Per transfer: the receiver's REQUEST -> HEADER (whole transfer: bytes, chunking, digest scheme, the pair's
generation; the sender joins that pair, building it if new) -> receiver's ACK (it joined the pair too,
and posted all its chunk recvs) -> pipelined chunks: gather chunk i into a ring slot and seal
it with its digest while the chunks before it are on the wire, send it once the receiver credited the
slot it lands in -> receiver's DONE. See transfer/protocol.py and transfer/ring.py.

A REQUEST that may come before the offer (early decode admission) is parked until the offer, then
answered READY (the receiver asks again; transfer/parking.py, transfer/protocol.py).

The pair's rendezvous values (transfer/rendezvous.py) travel on the same socket: the sender sends its own
to the connection the receiver's last verified REQUEST came on, and takes the receiver's only from there.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from cluster.frames import REASON_BAD_FIELD, REASON_MALFORMED
from transfer.channel import Channel, OpLane, PendingOp
from transfer.handshake import MAX_HANDSHAKE_FRAME_BYTES, Message, MessageKind
from transfer.kv_source import KvSource
from transfer.paced_link import PacedLink
from transfer.parking import ParkedRequests
from transfer.peers import PREFILL_RANK, PairKey, PeerId
from transfer.protocol import (
    KVHandoff,
    TransferError,
    TransferHeader,
    TransferMismatchError,
    TransferPeerLostError,
    TransferRejectedError,
    TransferRequest,
    TransferResult,
    TransferTimeoutError,
    chunk_tag,
    error_from_remote,
    tag_for_nonce,
)
from transfer.side import (
    DEFAULT_CHUNK_BYTES,
    NUM_SLOTS,
    POLL_S,
    PeerAbort,
    Side,
    abort_frame,
    as_transfer_error,
    fail,
)
from transfer.staging import ChunkPlan, block_index, chunk_view, junk_chunk

logger = logging.getLogger(__name__)

MAX_IDENTS = 4096  # receivers' connections remembered (one per live decode peer)


@dataclass
class _Lease:
    block_ids: tuple[int, ...]
    expiry: float  # time.monotonic()
    ready: Any = None  # CUDA event recorded by `offer` on the caller's stream (None on CPU)
    in_flight: bool = False


class KVSender(Side):
    """Prefill side: serves transfer requests for the requests it `offer`ed, one at a time.

    Block ownership: the sender never frees anything. For each offered request `on_sent(request_id, ok)`
    runs exactly once, on the transfer thread: ok=True after the receiver's `done`, ok=False when a
    transfer failed (its peer dropped included) or the lease expired; the owner frees the blocks then
    (keep the callback quick and thread-safe). A request withdrawn with `abort()` while not in flight gets
    no callback. A request asked for by a dropped peer is refused and stays offered (lease, abort). A
    transfer request that came before the offer and may wait for it is parked (transfer/parking.py).

    `offer` takes the request's block ids and keeps a frozen copy: the transfer thread never reads the
    engine's tables, and the blocks' bytes must not change until `on_sent` (or a withdrawing `abort`). Bind
    `endpoint` (tcp://127.0.0.1:* picks a port; see `self.endpoint`), the handshake socket, where every
    frame is checked against `secret` (transfer/handshake.py). `me` is this process (the handoff names it).
    `chunk_bytes` is the pipelining unit (rounded down to whole block rows); staging holds `num_slots` of
    them whatever the transfer's size. `integrity` / `checksum`: how chunks are sealed (see Side). `link`:
    a mock engine's paced handoffs (transfer/paced_link.py): only part of each K/V row is gathered and sent.
    """

    rank = PREFILL_RANK

    def __init__(
        self,
        kv: torch.Tensor | KvSource,
        *,
        me: PeerId,
        channel: Channel,
        secret: bytes,
        on_sent: Callable[[str, bool], None],
        endpoint: str = "tcp://127.0.0.1:*",
        timeout_s: float = 30.0,
        lease_s: float = 60.0,
        zmq_context: zmq.Context[Any] | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        num_slots: int = NUM_SLOTS,
        checksum: str | None = None,
        integrity: str | None = None,
        link: PacedLink | None = None,
    ) -> None:
        super().__init__(
            kv, me, channel, secret, timeout_s, zmq_context, num_slots, checksum, integrity, link
        )
        self._on_sent = on_sent
        self.lease_s = lease_s
        self.chunk_bytes = chunk_bytes
        self._leases: dict[str, _Lease] = {}
        self._pending: deque[tuple[bytes, TransferRequest]] = deque()
        self._parked = ParkedRequests()  # under the lock, with the leases
        # NOTE: the connection each decode peer's last verified request came on, by peer name: where its
        # pairs' rendezvous values go, and the only one theirs are taken from (transfer/rendezvous.py)
        self._idents: OrderedDict[str, bytes] = OrderedDict()
        self._num_posted = 0  # chunks of the transfer in flight posted so far
        self._is_done_early = False  # its `done` came while we waited for our sends to complete
        # (ident, nonce) -> (pair, tag, plan) of transfers we gave up on while waiting for the ack
        self._abandoned: dict[tuple[bytes, int], tuple[PairKey, int, ChunkPlan]] = {}
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_HANDSHAKE_FRAME_BYTES)  # NOTE: libzmq drops larger unread
        self._sock.bind(endpoint)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()  # the transfer thread's: the socket and the wakeup
        self._poller.register(self._sock, zmq.POLLIN)
        self._wakeup.register(self._poller)

    def offer(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        block_hashes: Sequence[str | bytes] = (),
        lease_s: float | None = None,
    ) -> KVHandoff:
        """Start holding `request_id` for a transfer of the blocks `block_ids` (its block table, in order;
        a frozen copy is kept). The blocks stay the caller's, unchanged, until `on_sent`.

        Call it on the thread that wrote the KV (a CUDA cache: after the forward that wrote it was queued
        on that thread's current stream; the transfer's copies are ordered after it without a host sync).
        Raises ValueError on block ids outside the cache and TransferRejectedError if already offered.
        """
        ids = tuple(int(b) for b in block_ids)
        num_blocks = int(self._kv.shape[1])
        if any(not 0 <= b < num_blocks for b in ids):
            raise ValueError(f"block_ids of {request_id!r} must be in [0, {num_blocks}), got {list(ids)}")
        ready = None
        if self._kv.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._kv.device))
        lease = self.lease_s if lease_s is None else lease_s
        with self._lock:
            if request_id in self._leases:
                raise TransferRejectedError(f"request {request_id!r} is already offered")
            self._leases[request_id] = _Lease(ids, expiry=time.monotonic() + lease, ready=ready)
            was_parked = self._parked.offered(request_id)
        if was_parked:
            self._wakeup.set()
        return KVHandoff(
            request_id=request_id,
            src_worker_id=self.me.worker_id,
            src_incarnation=self.me.incarnation,
            src_endpoint=self.endpoint,
            layout=self.layout,
            num_tokens=num_tokens,
            num_blocks=len(ids),
            lease_expiry=time.time() + lease,
            block_hashes=list(block_hashes),
        )

    def extend_lease(self, request_id: str, lease_s: float) -> bool:
        """Push an offer's lease expiry to at least ``lease_s`` from now (its decode side is waiting for
        blocks, not gone). False if the request is not offered (any more)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            lease.expiry = max(lease.expiry, time.monotonic() + lease_s)
            return True

    def abort(self, request_id: str) -> bool:
        """Withdraw an offer. True: withdrawn, no callback will come. False: in flight (its `on_sent`
        still comes) or unknown. A transfer request parked for it (not offered yet) is refused."""
        with self._lock:
            error = TransferRejectedError(f"{self.me.name} withdrew {request_id!r} before offering it")
            if self._parked.withdraw(request_id, error):
                self._wakeup.set()
            lease = self._leases.get(request_id)
            if lease is None or lease.in_flight:
                return False
            del self._leases[request_id]
            return True

    def num_held(self) -> int:
        with self._lock:
            return len(self._leases)

    def num_parked(self) -> int:
        """Transfer requests waiting for their offer (or for the transfer thread to answer them)."""
        with self._lock:
            return len(self._parked)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._flush_rendezvous()
                    self._expire_leases()
                    self._forget_dropped()
                    self._unpark()
                    if self._pending:
                        ident, req = self._pending.popleft()
                        if not self._park(ident, req):
                            self._serve(ident, req)
                        continue
                    events = dict(self._poller.poll(int(POLL_S * 1000)))
                    if self._wakeup.is_set(events):
                        self._wakeup.drain()
                    if self._sock in events:
                        self._on_frame(self._sock.recv_multipart(), None)
                except Exception:  # NOTE: e.g. a raising on_sent callback must not stop all transfers
                    logger.exception("KVSender %s: transfer thread error", self.me.name)
        finally:
            self._sock.close(linger=0)
            self._wakeup.close()

    def _close_sockets(self) -> None:
        if not self._thread.is_alive():
            self._sock.close(linger=0)
            self._wakeup.close()

    def _park(self, ident: bytes, req: TransferRequest) -> bool:
        """Park a request that came before its offer and may wait for it. False: serve it now (offered,
        or it may not wait: then it is refused as unknown)."""
        if req.offer_wait_until <= 0:
            return False
        with self._lock:
            if req.request_id in self._leases or time.time() >= req.offer_wait_until:
                return False
            is_parked = self._parked.park(ident, req)
        if not is_parked:
            error = TransferRejectedError(f"{req.request_id!r} already has a transfer request waiting")
            self._reply(ident, abort_frame(self._frames, _dst(req), req.nonce, error))
        return True

    def _unpark(self) -> None:
        """Tell the receivers of parked requests offered since to ask again; refuse withdrawn and late
        ones."""
        with self._lock:
            ready, refused = self._parked.take(time.time(), self.me.name)
        for ident, req in ready:
            self._reply(ident, self._frames.encode(_dst(req).name, MessageKind.READY, req.nonce))
        for (ident, req), error in refused:
            self._reply(ident, abort_frame(self._frames, _dst(req), req.nonce, error))

    def _forget_dropped(self) -> None:
        with self._lock:
            dropped = set(self._dropped)
        if not dropped:
            return
        for item in [p for p in self._pending if _dst(p[1]) in dropped]:
            self._pending.remove(item)
        with self._lock:
            self._parked.forget(dropped)
        for key in [k for k, v in self._abandoned.items() if v[0].decode in dropped]:
            del self._abandoned[key]
        for peer in dropped:
            self._idents.pop(peer.name, None)

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

    def _reply(self, ident: bytes, frame: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):  # best effort: the peer times out anyway
            self._sock.send_multipart([ident, frame], zmq.NOBLOCK)

    def _on_frame(self, frames: list[bytes], waiting: tuple[bytes, int] | None) -> Message | None:
        """Queue requests, drop stale frames; return the message if it answers `waiting` (ident, nonce).
        Frames that fail a check are counted and dropped (transfer/handshake.py)."""
        if len(frames) != 2:
            self._frames.reject(REASON_MALFORMED)
            return None
        ident, data = frames
        message = self._frames.decode(data)
        if message is None:
            return None
        kind, nonce, body = message
        if kind is MessageKind.RENDEZVOUS:
            self._take_rendezvous(body, self._idents.get(body["decode"]) == ident)
            return None
        if waiting == (ident, nonce):
            return message
        if kind is MessageKind.REQUEST:
            req = body["request"]
            if req.nonce != nonce:
                self._frames.reject(REASON_BAD_FIELD)
                return None
            self._remember(_dst(req), ident)
            self._see(_dst(req))
            try:
                self._check_peer(_dst(req))
                self._pending.append((ident, req))
            except TransferError as e:
                self._reply(ident, abort_frame(self._frames, _dst(req), nonce, e))
        elif kind is MessageKind.ACK and (ident, nonce) in self._abandoned:
            # NOTE: the receiver posted its recvs before acking; feed them junk (its checksum fails) so
            # no recv stays pending forever, which would close the gloo pair at the group timeout.
            key, tag, plan = self._abandoned.pop((ident, nonce))
            try:
                self._feed_junk(plan, 0, key, tag)
            except Exception:  # NOTE: must not fail the transfer this frame interrupted
                logger.exception("KVSender %s: could not feed an abandoned recv", self.me.name)
        elif kind is MessageKind.ABORT:  # the receiver gave up before we served it
            with self._lock:
                self._parked.cancel(ident, nonce)  # NOTE: a parked one has no lease to finish
            for item in [p for p in self._pending if p[0] == ident and p[1].nonce == nonce]:
                self._pending.remove(item)
                self._finish_lease(item[1].request_id, False)
        return None

    def _remember(self, peer: PeerId, ident: bytes) -> None:
        self._idents[peer.name] = ident
        self._idents.move_to_end(peer.name)
        if len(self._idents) > MAX_IDENTS:
            self._idents.popitem(last=False)

    def _send_rendezvous(self, peer: PeerId, frame: bytes) -> bool:
        ident = self._idents.get(peer.name)
        if ident is None:
            return False
        self._reply(ident, frame)
        return True

    def _feed_junk(self, plan: ChunkPlan, first_chunk: int, key: PairKey, tag: int) -> None:
        if first_chunk >= plan.num_chunks:
            return
        junk = self._scratch(plan.stride)
        junk_chunk(junk)
        lane = OpLane(f"junk-{key.decode.worker_id}")
        for chunk in range(first_chunk, plan.num_chunks):
            self._channel.isend(chunk_view(junk, plan, chunk), key, chunk_tag(tag, chunk), lane)

    def _finish_lease(self, request_id: str, ok: bool) -> None:
        with self._lock:
            lease = self._leases.pop(request_id, None)
        if lease is not None:
            self._on_sent(request_id, ok)

    def _poll(self, ident: bytes, nonce: int, timeout_ms: int) -> tuple[MessageKind, dict[str, Any]] | None:
        """One frame for (ident, nonce) if it comes within `timeout_ms`; raises PeerAbort on `abort`.
        Sends the rendezvous values queued meanwhile (a pair build wakes it)."""
        events = dict(self._poller.poll(timeout_ms))
        if self._wakeup.is_set(events):
            self._wakeup.drain()  # NOTE: the main loop looks at its parked requests after every transfer
            self._flush_rendezvous()
        if self._sock not in events:
            return None
        reply = self._on_frame(self._sock.recv_multipart(), (ident, nonce))
        if reply is None:
            return None
        kind, _, body = reply
        if kind is MessageKind.ABORT:
            raise PeerAbort(error_from_remote(body["error_type"], body["message"]))
        return kind, body

    def _await(
        self, ident: bytes, req: TransferRequest, want: MessageKind, deadline: float
    ) -> dict[str, Any]:
        while True:
            self._check_peer(_dst(req))
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise TransferTimeoutError(f"no {want.value} from the receiver within {self.timeout_s:.3f}s")
            reply = self._poll(ident, req.nonce, min(left_ms, int(POLL_S * 1000)))
            if reply is None:
                continue
            if reply[0] is not want:
                raise TransferError(f"expected {want.value} from the receiver, got {reply[0].value}")
            body: dict[str, Any] = reply[1]
            return body

    def _serve(self, ident: bytes, req: TransferRequest) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        result = TransferResult(req.request_id, ok=False)
        peer = _dst(req)
        with self._lock:
            lease = self._leases.get(req.request_id)
            if lease is not None:
                lease.in_flight = True
        plan: ChunkPlan | None = None
        key: PairKey | None = None
        ops: list[PendingOp] = []
        self._num_posted = 0
        self._is_done_early = False
        is_acked = False  # NOTE: from the ack on, the receiver's recvs are posted and must all be fed
        try:
            if lease is None:
                raise TransferRejectedError(
                    f"{self.me.name} does not hold request {req.request_id!r} (unknown, aborted or expired)"
                )
            # NOTE: the receiver asks for the least generation it accepts; ours may be later (we saw the
            # pair break): the header says which one both use, and both join it.
            generation = max(req.generation, self._channel.generation(self.me, peer))
            key = PairKey(self.me, peer, generation)
            header, plan, block_ids = self._prepare(req, lease, key)
            result.num_blocks, result.nbytes, result.generation = header.num_blocks, header.nbytes, generation
            self._reply(ident, self._frames.encode(peer.name, MessageKind.HEADER, req.nonce, header=header))
            joined = self._channel.connect(key, PREFILL_RANK)
            try:
                ack = self._await(ident, req, MessageKind.ACK, deadline)
            except TransferTimeoutError:
                if plan.num_chunks:
                    if len(self._abandoned) >= 64:
                        self._abandoned.pop(next(iter(self._abandoned)))
                    self._abandoned[(ident, req.nonce)] = (key, header.tag, plan)
                raise
            is_acked = True
            recv_slots = ack["num_slots"]
            if recv_slots < 1:
                raise TransferError(f"the receiver's ack has no valid num_slots: {recv_slots!r}")
            # NOTE: the receiver acks once it joined the pair, so ours is built by now (or it failed)
            self._wait_op(joined, deadline, lambda: self._check_and_flush(peer))
            t_wire = time.monotonic()
            with self._on_stream():
                self._send_chunks(
                    ident, req, key, plan, block_ids, lease.ready, recv_slots, deadline, result, ops
                )
            result.wire_seconds = time.monotonic() - t_wire
            if not self._is_done_early:
                self._await(ident, req, MessageKind.DONE, deadline)
            result.ok = True
        except PeerAbort as e:
            fail(result, e.error)
        except Exception as e:  # noqa: BLE001 (NOTE: the transfer thread must outlive any one bad transfer)
            error = as_transfer_error(e)
            fail(result, error)
            if not isinstance(error, TransferPeerLostError):
                self._reply(ident, abort_frame(self._frames, peer, req.nonce, error))
        if not result.ok:
            self._drop_staging()
            if is_acked and key is not None and plan is not None and not self.is_dropped(peer):
                try:
                    self._feed_junk(plan, self._num_posted, key, tag_for_nonce(req.nonce))
                except Exception:  # NOTE: on_sent below must still run
                    logger.exception("KVSender %s: could not feed the receiver's recvs", self.me.name)
            if key is not None:
                self._channel.abandon(key, ops)
        result.seconds = time.monotonic() - t0
        self._record(result)
        if lease is not None:
            self._finish_lease(req.request_id, result.ok)

    def _send_chunks(
        self,
        ident: bytes,
        req: TransferRequest,
        key: PairKey,
        plan: ChunkPlan,
        block_ids: Sequence[int],
        ready: Any,
        recv_slots: int,
        deadline: float,
        result: TransferResult,
        ops: list[PendingOp],
    ) -> None:
        """Gather, seal and post every chunk through the ring; counts them in `_num_posted` (junk feeds the
        rest if this raises) and the phases' seconds in `result`. Chunk i waits for its own slot (the send
        of chunk i - num_slots done) and for the receiver's (the credit of chunk i - recv_slots); `ops`
        collects the sends. Runs on the side's stream."""
        num_slots = min(self.num_slots, plan.num_chunks)
        ring = self._ring(plan, req.nonce, num_slots)
        ring.start(ready)
        index = block_index(block_ids, self._kv.device)
        tag = tag_for_nonce(req.nonce)
        lane = OpLane(f"send-{key.decode.worker_id}")
        num_credited = 0  # chunks the receiver has drained

        def take(timeout_ms: int) -> bool:
            """Handle one frame of this transfer if one comes within `timeout_ms`; `abort` raises."""
            nonlocal num_credited
            reply = self._poll(ident, req.nonce, timeout_ms)
            if reply is None:
                return False
            kind, body = reply
            if kind is MessageKind.CREDIT:
                num_credited = max(num_credited, body["chunk"] + 1)
            elif kind is MessageKind.DONE:  # NOTE: may overtake our wait for the last sends' completion
                self._is_done_early = True
            else:
                raise TransferError(f"expected credit or done from the receiver, got {kind.value} {body}")
            return True

        def check() -> None:
            self._check_peer(key.decode)
            while take(0):
                pass

        def await_credit(chunk: int) -> None:
            t0 = time.perf_counter()
            while num_credited < chunk + 1:
                check()
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    raise TransferTimeoutError(f"no credit for chunk {chunk} within {self.timeout_s:.3f}s")
                take(min(left_ms, int(POLL_S * 1000)))
            result.blocked_seconds += time.perf_counter() - t0

        try:
            for chunk in range(plan.num_chunks):
                if chunk >= num_slots:  # our slot is free once its last send completed
                    result.blocked_seconds += self._wait_op(ops[chunk - num_slots], deadline, check)
                wire = ring.fill(self._rows, index, chunk)
                if chunk >= recv_slots:  # the receiver's slot is free once it drained its last chunk
                    await_credit(chunk - recv_slots)
                ops.append(self._channel.isend(wire, key, chunk_tag(tag, chunk), lane))
                self._num_posted = chunk + 1
                check()
            for op in ops[-num_slots:] if num_slots else []:
                result.blocked_seconds += self._wait_op(op, deadline, check)
        finally:
            result.gather_seconds, result.hash_seconds = ring.gather_seconds, ring.hash_seconds

    def _prepare(
        self, req: TransferRequest, lease: _Lease, key: PairKey
    ) -> tuple[TransferHeader, ChunkPlan, tuple[int, ...]]:
        """Check the request against the blocks we hold and describe the whole transfer."""
        block_ids = lease.block_ids
        skip = req.skip_first_n_blocks
        if not 0 <= skip <= len(block_ids):
            raise TransferMismatchError(
                f"skip_first_n_blocks={skip} but request {req.request_id!r} has {len(block_ids)} blocks"
            )
        num_blocks = len(block_ids) - skip
        if num_blocks != req.num_dst_blocks:  # NOTE: checked before any work; the header check repeats it
            raise TransferMismatchError(
                f"num_blocks: {req.request_id!r} has {num_blocks} blocks after skipping {skip}, "
                f"the receiver reserved {req.num_dst_blocks}"
            )
        plan = ChunkPlan.create(self.layout.num_layers, num_blocks, self._row_bytes, self.chunk_bytes)
        header = TransferHeader(
            request_id=req.request_id,
            nonce=req.nonce,
            src_worker_id=self.me.worker_id,
            dst_worker_id=req.dst_worker_id,
            generation=key.generation,
            backend=self._channel.backend,
            layout=self.layout,
            dtype=self.layout.dtype,
            shape=self.layout.layer_shape(num_blocks),
            num_blocks=num_blocks,
            nbytes=plan.nbytes,
            num_chunks=plan.num_chunks,
            chunk_bytes=plan.chunk_bytes,
            checksum=self.checksum,
            tag=tag_for_nonce(req.nonce),
            sample_bytes=self.sample_bytes,
        )
        return header, plan, block_ids[skip:]

    def _check_and_flush(self, peer: PeerId) -> None:
        self._check_peer(peer)
        self._flush_rendezvous()


def _dst(req: TransferRequest) -> PeerId:
    return PeerId(req.dst_worker_id, req.dst_incarnation)

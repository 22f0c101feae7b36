"""DecodeRole: admits requests prefilled elsewhere (reserve blocks -> receive KV -> commit) and decodes.

A handoff waiting for its KV holds its reserved blocks and a seat among max_num_seqs; if blocks are short,
the handoff waits here (bounded by its deadline) and is retried every step-loop turn. An abort during an
in-flight transfer is deferred until the transfer ends: the transfer thread may still be writing into the
reserved blocks, so they must not go back to the pool before then.

Early admission (``PrepareDecode``, sent while the prefill still runs): blocks are reserved at once (or,
when short, retried while no real handoff waits) and the fetch is posted to the prefill worker's sender,
which serves it the moment it offers the KV. The request commits once both the KV and its first token
(the ``DecodeHandoff`` that follows the prefill) are here. An early request never reserved when its
handoff comes takes the usual path; an early fetch that fails before the first token comes frees its
blocks and keeps the error for the handoff, which then applies the failure policy as usual.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from cluster.protocol import ErrorCode, TokenDelta, TransferStats
from cluster.wire import DecodeHandoff, KeepAlive, PeerDead, PrepareDecode, RequestFailed, Transferred
from transfer.connector import KVReceiver
from transfer.pairs import PairChannel
from transfer.protocol import KVHandoff, TransferError, TransferResult
from workers.mock_runner import paced_link
from workers.role import WorkerContext


@dataclass(frozen=True)
class _KVDone:
    """The receiver finished a fetch (the future holds the result or the TransferError)."""

    request_id: str
    future: Future[TransferResult]


@dataclass
class _Early:
    """A request admitted before its prefill finished (see the module docstring)."""

    op: PrepareDecode
    is_reserved: bool = False  # blocks reserved and the fetch posted (or done)
    result: TransferResult | None = None  # the KV landed; the first token has not come yet
    error: TransferError | None = None  # the fetch failed before the first token came (blocks freed)


class PendingHandoffs:
    """Handoffs waiting for blocks or seats, in arrival order, retried until their deadline."""

    def __init__(self) -> None:
        self.items: deque[tuple[DecodeHandoff, KVHandoff]] = deque()

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, request_id: str) -> bool:
        return any(item[0].request_id == request_id for item in self.items)

    def remove(self, request_id: str) -> bool:
        for item in self.items:
            if item[0].request_id == request_id:
                self.items.remove(item)
                return True
        return False

    def expired(self, now: float) -> list[DecodeHandoff]:
        gone = [item for item in self.items if item[0].deadline < now]
        for item in gone:
            self.items.remove(item)
        return [op for op, _ in gone]


class DecodeRole:
    holds_prefills = False
    accepts_handoffs = True

    def __init__(self, context: WorkerContext) -> None:
        self.ctx = context
        self.receiver: KVReceiver | None = None
        self._channel: PairChannel | None = None  # this worker's KV-transfer pairs
        self._pending = PendingHandoffs()
        # NOTE: an early fetch is in flight with None until its DecodeHandoff (first token) comes
        self._in_flight: dict[str, DecodeHandoff | None] = {}
        self._early: dict[str, _Early] = {}
        self._next_early_expiry = 0.0
        self._abort_after_transfer: set[str] = set()
        self._last_keep_alive = 0.0

    def start(self) -> None:
        channel = self._channel = self.ctx.channel()
        if channel is None:
            return
        runner = self.ctx.engine.runner
        self.receiver = KVReceiver(
            runner.kv_relay or runner.kv_cache,  # NOTE: a tensor-parallel worker: every rank's heads
            me=self.ctx.me,
            channel=channel,
            secret=self.ctx.secret,
            timeout_s=self.ctx.transfer_config.timeout_s,
            integrity=self.ctx.transfer_config.integrity,
            link=paced_link(runner.model, runner.kv_cache, self.ctx.bind_host),
        )
        self.receiver.start()

    def _fail(self, request_id: str, code: ErrorCode, message: str) -> None:
        self.ctx.send(RequestFailed(self.ctx.worker_id, request_id, code, message))

    # ---- handoffs -------------------------------------------------------------------------------------
    def on_first_token(self, delta: TokenDelta) -> None:
        raise RuntimeError("a decode worker never holds a prefill")

    def on_prepare(self, op: PrepareDecode) -> None:
        """Early admission: reserve and post the fetch now if blocks allow and no handoff waits."""
        if self.receiver is None or op.request_id in self._early or op.request_id in self._in_flight:
            return  # NOTE: the DecodeHandoff that follows takes the usual path (or fails it)
        early = self._early[op.request_id] = _Early(op)
        if not self._pending:
            self._try_reserve_early(early)

    def _try_reserve_early(self, early: _Early) -> bool:
        """Reserve an early request's blocks and post its fetch; False if blocks or seats are short."""
        assert self.receiver is not None
        op = early.op
        try:
            reserved = self.ctx.engine.add_prefilled_request(
                op.request_id, op.prompt_token_ids, None, op.params
            )
        except ValueError as e:
            del self._early[op.request_id]
            self._fail(op.request_id, ErrorCode.INVALID_REQUEST, str(e))
            return True
        if reserved is None:
            return False
        block_ids, num_hit = reserved
        block_size = self.receiver.layout.block_size
        handoff = KVHandoff(
            request_id=op.request_id,
            src_worker_id=op.src_worker_id,
            src_incarnation=op.src_incarnation,
            src_endpoint=op.src_endpoint,
            layout=self.receiver.layout,
            num_tokens=len(op.prompt_token_ids),
            num_blocks=-(-len(op.prompt_token_ids) // block_size),
            lease_expiry=op.deadline,
        )
        self._submit(op.request_id, None, handoff, block_ids, num_hit, op.deadline, wait_for_offer=True)
        early.is_reserved = True
        return True

    def on_decode(self, op: DecodeHandoff) -> None:
        early = self._early.get(op.request_id)
        if early is not None and early.is_reserved:
            self._on_first_token(early, op)
            return
        self._early.pop(op.request_id, None)
        if self.receiver is None:
            self._fail(op.request_id, ErrorCode.INTERNAL, "decode worker has no KV receiver (it moves no KV)")
            return
        try:
            handoff = KVHandoff.from_bytes(op.handoff)
        except (TransferError, ValueError, TypeError) as e:
            self._fail(op.request_id, ErrorCode.INVALID_REQUEST, f"bad KV handoff: {e}")
            return
        if not self._try_start(op, handoff):
            self._pending.items.append((op, handoff))

    def _try_start(self, op: DecodeHandoff, handoff: KVHandoff) -> bool:
        """Reserve blocks and submit the fetch; False if blocks or seats are short right now."""
        assert self.receiver is not None
        try:
            reserved = self.ctx.engine.add_prefilled_request(
                op.request_id, op.prompt_token_ids, op.first_token_id, op.params
            )
        except ValueError as e:
            self._fail(op.request_id, ErrorCode.INVALID_REQUEST, str(e))
            return True
        if reserved is None:
            return False
        block_ids, num_hit = reserved
        self._submit(op.request_id, op, handoff, block_ids, num_hit, op.deadline, wait_for_offer=False)
        return True

    def _submit(
        self,
        request_id: str,
        op: DecodeHandoff | None,
        handoff: KVHandoff,
        block_ids: list[int],
        num_hit: int,
        deadline: float,
        wait_for_offer: bool,
    ) -> None:
        assert self.receiver is not None
        future = self.receiver.submit(
            handoff, block_ids[num_hit:], num_hit, deadline=deadline, wait_for_offer=wait_for_offer
        )
        self._in_flight[request_id] = op
        future.add_done_callback(lambda f: self.ctx.post(_KVDone(request_id, f)))

    def _on_first_token(self, early: _Early, op: DecodeHandoff) -> None:
        """The DecodeHandoff of a reserved early request: commit if its KV is here, else wait for it."""
        rid = op.request_id
        if rid in self._in_flight:
            self._in_flight[rid] = op  # NOTE: committed when the fetch ends
            return
        del self._early[rid]
        if early.error is not None:
            self._on_transfer_failed(op, early.error)
        elif early.result is not None:
            self._commit(op, early.result, is_early=True)

    def poll(self) -> None:
        if self._early:
            self._poll_early()
        if not self._pending:
            return
        for op in self._pending.expired(time.time()):
            self._fail(
                op.request_id,
                ErrorCode.DEADLINE_EXCEEDED,
                "deadline passed while waiting for KV blocks on the decode worker",
            )
        while self._pending and self._try_start(*self._pending.items[0]):
            self._pending.items.popleft()
        now = time.monotonic()
        if self._pending and now - self._last_keep_alive >= self.ctx.transfer_config.lease_s / 4:
            # NOTE: waiting for blocks is not being gone: keep the prefill side holding the KV
            self._last_keep_alive = now
            for op, _ in self._pending.items:
                self.ctx.send(KeepAlive(self.ctx.worker_id, op.request_id))

    def _poll_early(self) -> None:
        """Reserve early requests still waiting for blocks (after every real handoff); drop those past
        their deadline that no fetch holds (the router has failed them by then)."""
        if not self._pending:
            for early in [e for e in self._early.values() if not e.is_reserved]:
                if not self._try_reserve_early(early):
                    break
        now = time.time()
        if now < self._next_early_expiry:
            return
        self._next_early_expiry = now + 1.0
        for rid, early in list(self._early.items()):
            if early.op.deadline < now and rid not in self._in_flight:
                del self._early[rid]
                self.ctx.engine.abort(rid)

    def on_abort(self, request_id: str) -> bool:
        early = self._early.pop(request_id, None)
        if request_id in self._in_flight:
            self._abort_after_transfer.add(request_id)
            if self.receiver is not None and early is not None:
                self.receiver.cancel(request_id)  # NOTE: a fetch still waiting for the offer ends now
            return True
        if early is not None:
            self.ctx.engine.abort(request_id)
            return True
        return self._pending.remove(request_id)

    def holds(self, request_id: str) -> bool:
        return request_id in self._early or request_id in self._in_flight or request_id in self._pending

    def handle(self, cmd: object) -> None:
        if not isinstance(cmd, _KVDone):
            raise RuntimeError(f"decode role: unexpected command {type(cmd).__name__}")
        rid, engine = cmd.request_id, self.ctx.engine
        op = self._in_flight.pop(rid)
        if rid in self._abort_after_transfer:
            self._abort_after_transfer.discard(rid)
            engine.abort(rid)
            return
        # NOTE: op None: an early fetch whose first token has not come; its entry waits for it
        early = self._early.get(rid) if op is None else self._early.pop(rid, None)
        try:
            result = cmd.future.result()
        except TransferError as e:
            if op is not None:
                self._on_transfer_failed(op, e)
                return
            engine.abort(rid)
            if early is not None:
                early.error = e
            return
        if op is not None:
            self._commit(op, result, is_early=early is not None)
        elif early is not None:
            early.result = result
        else:
            engine.abort(rid)  # NOTE: unreachable: an early entry leaves only by abort, handoff or expiry

    def _commit(self, op: DecodeHandoff, result: TransferResult, is_early: bool) -> None:
        rid = op.request_id
        self.ctx.engine.commit_prefilled(rid, op.first_token_id if is_early else None)
        self.ctx.send(Transferred(self.ctx.worker_id, rid, result.seconds, result.nbytes))

    def _on_transfer_failed(self, op: DecodeHandoff, error: TransferError) -> None:
        engine, rid = self.ctx.engine, op.request_id
        engine.abort(rid)
        if self.ctx.transfer_config.failure_policy == "recompute":
            # NOTE: the first token already reached the client: compute prompt + it here, sample on.
            engine.add_request(rid, op.prompt_token_ids, op.params, output_token_ids=[op.first_token_id])
            reason = f"{type(error).__name__}: {error}"
            self.ctx.send(Transferred(self.ctx.worker_id, rid, 0.0, 0, recomputed=reason))
        else:
            self._fail(
                rid, ErrorCode.KV_TRANSFER_FAILED, f"KV transfer failed: {type(error).__name__}: {error}"
            )

    def on_extend_lease(self, request_id: str) -> None:
        raise RuntimeError("a decode worker holds no prefills")

    def on_peer_dead(self, op: PeerDead) -> None:
        if self.receiver is not None:
            self.receiver.drop_peer(op.worker_id, op.incarnation or None)

    # ---- observability --------------------------------------------------------------------------------
    def num_waiting_for_kv(self) -> int:
        return len(self._in_flight.keys() | self._early.keys()) + len(self._pending)

    def transfer_stats(self) -> TransferStats:
        return self.receiver.stats() if self.receiver is not None else TransferStats()

    def kv_endpoint(self) -> str:
        return ""

    def broken_peers(self) -> list[str]:
        return self.receiver.broken_peers() if self.receiver is not None else []

    def rejected_frames(self) -> dict[str, int]:
        return self.receiver.rejected_frames() if self.receiver is not None else {}

    def threads(self) -> list[threading.Thread]:
        return [self.receiver.thread] if self.receiver is not None else []

    def check_leaks(self) -> None:
        if self._in_flight or self._pending or self._early:
            raise AssertionError(
                f"handoffs left: in flight {sorted(self._in_flight)}, pending {len(self._pending)}, "
                f"early {sorted(self._early)}"
            )

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self._channel is not None:
            self._channel.close()

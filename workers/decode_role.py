"""DecodeRole: admits requests prefilled elsewhere (reserve blocks -> receive KV -> commit) and decodes.

A handoff waiting for its KV holds its reserved blocks and a seat among max_num_seqs; if blocks are short,
the handoff waits here (bounded by its deadline) and is retried every step-loop turn. An abort during an
in-flight transfer is deferred until the transfer ends: the transfer thread may still be writing into the
reserved blocks, so they must not go back to the pool before then.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from cluster.protocol import ErrorCode, TokenDelta, TransferStats
from cluster.wire import DecodeHandoff, KeepAlive, PeerDead, RequestFailed, Transferred
from transfer.connector import KVReceiver
from transfer.pairs import PairChannel
from transfer.protocol import KVHandoff, TransferError, TransferResult
from workers.role import WorkerContext


@dataclass(frozen=True)
class _KVDone:
    """The receiver finished a fetch (the future holds the result or the TransferError)."""

    request_id: str
    future: Future[TransferResult]


class PendingHandoffs:
    """Handoffs waiting for blocks or seats, in arrival order, retried until their deadline."""

    def __init__(self) -> None:
        self.items: deque[tuple[DecodeHandoff, KVHandoff]] = deque()

    def __len__(self) -> int:
        return len(self.items)

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
        self._in_flight: dict[str, DecodeHandoff] = {}
        self._abort_after_transfer: set[str] = set()
        self._last_keep_alive = 0.0

    def start(self) -> None:
        channel = self._channel = self.ctx.channel()
        if channel is None:
            return
        self.receiver = KVReceiver(
            self.ctx.engine.runner.kv_cache,
            me=self.ctx.me,
            channel=channel,
            secret=self.ctx.secret,
            timeout_s=self.ctx.transfer_config.timeout_s,
        )
        self.receiver.start()

    def _fail(self, request_id: str, code: ErrorCode, message: str) -> None:
        self.ctx.send(RequestFailed(self.ctx.worker_id, request_id, code, message))

    # ---- handoffs -------------------------------------------------------------------------------------
    def on_first_token(self, delta: TokenDelta) -> None:
        raise RuntimeError("a decode worker never holds a prefill")

    def on_decode(self, op: DecodeHandoff) -> None:
        if self.receiver is None:
            self._fail(op.request_id, ErrorCode.INTERNAL, "decode worker has no KV receiver (no KV store)")
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
        future = self.receiver.submit(
            handoff, block_ids[num_hit:], skip_first_n_blocks=num_hit, deadline=op.deadline
        )
        self._in_flight[op.request_id] = op
        future.add_done_callback(lambda f: self.ctx.post(_KVDone(op.request_id, f)))
        return True

    def poll(self) -> None:
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

    def on_abort(self, request_id: str) -> bool:
        if request_id in self._in_flight:
            self._abort_after_transfer.add(request_id)
            return True
        return self._pending.remove(request_id)

    def handle(self, cmd: object) -> None:
        if not isinstance(cmd, _KVDone):
            raise RuntimeError(f"decode role: unexpected command {type(cmd).__name__}")
        rid, engine = cmd.request_id, self.ctx.engine
        op = self._in_flight.pop(rid)
        if rid in self._abort_after_transfer:
            self._abort_after_transfer.discard(rid)
            engine.abort(rid)
            return
        try:
            result = cmd.future.result()
        except TransferError as e:
            self._on_transfer_failed(op, e)
            return
        engine.commit_prefilled(rid)
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
        return len(self._in_flight) + len(self._pending)

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
        if self._in_flight or self._pending:
            raise AssertionError(
                f"handoffs left: in flight {sorted(self._in_flight)}, pending {len(self._pending)}"
            )

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self._channel is not None:
            self._channel.close()

"""DecodeWorker: admits already-prefilled requests (reserve blocks -> receive KV -> register) and decodes.

It also runs whole requests itself (colocated / conditional mode). A request waiting for its KV holds
its reserved blocks and a seat among max_num_seqs; if blocks are short, the handoff waits here (bounded
by its deadline) and is retried every loop.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from cluster.protocol import SamplingParams
from transfer.channel import TorchDistChannel
from transfer.connector import KVReceiver
from transfer.protocol import TransferError, TransferResult, handoff_from_dict
from workers.worker import EngineWorker


class PendingHandoffs:
    """Decode side: handoffs waiting for blocks or seats, retried each loop until their deadline."""

    def __init__(self) -> None:
        self.items: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.items)

    def remove(self, rid: str) -> bool:
        for msg in self.items:
            if msg["rid"] == rid:
                self.items.remove(msg)
                return True
        return False

    def expired(self, now: float) -> list[dict[str, Any]]:
        gone = [m for m in self.items if m.get("deadline") is not None and m["deadline"] < now]
        for m in gone:
            self.items.remove(m)
        return gone


class DecodeWorker(EngineWorker):
    pool = "decode"
    receiver: KVReceiver | None = None

    def _start_transfer(self, rank: int) -> None:
        self.receiver = KVReceiver(
            self.engine.runner.kv_cache,
            rank=rank,
            channel=TorchDistChannel(),
            timeout_s=self.transfer_config.timeout_s,
        )
        self.receiver.start()
        self._pending = PendingHandoffs()
        self._in_flight: dict[str, dict[str, Any]] = {}
        self._abort_after_transfer: set[str] = set()

    def _on_decode(self, msg: dict[str, Any]) -> None:
        if self.receiver is None:
            self._send_error(
                msg["rid"], 500, "decode worker has no KV receiver (process group not initialised)"
            )
        elif not self._try_start(msg):
            self._pending.items.append(msg)
        self._num_waiting_for_kv = len(self._in_flight) + len(self._pending)

    def _try_start(self, msg: dict[str, Any]) -> bool:
        """Reserve blocks and submit the fetch; False if blocks or seats are short right now."""
        assert self.receiver is not None
        rid = msg["rid"]
        try:
            reserved = self.engine.add_prefilled_request(
                rid, msg["prompt"], msg["first_token"], SamplingParams(**msg["params"])
            )
        except ValueError as e:
            self._send_error(rid, 400, str(e))
            return True
        if reserved is None:
            return False
        block_ids, num_hit = reserved
        handoff = handoff_from_dict(msg["handoff"])
        future = self.receiver.submit(
            handoff, block_ids[num_hit:], skip_first_n_blocks=num_hit, deadline=msg.get("deadline")
        )
        self._in_flight[rid] = msg
        future.add_done_callback(lambda f: self._commands.put(("kv_done", (rid, f))))
        return True

    def _has_pending_work(self) -> bool:
        return bool(self.receiver is not None and len(self._pending))

    def _poll_pending_work(self) -> None:
        if self.receiver is None or not len(self._pending):
            return
        for msg in self._pending.expired(time.time()):
            self._send_error(
                msg["rid"], 504, "deadline passed while waiting for KV blocks on the decode worker"
            )
        while len(self._pending) and self._try_start(self._pending.items[0]):
            self._pending.items.popleft()
        self._num_waiting_for_kv = len(self._in_flight) + len(self._pending)

    def _on_abort(self, rid: str) -> None:
        if self.receiver is not None:
            if rid in self._in_flight:
                # NOTE: the transfer thread may be writing into the reserved blocks right now; freeing
                # them before it ends could hand them to another request mid-write.
                self._abort_after_transfer.add(rid)
                return
            if self._pending.remove(rid):
                return
        self.engine.abort(rid)

    def _handle_transfer_command(self, kind: str, payload: Any) -> None:
        if kind != "kv_done":
            raise RuntimeError(f"unknown command {kind!r}")
        rid, future = payload
        msg = self._in_flight.pop(rid)
        self._num_waiting_for_kv = len(self._in_flight) + len(self._pending)
        if rid in self._abort_after_transfer:
            self._abort_after_transfer.discard(rid)
            self.engine.abort(rid)
            return
        try:
            result: TransferResult = future.result()
        except TransferError as e:
            self._on_transfer_failed(rid, msg, e)
            return
        self.engine.commit_prefilled(rid)
        self._transfer_bytes += result.nbytes
        self._transfer_seconds += result.seconds
        self._num_transfers += 1
        self._send({"kind": "transferred", "rid": rid, "seconds": result.seconds, "nbytes": result.nbytes})

    def _on_transfer_failed(self, rid: str, msg: dict[str, Any], error: TransferError) -> None:
        self._num_failed_transfers += 1
        self.engine.abort(rid)
        if self.transfer_config.failure_policy == "recompute":
            # the first token already reached the client: compute prompt + it here, sample on from there
            self.engine.add_request(
                rid, msg["prompt"], SamplingParams(**msg["params"]), output_token_ids=[msg["first_token"]]
            )
            self._send(
                {"kind": "transferred", "rid": rid, "seconds": 0.0, "nbytes": 0, "recomputed": str(error)}
            )
        else:
            self._send_error(rid, 500, f"KV transfer failed: {type(error).__name__}: {error}")

    def _on_peer_dead(self, rank: int) -> None:
        if self.receiver is not None:
            self.receiver.drop_peer(rank)

    def _check_transfer_leaks(self) -> None:
        if self.receiver is not None and (self._in_flight or len(self._pending)):
            raise AssertionError(
                f"handoffs left: in flight {sorted(self._in_flight)}, pending {len(self._pending)}"
            )

    def _close_transfer(self) -> None:
        if self.receiver is not None:
            self.receiver.close()

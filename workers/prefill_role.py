"""PrefillRole: a held request (SENDING_KV after its first token) is offered to the KV sender; its blocks
are freed when the decode side acks the transfer, when the transfer fails, when the lease expires
(``on_sent``), or on abort (deferred while its transfer is in flight)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from cluster.protocol import ErrorCode, TokenDelta, TransferStats
from cluster.wire import DecodeHandoff, PeerDead, Prefilled, PrepareDecode, RequestFailed
from transfer.connector import KVSender
from transfer.pairs import PairChannel
from workers.mock_runner import paced_link
from workers.request import RequestStatus
from workers.role import WorkerContext


@dataclass(frozen=True)
class _Sent:
    """The sender is done with a request (ok: the decode side has its KV)."""

    request_id: str
    ok: bool


class PrefillRole:
    holds_prefills = True
    accepts_handoffs = False

    def __init__(self, context: WorkerContext) -> None:
        self.ctx = context
        self.sender: KVSender | None = None
        self._channel: PairChannel | None = None  # this worker's KV-transfer pairs

    def start(self) -> None:
        engine, cfg = self.ctx.engine, self.ctx.transfer_config
        channel = self._channel = self.ctx.channel()
        if channel is None:
            return
        self.sender = KVSender(
            engine.runner.kv_relay or engine.runner.kv_cache,  # NOTE: at TP > 1 every rank's heads
            me=self.ctx.me,
            channel=channel,
            secret=self.ctx.secret,
            on_sent=lambda rid, ok: self.ctx.post(_Sent(rid, ok)),
            endpoint=f"tcp://{self.ctx.bind_host}:*",
            timeout_s=cfg.timeout_s,
            lease_s=cfg.lease_s,
            integrity=cfg.integrity,
            link=paced_link(engine.runner.model, engine.runner.kv_cache, self.ctx.bind_host),
        )
        self.sender.start()

    def on_first_token(self, delta: TokenDelta) -> None:
        engine, rid = self.ctx.engine, delta.request_id
        if self.sender is None:
            engine.abort(rid)
            self.ctx.send(
                RequestFailed(
                    self.ctx.worker_id,
                    rid,
                    ErrorCode.INTERNAL,
                    "prefill worker has no KV sender (it moves no KV)",
                )
            )
            return
        block_ids = engine.held_block_ids(rid)
        if block_ids is None:
            raise RuntimeError(f"held request {rid!r} holds no blocks")
        prompt_len = len(engine.scheduler.requests[rid].prompt_token_ids)
        # NOTE: the sender keeps its own frozen copy of the ids; it never reads the engine's tables
        handoff = self.sender.offer(rid, block_ids, num_tokens=prompt_len)
        self.ctx.send(Prefilled(self.ctx.worker_id, delta, handoff.to_bytes()))

    def on_prepare(self, op: PrepareDecode) -> None:
        raise RuntimeError("a prefill worker accepts no handoffs")

    def on_decode(self, op: DecodeHandoff) -> None:
        raise RuntimeError("a prefill worker accepts no handoffs")

    def on_abort(self, request_id: str) -> bool:
        if self.sender is None:
            return False
        held = self.ctx.engine.request_status(request_id) == RequestStatus.SENDING_KV
        # NOTE: an offer in flight cannot be withdrawn; its on_sent comes and frees the blocks then. A
        # request still prefilling has no offer, but maybe a fetch parked for it (early admission): the
        # sender refuses that one now.
        is_withdrawn = self.sender.abort(request_id)
        return held and not is_withdrawn

    def holds(self, request_id: str) -> bool:
        return False  # NOTE: a held request stays in the engine (SENDING_KV) until its KV is sent

    def on_peer_dead(self, op: PeerDead) -> None:
        if self.sender is not None:
            self.sender.drop_peer(op.worker_id, op.incarnation or None)

    def on_extend_lease(self, request_id: str) -> None:
        if self.sender is not None:
            self.sender.extend_lease(request_id, self.ctx.transfer_config.lease_s)

    def handle(self, cmd: object) -> None:
        if not isinstance(cmd, _Sent):
            raise RuntimeError(f"prefill role: unexpected command {type(cmd).__name__}")
        if self.ctx.engine.request_status(cmd.request_id) == RequestStatus.SENDING_KV:
            self.ctx.engine.release(cmd.request_id)

    def poll(self) -> None:
        return None

    def num_waiting_for_kv(self) -> int:
        return 0

    def transfer_stats(self) -> TransferStats:
        return self.sender.stats() if self.sender is not None else TransferStats()

    def kv_endpoint(self) -> str:
        return self.sender.endpoint if self.sender is not None else ""

    def broken_peers(self) -> list[str]:
        return self.sender.broken_peers() if self.sender is not None else []

    def rejected_frames(self) -> dict[str, int]:
        return self.sender.rejected_frames() if self.sender is not None else {}

    def threads(self) -> list[threading.Thread]:
        return [self.sender.thread] if self.sender is not None else []

    def check_leaks(self) -> None:
        if self.sender is not None and (self.sender.num_held() or self.sender.num_parked()):
            raise AssertionError(
                f"KV sender still holds {self.sender.num_held()} offers, "
                f"{self.sender.num_parked()} parked transfer requests"
            )

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self._channel is not None:
            self._channel.close()

"""PrefillWorker: computes prompts, samples the first token, holds the blocks until the handoff ends.

A held request (SENDING_KV) is offered to the KV sender; its blocks are freed when the decode side
acks the transfer, when the transfer fails, when the lease expires (``on_sent``), or on abort.
"""

from __future__ import annotations

from typing import Any

from cluster.protocol import TokenDelta, to_dict
from transfer.channel import TorchDistChannel
from transfer.connector import KVSender
from workers.request import RequestStatus
from workers.worker import EngineWorker


class PrefillWorker(EngineWorker):
    pool = "prefill"
    sender: KVSender | None = None

    def _start_transfer(self, rank: int) -> None:
        host = self.request_endpoint.rsplit(":", 1)[0]
        self.sender = KVSender(
            self.engine.runner.kv_cache,
            rank=rank,
            channel=TorchDistChannel(),
            on_sent=lambda rid, ok: self._commands.put(("sent", (rid, ok))),
            endpoint=f"{host}:*",
            timeout_s=self.transfer_config.timeout_s,
            lease_s=self.transfer_config.lease_s,
        )
        self.sender.start()

    def _on_prefilled(self, delta: TokenDelta) -> None:
        rid = delta.request_id
        if self.sender is None:
            self.engine.abort(rid)
            self._send_error(rid, 500, "prefill worker has no KV sender (process group not initialised)")
            return
        prompt_len = len(self.engine.scheduler.requests[rid].prompt_token_ids)
        block_ids = self.engine.held_block_ids(rid)
        if block_ids is None:  # NOTE: cannot happen: the request was just prefilled and is held
            raise RuntimeError(f"prefilled request {rid!r} holds no KV blocks")
        handoff = self.sender.offer(rid, block_ids, num_tokens=prompt_len)
        self._send({"kind": "prefilled", "delta": to_dict(delta), "handoff": to_dict(handoff)})

    def _on_abort(self, rid: str) -> None:
        held = self.engine.request_status(rid) == RequestStatus.SENDING_KV and self.sender is not None
        if held and self.sender is not None and not self.sender.abort(rid):
            return  # in flight: its on_sent comes and frees the blocks then
        self.engine.abort(rid)

    def _handle_transfer_command(self, kind: str, payload: Any) -> None:
        if kind != "sent":
            raise RuntimeError(f"unknown command {kind!r}")
        rid, _ok = payload
        if self.engine.request_status(rid) == RequestStatus.SENDING_KV:
            self.engine.release(rid)
        if self.sender is not None:
            st = self.sender.stats()
            self._transfer_bytes, self._transfer_seconds, self._num_transfers = (
                st.bytes_total,
                st.seconds_total,
                st.num_ok,
            )

    def _on_peer_dead(self, rank: int) -> None:
        if self.sender is not None:
            self.sender.drop_peer(rank)

    def _check_transfer_leaks(self) -> None:
        if self.sender is not None and self.sender.num_held():
            raise AssertionError(f"KV sender still holds {self.sender.num_held()} offers")

    def _close_transfer(self) -> None:
        if self.sender is not None:
            self.sender.close()

"""KVReceiver's own checks, without a peer (a channel that moves nothing): it refuses fetches it cannot
run (not started or closed, bad block ids) and fails a fetch whose deadline passed while it was queued
before a single frame goes out."""

from __future__ import annotations

import pytest
import torch
import zmq

from cluster.frames import new_secret
from transfer.channel import Channel, OpLane, PendingOp
from transfer.peers import PairKey, PeerId
from transfer.protocol import KVHandoff, KVLayout, TransferError, TransferTimeoutError
from transfer.receiver import KVReceiver

NUM_BLOCKS = 8


class IdleChannel(Channel):
    """A channel no transfer in these tests reaches past the handshake."""

    backend = "gloo"

    def staging_device(self, kv_device: torch.device) -> torch.device:
        return kv_device

    def generation(self, prefill: PeerId, decode: PeerId) -> int:
        return 0

    def isend(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp:
        raise AssertionError("no bytes move in these tests")

    def irecv(self, buf: torch.Tensor, key: PairKey, tag: int, lane: OpLane | None = None) -> PendingOp:
        raise AssertionError("no bytes move in these tests")


def make_receiver() -> KVReceiver:
    kv = torch.zeros(2, NUM_BLOCKS, 2, 4, 2, 8)
    return KVReceiver(
        kv, me=PeerId("decode-0", "d0"), channel=IdleChannel(), secret=new_secret(), timeout_s=5.0
    )


def handoff(rid: str, endpoint: str = "tcp://127.0.0.1:1") -> KVHandoff:
    return KVHandoff(rid, "prefill-0", "p0", endpoint, KVLayout(2, 4, 2, 8, "float32"), 10, 3, 0.0)


def test_fetches_it_cannot_run_are_refused() -> None:
    receiver = make_receiver()
    with pytest.raises(TransferError, match="not running"):
        receiver.submit(handoff("early"), [1, 2, 3])
    receiver.start()
    try:
        for ids, skip in (([0, 1, 2], 0), ([1, 2, NUM_BLOCKS], 0), ([1, 2, 2], 0), ([1, 2, 3], -1)):
            with pytest.raises(ValueError):
                receiver.submit(handoff("bad"), ids, skip_first_n_blocks=skip)
        assert receiver.stats().num_failed == 0 and receiver.results() == []
    finally:
        receiver.close()
    with pytest.raises(TransferError, match="not running"):
        receiver.submit(handoff("late"), [1, 2, 3])


def test_a_fetch_past_its_deadline_fails_with_a_timeout_and_is_counted() -> None:
    ctx = zmq.Context()
    sender = ctx.socket(zmq.ROUTER)  # where the REQUEST would go
    sender.bind("tcp://127.0.0.1:*")
    receiver = make_receiver()
    receiver.start()
    try:
        future = receiver.submit(
            handoff("stale", sender.getsockopt_string(zmq.LAST_ENDPOINT)), [1, 2, 3], deadline=0.0
        )
        # NOTE: every fetch's request goes out at once (early decode admission); no header came in time
        with pytest.raises(TransferTimeoutError, match="no header for 'stale' before its deadline"):
            future.result(timeout=10)
        (result,) = receiver.results()
        assert (result.request_id, result.ok, result.num_blocks, result.error_type) == (
            "stale",
            False,
            3,
            "TransferTimeoutError",
        )
        assert receiver.stats().num_failed == 1
    finally:
        receiver.close()
        sender.close(linger=0)
        ctx.term()

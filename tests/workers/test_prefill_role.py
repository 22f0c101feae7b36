"""PrefillRole driven turn by turn (tests/support/handoff_fakes.py) with a fake KV sender: a held request is
offered with its block table and prompt length, keeps its blocks until the sender is done with it (an
abort during the send waits for that too), then leaves them to the prefix cache."""

from __future__ import annotations

import pytest

from cluster.config import TransferConfig
from cluster.protocol import ErrorCode, TokenDelta, TransferStats
from cluster.wire import DecodeHandoff, PeerDead, Prefilled, PrepareDecode, RequestFailed
from tests.support.handoff_fakes import PrefillSide, greedy
from tests.support.oracle_cache import hf_reference, qwen3_model
from transfer.protocol import KVHandoff
from workers.request import RequestStatus

PROMPT = [11, 48, 301, 7, 250, 99, 3, 480, 17, 64]  # 10 tokens: 3 blocks of 4, 2 of them full


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return qwen3_model(tmp_path_factory)


@pytest.fixture(scope="module")
def first_token(model_dir: str) -> int:
    return hf_reference(model_dir, [PROMPT], [1])[0][0]


def held(model_dir: str, rid: str = "A", **transfer: float) -> PrefillSide:
    """A prefill side whose request ``rid`` has sampled its first token and is offered."""
    p = PrefillSide(model_dir, TransferConfig(**transfer), num_kv_blocks=32)
    p.engine.add_request(rid, PROMPT, greedy(8), hold_after_prefill=True)
    p.turn()
    assert p.engine.request_status(rid) == RequestStatus.SENDING_KV
    return p


@pytest.mark.parametrize("ok", [True, False])
def test_a_held_prefill_is_offered_and_its_blocks_kept_until_the_sender_is_done(
    model_dir: str, first_token: int, ok: bool
) -> None:
    p = held(model_dir)
    assert p.sender.offers == {"A": ([1, 2, 3], len(PROMPT))}
    (event,) = p.events
    assert isinstance(event, Prefilled) and event.worker_id == "worker-0"
    assert event.delta.request_id == "A" and event.delta.token_ids == [first_token]
    handoff = KVHandoff.from_bytes(event.handoff)
    assert (handoff.request_id, handoff.num_tokens, handoff.num_blocks) == ("A", len(PROMPT), 3)
    p.turn()
    assert p.engine.held_block_ids("A") == [1, 2, 3]  # still held for the transfer
    with pytest.raises(AssertionError, match="holds 1 offers"):
        p.role.check_leaks()
    p.sent("A", ok)
    p.turn()
    assert p.engine.request_status("A") is None
    p.engine.check_no_leaks()
    p.role.check_leaks()
    cache = p.engine.scheduler.kv.prefix_cache
    assert cache is not None and [cache.is_cached(b) for b in (1, 2, 3)] == [True, True, False]
    p.sent("A", ok)  # a second word about it changes nothing
    p.turn()
    p.engine.check_no_leaks()


def test_an_abort_during_the_send_waits_for_the_sender(model_dir: str) -> None:
    p = held(model_dir)
    p.sender.in_flight.add("A")
    p.abort("A")
    p.turn()
    assert p.engine.held_block_ids("A") == [1, 2, 3]  # the sender may still read them
    p.sent("A", False)
    p.turn()
    assert p.engine.request_status("A") is None
    p.engine.check_no_leaks()
    p.role.check_leaks()


def test_an_abort_before_the_send_frees_at_once(model_dir: str) -> None:
    p = held(model_dir)
    p.abort("A")  # the offer is withdrawn: no on_sent will come
    assert p.engine.request_status("A") is None and p.sender.offers == {}
    p.engine.check_no_leaks()
    # a request still prefilling is the engine's to abort
    p.engine.add_request("B", PROMPT, greedy(8), hold_after_prefill=True)
    p.abort("B")
    assert p.engine.request_status("B") is None
    p.engine.check_no_leaks()
    p.role.check_leaks()


def test_lease_and_peer_ops_reach_the_sender(model_dir: str) -> None:
    p = held(model_dir, lease_s=7.5)
    p.role.on_extend_lease("A")
    p.role.on_peer_dead(PeerDead("decode-1", "inc7"))
    p.role.on_peer_dead(PeerDead("decode-2", ""))
    assert p.sender.leases == [("A", 7.5)]
    assert p.sender.dropped == [("decode-1", "inc7"), ("decode-2", None)]
    p.sent("A", True)
    p.turn()
    p.engine.check_no_leaks()


def test_without_a_sender_a_held_request_fails_and_frees(model_dir: str) -> None:
    p = PrefillSide(model_dir, num_kv_blocks=32)
    p.role.sender = None
    p.engine.add_request("A", PROMPT, greedy(8), hold_after_prefill=True)
    p.turn()
    (event,) = p.events
    assert isinstance(event, RequestFailed) and (event.request_id, event.code) == ("A", ErrorCode.INTERNAL)
    assert event.message == "prefill worker has no KV sender (it moves no KV)"
    p.engine.check_no_leaks()


def test_the_role_reports_its_senders_state(model_dir: str) -> None:
    p = PrefillSide(model_dir, num_kv_blocks=32)
    sender = p.sender
    sender.broken, sender.rejected = ["decode-1/d1"], {"replayed": 1}
    assert p.role.transfer_stats() == TransferStats(num_ok=0, bytes_total=9)
    assert (p.role.broken_peers(), p.role.rejected_frames()) == (["decode-1/d1"], {"replayed": 1})
    assert p.role.threads() == [sender.thread] and p.role.kv_endpoint() == "tcp://127.0.0.1:9"
    assert p.role.num_waiting_for_kv() == 0
    p.role.sender = None
    assert (p.role.transfer_stats(), p.role.broken_peers(), p.role.rejected_frames()) == (
        TransferStats(),
        [],
        {},
    )
    assert p.role.threads() == [] and p.role.kv_endpoint() == ""


def test_without_a_sender_an_abort_is_the_engines(model_dir: str) -> None:
    p = PrefillSide(model_dir, num_kv_blocks=32)
    p.role.sender = None
    p.engine.add_request("A", PROMPT, greedy(8), hold_after_prefill=True)
    assert p.role.on_abort("A") is False  # the worker then aborts it in the engine
    assert p.engine.request_status("A") is not None
    p.abort("A")
    assert p.engine.request_status("A") is None and p.events == []
    p.engine.check_no_leaks()


def test_a_prefill_role_refuses_what_is_not_its_to_do(model_dir: str) -> None:
    """Programming errors, loud: the worker routes none of these to a prefill role."""
    p = PrefillSide(model_dir, num_kv_blocks=32)
    with pytest.raises(RuntimeError, match="a prefill worker accepts no handoffs"):
        p.role.on_prepare(PrepareDecode("A", PROMPT, greedy(8), 1e12, "prefill-1", "p1", "tcp://x:1"))
    handoff = KVHandoff("A", "prefill-1", "p1", "tcp://x:1", p.sender.layout, 10, 3, 0.0).to_bytes()
    with pytest.raises(RuntimeError, match="a prefill worker accepts no handoffs"):
        p.role.on_decode(DecodeHandoff("A", PROMPT, 5, greedy(8), handoff, 1e12))
    with pytest.raises(RuntimeError, match="prefill role: unexpected command object"):
        p.role.handle(object())
    with pytest.raises(RuntimeError, match="held request 'B' holds no blocks"):
        p.role.on_first_token(TokenDelta("B", [5]))
    assert p.role.poll() is None and p.events == [] and p.sender.offers == {}

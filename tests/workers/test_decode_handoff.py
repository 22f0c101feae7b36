"""DecodeRole driven turn by turn (tests/support/handoff_fakes.py): a real engine, the KV mover faked so each test
decides when a transfer ends and what it wrote. An abort that arrives while the KV is in flight ends
the request on this worker once the transfer ends (never decodes, never recomputes), and its reserved
blocks stay out of the pool until then: traffic that would reuse them waits, and still equals
transformers after the late bytes land."""

from __future__ import annotations

import time

import pytest
import torch

from cluster.config import TransferConfig
from cluster.protocol import ErrorCode, TokenDelta, TransferStats
from cluster.wire import DecodeHandoff, KeepAlive, PeerDead, PrepareDecode, RequestFailed, Transferred
from tests.support.cluster_utils import wait_for
from tests.support.handoff_fakes import DecodeSide, FakeReceiver, PrefillEngine, context, greedy
from tests.support.oracle_cache import hf_reference, qwen3_model
from workers.decode_role import DecodeRole

PROMPT_A = [11, 48, 301, 7, 250, 99, 3, 480, 17, 64]  # 10 tokens: 3 blocks of 4
PROMPT_B = [5, 77, 402, 18, 260, 90, 91, 92, 33, 8, 140, 9]  # 12 tokens: 3 blocks
PROMPT_C = [200, 201, 17, 5, 3, 88, 412]  # 7 tokens: 2 blocks
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return qwen3_model(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(model_dir: str) -> dict[str, list[int]]:
    prompts = {"A": PROMPT_A, "B": PROMPT_B, "C": PROMPT_C}
    outs = hf_reference(model_dir, list(prompts.values()), [NUM_TOKENS] * 3)
    return dict(zip(prompts, outs, strict=True))


@pytest.fixture(scope="module")
def prefill(model_dir: str) -> PrefillEngine:
    return PrefillEngine(model_dir, num_kv_blocks=64)


def test_a_handoff_lands_in_its_reserved_blocks_and_decodes_like_transformers(
    model_dir: str, prefill: PrefillEngine, reference: dict[str, list[int]]
) -> None:
    d = DecodeSide(model_dir, num_kv_blocks=32)
    first, rows = prefill.prefill("C", PROMPT_C, greedy(NUM_TOKENS))
    assert first == reference["C"][0]
    d.handoff("C", PROMPT_C, first, greedy(NUM_TOKENS))
    fetch = d.receiver.fetches["C"]
    # NOTE: the prefill side holds the KV: a fetch that found it gone fails at once, never waits for it
    assert (fetch.dst_block_ids, fetch.skip_first_n_blocks, fetch.wait_for_offer) == ([1, 2], 0, False)
    assert d.role.num_waiting_for_kv() == 1
    d.turn()
    assert d.tokens["C"] == []  # nothing decodes before the KV is there
    with pytest.raises(AssertionError, match=r"handoffs left: in flight \['C'\], pending 0"):
        d.role.check_leaks()
    d.receiver.land("C", rows)
    d.run_until_idle()
    assert [first, *d.tokens["C"]] == reference["C"]
    assert d.events_for("C") == [Transferred("worker-0", "C", 0.25, rows.numel() * 4)]
    d.check_no_leaks()

    # the same prompt again: its first full block is this worker's own prefix-cache hit, so the fetch
    # skips it and lands in the one block that is not cached
    d.handoff("C2", PROMPT_C, first, greedy(NUM_TOKENS))
    fetch = d.receiver.fetches["C2"]
    assert fetch.skip_first_n_blocks == 1 and len(fetch.dst_block_ids) == 1
    assert d.engine.held_block_ids("C2") == [1, *fetch.dst_block_ids]
    d.receiver.land("C2", rows[:, 1:])
    d.run_until_idle()
    assert [first, *d.tokens["C2"]] == reference["C"]
    assert d.engine.stats().prefix_cache_hits == 4
    d.check_no_leaks()


@pytest.mark.parametrize("outcome", ["landed", "failed"])
def test_an_abort_while_the_kv_is_in_flight_ends_the_request_on_the_decode_worker(
    model_dir: str, prefill: PrefillEngine, reference: dict[str, list[int]], outcome: str
) -> None:
    """The abort is deferred, not dropped: when the transfer ends (either way) the request is gone
    from the engine without a token, even under the recompute policy, while its neighbour decodes on."""
    d = DecodeSide(model_dir, TransferConfig(failure_policy="recompute"), num_kv_blocks=32)
    first_c, rows_c = prefill.prefill("C", PROMPT_C, greedy(NUM_TOKENS))
    first_a, rows_a = prefill.prefill("A", PROMPT_A, greedy(NUM_TOKENS))
    d.handoff("C", PROMPT_C, first_c, greedy(NUM_TOKENS))
    d.receiver.land("C", rows_c)
    d.handoff("A", PROMPT_A, first_a, greedy(NUM_TOKENS))
    reserved = d.engine.held_block_ids("A")
    assert reserved is not None and reserved == d.receiver.fetches["A"].dst_block_ids
    d.turn()
    d.turn()
    d.abort("A")
    # the transfer may still write into A's blocks: they stay reserved until it ends
    assert d.engine.held_block_ids("A") == reserved
    d.turn()
    if outcome == "landed":
        d.receiver.land("A", rows_a)
    else:
        d.receiver.fail("A")
    d.turn()
    assert d.engine.request_status("A") is None and d.role.num_waiting_for_kv() == 0
    d.run_until_idle()
    assert d.tokens["A"] == []
    assert d.events_for("A") == []  # the router gave up on it: neither Transferred nor a failure
    assert [first_c, *d.tokens["C"]] == reference["C"]
    d.check_no_leaks()
    # the caller may use the id again: the old abort is spent, the new request decodes in full
    d.handoff("A", PROMPT_A, first_a, greedy(NUM_TOKENS))
    d.receiver.land("A", rows_a)
    d.run_until_idle()
    assert [first_a, *d.tokens["A"]] == reference["A"]
    d.check_no_leaks()


def test_an_abort_while_decoding_stops_the_request_at_once(
    model_dir: str, prefill: PrefillEngine, reference: dict[str, list[int]]
) -> None:
    d = DecodeSide(model_dir, num_kv_blocks=32)
    first, rows = prefill.prefill("A", PROMPT_A, greedy(NUM_TOKENS))
    d.handoff("A", PROMPT_A, first, greedy(NUM_TOKENS))
    d.receiver.land("A", rows)
    d.turn()
    d.turn()
    assert [first, *d.tokens["A"]] == reference["A"][:3]
    d.abort("A")
    assert d.engine.request_status("A") is None
    d.run_until_idle()
    assert [first, *d.tokens["A"]] == reference["A"][:3]
    d.check_no_leaks()


@pytest.mark.parametrize("outcome", ["landed", "failed"])
def test_blocks_of_an_aborted_in_flight_transfer_are_not_reused_until_it_ends(
    model_dir: str, reference: dict[str, list[int]], outcome: str
) -> None:
    """Five usable blocks: A's fetch reserves three, then A is aborted. B needs all five, so it must
    wait for A's transfer to end; the late bytes (junk) land in A's blocks, and B, run in those same
    blocks afterwards, still equals transformers."""
    d = DecodeSide(model_dir, TransferConfig(failure_policy="recompute"), num_kv_blocks=6)
    d.handoff("A", PROMPT_A, 1, greedy(NUM_TOKENS))
    reserved = d.receiver.fetches["A"].dst_block_ids
    assert len(reserved) == 3
    d.abort("A")
    d.engine.add_request("B", PROMPT_B, greedy(NUM_TOKENS))  # 12 + 8 - 1 computed tokens: 5 blocks
    for _ in range(3):
        d.turn()
        assert d.tokens["B"] == [] and d.engine.held_block_ids("B") is None
        assert d.engine.held_block_ids("A") == reserved
    if outcome == "landed":
        d.receiver.land("A", d.engine.runner.kv_cache[:, reserved].clone().fill_(1e4))
    else:
        d.receiver.fail("A", junk=True)
    d.run_until_idle()
    assert set(reserved) <= set(range(1, 6))  # B ran in the pool's only blocks, A's among them
    assert d.tokens["B"] == reference["B"] and d.tokens["A"] == []
    d.check_no_leaks()


def test_a_failed_transfer_fails_the_request_or_recomputes_it(
    model_dir: str, reference: dict[str, list[int]]
) -> None:
    fail = DecodeSide(model_dir, TransferConfig(failure_policy="fail"), num_kv_blocks=32)
    fail.handoff("A", PROMPT_A, reference["A"][0], greedy(NUM_TOKENS))
    fail.receiver.fail("A", junk=True)
    fail.run_until_idle()
    (event,) = fail.events_for("A")
    assert isinstance(event, RequestFailed) and event.code == ErrorCode.KV_TRANSFER_FAILED
    assert event.message == "KV transfer failed: TransferError: injected: the sender went away"
    assert fail.tokens["A"] == []
    fail.check_no_leaks()

    again = DecodeSide(model_dir, TransferConfig(failure_policy="recompute"), num_kv_blocks=32)
    again.handoff("A", PROMPT_A, reference["A"][0], greedy(NUM_TOKENS))
    again.receiver.fail("A", junk=True)  # the junk must not be read: the prompt is computed here
    again.run_until_idle()
    assert again.events_for("A") == [
        Transferred("worker-0", "A", 0.0, 0, recomputed="TransferError: injected: the sender went away")
    ]
    assert [reference["A"][0], *again.tokens["A"]] == reference["A"]
    again.check_no_leaks()


def test_handoffs_short_of_seats_wait_in_order_keep_the_lease_and_obey_aborts(
    model_dir: str, prefill: PrefillEngine, reference: dict[str, list[int]]
) -> None:
    """One seat (max_num_seqs 1): A takes it; B and E wait (their prefill side is kept holding the
    KV); E is aborted while waiting and never fetched; B starts only once A has ended."""
    d = DecodeSide(model_dir, TransferConfig(lease_s=0.001), num_kv_blocks=32, max_num_seqs=1)
    first_a, rows_a = prefill.prefill("A", PROMPT_A, greedy(NUM_TOKENS))
    first_b, rows_b = prefill.prefill("B", PROMPT_B, greedy(NUM_TOKENS))
    d.handoff("A", PROMPT_A, first_a, greedy(NUM_TOKENS))
    d.handoff("B", PROMPT_B, first_b, greedy(NUM_TOKENS))
    d.handoff("E", PROMPT_C, 1, greedy(NUM_TOKENS))
    assert sorted(d.receiver.fetches) == ["A"] and d.role.num_waiting_for_kv() == 3
    d.turn()
    assert [(type(e), e.request_id) for e in d.events] == [(KeepAlive, "B"), (KeepAlive, "E")]
    d.abort("E")
    assert d.role.num_waiting_for_kv() == 2
    d.receiver.land("A", rows_a)
    while d.engine.request_status("A") is not None:
        assert "B" not in d.receiver.fetches
        d.turn()
    d.turn()
    assert sorted(d.receiver.fetches) == ["A", "B"]
    d.receiver.land("B", rows_b)
    d.run_until_idle()
    assert "E" not in d.receiver.fetches and d.tokens["E"] == []
    assert not [e for e in d.events_for("E") if not isinstance(e, KeepAlive)]
    assert [first_a, *d.tokens["A"]] == reference["A"]
    assert [first_b, *d.tokens["B"]] == reference["B"]
    d.check_no_leaks()


def test_keep_alives_for_waiting_handoffs_are_paced_at_a_quarter_lease(model_dir: str) -> None:
    d = DecodeSide(model_dir, TransferConfig(lease_s=3.0), num_kv_blocks=32, max_num_seqs=1)
    d.handoff("A", PROMPT_A, 1, greedy(NUM_TOKENS))  # takes the only seat, its KV never comes
    d.handoff("B", PROMPT_B, 1, greedy(NUM_TOKENS))
    for _ in range(3):  # three turns well within 0.75 s (nothing to step): one keep-alive
        d.turn()
    assert d.events == [KeepAlive("worker-0", "B")]
    d.abort("B")
    d.abort("A")
    d.receiver.fail("A")
    d.run_until_idle()
    d.check_no_leaks()


def test_a_handoff_waiting_past_its_deadline_fails_with_deadline_exceeded(model_dir: str) -> None:
    d = DecodeSide(model_dir, num_kv_blocks=6)  # 5 usable blocks: A takes 3, B and C need 3 each
    d.handoff("A", PROMPT_A, 1, greedy(NUM_TOKENS))
    d.handoff("B", PROMPT_B, 1, greedy(NUM_TOKENS), deadline_s=-1.0)
    d.handoff("C", PROMPT_B, 1, greedy(NUM_TOKENS))
    d.turn()
    assert [(type(e), e.request_id) for e in d.events] == [(RequestFailed, "B"), (KeepAlive, "C")]
    assert d.events[0].code == ErrorCode.DEADLINE_EXCEEDED
    assert d.role.num_waiting_for_kv() == 2  # A in flight, C still waiting
    d.abort("C")
    d.abort("A")
    d.receiver.fail("A")
    d.run_until_idle()
    assert len(d.events) == 2 and sorted(d.receiver.fetches) == ["A"]
    d.check_no_leaks()


def test_bad_handoffs_fail_the_request_and_leave_nothing(model_dir: str) -> None:
    d = DecodeSide(model_dir, num_kv_blocks=8, max_model_len=16)
    d.handoff("long", PROMPT_B, 1, greedy(NUM_TOKENS))  # 12 + 8 > 16
    d.role.on_prepare(
        PrepareDecode(
            "long-early", PROMPT_B, greedy(NUM_TOKENS), time.time() + 60, "prefill-0", "p0", "tcp://x:1"
        )
    )
    d.role.on_decode(DecodeHandoff("garbled", PROMPT_A, 1, greedy(2), b"\x00", 1e12))
    events = {e.request_id: e for e in d.events}
    for rid in ("long", "long-early"):
        assert events[rid].code == ErrorCode.INVALID_REQUEST and "max_model_len" in events[rid].message
    assert events["garbled"].code == ErrorCode.INVALID_REQUEST
    assert events["garbled"].message.startswith("bad KV handoff: ")
    assert d.receiver.fetches == {} and d.role.num_waiting_for_kv() == 0
    d.role.on_peer_dead(PeerDead("prefill-1", ""))
    assert d.receiver.dropped == [("prefill-1", None)]
    d.role.receiver = None
    d.handoff("orphan", PROMPT_A, 1, greedy(2))
    assert d.events[-1].code == ErrorCode.INTERNAL and d.events[-1].request_id == "orphan"
    d.check_no_leaks()


def test_the_role_reports_its_receivers_state() -> None:
    """What the worker publishes (stats, broken pairs, dropped handshake frames, threads to watch) is
    the receiver's; without a receiver, nothing."""
    role = DecodeRole(context(None, TransferConfig(), [], []))  # type: ignore[arg-type]  # no engine needed
    assert (role.transfer_stats(), role.broken_peers(), role.rejected_frames()) == (TransferStats(), [], {})
    assert role.threads() == [] and role.kv_endpoint() == ""
    receiver = FakeReceiver(torch.zeros(1, 2, 2, 1, 1, 1))
    receiver.broken, receiver.rejected = ["prefill-1/p1"], {"bad_mac": 2}
    role.receiver = receiver  # type: ignore[assignment]
    assert role.transfer_stats() == TransferStats(num_ok=0, bytes_total=7)
    assert (role.broken_peers(), role.rejected_frames()) == (["prefill-1/p1"], {"bad_mac": 2})
    assert role.threads() == [receiver.thread] and role.kv_endpoint() == ""


def test_an_early_admission_posts_its_fetch_at_once_unless_handoffs_wait_before_it(model_dir: str) -> None:
    """PrepareDecode reserves and posts the fetch in the same turn when nothing waits; behind a handoff
    that waits for a seat it waits too (it never takes a seat or blocks a waiting handoff needs)."""
    d = DecodeSide(model_dir, num_kv_blocks=32, max_num_seqs=1)

    def prepare(rid: str, prompt: list[int]) -> None:
        deadline = time.time() + 60
        d.role.on_prepare(
            PrepareDecode(rid, prompt, greedy(NUM_TOKENS), deadline, "prefill-0", "p0", "tcp://x:1")
        )

    prepare("C", PROMPT_C)
    assert sorted(d.receiver.fetches) == ["C"]  # before any turn of the step loop
    fetch = d.receiver.fetches["C"]
    assert (fetch.dst_block_ids, fetch.handoff.num_blocks, fetch.wait_for_offer) == ([1, 2], 2, True)
    num_free = d.engine.scheduler.kv.pool.num_free
    d.handoff("A", PROMPT_A, 5, greedy(NUM_TOKENS))  # C holds the only seat: A waits
    prepare("B", PROMPT_B)
    for _ in range(3):
        d.turn()
    assert sorted(d.receiver.fetches) == ["C"] and d.engine.scheduler.kv.pool.num_free == num_free
    for rid in ("B", "A", "C"):
        d.abort(rid)  # C's fetch is cancelled (it waited for the offer)
    d.run_until_idle()
    assert d.tokens == {} and d.engine.scheduler.kv.pool.num_free == 31
    d.check_no_leaks()


def test_early_admissions_wait_their_turn_and_expire_only_when_no_fetch_holds_them(model_dir: str) -> None:
    """Past its deadline an early request that holds no fetch is dropped; one whose fetch is in flight
    is kept (its blocks are being written) until the fetch ends. Those that waited behind a handoff are
    reserved, in order, once seats free up."""
    d = DecodeSide(model_dir, num_kv_blocks=32, max_num_seqs=1)

    def prepare(rid: str, prompt: list[int], deadline_s: float = 60) -> None:
        op = PrepareDecode(
            rid, prompt, greedy(NUM_TOKENS), time.time() + deadline_s, "prefill-0", "p0", "tcp://x:1"
        )
        d.role.on_prepare(op)

    prepare("C", PROMPT_C, deadline_s=-1)  # the seat; its fetch posted, its deadline already passed
    d.handoff("A", PROMPT_A, 5, greedy(NUM_TOKENS))  # waits for the seat
    prepare("Y", PROMPT_B, deadline_s=-1)  # waits behind A, expired
    prepare("B", PROMPT_B)  # waits behind A
    d.turn()
    assert d.role.num_waiting_for_kv() == 3  # C (in flight), A (pending), B: Y is gone
    assert d.engine.request_status("C") is not None and sorted(d.receiver.fetches) == ["C"]
    d.abort("C")  # its fetch is cancelled; the seat goes to A, not to B
    d.turn()
    d.turn()
    assert sorted(d.receiver.fetches) == ["A", "C"]
    d.abort("A")
    d.receiver.fail("A")
    d.turn()
    d.turn()
    assert sorted(d.receiver.fetches) == ["A", "B", "C"]  # B, reserved once nothing waits before it
    d.abort("B")
    d.run_until_idle()
    assert d.tokens == {} and d.engine.scheduler.kv.pool.num_free == 31
    d.check_no_leaks()


def test_an_early_request_whose_kv_landed_but_whose_first_token_never_came_expires(model_dir: str) -> None:
    """The fetch ended, the DecodeHandoff never comes (the router failed the request): past its deadline
    the role drops the request and its blocks return to the pool."""
    d = DecodeSide(model_dir, num_kv_blocks=32)
    op = PrepareDecode("C", PROMPT_C, greedy(NUM_TOKENS), time.time() - 1, "prefill-0", "p0", "tcp://x:1")
    d.role.on_prepare(op)
    fetch = d.receiver.fetches["C"]
    d.receiver.land("C", torch.zeros_like(d.engine.runner.kv_cache[:, fetch.dst_block_ids]))
    assert d.engine.scheduler.kv.pool.num_free == 29
    # NOTE: the expiry sweep runs at most once a second; turns until it did (bounded)
    wait_for(lambda: not d.turn() and d.role.num_waiting_for_kv() == 0, 10, "C expired")
    assert d.engine.request_status("C") is None and d.engine.scheduler.kv.pool.num_free == 31
    assert d.tokens == {} and d.events_for("C") == []
    d.check_no_leaks()


def test_early_requests_that_waited_are_all_reserved_in_the_turn_seats_free_up(model_dir: str) -> None:
    d = DecodeSide(model_dir, num_kv_blocks=32, max_num_seqs=3)

    def prepare(rid: str) -> None:
        deadline = time.time() + 60
        d.role.on_prepare(PrepareDecode(rid, PROMPT_C, greedy(2), deadline, "prefill-0", "p0", "tcp://x:1"))

    for rid in ("C1", "C2", "C3"):  # every seat
        prepare(rid)
    d.handoff("A", PROMPT_A, 5, greedy(2))  # waits for a seat
    prepare("B1")
    d.role.on_prepare(  # waits too; fails once its turn comes (more tokens than the model takes)
        PrepareDecode("bad", PROMPT_C, greedy(10**6), time.time() + 60, "prefill-0", "p0", "tcp://x:1")
    )
    prepare("B2")
    d.turn()
    assert sorted(d.receiver.fetches) == ["C1", "C2", "C3"]
    assert not [e for e in d.events if isinstance(e, RequestFailed)]
    for rid in ("C1", "C2", "C3"):
        d.abort(rid)
    d.turn()  # the cancelled fetches end and A takes a seat
    assert sorted(d.receiver.fetches) == ["A", "C1", "C2", "C3"]
    d.turn()  # both valid early requests that waited, in one turn
    assert sorted(d.receiver.fetches) == ["A", "B1", "B2", "C1", "C2", "C3"]
    assert [(e.request_id, e.code) for e in d.events if isinstance(e, RequestFailed)] == [
        ("bad", ErrorCode.INVALID_REQUEST)
    ]
    for rid in ("A", "B1", "B2"):
        d.abort(rid)
    d.receiver.fail("A")
    d.run_until_idle()
    d.check_no_leaks()


def test_an_abort_after_an_early_fetch_landed_but_before_its_first_token_frees_its_blocks(
    model_dir: str,
) -> None:
    d = DecodeSide(model_dir, num_kv_blocks=32)
    op = PrepareDecode("C", PROMPT_C, greedy(NUM_TOKENS), time.time() + 60, "prefill-0", "p0", "tcp://x:1")
    d.role.on_prepare(op)
    fetch = d.receiver.fetches["C"]
    d.receiver.land("C", torch.zeros_like(d.engine.runner.kv_cache[:, fetch.dst_block_ids]))
    d.turn()  # the fetch's end is handled: the KV waits for its first token
    assert d.engine.scheduler.kv.pool.num_free == 29 and d.role.num_waiting_for_kv() == 1
    assert d.role.on_abort("C")  # the role takes the abort (the worker does nothing more)
    assert d.engine.request_status("C") is None and d.engine.scheduler.kv.pool.num_free == 31
    assert d.role.num_waiting_for_kv() == 0 and d.events_for("C") == []
    d.check_no_leaks()


def test_a_repeated_prepare_or_one_without_a_receiver_reserves_nothing(model_dir: str) -> None:
    d = DecodeSide(model_dir, num_kv_blocks=32)
    op = PrepareDecode("C", PROMPT_C, greedy(NUM_TOKENS), time.time() + 60, "prefill-0", "p0", "tcp://x:1")
    d.role.on_prepare(op)
    fetch, num_free = d.receiver.fetches["C"], d.engine.scheduler.kv.pool.num_free
    d.role.on_prepare(op)  # again while its fetch is in flight
    d.receiver.land("C", torch.zeros_like(d.engine.runner.kv_cache[:, fetch.dst_block_ids]))
    d.turn()
    d.role.on_prepare(op)  # and once its KV is here
    assert d.receiver.fetches == {"C": fetch} and d.engine.scheduler.kv.pool.num_free == num_free
    assert d.events == [] and d.role.num_waiting_for_kv() == 1
    d.abort("C")
    d.role.receiver = None  # a worker that moves no KV ignores the hint (the handoff fails later)
    d.role.on_prepare(
        PrepareDecode("D", PROMPT_A, greedy(2), time.time() + 60, "prefill-0", "p0", "tcp://x:1")
    )
    assert d.role.num_waiting_for_kv() == 0 and d.events == []
    d.check_no_leaks()


def test_what_a_decode_worker_is_never_sent_fails_loudly() -> None:
    """Prefill-side callbacks and unknown commands are bugs in the worker's dispatch, not input to drop."""
    role = DecodeRole(context(None, TransferConfig(), [], []))  # type: ignore[arg-type]  # no engine needed
    with pytest.raises(RuntimeError, match="never holds a prefill"):
        role.on_first_token(TokenDelta("r", [1]))
    with pytest.raises(RuntimeError, match="holds no prefills"):
        role.on_extend_lease("r")
    with pytest.raises(RuntimeError, match="unexpected command object"):
        role.handle(object())

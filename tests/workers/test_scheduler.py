"""Scheduler driven with fake model outputs: exact batches, chunking, preemption, leaks."""

from __future__ import annotations

import pytest

from cluster.config import EngineConfig
from cluster.protocol import SamplingParams, TokenLogprobs
from workers.request import Request, RequestStatus
from workers.scheduler import SampledTokens, ScheduledRequest, Scheduler, SchedulerOutput


def make(num_blocks: int = 64, block_size: int = 4, **kw: object) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **kw)  # type: ignore[arg-type]
    return Scheduler(cfg, num_blocks, max_model_len=1024)


def add(s: Scheduler, rid: str, n: int, max_tokens: int = 8, first_id: int = 100, **kw: object) -> Request:
    """A request whose prompt is ``n`` consecutive token ids from ``first_id``."""
    r = Request(
        rid,
        list(range(first_id, first_id + n)),
        SamplingParams(max_tokens=max_tokens, **kw),  # type: ignore[arg-type]
        eos_token_ids=(2,),
    )
    s.add_request(r)
    return r


def run_step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, SampledTokens({x.request_id: token for x in out.scheduled if x.needs_sample}))
    return out


def shape(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(x.request_id, x.start_position, len(x.token_ids)) for x in out.scheduled]


def test_chunked_prefill_then_decode_first_and_mixed() -> None:
    s = make(max_num_batched_tokens=10)
    add(s, "a", 6)
    add(s, "b", 9)
    out = run_step(s)
    assert shape(out) == [("a", 0, 6), ("b", 0, 4)]
    assert [x.needs_sample for x in out.scheduled] == [True, False]
    assert not out.is_mixed
    out = run_step(s)
    # a decodes (1 token, listed first), b's next chunk takes the rest of the budget
    assert shape(out) == [("a", 6, 1), ("b", 4, 5)]
    assert out.is_mixed and out.num_single_token_seqs == 1 and out.num_batched_tokens == 6
    out = run_step(s)
    assert shape(out) == [("a", 7, 1), ("b", 9, 1)]
    assert out.num_single_token_seqs == 2
    assert s.requests["b"].output_token_ids == [7, 7]


def test_max_num_seqs_limits_running() -> None:
    s = make(max_num_seqs=2)
    for rid in "abc":
        add(s, rid, 3)
    out = run_step(s)
    assert [x.request_id for x in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_stop_conditions_and_leak_free() -> None:
    s = make()
    add(s, "len", 3, max_tokens=2)
    add(s, "eos", 3, max_tokens=5)
    add(s, "stop_id", 3, max_tokens=5, stop_token_ids=[9])
    out = s.schedule()
    upd = s.update_from_output(out, SampledTokens({"len": 5, "eos": 2, "stop_id": 9}))
    assert [(r.request_id, r.status) for r in upd] == [
        ("len", RequestStatus.RUNNING),
        ("eos", RequestStatus.FINISHED_STOPPED),
        ("stop_id", RequestStatus.FINISHED_STOPPED),
    ]
    run_step(s, token=5)
    assert s.num_unfinished == 0
    s.check_no_leaks()


def test_length_stop_at_max_model_len_before_max_tokens() -> None:
    """The step asks check_stop only from `length_check_at` outputs on: the context's end (10 tokens
    here) comes before max_tokens and still ends the request on the token that fills it, not later."""
    cfg = EngineConfig(block_size=4, num_kv_blocks=64)
    s = Scheduler(cfg, 64, max_model_len=10)
    r = Request("a", list(range(100, 106)), SamplingParams(max_tokens=50), eos_token_ids=(2,))
    s.add_request(r)
    assert r.length_check_at == 4
    steps = 0
    while s.num_unfinished:
        run_step(s, token=7)
        steps += 1
    assert (steps, r.output_token_ids, r.status) == (4, [7, 7, 7, 7], RequestStatus.FINISHED_LENGTH)
    # a request no scheduler set up (length_check_at 0) is checked after every token: same end
    bare = Request("b", list(range(100, 106)), SamplingParams(max_tokens=50))
    bare.output_token_ids = [7, 7, 7, 7]
    assert bare.length_check_at == 0 and bare.check_stop(10) is RequestStatus.FINISHED_LENGTH
    s.check_no_leaks()


def test_ignore_eos_runs_to_max_tokens() -> None:
    s = make()
    r = add(s, "a", 3, max_tokens=3, ignore_eos=True)
    for _ in range(3):
        run_step(s, token=2)
    assert r.output_token_ids == [2, 2, 2] and r.status == RequestStatus.FINISHED_LENGTH
    s.check_no_leaks()


def test_preemption_by_recompute_of_newest() -> None:
    # 6 usable blocks of 2 tokens; a and b fill 2 blocks each, then grow until blocks run out
    s = make(num_blocks=7, block_size=2, enable_prefix_caching=False)
    a = add(s, "a", 4, max_tokens=20)
    b = add(s, "b", 4, max_tokens=20)
    run_step(s)  # prompts computed: 2 blocks each, 1 output each
    run_step(s)  # token 4 computed: 3 blocks each = all 6 blocks
    assert s.kv.pool.num_free == 0
    assert run_step(s).preempted_ids == []  # token 5 still fits the 3rd block
    out = run_step(s)  # token 6 needs a 4th block: b (newest) is preempted, a continues
    assert out.preempted_ids == ["b"]
    assert shape(out) == [("a", 6, 1)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(s.waiting) == [b] and s.num_preemptions == 1
    assert len(s.kv.block_tables["a"]) == 4
    # b comes back as a recompute of prompt + its 3 outputs once blocks allow (after a ends)
    assert a.output_token_ids == [7, 7, 7, 7]
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    out = run_step(s)
    assert shape(out) == [("b", 0, 7)]
    assert b.output_token_ids == [7, 7, 7, 7]
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    s.check_no_leaks()


def test_prefix_hit_on_schedule_counts_cached_tokens() -> None:
    s = make(block_size=4, enable_prefix_caching=True)
    add(s, "a", 10, max_tokens=1)
    run_step(s)
    assert s.num_unfinished == 0
    r = add(s, "b", 10, max_tokens=1)
    out = s.schedule()
    assert shape(out) == [("b", 8, 2)]
    assert r.num_cached_tokens == 8
    s.update_from_output(out, SampledTokens({"b": 1}))
    s.check_no_leaks()


def test_hold_after_prefill_keeps_blocks_until_release() -> None:
    s = make(block_size=4)
    r = add(s, "p", 9, max_tokens=10)
    r.hold_after_prefill = True
    run_step(s)
    assert r.status == RequestStatus.SENDING_KV and r.output_token_ids == [7]
    assert s.kv.block_tables["p"] == [1, 2, 3] and not s.running
    assert s.schedule().is_empty
    s.release("p")
    s.check_no_leaks()


def test_reserve_and_commit_prefilled() -> None:
    s = make(block_size=4, max_num_seqs=2)
    r = Request("d", list(range(9)), SamplingParams(max_tokens=3))
    r.output_token_ids.append(5)
    reserved = s.reserve_prefilled(r)
    assert reserved == ([1, 2, 3], 0)
    assert r.status == RequestStatus.WAITING_FOR_KV
    add(s, "x", 3)
    add(s, "y", 3)
    # one seat is taken by the request waiting for KV
    assert [x.request_id for x in run_step(s).scheduled] == ["x"]
    s.commit_prefilled("d")
    out = s.schedule()
    assert shape(out) == [("x", 3, 1), ("d", 9, 1)]
    s.finish_request("d", RequestStatus.FINISHED_ABORTED)
    s.finish_request("x", RequestStatus.FINISHED_ABORTED)
    s.finish_request("y", RequestStatus.FINISHED_ABORTED)
    s.check_no_leaks()


def test_abort_in_every_state_frees_everything() -> None:
    s = make(block_size=2, max_num_batched_tokens=4)
    add(s, "running", 3)
    add(s, "chunked", 8)
    add(s, "waiting", 3)
    run_step(s)
    assert s.requests["chunked"].status == RequestStatus.RUNNING
    assert s.requests["waiting"].status == RequestStatus.WAITING
    for rid in ("running", "chunked", "waiting"):
        assert s.finish_request(rid, RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish_request("running", RequestStatus.FINISHED_ABORTED) is None
    s.check_no_leaks()


def test_a_failed_reservation_leaves_no_state() -> None:
    s = make(num_blocks=4, block_size=4, enable_prefix_caching=True)  # 3 usable blocks
    r = Request("big", list(range(17)), SamplingParams(max_tokens=3))  # needs 5 blocks
    r.output_token_ids.append(5)
    assert s.reserve_prefilled(r) is None
    assert "big" not in s.requests
    s.check_no_leaks()


def test_running_decodes_keep_their_seats_when_a_long_prompt_arrives() -> None:
    """Running requests are packed before waiting ones: a long prompt gets what the decodes leave."""
    s = make(max_num_batched_tokens=8)
    add(s, "a", 3, max_tokens=20)
    add(s, "b", 4, max_tokens=20)
    run_step(s)  # both prompts: 7 tokens
    add(s, "long", 30, first_id=300)
    shapes = [shape(run_step(s)) for _ in range(5)]
    assert shapes == [
        [("a", 3, 1), ("b", 4, 1), ("long", 0, 6)],
        [("a", 4, 1), ("b", 5, 1), ("long", 6, 6)],
        [("a", 5, 1), ("b", 6, 1), ("long", 12, 6)],
        [("a", 6, 1), ("b", 7, 1), ("long", 18, 6)],
        [("a", 7, 1), ("b", 8, 1), ("long", 24, 6)],
    ]
    out = run_step(s)
    assert shape(out) == [("a", 8, 1), ("b", 9, 1), ("long", 30, 1)]
    assert out.num_single_token_seqs == 3 and not out.is_mixed


def test_one_token_prompt_chunks_are_packed_with_the_decodes() -> None:
    """The kernels' contract: every one-query-token sequence comes first, a prompt whose prefix hit
    leaves a single token to compute included."""
    s = make(block_size=4, enable_prefix_caching=True)
    add(s, "a", 9, max_tokens=1)
    run_step(s)  # a's 2 full blocks are cached when it finishes
    add(s, "x", 6, first_id=300)
    add(s, "y", 9)  # a's prompt again: 8 tokens hit, 1 left
    out = s.schedule()
    assert shape(out) == [("y", 8, 1), ("x", 0, 6)]
    assert out.num_single_token_seqs == 1 and [x.is_decode for x in out.scheduled] == [False, False]
    assert not out.is_mixed and out.num_batched_tokens == 7


def test_budget_spent_mid_running_list_schedules_no_empty_entries() -> None:
    s = make(max_num_batched_tokens=2)
    for rid in "abc":  # three handed-off requests, all decoding: one more than the budget
        r = Request(rid, [100, 101], SamplingParams(max_tokens=5))
        r.output_token_ids.append(7)
        assert s.reserve_prefilled(r) is not None
        s.commit_prefilled(rid)
    assert shape(run_step(s)) == [("a", 2, 1), ("b", 2, 1)]  # c waits for a step with budget left
    assert shape(run_step(s)) == [("a", 3, 1), ("b", 3, 1)]


def test_newest_request_preempts_itself_and_keeps_no_block() -> None:
    # 5 usable blocks of 2 tokens: a and b take 2 each; a's third block is the last free one
    s = make(num_blocks=6, block_size=2, enable_prefix_caching=False)
    a = add(s, "a", 4, max_tokens=20)
    b = add(s, "b", 4, max_tokens=20)
    run_step(s)
    first_scheduled = b.first_scheduled_time
    out = run_step(s)
    assert out.preempted_ids == ["b"] and shape(out) == [("a", 4, 1)]
    assert "b" not in s.kv.block_tables and s.kv.pool.num_free == 2
    assert (b.status, b.num_preemptions, list(s.waiting)) == (RequestStatus.PREEMPTED, 1, [b])
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    out = run_step(s)  # b recomputes its prompt and its first output, then samples its second
    assert shape(out) == [("b", 0, 5)]
    assert b.output_token_ids == [7, 7] and b.first_scheduled_time == first_scheduled
    assert a.num_preemptions == 0 and s.num_preemptions == 1
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    s.check_no_leaks()


def test_admission_stops_at_the_first_waiting_request_that_does_not_fit() -> None:
    s = make(num_blocks=5, block_size=4, enable_prefix_caching=False)  # 4 usable blocks
    add(s, "a", 8, max_tokens=4)
    run_step(s)  # a holds 2 blocks
    add(s, "big", 12)  # 3 blocks: does not fit
    add(s, "small", 2)  # would fit, but admission is first come, first served
    assert shape(run_step(s)) == [("a", 8, 1)]
    assert [r.request_id for r in s.waiting] == ["big", "small"] and "big" not in s.kv.block_tables
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert shape(run_step(s)) == [("big", 0, 12), ("small", 0, 2)]


def test_chunked_recompute_of_generated_tokens_feeds_the_right_ids() -> None:
    """A request resumed with tokens generated elsewhere recomputes prompt + outputs in chunks."""
    s = make(max_num_batched_tokens=2)
    r = Request("r", [100, 101, 102, 103], SamplingParams(max_tokens=9))
    r.output_token_ids.extend([7, 8, 9, 10, 11])
    s.add_request(r)
    chunks = []
    while not r.output_token_ids[5:]:
        out = run_step(s, token=12)
        chunks += [(x.start_position, x.token_ids, x.is_decode, x.needs_sample) for x in out.scheduled]
    assert chunks == [
        (0, [100, 101], False, False),
        (2, [102, 103], False, False),
        (4, [7, 8], False, False),
        (6, [9, 10], False, False),
        (8, [11], True, True),
    ]
    assert r.output_token_ids == [7, 8, 9, 10, 11, 12]


def test_a_one_token_partial_chunk_first_does_not_cost_later_tokens() -> None:
    s = make(max_num_batched_tokens=7)
    a = add(s, "a", 6)
    add(s, "b", 5, first_id=300)  # gets the last budget token: a 1-token chunk, packed first
    out = run_step(s)
    assert shape(out) == [("b", 0, 1), ("a", 0, 6)]
    assert [x.needs_sample for x in out.scheduled] == [False, True]
    assert a.output_token_ids == [7]


def test_request_ended_while_its_step_ran_is_skipped() -> None:
    s = make()
    add(s, "a", 3)
    b = add(s, "b", 3)
    out = s.schedule()
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    updated = s.update_from_output(out, SampledTokens({"a": 5, "b": 6}))
    assert updated == [b] and b.output_token_ids == [6]
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    s.check_no_leaks()


def test_logprobs_and_timestamps_are_recorded_once() -> None:
    s = make()
    r = add(s, "r", 3, max_tokens=2)
    plain = add(s, "plain", 3, max_tokens=2)
    lp = [TokenLogprobs(7, -0.25, [7, 9], [-0.25, -1.5]), TokenLogprobs(8, -0.5, [8], [-0.5])]
    for i in range(2):
        out = s.schedule()
        s.update_from_output(out, SampledTokens({"r": 7 + i, "plain": 7 + i}, {"r": lp[i]}))
        if i == 0:
            times = (r.first_scheduled_time, r.first_token_time)
            assert None not in times and r.finish_time is None
    assert (r.first_scheduled_time, r.first_token_time) == times
    assert r.logprobs == lp and plain.logprobs == []
    assert r.status == RequestStatus.FINISHED_LENGTH and r.finish_time is not None
    s.check_no_leaks()


def test_admission_errors_leave_the_scheduler_unchanged() -> None:
    s = make(num_blocks=4, block_size=4, max_num_seqs=2)  # 3 usable blocks
    add(s, "a", 3)
    with pytest.raises(ValueError, match="'a' is already in use"):
        add(s, "a", 3)
    prefilled = Request("a", [1, 2, 3], SamplingParams())
    with pytest.raises(ValueError, match="'a' is already in use"):
        s.reserve_prefilled(prefilled)
    too_long = Request("long", list(range(13)), SamplingParams())  # 4 blocks
    assert s.reserve_prefilled(too_long) is None
    assert "long" not in s.requests and "long" not in s.kv.block_tables
    run_step(s)
    assert s.reserve_prefilled(Request("d", [1], SamplingParams())) == ([2], 0)
    no_seat = Request("e", [1], SamplingParams())  # a runs, d waits for KV: both seats are taken
    assert s.reserve_prefilled(no_seat) is None
    assert no_seat.status == RequestStatus.WAITING and "e" not in s.kv.block_tables
    with pytest.raises(RuntimeError, match="commit_prefilled\\('a'\\) in status"):
        s.commit_prefilled("a")
    with pytest.raises(RuntimeError, match="release\\('a'\\): not a held request"):
        s.release("a")
    with pytest.raises(RuntimeError, match="release\\('zz'\\): not a held request"):
        s.release("zz")
    assert s.requests["a"].status == RequestStatus.RUNNING
    with pytest.raises(AssertionError, match="requests left: \\['a', 'd'\\]"):
        s.check_no_leaks()
    for rid in ("a", "d"):
        s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    s.check_no_leaks()
    assert s.kv.allocate_slots(Request("ghost", [1], SamplingParams()), 1)
    with pytest.raises(AssertionError, match="KV leak: block tables left for \\['ghost'\\]"):
        s.check_no_leaks()


def test_num_decodes_counts_only_the_leading_one_token_sequences() -> None:
    def entry(rid: str, num_tokens: int) -> ScheduledRequest:
        return ScheduledRequest(rid, [1] * num_tokens, 0, [1], True, False, SamplingParams(), 0)

    out = SchedulerOutput([entry("a", 1), entry("b", 3), entry("c", 1)], 5)
    assert out.num_single_token_seqs == 1
    assert SchedulerOutput([entry("a", 1), entry("c", 1)], 2).num_single_token_seqs == 2
    assert SchedulerOutput([], 0).num_single_token_seqs == 0 and SchedulerOutput([], 0).is_empty

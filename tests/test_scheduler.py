"""Scheduler driven with fake model outputs: exact batches, chunking, preemption, leaks."""

from __future__ import annotations

from cluster.config import EngineConfig
from cluster.protocol import SamplingParams
from workers.request import Request, RequestStatus
from workers.scheduler import SampledToken, Scheduler, SchedulerOutput


def make(num_blocks: int = 64, block_size: int = 4, **kw: object) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **kw)  # type: ignore[arg-type]
    return Scheduler(cfg, num_blocks, max_model_len=1024)


def add(s: Scheduler, rid: str, n: int, max_tokens: int = 8, **kw: object) -> Request:
    r = Request(
        rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens, **kw), eos_token_ids=(2,)
    )  # type: ignore[arg-type]
    s.add_request(r)
    return r


def run_step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, {x.request_id: SampledToken(token) for x in out.scheduled if x.needs_sample})
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
    assert out.is_mixed and out.num_decodes == 1 and out.num_batched_tokens == 6
    out = run_step(s)
    assert shape(out) == [("a", 7, 1), ("b", 9, 1)]
    assert out.num_decodes == 2
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
    upd = s.update_from_output(
        out, {"len": SampledToken(5), "eos": SampledToken(2), "stop_id": SampledToken(9)}
    )
    assert [(r.request_id, r.status) for r in upd] == [
        ("len", RequestStatus.RUNNING),
        ("eos", RequestStatus.FINISHED_STOPPED),
        ("stop_id", RequestStatus.FINISHED_STOPPED),
    ]
    run_step(s, token=5)
    assert s.num_unfinished == 0
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
    s.update_from_output(out, {"b": SampledToken(1)})
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

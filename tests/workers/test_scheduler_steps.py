"""Scheduler (fake model outputs, no torch): the counts a step carries equal those derived from its
sequences, and a request waiting for KV holds a seat exactly until it is committed or ends."""

from __future__ import annotations

from cluster.config import EngineConfig
from cluster.protocol import SamplingParams
from workers.request import Request, RequestStatus
from workers.scheduler import SampledTokens, Scheduler, SchedulerOutput


def make(**options: int) -> Scheduler:
    config = EngineConfig(block_size=4, num_kv_blocks=64, **options)  # type: ignore[arg-type]
    return Scheduler(config, 64, max_model_len=1024)


def request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, SampledTokens({x.request_id: 7 for x in out.scheduled if x.needs_sample}))
    return out


def counts(out: SchedulerOutput) -> tuple[int, int, bool, int, int]:
    return (
        out.num_batched_tokens,
        out.num_single_token_seqs,
        out.is_mixed,
        out.num_prompt_tokens,
        out.num_sampling,
    )


def test_a_steps_counts_equal_those_derived_from_its_sequences() -> None:
    s = make(max_num_batched_tokens=8)
    s.add_request(request("a", list(range(100, 105)), 3))
    steps = [step(s)]
    s.add_request(request("b", list(range(200, 214)), 2))
    s.add_request(request("c", [300], 2))
    while s.num_unfinished:
        steps.append(step(s))
    # 1: a's prompt; 2, 3: a's decode + b's 7-token chunks; 4: b's decode + c's one-token prompt (one
    # token, not a decode); 5: c's decode. Sampling: every sequence but b's first chunk.
    assert [counts(out) for out in steps] == [
        (5, 0, False, 5, 1),
        (8, 1, True, 7, 1),
        (8, 1, True, 7, 2),
        (2, 2, True, 1, 2),
        (1, 1, False, 0, 1),
    ]
    for out in steps:
        derived = SchedulerOutput(out.scheduled, out.num_batched_tokens, out.preempted_ids)
        assert counts(derived) == counts(out)
    s.check_no_leaks()


def test_a_resumed_request_with_its_prefix_cached_decodes_straight_from_the_queue() -> None:
    """A migrated request (prompt + the tokens it had) whose prompt is cached: its first step computes
    only its last token, which is a decode, and the step counts it as one."""
    s = make(max_num_batched_tokens=8, enable_prefix_caching=True)
    s.add_request(request("p", [5, 6, 7, 8], 1))
    step(s)  # computes the 4-token prompt: one full block, cached
    resumed = request("m", [5, 6, 7, 8], 3)
    resumed.output_token_ids.append(11)
    s.add_request(resumed)
    out = step(s)
    assert [(x.request_id, x.start_position, x.token_ids, x.is_decode) for x in out.scheduled] == [
        ("m", 4, [11], True)
    ]
    assert counts(out) == (1, 1, False, 0, 1) and resumed.num_cached_tokens == 4
    derived = SchedulerOutput(out.scheduled, out.num_batched_tokens, out.preempted_ids)
    assert counts(derived) == counts(out)
    while s.num_unfinished:
        step(s)
    s.check_no_leaks()


def test_a_request_waiting_for_kv_holds_its_seat_until_committed_or_ended() -> None:
    s = make(max_num_seqs=1)
    d = request("d", [1, 2, 3, 4, 5], 4)
    d.output_token_ids.append(9)
    assert s.reserve_prefilled(d) == ([1, 2], 0)
    s.add_request(request("w", [6, 7, 8], 2))
    assert step(s).is_empty  # d's seat
    s.finish_request("d", RequestStatus.FINISHED_ABORTED)  # its KV never came
    assert [x.request_id for x in step(s).scheduled] == ["w"]
    s.finish_request("w", RequestStatus.FINISHED_ABORTED)

    e = request("e", [1, 2, 3, 4, 5], 4)
    e.output_token_ids.append(9)
    assert s.reserve_prefilled(e) is not None
    s.commit_prefilled("e")
    late = request("late", [6, 7], 2)
    late.output_token_ids.append(9)
    assert s.reserve_prefilled(late) is None  # e runs in the only seat
    while s.num_unfinished:
        step(s)
    assert e.status == RequestStatus.FINISHED_LENGTH
    f = request("f", [1, 2, 3, 4, 5], 4)
    f.output_token_ids.append(9)
    assert s.reserve_prefilled(f) is not None  # e's seat is free again
    s.finish_request("f", RequestStatus.FINISHED_ABORTED)
    s.check_no_leaks()

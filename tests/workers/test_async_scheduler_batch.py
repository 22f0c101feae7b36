"""The asynchronous scheduler's per-step bookkeeping over the whole batch (issue 42 item 3): which requests
sit a step out, the placeholders, the stop checks as of a token, and the blocks it registers in the prefix
cache, against the synchronous scheduler on the same fake token stream (no model)."""

from __future__ import annotations

import pytest

from cluster.block_hash import hash_full_blocks
from cluster.config import EngineConfig
from cluster.protocol import SamplingParams
from workers.async_scheduler import PLACEHOLDER, AsyncScheduler
from workers.request import Request, RequestStatus
from workers.scheduler import SampledTokens, Scheduler, SchedulerOutput

EOS = 2
MAX_MODEL_LEN = 40


def _token(request_id: str, index: int) -> int:
    """The fake model: output ``index`` of a request, a function of the request and the index only (so
    both schedulers see the same stream); request r3 samples EOS at index 5, r6 its stop id 9 at 3."""
    n = int(request_id[1:])
    if (n, index) in ((3, 5), (6, 3)):
        return EOS if n == 3 else 9
    return 10 + (7 * index + 13 * n) % 40


def _requests() -> list[Request]:
    """Prompts sharing prefixes (prefix hits), several chunks long; ends by max_tokens, by the context
    (max_model_len before max_tokens), by EOS, by a stop id; one ignores EOS."""
    shared = list(range(100, 112))
    out = []
    for n in range(8):
        prompt = shared[: 4 + 2 * n] + [200 + n] * (n % 3 + 1)
        params = SamplingParams(
            max_tokens=MAX_MODEL_LEN if n == 4 else 6 + n,  # r4: the context ends it
            stop_token_ids=[9] if n == 6 else None,
            ignore_eos=n == 7,
        )
        out.append(Request(f"r{n}", prompt, params, (EOS,)))
    return out


def _sampled(out: SchedulerOutput) -> SampledTokens:
    return SampledTokens(
        {s.request_id: _token(s.request_id, s.num_output_tokens) for s in out.scheduled if s.needs_sample}
    )


def _config(num_blocks: int) -> EngineConfig:
    return EngineConfig(block_size=4, num_kv_blocks=num_blocks, max_num_batched_tokens=16, max_num_seqs=6)


def _run_sync(num_blocks: int) -> tuple[dict[str, tuple[list[int], RequestStatus]], Scheduler]:
    s = Scheduler(_config(num_blocks), num_blocks, MAX_MODEL_LEN)
    for r in _requests():
        s.add_request(r)
    ends: dict[str, tuple[list[int], RequestStatus]] = {}
    while s.requests:
        out = s.schedule()
        for r in s.update_from_output(out, _sampled(out)):
            if r.status.is_finished:
                ends[r.request_id] = (list(r.output_token_ids), r.status)
    return ends, s


def _run_async(num_blocks: int) -> tuple[dict[str, tuple[list[int], RequestStatus]], AsyncScheduler]:
    s = AsyncScheduler(_config(num_blocks), num_blocks, MAX_MODEL_LEN)
    for r in _requests():
        s.add_request(r)
    ends: dict[str, tuple[list[int], RequestStatus]] = {}
    previous: tuple[SchedulerOutput, SampledTokens] | None = None
    while s.requests or s.has_in_flight:
        out = s.schedule()
        if previous is not None:
            for r, index in s.resolve(*previous):
                assert r.output_token_ids[index] != PLACEHOLDER
                if r.status.is_finished:
                    assert PLACEHOLDER not in r.output_token_ids
                    ends[r.request_id] = (list(r.output_token_ids), r.status)
        previous = None if out.is_empty else (out, _sampled(out))
    return ends, s


def _cached_hashes(s: Scheduler) -> set[bytes]:
    cache = s.kv.prefix_cache
    assert cache is not None
    return set(cache._block_of)


@pytest.mark.parametrize("num_blocks", [64, 12])  # 12: preemptions
def test_async_ends_every_request_as_sync_does(num_blocks: int) -> None:
    sync_ends, sync = _run_sync(num_blocks)
    async_ends, asynchronous = _run_async(num_blocks)
    assert async_ends == sync_ends
    assert {rid: status for rid, (_, status) in sync_ends.items()} == {
        "r0": RequestStatus.FINISHED_LENGTH,
        "r1": RequestStatus.FINISHED_LENGTH,
        "r2": RequestStatus.FINISHED_LENGTH,
        "r3": RequestStatus.FINISHED_STOPPED,
        "r4": RequestStatus.FINISHED_LENGTH,
        "r5": RequestStatus.FINISHED_LENGTH,
        "r6": RequestStatus.FINISHED_STOPPED,
        "r7": RequestStatus.FINISHED_LENGTH,
    }
    assert len(sync_ends["r3"][0]) == 6 and len(sync_ends["r6"][0]) == 4
    assert len(sync_ends["r4"][0]) == MAX_MODEL_LEN - 14  # r4's prompt: 14 tokens
    # NOTE: one token past the end only for the stops the scheduler cannot see coming (r3's EOS, r6's stop
    # id); a request that ends on length with its in-flight token sits the next step out
    assert asynchronous.num_discarded_tokens == 2
    if num_blocks == 12:
        assert sync.num_preemptions > 0 and asynchronous.num_preemptions > 0
    sync.check_no_leaks()
    asynchronous.check_no_leaks()


def test_async_registers_the_blocks_sync_registers() -> None:
    """Every block full of computed tokens (a request's prompt and outputs but its last, never computed)
    enters the prefix cache (no eviction with 64 blocks), though the asynchronous scheduler looks only
    at the requests whose step may have filled one."""
    ends, sync = _run_sync(64)
    _, asynchronous = _run_async(64)
    prompts = {r.request_id: r.prompt_token_ids for r in _requests()}
    computed = {h for rid, (outs, _) in ends.items() for h in hash_full_blocks(prompts[rid] + outs[:-1], 4)}
    assert len(computed) == 23  # 38 full blocks, 15 of them shared prefixes
    assert _cached_hashes(sync) == computed
    assert _cached_hashes(asynchronous) == computed


def test_check_stop_as_of_an_earlier_output() -> None:
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=[9]), (EOS,))
    r.output_token_ids = [5, 9, PLACEHOLDER]
    assert r.check_stop(100, 1) is None
    assert r.check_stop(100, 2) is RequestStatus.FINISHED_STOPPED
    r.output_token_ids = [5, 6, 7, 8, PLACEHOLDER]
    assert r.check_stop(100, 3) is None
    assert r.check_stop(100, 4) is RequestStatus.FINISHED_LENGTH
    assert r.check_stop(6, 3) is RequestStatus.FINISHED_LENGTH  # the context: 3 + 3 tokens

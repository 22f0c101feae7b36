"""Prefix cache through the scheduler (fake model outputs, no torch): blocks filled during decode carry
the chained hash of the whole token sequence, so a multi-turn follow-up reuses every computed block."""

from __future__ import annotations

import pytest

from cluster.block_hash import hash_block, hash_full_blocks
from cluster.config import EngineConfig
from cluster.protocol import SamplingParams
from workers.prefix_cache import PrefixCache
from workers.request import Request, RequestStatus
from workers.scheduler import SampledTokens, Scheduler

PROMPT = list(range(100, 110))  # 10 tokens
NUM_OUTPUT = 9


def make(block_size: int, num_blocks: int = 64, max_num_batched_tokens: int = 2048) -> Scheduler:
    config = EngineConfig(
        block_size=block_size,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=True,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    return Scheduler(config, num_blocks, max_model_len=1024)


def step(s: Scheduler) -> dict[str, list[int]]:
    """One step; every sampling request gets a token that differs per position (so blocks differ).
    Returns the block table each scheduled request had in this step."""
    out = s.schedule()
    sampled = SampledTokens(
        {x.request_id: 300 + x.start_position + len(x.token_ids) for x in out.scheduled if x.needs_sample}
    )
    s.update_from_output(out, sampled)
    return {x.request_id: list(x.block_ids) for x in out.scheduled}


def cached_prefix(s: Scheduler, token_ids: list[int]) -> list[int]:
    """Block ids the prefix cache holds for the full blocks of ``token_ids`` (longest cached prefix)."""
    assert s.kv.prefix_cache is not None
    return s.kv.prefix_cache.lookup(hash_full_blocks(token_ids, s.kv.block_size))


# (block size, token budget): the prompt in one chunk, or in 2-token chunks that end mid-block
@pytest.mark.parametrize(("block_size", "budget"), [(1, 2048), (3, 2), (4, 2048)])
def test_blocks_filled_during_decode_hash_as_the_whole_sequence(block_size: int, budget: int) -> None:
    s = make(block_size, max_num_batched_tokens=budget)
    a = Request("a", list(PROMPT), SamplingParams(max_tokens=NUM_OUTPUT))
    s.add_request(a)
    table: list[int] = []
    while s.num_unfinished:
        table = step(s)["a"]
        if a.status == RequestStatus.RUNNING:
            computed = a.all_token_ids[: a.num_computed_tokens]
            # every full block so far, prompt or decode, is registered under the chained hash
            assert cached_prefix(s, computed) == table[: len(computed) // block_size]
    assert a.status == RequestStatus.FINISHED_LENGTH and len(a.output_token_ids) == NUM_OUTPUT
    # the last sampled token is never computed: its KV does not exist
    num_computed = len(PROMPT) + NUM_OUTPUT - 1
    num_full = num_computed // block_size
    assert cached_prefix(s, a.all_token_ids) == table[:num_full]
    s.check_no_leaks()

    # a follow-up turn: the previous prompt + its answer + new text hits every computed full block
    follow_up = Request("b", [*a.all_token_ids, 7, 8, 9], SamplingParams(max_tokens=2))
    s.add_request(follow_up)
    out = s.schedule()
    num_hit = num_full * block_size
    assert [(x.request_id, x.start_position, len(x.token_ids)) for x in out.scheduled] == [
        ("b", num_hit, min(len(follow_up.prompt_token_ids) - num_hit, budget))
    ]
    assert follow_up.num_cached_tokens == num_hit
    assert s.kv.block_tables["b"][:num_full] == table[:num_full]
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    s.check_no_leaks()


def test_decode_side_commit_registers_the_prompt_and_later_decode_blocks() -> None:
    """A request whose prompt KV arrived by transfer: the prompt's blocks are cached at commit, and the
    blocks its decode fills chain on from them."""
    s = make(block_size=4)
    d = Request("d", list(PROMPT), SamplingParams(max_tokens=NUM_OUTPUT))
    d.output_token_ids.append(310)  # the first token, sampled by the prefill worker
    reserved = s.reserve_prefilled(d)
    assert reserved == ([1, 2, 3], 0)
    assert cached_prefix(s, d.all_token_ids) == []  # nothing is cached before the KV is there
    s.commit_prefilled("d")
    assert cached_prefix(s, d.all_token_ids) == [1, 2]
    while s.num_unfinished:
        step(s)
    # 10 prompt + 9 output tokens, 18 computed: 4 full blocks
    assert cached_prefix(s, d.all_token_ids) == [1, 2, 3, 4]
    again = Request("e", list(PROMPT), SamplingParams(max_tokens=1))
    again.output_token_ids.append(310)
    assert s.reserve_prefilled(again) == ([1, 2, 5], 2)
    assert again.num_cached_tokens == 8
    s.finish_request("e", RequestStatus.FINISHED_ABORTED)
    s.check_no_leaks()


def test_lookup_stops_at_the_first_missing_block() -> None:
    cache = PrefixCache()
    h = hash_full_blocks(list(range(12)), 4)
    assert cache.insert(5, h[0]) and cache.insert(6, h[2])
    assert cache.lookup(h) == [5]  # block 1 missing: block 2's hash alone is no prefix
    assert cache.insert(7, h[1])
    assert cache.lookup(h) == [5, 7, 6]
    assert cache.lookup([hash_block(b"", [0, 1, 2, 9])]) == []
    assert len(cache) == 3


def test_insert_refuses_duplicates_and_evict_forgets() -> None:
    cache = PrefixCache()
    assert cache.insert(1, b"x")
    assert not cache.insert(2, b"x")  # that content is already cached under block 1
    assert not cache.insert(1, b"y")  # block 1 already carries a hash
    assert cache.lookup([b"x"]) == [1] and cache.lookup([b"y"]) == []
    assert not cache.is_cached(2) and cache.is_cached(1)
    assert cache.evict(1) and not cache.evict(1) and not cache.evict(2)
    assert len(cache) == 0 and cache.lookup([b"x"]) == []
    assert cache.insert(2, b"x")  # content and block are both free again
    cache.record_query(10, 4)
    cache.record_query(6, 0)
    assert (cache.num_query_tokens, cache.num_hit_tokens) == (16, 4)

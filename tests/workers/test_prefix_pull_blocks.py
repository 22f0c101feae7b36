"""Prefix pulls' block bookkeeping (KVCacheManager.hold_prefix / reserve_prefix / commit_prefix): exact
block ids, ref counts, and the leak check after every ending."""

from __future__ import annotations

import pytest

from cluster.block_hash import hash_full_blocks
from cluster.protocol import SamplingParams
from workers.block_manager import KVCacheManager
from workers.request import Request

BS = 4


def cached(kv: KVCacheManager, tokens: list[int]) -> list[int]:
    """Compute ``tokens`` as a request would (its full blocks cached), then free it."""
    r = Request("r", tokens, SamplingParams(max_tokens=1))
    assert kv.allocate_slots(r, len(tokens), kv.get_computed_blocks(r))
    r.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(r)
    table = list(kv.block_tables["r"])
    kv.free("r")
    return table


def test_hold_takes_the_cached_device_prefix_until_freed() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    tokens = list(range(14))  # 3 full blocks and 2 tokens
    assert cached(kv, tokens) == [1, 2, 3, 4]
    assert kv.hold_prefix("h", [*tokens, 99, 98]) == [1, 2, 3]
    assert kv.pool.ref_counts[1:5] == [1, 1, 1, 0]
    with pytest.raises(RuntimeError, match="holds blocks already"):
        kv.hold_prefix("h", tokens)
    with pytest.raises(AssertionError, match="block tables left for \\['h'\\]"):
        kv.check_no_leaks()
    assert kv.hold_prefix("none", [7] * 9) == []  # nothing cached: no table
    kv.free("h")
    kv.check_no_leaks()
    assert kv.prefix_cache is not None and kv.prefix_cache.lookup(hash_full_blocks(tokens, BS)) == [1, 2, 3]


def test_reserve_commit_caches_the_pulled_blocks_with_no_user() -> None:
    kv = KVCacheManager(10, BS, enable_prefix_caching=True)
    tokens = list(range(20))  # 5 full blocks
    cached(kv, tokens[:8])  # this cache holds blocks 0-1 (ids 1, 2)
    reserved = kv.reserve_prefix("p", tokens, 5)
    assert reserved == ([1, 2, 3, 4, 5], 2)
    assert kv.pool.ref_counts[1:6] == [1, 1, 1, 1, 1]
    kv.commit_prefix("p")
    kv.check_no_leaks()
    assert kv.prefix_cache is not None
    assert kv.prefix_cache.lookup(hash_full_blocks(tokens, BS)) == [1, 2, 3, 4, 5]
    assert kv.reserve_prefix("q", tokens, 5) is None  # nothing is missing any more
    kv.check_no_leaks()


def test_abort_frees_fresh_blocks_uncached_and_short_blocks_take_nothing() -> None:
    kv = KVCacheManager(5, BS, enable_prefix_caching=True)  # 4 usable blocks
    tokens = list(range(24))
    assert kv.reserve_prefix("big", tokens, 5) is None  # 5 blocks > 4 free: nothing taken
    assert kv.reserve_prefix("short", tokens[:6], 2) is None  # the tokens hold 1 full block only
    kv.check_no_leaks()
    assert kv.reserve_prefix("p", tokens, 3) == ([1, 2, 3], 0)
    kv.free("p")  # an aborted pull: the fresh blocks were never cached
    kv.check_no_leaks()
    assert kv.prefix_cache is not None and len(kv.prefix_cache) == 0
    assert list(kv.pool.free_queue) == [1, 2, 3, 4]

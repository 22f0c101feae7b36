"""Block pool and prefix cache: exact block ids, ref counts and eviction order."""

from __future__ import annotations

import pytest

from cluster.block_hash import hash_block, hash_full_blocks
from cluster.protocol import SamplingParams
from workers.block_manager import BlockPool, KVCacheManager
from workers.prefix_cache import PrefixCache
from workers.request import Request


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_pool_allocates_from_front_and_never_block_zero() -> None:
    pool = BlockPool(5, None)
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free == 0
    with pytest.raises(RuntimeError, match="only 0 free"):
        pool.allocate(1)
    pool.free([1, 2])
    # uncached blocks go to the front: freed tail first, so 1 ends up in front of 2
    assert list(pool.free_queue) == [1, 2]
    assert pool.ref_counts == [0, 0, 0, 1, 1]


def test_pool_double_free_is_an_error() -> None:
    pool = BlockPool(3, None)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(ids)


def test_cached_blocks_go_to_back_in_reverse_and_are_evicted_lru() -> None:
    cache = PrefixCache()
    pool = BlockPool(6, cache)
    a = pool.allocate(3)  # [1, 2, 3]
    for i, b in enumerate(a):
        assert cache.insert(b, bytes([i]))
    pool.free(a)
    # remaining uncached 4, 5 stay in front; cached tail-first: 3, 2, 1
    assert list(pool.free_queue) == [4, 5, 3, 2, 1]
    assert pool.allocate(3) == [4, 5, 3]
    assert not cache.is_cached(3) and cache.is_cached(2) and cache.is_cached(1)
    assert len(cache) == 2


def test_touch_pulls_cached_block_out_of_free_queue() -> None:
    cache = PrefixCache()
    pool = BlockPool(4, cache)
    [b] = pool.allocate(1)
    cache.insert(b, b"x")
    pool.free([b])
    assert b in pool.free_queue
    pool.touch([b])
    pool.touch([b])
    assert b not in pool.free_queue and pool.ref_counts[b] == 2
    pool.free([b])
    assert b not in pool.free_queue
    pool.free([b])
    assert list(pool.free_queue)[-1] == b


def test_hashes_are_chained_and_deterministic() -> None:
    h = hash_full_blocks([1, 2, 3, 4, 5], 2)
    assert len(h) == 2
    assert h[0] == hash_block(b"", [1, 2])
    assert h[1] == hash_block(h[0], [3, 4])
    assert hash_full_blocks([9, 2, 3, 4], 2)[1] != h[1]  # same block tokens, other prefix
    assert hash_full_blocks([3, 4, 5, 6], 2, start_block=1, parent=h[0]) == [hash_block(h[0], [5, 6])]


def test_prefix_hit_shares_blocks_and_keeps_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(12)))  # exactly 3 full blocks
    miss = kv.get_computed_blocks(a)
    assert miss.block_ids == []
    assert kv.allocate_slots(a, 12, miss)
    assert kv.block_tables["a"] == [1, 2, 3]
    a.num_computed_tokens = 12
    kv.cache_full_blocks(a)
    # same prompt: only 2 of 3 blocks may hit, the last token must be computed
    b = req("b", list(range(12)))
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == [1, 2]
    assert kv.allocate_slots(b, 4, hit)
    assert kv.block_tables["b"] == [1, 2, 4]
    assert [kv.pool.ref_counts[i] for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert kv.prefix_cache is not None
    # NOTE: a lookup counts once its blocks are taken (a waiting request is looked up again each step)
    assert (kv.prefix_cache.num_query_tokens, kv.prefix_cache.num_hit_tokens) == (24, 8)
    kv.free("a")
    kv.free("b")
    kv.check_no_leaks()
    # everything cached is evictable; b's duplicate block 4 was not registered and went to the front
    assert list(kv.pool.free_queue)[:1] == [4]


def test_allocate_fails_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = req("a", [1, 2, 3, 4, 5])
    assert not kv.allocate_slots(a, 7)  # needs 4 blocks, 3 usable
    assert "a" not in kv.block_tables and kv.pool.num_free == 3
    assert kv.allocate_slots(a, 5)
    assert kv.block_tables["a"] == [1, 2, 3]
    a.num_computed_tokens = 5
    assert kv.allocate_slots(a, 1)  # 6th token still fits block 3
    assert not kv.allocate_slots(req("b", [1]), 1)
    kv.free("a")
    kv.check_no_leaks()


def test_hit_on_free_cached_block_counts_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    kv.free("a")
    assert list(kv.pool.free_queue) == [3, 2, 1]
    b = req("b", [1, 2, 3, 4, 9, 9, 9])  # hits blocks 1, 2; needs 2 more; only block 3 is left
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == [1, 2]
    assert not kv.allocate_slots(b, 3, hit)
    assert kv.pool.ref_counts[1:] == [0, 0, 0]
    assert kv.allocate_slots(b, 1, hit)  # chunk of 1 token fits in block 3
    assert kv.block_tables["b"] == [1, 2, 3]
    kv.free("b")
    kv.check_no_leaks()


def test_leak_check_reports() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    assert kv.allocate_slots(req("a", [1, 2, 3]), 3)
    with pytest.raises(AssertionError, match="block tables left"):
        kv.check_no_leaks()


def test_pool_needs_a_usable_block_besides_block_zero() -> None:
    with pytest.raises(ValueError, match="num_kv_blocks must be >= 2"):
        BlockPool(1, None)
    pool = BlockPool(2, None)
    assert (pool.num_usable, pool.allocate(1)) == (1, [1])


def test_zero_new_tokens_hold_nothing_but_a_hit_is_still_taken() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    fresh = req("fresh", [1, 2, 3])
    assert kv.allocate_slots(fresh, 0)
    assert "fresh" not in kv.block_tables and kv.pool.num_free == 3
    kv.cache_full_blocks(fresh)  # no blocks: nothing to register
    kv.free("fresh")
    a = req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    assert kv.block_tables["a"] == [1, 2, 3]
    assert kv.pool.num_free == 0
    b = req("b", [1, 2, 3, 4, 5])
    hit = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 0, hit)  # a's blocks: no free block needed
    assert kv.block_tables["b"] == [1, 2] and kv.pool.ref_counts[1:4] == [2, 2, 1]
    kv.free("a")
    kv.free("b")
    kv.check_no_leaks()


def test_hit_on_blocks_in_use_takes_no_free_block() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = req("a", [1, 2, 3, 4])
    assert kv.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    kv.cache_full_blocks(a)
    assert kv.pool.num_free == 1
    b = req("b", [1, 2, 3, 4, 5])  # hits a's 2 blocks (held by a) and needs 1 more: the last free one
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == [1, 2]
    assert kv.allocate_slots(b, 1, hit)
    assert kv.block_tables["b"] == [1, 2, 3] and kv.pool.num_free == 0
    assert kv.usage == 1.0
    kv.free("a")
    kv.free("b")
    kv.check_no_leaks()


def test_usage_counts_blocks_with_a_user() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=2, enable_prefix_caching=False)
    assert kv.usage == 0.0
    assert kv.allocate_slots(req("a", [1, 2, 3]), 3)
    assert kv.usage == 2 / 8
    kv.free("a")
    assert kv.usage == 0.0


def test_leak_check_names_each_kind_of_leak() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    kv.get_computed_blocks(req("looked-up", [1, 2, 3]))  # a lookup leaves hash state until free()
    with pytest.raises(AssertionError, match=r"^KV leak: per-request hash state left$"):
        kv.check_no_leaks()
    kv.free("looked-up")
    kv.check_no_leaks()
    [block] = kv.pool.allocate(1)  # a block with a user and no table
    with pytest.raises(AssertionError, match=r"^KV leak: blocks with users: \[1\]; 2 of 3 blocks free$"):
        kv.check_no_leaks()
    kv.pool.free([block])
    kv.check_no_leaks()

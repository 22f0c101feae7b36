"""Prefix cache over full blocks, keyed by chained content hashes.

The hashes themselves are ``cluster/block_hash.py`` (the router computes the same ones for affinity).

This module only maps hash <-> block id and counts queries/hits; who may evict, and when, is the block
pool's business (an evictable block is a cached block with ref count 0 waiting in the free queue).
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.block_hash import BlockHash
from workers.kv_events import TIER_DEVICE, KvEventLog


class PrefixCache:
    """hash <-> block id maps plus query/hit counters (in tokens)."""

    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.events: KvEventLog | None = None  # set by a subscriber (KVCacheManager.subscribe_events)

    def __len__(self) -> int:
        return len(self._block_of)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``."""
        hit: list[int] = []
        for h in hashes:
            block_id = self._block_of.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def insert(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a freshly filled block. False (and nothing changes) if that content is already
        cached under another block, or this block already carries a hash."""
        if block_hash in self._block_of or block_id in self._hash_of:
            return False
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        if self.events is not None:
            self.events.stored(TIER_DEVICE, block_hash)
        return True

    def hashes(self) -> list[BlockHash]:
        return list(self._block_of)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def evict(self, block_id: int) -> BlockHash | None:
        """Forget a block (it is being reused for other content): its hash, or None if it was not cached."""
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is None:
            return None
        del self._block_of[block_hash]
        if self.events is not None:
            self.events.removed(TIER_DEVICE, block_hash)
        return block_hash

"""What a worker's KV tiers hold, as events: block hashes stored and removed per tier, for the router's
exact prefix index (cluster/router/kv_index.py).

The log keeps the net change since the last ``take``: storing then removing a hash in the same batch
leaves nothing to send, removing then storing it again leaves a store. A batch is thus bounded by what
the tiers can hold (device blocks + host blocks), never by how busy the worker was; the log records
nothing until someone subscribes (``KVCacheManager.kv_events``: the offline API never drains it).
"""

from __future__ import annotations

from cluster.block_hash import BlockHash
from cluster.protocol import KvEventBatch

TIER_DEVICE = 0
TIER_HOST = 1
TIER_NAMES = ("device", "host")


class KvEventLog:
    """Net stored / removed hashes per tier since the last ``take`` (see the module docstring)."""

    def __init__(self) -> None:
        self._changes: dict[tuple[int, BlockHash], bool] = {}

    def __len__(self) -> int:
        return len(self._changes)

    def stored(self, tier: int, block_hash: BlockHash) -> None:
        self._changes[(tier, block_hash)] = True

    def removed(self, tier: int, block_hash: BlockHash) -> None:
        self._changes[(tier, block_hash)] = False

    def take(self) -> KvEventBatch:
        """The changes since the last call (and forgets them)."""
        changes, self._changes = self._changes, {}
        batch = KvEventBatch()
        for (tier, block_hash), is_stored in changes.items():
            (batch.stored if is_stored else batch.removed).append((tier, block_hash))
        return batch

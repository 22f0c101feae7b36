"""Block bookkeeping: the pool of KV blocks (ref counts, free queue) and per-request block tables.

Block 0 is reserved as the null block (padding in block tables) and never handed out.

Free queue order is eviction order: blocks at the front are reused first. A freed block that holds no
cached content goes to the front (nothing is lost by reusing it); a freed cached block goes to the back,
a request's blocks in reverse order so its tail is evicted before its head (a shorter prefix stays
useful longer). Taking a cached block with ref count 0 (a prefix hit) pulls it out of the queue.

With a host tier (``num_host_blocks``, workers/host_tier.py) an evicted cached block is offloaded to it
instead of forgotten, and a lookup continues there past the device's hit; the copies of a step are
taken with ``take_copies`` once it is scheduled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cluster.block_hash import BlockHash, hash_full_blocks
from cluster.protocol import KvEventBatch
from workers.host_tier import HostTier, KvCopies, LoadRule
from workers.kv_events import TIER_DEVICE, TIER_HOST, KvEventLog
from workers.prefix_cache import PrefixCache
from workers.request import Request


class BlockPool:
    """Owns every block id's ref count and the free queue."""

    def __init__(self, num_blocks: int, prefix_cache: PrefixCache | None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def allocate(self, num: int, on_evict: Callable[[int, BlockHash], None] | None = None) -> list[int]:
        """Take ``num`` blocks from the front of the free queue, evicting their cached content
        (``on_evict(block id, its hash)`` for each cached one, before it is reused)."""
        if num > len(self.free_queue):
            raise RuntimeError(f"allocate({num}) with only {len(self.free_queue)} free blocks")
        block_ids: list[int] = []
        for _ in range(num):
            block_id, _ = self.free_queue.popitem(last=False)
            if self.prefix_cache is not None:
                evicted = self.prefix_cache.evict(block_id)
                if evicted is not None and on_evict is not None:
                    on_evict(block_id, evicted)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add a user to cached blocks (prefix hit); a block with no user leaves the free queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one user of each block, tail first; blocks that reach 0 users join the free queue."""
        for block_id in reversed(block_ids):
            count = self.ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            self.ref_counts[block_id] = count
            if count == 0:
                self.free_queue[block_id] = None
                if self.prefix_cache is None or not self.prefix_cache.is_cached(block_id):
                    self.free_queue.move_to_end(block_id, last=False)


@dataclass(frozen=True)
class PrefixHit:
    """A cached prefix: device blocks ``block_ids``, then blocks of the host tier (their hashes), which
    ``allocate_slots`` loads into fresh device blocks."""

    block_ids: list[int]
    host_hashes: list[BlockHash] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids) + len(self.host_hashes)

    def num_tokens(self, block_size: int) -> int:
        return self.num_blocks * block_size


class KVCacheManager:
    """Per-request block tables on top of a BlockPool, plus prefix-cache lookups and registration.

    Contract: a request holds blocks from its first successful ``allocate_slots`` until ``free``; the
    scheduler frees on finish, abort and preemption, or later (``release``) for a held handoff.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_host_blocks: int = 0,
        load_rule: LoadRule | None = None,
    ) -> None:
        self.block_size = block_size
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self.prefix_cache)
        if num_host_blocks and self.prefix_cache is None:
            raise ValueError("a host tier needs prefix caching (it holds prefix-cache blocks)")
        self.host = HostTier(num_host_blocks) if num_host_blocks else None
        self.load_rule = load_rule
        self._copies = KvCopies()
        self.block_tables: dict[str, list[int]] = {}
        # full-block hashes computed so far per request (also those not registered: duplicates)
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    def subscribe_events(self) -> KvEventLog:
        """Start recording what the tiers store and remove (workers/kv_events.py); the log's first batch
        holds everything cached now. Idempotent."""
        if self.prefix_cache is None:
            raise RuntimeError("KV events need prefix caching (nothing is cached without it)")
        if self.prefix_cache.events is None:
            log = KvEventLog()
            for tier, block_hash in self._held():
                log.stored(tier, block_hash)
            if self.host is not None:
                self.host.events = log
            self.prefix_cache.events = log
        return self.prefix_cache.events

    def _held(self) -> list[tuple[int, BlockHash]]:
        """Every (tier, hash) the tiers hold now."""
        device = [] if self.prefix_cache is None else [(TIER_DEVICE, h) for h in self.prefix_cache.hashes()]
        return device + ([] if self.host is None else [(TIER_HOST, h) for h in self.host.hashes()])

    def get_computed_blocks(
        self, request: Request, num_pending_tokens: int = 0, use_host: bool = True
    ) -> PrefixHit:
        """Longest cached prefix of the request's tokens, leaving >= 1 token to compute (for logits):
        device blocks, then (``use_host`` and the load rule agreeing) host-tier blocks after them.
        ``num_pending_tokens``: tokens that will follow before anything is computed (a decode-side
        reservation made before its first token is known: that token is the one left to compute)."""
        if self.prefix_cache is None:
            return PrefixHit([])
        hashes = self._request_hashes(request)
        max_blocks = (request.num_tokens + num_pending_tokens - 1) // self.block_size
        hit = self.prefix_cache.lookup(hashes[:max_blocks])
        host_hashes: list[BlockHash] = []
        is_worth = self.load_rule is None or self.load_rule.worth_loading()
        if use_host and self.host is not None and len(hit) < max_blocks and is_worth:
            rest = hashes[len(hit) : max_blocks]
            host_hashes = rest[: len(self.host.lookup(rest))]
        return PrefixHit(hit, host_hashes)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None, can_offload: bool = True
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens`` (plus the
        prefix hit, for a request not yet holding blocks; its host part is loaded into the first fresh
        blocks). False, with nothing changed, if blocks are short. ``can_offload``: evicted cached blocks
        may go to the host tier; False where nothing copies them before they are written (a handoff's
        reservation, written by the transfer): they are dropped."""
        table = self.block_tables.get(request.request_id)
        host, cache = self.host, self.prefix_cache
        hit_ids = hit.block_ids if hit is not None else []
        host_hashes = hit.host_hashes if hit is not None else []
        num_held = (len(table) if table is not None else 0) + len(hit_ids)
        num_tokens = request.num_computed_tokens + (len(hit_ids) + len(host_hashes)) * self.block_size
        num_needed = -(-(num_tokens + num_new_tokens) // self.block_size) - num_held
        if num_needed <= 0 and not hit_ids:
            return True
        # a hit block with no users sits in the free queue: taking it uses up a free slot too
        num_hit_free = sum(1 for b in hit_ids if self.pool.ref_counts[b] == 0)
        if max(num_needed, 0) + num_hit_free > self.pool.num_free:
            return False
        if hit is not None and cache is not None:
            # NOTE: counted when the lookup is used, not each time a waiting request is looked at again
            cache.record_query(request.num_tokens, hit.num_tokens(self.block_size))
        if table is None:
            table = self.block_tables[request.request_id] = []
        if hit_ids:
            self.pool.touch(hit_ids)
            table.extend(hit_ids)
            self._num_cached_blocks[request.request_id] = len(table)
        # NOTE: pinned before anything is evicted: no offload of this batch overwrites the slots it loads
        slots = host.take_hit(host_hashes) if host is not None and host_hashes else []
        if num_needed > 0:
            on_evict = self._offload if can_offload and host is not None else None
            fresh = self.pool.allocate(num_needed, on_evict)
            if slots and host is not None and cache is not None:
                for block_id, block_hash in zip(fresh, host_hashes, strict=False):
                    cache.insert(block_id, block_hash)
                self._copies.load_slots.extend(slots)
                self._copies.load_blocks.extend(fresh[: len(slots)])
                self._num_cached_blocks[request.request_id] = len(table) + len(slots)
            table.extend(fresh)
        return True

    def _offload(self, block_id: int, block_hash: BlockHash) -> None:
        """A cached block is being reused: its bytes go to the host tier first (if a slot is had)."""
        if self.host is None:
            return
        slot = self.host.store(block_hash)
        if slot is not None:
            self._copies.offload_blocks.append(block_id)
            self._copies.offload_slots.append(slot)

    def kv_snapshot(self) -> KvEventBatch:
        """Everything the tiers hold now, as stored events, for a router that lost track
        (``KvResync``); the changes logged so far are dropped (the snapshot covers them), and the log
        goes on from here. Subscribes if nothing did yet."""
        self.subscribe_events().take()
        return KvEventBatch(stored=self._held())

    def take_copies(self) -> KvCopies | None:
        """The copies between the tiers decided since the last call (the runner runs them before the
        step's forward), or None."""
        if self.host is None or not self._copies:
            return None
        copies, self._copies = self._copies, KvCopies()
        self.host.end_batch()
        return copies

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens."""
        if self.prefix_cache is None:
            return
        table = self.block_tables.get(request.request_id)
        if table is None:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._request_hashes(request, num_full)
        for i in range(start, num_full):
            self.prefix_cache.insert(table[i], hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if table:
            self.pool.free(table)

    def _request_hashes(self, request: Request, num_blocks: int | None = None) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        want = request.num_tokens // self.block_size if num_blocks is None else num_blocks
        if len(hashes) < want:
            start = len(hashes)
            tokens = request.token_slice(start * self.block_size, want * self.block_size)
            parent = hashes[-1] if hashes else b""
            hashes.extend(hash_full_blocks(tokens, self.block_size, 0, parent))
        return hashes

    # ---- prefix pulls (workers/prefix_pulls.py) ----------------------------------------------------------
    def _prefix_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        num_full = len(token_ids) // self.block_size
        return hash_full_blocks(list(token_ids[: num_full * self.block_size]), self.block_size)

    def hold_prefix(self, hold_id: str, token_ids: Sequence[int]) -> list[int]:
        """Holder side of a pull: the device blocks of the longest cached full-block prefix of
        ``token_ids``, each with one more user under the pseudo block table ``hold_id`` (so nothing evicts
        them) until ``free(hold_id)``. An empty hold takes no table."""
        if hold_id in self.block_tables:
            raise RuntimeError(f"hold_prefix({hold_id!r}): the id holds blocks already")
        if self.prefix_cache is None:
            return []
        block_ids = self.prefix_cache.lookup(self._prefix_hashes(token_ids))
        if block_ids:
            self.pool.touch(block_ids)
            self.block_tables[hold_id] = list(block_ids)
        return block_ids

    def reserve_prefix(
        self, pull_id: str, token_ids: Sequence[int], num_blocks: int
    ) -> tuple[list[int], int] | None:
        """Puller side: blocks for the first ``num_blocks`` full blocks of ``token_ids`` under the pseudo
        table ``pull_id``: (the table, how many leading blocks this cache already holds; the rest are
        fresh, for the transfer to write). None (nothing taken) when nothing is missing or blocks are
        short. Evicted cached blocks are dropped, not offloaded (the transfer writes the fresh blocks
        outside any step). Then ``commit_prefix`` or ``free``."""
        if pull_id in self.block_tables:
            raise RuntimeError(f"reserve_prefix({pull_id!r}): the id holds blocks already")
        hashes = self._prefix_hashes(token_ids)[:num_blocks]
        if self.prefix_cache is None or len(hashes) < num_blocks:
            return None
        hit = self.prefix_cache.lookup(hashes)
        num_fresh = num_blocks - len(hit)
        num_hit_free = sum(1 for b in hit if self.pool.ref_counts[b] == 0)
        if num_fresh <= 0 or num_fresh + num_hit_free > self.pool.num_free:
            return None
        self.pool.touch(hit)
        table = self.block_tables[pull_id] = hit + self.pool.allocate(num_fresh)
        self._hashes[pull_id] = hashes
        self._num_cached_blocks[pull_id] = len(hit)
        return list(table), len(hit)

    def commit_prefix(self, pull_id: str) -> None:
        """The pulled blocks are written: they join the prefix cache under their hashes (a hash cached
        meanwhile under another block keeps that one), then the pseudo table goes: cached, no user."""
        table, hashes = self.block_tables[pull_id], self._hashes[pull_id]
        if self.prefix_cache is not None:
            for i in range(self._num_cached_blocks[pull_id], len(table)):
                self.prefix_cache.insert(table[i], hashes[i])
        self.free(pull_id)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks with at least one user."""
        return 1.0 - self.pool.num_free / self.pool.num_usable

    def check_no_leaks(self) -> None:
        """Leak invariant: no table left, every block free (cached blocks with ref 0 count as free)."""
        problems = []
        if self.block_tables:
            problems.append(f"block tables left for {sorted(self.block_tables)}")
        if self._hashes or self._num_cached_blocks:
            problems.append("per-request hash state left")
        used = [b for b in range(1, self.pool.num_blocks) if self.pool.ref_counts[b] != 0]
        if used:
            problems.append(f"blocks with users: {used[:16]}")
        if self.pool.num_free != self.pool.num_usable:
            problems.append(f"{self.pool.num_free} of {self.pool.num_usable} blocks free")
        if self._copies:
            problems.append("tier copies decided but never taken")
        if self.host is not None:
            try:
                self.host.check()
            except AssertionError as e:
                problems.append(str(e))
        if problems:
            raise AssertionError("KV leak: " + "; ".join(problems))

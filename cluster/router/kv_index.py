"""The router's exact index of what every worker's KV tiers hold, fed by the workers' ``KvEvents``
(cluster/wire.py; workers publish the net change of their tiers, workers/kv_events.py), read by
placement (cluster/router/placement.py ``explain_by_index``).

Per worker incarnation: a map from block hash (cluster/block_hash.py's chained hash) to the tiers that
hold it (bit 0: device, bit 1: host). ``hit`` answers how much of a prompt a worker holds: the longest
chain of the prompt's full blocks each held on *some* tier of that worker (a block's hash covers every
token before it, so a held block whose parent is not held is of no use: the engine stops at the first
block it lacks). A block of that chain the device holds is a device hit (nothing to move); one only
the host tier holds is a host hit (copied back before use). Like the engine, at most
``(num_tokens - 1) // block_size`` blocks: the last token is always computed.

What the index drops, and why that is safe: the index can only be wrong in two ways: it lacks a block
the worker holds (a hit missed: the request is computed as without the index) or it holds one the
worker dropped (a hit promised that is not there: the same, plus a worse choice of worker). It never
keeps entries it cannot vouch for, so it only ever errs the first, harmless way:
  - a new incarnation of a worker (Ray restarted it): the old one's entries go at once;
  - a worker dead, draining, removed, or silent past ``health_timeout_s`` (unhealthy): its entries go
    (the router calls ``forget``); a live one's later events refill the index;
  - a frame lost (``seq`` not the next one: a router's queue on the worker overflowed, or this router
    met the worker mid-stream): what the lost frame removed might still be listed, so every entry of
    that worker goes and the index refills from the frames that follow;
  - a snapshot (a frame marked ``reset``): the worker's entries are replaced by it;
  - bounds: at most ``max_blocks_per_worker`` entries a worker (past it, the least recently stored go)
    and ``max_workers`` workers (past it, the one heard from least recently goes).
Complete: a worker's entries are complete when they grew from a snapshot (its first frame, seq 0, is
one: everything cached when it began publishing; or a ``reset`` frame) with no frame lost since. After a
loss they are not (short of what the worker holds) until a snapshot comes: ``wants_snapshot`` tells the
router when to ask the worker for one (``KvResync``, cluster/router/kv_feed.py), at most every
``RESYNC_INTERVAL_S``.
Not thread-safe: the router's loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.block_hash import BlockHash

RESYNC_INTERVAL_S = 1.0  # NOTE: a snapshot takes a round trip and a frame per 4,096 blocks: no sooner
DEVICE_BIT = 1  # tier 0 (workers/kv_events.py TIER_DEVICE)
HOST_BIT = 2  # tier 1 (TIER_HOST)


@dataclass(frozen=True)
class KvHit:
    """How much of a prompt one worker holds: its longest held chain of full blocks, split by tier."""

    device_blocks: int = 0
    host_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        return self.device_blocks + self.host_blocks


MISS = KvHit()


@dataclass
class _WorkerBlocks:
    """One worker incarnation's entries and the next frame number expected of it."""

    incarnation: str
    next_seq: int
    tiers: OrderedDict[BlockHash, int]  # oldest stored first
    complete: bool = False  # grown from a snapshot, no frame lost since (the module docstring)


class KvIndex:
    """See the module docstring."""

    def __init__(self, max_blocks_per_worker: int, max_workers: int) -> None:
        if max_blocks_per_worker < 1 or max_workers < 1:
            raise ValueError(
                f"KvIndex bounds must be >= 1, got {max_blocks_per_worker} blocks, {max_workers} workers"
            )
        self.max_blocks_per_worker = max_blocks_per_worker
        self.max_workers = max_workers
        self._workers: OrderedDict[str, _WorkerBlocks] = OrderedDict()  # least recently heard first
        self.num_gaps = 0  # frames found missing (each cleared its worker)
        self.num_evicted = 0  # entries dropped for the per-worker bound
        self.num_workers_evicted = 0  # workers dropped for the worker bound
        self.num_snapshots = 0  # reset frames taken
        self._asked: dict[str, float] = {}  # worker id -> when a snapshot was last asked of it

    # ---- updates ----------------------------------------------------------------------------------------
    def apply(
        self,
        worker_id: str,
        incarnation: str,
        seq: int,
        stored: Sequence[tuple[int, BlockHash]],
        removed: Sequence[tuple[int, BlockHash]],
        reset: bool = False,
    ) -> None:
        """Take one KvEvents frame of ``worker_id``'s process ``incarnation`` (tier 0 or 1, checked by
        the wire's decoder). A new incarnation replaces the old one's entries; a frame out of sequence
        clears the worker first; a ``reset`` frame replaces its entries (see the module docstring)."""
        w = self._workers.get(worker_id)
        if w is None or w.incarnation != incarnation or reset:
            w = _WorkerBlocks(incarnation, seq, OrderedDict(), complete=reset or seq == 0)
            self._workers[worker_id] = w
            self.num_snapshots += reset
            while len(self._workers) > self.max_workers:
                self._workers.popitem(last=False)
                self.num_workers_evicted += 1
        elif seq != w.next_seq:
            self.num_gaps += 1
            w.tiers.clear()
            w.complete = False
        self._workers.move_to_end(worker_id)
        w.next_seq = seq + 1
        tiers = w.tiers
        for tier, block_hash in removed:
            bits = tiers.get(block_hash, 0) & ~(1 << tier)
            if bits:
                tiers[block_hash] = bits
            else:
                tiers.pop(block_hash, None)
        for tier, block_hash in stored:
            tiers[block_hash] = tiers.get(block_hash, 0) | (1 << tier)
            tiers.move_to_end(block_hash)
        excess = len(tiers) - self.max_blocks_per_worker
        for _ in range(max(0, excess)):
            tiers.popitem(last=False)
        self.num_evicted += max(0, excess)

    def forget(self, worker_id: str, incarnation: str | None = None) -> None:
        """Drop a worker's entries (only ``incarnation``'s, when given; without one, the worker is gone
        for good and what was asked of it goes too)."""
        w = self._workers.get(worker_id)
        if w is not None and (incarnation is None or w.incarnation == incarnation):
            del self._workers[worker_id]
        if incarnation is None:
            self._asked.pop(worker_id, None)

    def wants_snapshot(self, worker_id: str, incarnation: str, now: float) -> bool:
        """Whether to ask ``worker_id``'s process ``incarnation`` for a snapshot now (``now``: monotonic
        seconds): its entries are not complete and none was asked of it in the last
        ``RESYNC_INTERVAL_S``. True records the ask."""
        w = self._workers.get(worker_id)
        if w is not None and w.incarnation == incarnation and w.complete:
            return False
        if now - self._asked.get(worker_id, -RESYNC_INTERVAL_S) < RESYNC_INTERVAL_S:
            return False
        self._asked[worker_id] = now
        return True

    def is_complete(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.complete

    # ---- reads ------------------------------------------------------------------------------------------
    def hit(self, worker_id: str, hashes: Sequence[BlockHash], num_tokens: int, block_size: int) -> KvHit:
        """What ``worker_id`` holds of a ``num_tokens`` prompt whose full blocks hash to ``hashes``."""
        w = self._workers.get(worker_id)
        if w is None or num_tokens < 1:
            return MISS
        tiers = w.tiers
        device = host = 0
        for h in hashes[: (num_tokens - 1) // block_size]:
            bits = tiers.get(h, 0)
            if not bits:
                break
            if bits & DEVICE_BIT:
                device += 1
            else:
                host += 1
        return KvHit(device, host) if device or host else MISS

    def match(self, hashes: Sequence[BlockHash], num_tokens: int, block_size: int) -> dict[str, KvHit]:
        """``hit`` for every indexed worker that holds some of the prompt."""
        out: dict[str, KvHit] = {}
        for worker_id in self._workers:
            h = self.hit(worker_id, hashes, num_tokens, block_size)
            if h.num_blocks:
                out[worker_id] = h
        return out

    def num_blocks(self, worker_id: str, tier: int | None = None) -> int:
        """Entries of ``worker_id`` (those ``tier`` holds, when given)."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        if tier is None:
            return len(w.tiers)
        bit = 1 << tier
        return sum(1 for bits in w.tiers.values() if bits & bit)

    def incarnation(self, worker_id: str) -> str | None:
        w = self._workers.get(worker_id)
        return None if w is None else w.incarnation

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)

    @property
    def num_entries(self) -> int:
        return sum(len(w.tiers) for w in self._workers.values())

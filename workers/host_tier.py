"""The host-memory KV tier's bookkeeping: which block hashes its slots hold, in LRU order (no tensors:
the runner's ``HostKv`` holds the bytes, workers/host_kv.py).

One LRU over both tiers. The device prefix cache evicts its least recently freed cached block when it
needs a block (workers/block_manager.py); with a tier, that block's bytes are first copied into a host
slot (an *offload*), taking a free slot or the slot of the tier's least recently used hash. A prefix
lookup that runs out of device blocks continues in the tier: the blocks found there are *loaded* into
fresh device blocks, which join the device cache under their hashes. A block loaded back stays in the
tier too (its next eviction from the device copies nothing), and a hit moves it to the tier's young end.

Copies are decided while a step is scheduled and carried out by the runner before that step's forward
(``KvCopies``: every offload, then every load; on CUDA enqueued on the step's stream, so they are
ordered after the previous step's writes and before this step's, and the step thread never waits for
them). A slot a load of the batch reads is pinned until the batch is taken, so no offload of the same
batch overwrites it first.

A preempted request's blocks go free with their hashes (the device cache keeps them, youngest), so
under the pressure that preempted it they are offloaded rather than lost, and its return finds them in
one tier or the other: a swap out and back instead of a recompute, whenever ``LoadRule`` says copying a
block back costs less than computing its tokens (see there).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from cluster.block_hash import BlockHash
from workers.kv_events import TIER_HOST, KvEventLog

# A host link's copy rate when none was measured (CUDA copies are not timed: they run beside the step):
# pinned memory over PCIe 4.0 x16 moves ~20-25 GB/s; the rule only needs the order of magnitude.
NOMINAL_HOST_LINK_BYTES_PER_S = 20e9


@dataclass
class KvCopies:
    """One step's copies between the tiers: device block ``offload_blocks[i]`` into host slot
    ``offload_slots[i]`` (all of them first), then host slot ``load_slots[i]`` into device block
    ``load_blocks[i]``."""

    offload_blocks: list[int] = field(default_factory=list)
    offload_slots: list[int] = field(default_factory=list)
    load_slots: list[int] = field(default_factory=list)
    load_blocks: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.offload_blocks or self.load_blocks)


@dataclass
class LoadRule:
    """Whether a block found in the host tier is loaded back or its tokens recomputed.

    Both costs grow with the number of blocks, so the choice is per block: load when
    ``bytes_per_block / copy_bytes_per_s < block_size * prefill_s_per_token``.

    - ``copy_bytes_per_s``: the rate the runner measured for its copies (the first measurement, then an
      EMA; on CUDA the nominal host link, since copies run beside the host and are not timed).
    - ``prefill_s_per_token``: a recomputed token's marginal cost: the least-squares slope of the forward
      time of recent steps that computed prompt tokens over their tokens, so a step's fixed costs
      (launches, the host's share, a mock's per-step overhead) are not spread over its tokens (which would
      make recomputing look dearer than it is); the mean time per token while the steps are too alike in
      size for a slope (or noise makes it <= 0). Until a forward is measured, blocks are loaded.

    ``load_cost_ratio`` is the same comparison as a number, for the router (``EngineStats.host_load_cost``):
    what a host-tier hit costs against recomputing its tokens. The estimate is updated as steps are
    observed, not at each read: the engine's stats read it every loop turn.
    """

    bytes_per_block: int
    block_size: int
    copy_bytes_per_s: float = NOMINAL_HOST_LINK_BYTES_PER_S
    is_copy_measured: bool = False
    steps: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=64))
    _per_token: float | None = field(default=None, init=False, repr=False)

    EMA: ClassVar[float] = 0.2
    MIN_STEPS_FOR_SLOPE: ClassVar[int] = 4

    @property
    def prefill_s_per_token(self) -> float | None:
        return self._per_token

    def _estimate(self) -> float | None:
        steps = self.steps
        if not steps:
            return None
        n = len(steps)
        mean_x = sum(x for x, _ in steps) / n
        mean_y = sum(y for _, y in steps) / n
        var = sum((x - mean_x) ** 2 for x, _ in steps)
        sizes = [x for x, _ in steps]
        if n >= self.MIN_STEPS_FOR_SLOPE and var > 0 and max(sizes) >= 2 * min(sizes):
            slope = sum((x - mean_x) * (y - mean_y) for x, y in steps) / var
            if slope > 0:
                return slope
        return mean_y / mean_x

    def worth_loading(self) -> bool:
        ratio = self.load_cost_ratio()
        return ratio is None or ratio < 1.0

    def load_cost_ratio(self) -> float | None:
        """A block's copy time over its tokens' recompute time (< 1: loading is cheaper); None until a
        forward is measured."""
        per_token = self._per_token
        if per_token is None:
            return None
        return (self.bytes_per_block / self.copy_bytes_per_s) / (self.block_size * per_token)

    def observe_copy(self, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0:
            return
        rate = num_bytes / seconds
        if self.is_copy_measured:
            self.copy_bytes_per_s += self.EMA * (rate - self.copy_bytes_per_s)
        else:
            self.copy_bytes_per_s, self.is_copy_measured = rate, True

    def observe_forward(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.steps.append((num_tokens, seconds))
            self._per_token = self._estimate()


class HostTier:
    """Host slots by block hash, least recently used first (see the module docstring)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs >= 1 slot, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[BlockHash, int] = OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self.events: KvEventLog | None = None  # set by a subscriber (KVCacheManager.subscribe_events)
        self.num_offloaded = 0  # blocks copied in
        self.num_loaded = 0  # blocks copied out

    def __len__(self) -> int:
        return len(self._slot_of)

    def hashes(self) -> list[BlockHash]:
        return list(self._slot_of)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Slots of the longest prefix of ``hashes`` held here."""
        slots: list[int] = []
        for h in hashes:
            slot = self._slot_of.get(h)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def take_hit(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The slots of ``hashes`` (all held), pinned for the copy batch being built and made young."""
        slots = []
        for h in hashes:
            self._slot_of.move_to_end(h)
            slot = self._slot_of[h]
            self._pinned.add(slot)
            slots.append(slot)
        self.num_loaded += len(slots)
        return slots

    def store(self, block_hash: BlockHash) -> int | None:
        """A slot to copy the block of ``block_hash`` into, or None: the tier holds it already (now
        young), or every slot is pinned by this batch's loads (the block is dropped)."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return None
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((h for h, s in self._slot_of.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._slot_of.pop(victim)
            if self.events is not None:
                self.events.removed(TIER_HOST, victim)
        self._slot_of[block_hash] = slot
        if self.events is not None:
            self.events.stored(TIER_HOST, block_hash)
        self.num_offloaded += 1
        return slot

    def end_batch(self) -> None:
        """The batch's copies were handed to the runner: its loads' slots are no longer pinned."""
        self._pinned.clear()

    def check(self) -> None:
        """The tier's own invariant: every slot free or holding one hash, nothing pinned."""
        held = list(self._slot_of.values())
        if len(set(held)) != len(held) or set(held) & set(self._free_slots):
            raise AssertionError("host tier: a slot holds two hashes, or is held and free")
        if len(held) + len(self._free_slots) != self.num_slots:
            raise AssertionError(
                f"host tier: {len(held)} held + {len(self._free_slots)} free != {self.num_slots}"
            )
        if self._pinned:
            raise AssertionError(f"host tier: slots pinned outside a step: {sorted(self._pinned)[:16]}")

"""The host tier's bytes (workers/host_tier.py keeps its bookkeeping): one rank's share of every block
it holds, ``[num_slots, num_layers, 2, block_size, num_kv_heads, head_dim]`` (a slot is contiguous), in
page-locked memory on CUDA so copies run beside the host.

``apply`` carries out one step's ``KvCopies`` before its forward: the offloads (device block -> slot),
then the loads (slot -> device block). On CUDA they are enqueued on the current stream, after the
previous step's kernels and before this step's, and the host does not wait for them; nothing on the host
reads or writes the slots, so only the stream's order matters. On CPU they are plain copies, timed for
the load rule (``LoadRule.observe_copy``).

A mock engine with a cost profile that names a host link (``PacedHostCopies``; workers/mock_runner.py
``paced_host_copies``) copies as its KV handoffs move (transfer/paced_link.py): only the first word of
each block's K and V in every layer (the signature the mock's forward wrote for the block's first slot,
``kv_signature``), then it waits until the step's copies have taken what the profile's host link (PCIe)
predicts for the blocks' whole bytes. Its slots hold those words only (``[num_slots, num_layers, 2,
words]`` int64), while the tier's size, its slots and every byte count stay the whole blocks' (what the
GPU box holds and moves), so the load rule weighs the link's rate against the profile's prefill time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cluster.cost_model import CostProfile
from transfer.channel import layout_of
from transfer.paced_link import SIGNATURE_BYTES, sample_bytes_of
from transfer.protocol import half_row_bytes
from workers.host_tier import KvCopies

logger = logging.getLogger(__name__)

GIB = 1 << 30


def num_host_slots(kv_offload_gib: float, bytes_per_block: int) -> int:
    """Slots the budget holds (never over it); ValueError when it holds none but is not 0."""
    if kv_offload_gib <= 0:
        return 0
    num = int(kv_offload_gib * GIB) // bytes_per_block
    if num < 1:
        raise ValueError(
            f"kv_offload_gib ({kv_offload_gib}) holds no KV block of {bytes_per_block} bytes per rank: "
            f"set it to >= {bytes_per_block / GIB:.6f} or 0"
        )
    return num


@dataclass
class PacedHostCopies:
    """How a mock engine's host tier copies (see the module docstring): ``profile``'s host link
    (``CostProfile.host_copy_s``) times them; ``sample_bytes``: the part of each block's K and of its V, in
    every layer, that really moves. ``clock`` and ``sleep`` are injectable (tests)."""

    profile: CostProfile
    sample_bytes: int = SIGNATURE_BYTES
    clock: Callable[[], float] = field(default=time.perf_counter)
    sleep: Callable[[float], None] = field(default=time.sleep)

    def __post_init__(self) -> None:
        if self.profile.host_link_bytes_per_s <= 0:
            raise ValueError(f"cost profile {self.profile.name!r} names no host link (host_link_bytes_per_s)")
        if self.sample_bytes < 1 or self.sample_bytes % 8:
            raise ValueError(
                f"PacedHostCopies.sample_bytes must be a positive multiple of 8, got {self.sample_bytes}"
            )

    def link_s(self, nbytes: int) -> float:
        """What the host link predicts for copies of ``nbytes`` (the blocks' whole bytes)."""
        return self.profile.host_copy_s(nbytes)


class HostKv:
    """One rank's host-tier memory (see the module docstring). ``num_copied_bytes``: the whole blocks'
    bytes offloaded and loaded; ``copy_seconds``: what those copies took (CPU: their wall time, a paced
    mock's wait included; CUDA: not timed); ``paced_seconds``: a paced mock's, what the host link predicts
    for them (``waited_seconds`` of it were slept, the rest was the real part's own time)."""

    def __init__(self, kv_cache: torch.Tensor, num_slots: int, paced: PacedHostCopies | None = None) -> None:
        num_layers, _, *block_shape = kv_cache.shape
        self.is_cuda = kv_cache.is_cuda
        if paced is not None and self.is_cuda:
            raise ValueError("paced host copies are a mock engine's, whose KV cache is in host memory")
        self.paced = paced
        self.num_slots = num_slots
        self.bytes_per_block = kv_cache[:, 0].numel() * kv_cache.element_size()
        # NOTE: 0 where a paced copy moves every byte (a block's K no longer than the sample: tiny models)
        self.sample_words = (
            0 if paced is None else sample_bytes_of(layout_of(kv_cache), paced.sample_bytes) // 8
        )
        if self.sample_words:
            self.slots = torch.zeros((num_slots, num_layers, 2, self.sample_words), dtype=torch.int64)
        else:
            self.slots = torch.zeros(
                (num_slots, num_layers, *block_shape), dtype=kv_cache.dtype, pin_memory=self.is_cuda
            )
        self.num_copied_bytes = 0  # offloaded and loaded, this rank
        self.copy_seconds = 0.0
        self.paced_seconds = 0.0
        self.waited_seconds = 0.0

    @classmethod
    def create(
        cls, kv_cache: torch.Tensor, kv_offload_gib: float, paced: PacedHostCopies | None = None
    ) -> HostKv | None:
        """The tier ``kv_offload_gib`` buys for ``kv_cache``'s blocks (None: 0, no tier), its copies paced
        by ``paced`` (logged) or not."""
        num_slots = num_host_slots(kv_offload_gib, kv_cache[:, 0].numel() * kv_cache.element_size())
        if not num_slots:
            return None
        host_kv = cls(kv_cache, num_slots, paced)
        if paced is not None:
            half = half_row_bytes(layout_of(kv_cache))
            moved = f"{host_kv.sample_words * 8} of each block's {half} B of K and of V per layer"
            logger.info(
                "mock engine: host KV tier copies move %s and wait out the host link's %g GB/s",
                moved if host_kv.sample_words else "every byte",
                paced.profile.host_link_bytes_per_s / 1e9,
            )
        return host_kv

    @property
    def num_bytes(self) -> int:
        """The tier's size: its slots' whole blocks (a paced mock's holds their signatures only)."""
        return self.num_slots * self.bytes_per_block

    @torch.inference_mode()
    def apply(self, kv_cache: torch.Tensor, copies: KvCopies) -> None:
        """``copies``, in order: every offload, then every load (see the module docstring); a paced mock
        returns once the host link's time for them has passed."""
        clock = time.perf_counter if self.paced is None else self.paced.clock
        t0 = clock()
        if self.sample_words:
            self._copy_signatures(kv_cache, copies)
        else:
            self._copy_blocks(kv_cache, copies)
        nbytes = (len(copies.offload_blocks) + len(copies.load_blocks)) * self.bytes_per_block
        self.num_copied_bytes += nbytes
        if self.paced is not None:
            link_s = self.paced.link_s(nbytes)
            self.paced_seconds += link_s
            remaining = link_s - (clock() - t0)
            if remaining > 0:
                self.waited_seconds += remaining
                self.paced.sleep(remaining)
        if not self.is_cuda:
            self.copy_seconds += clock() - t0

    def _copy_blocks(self, kv_cache: torch.Tensor, copies: KvCopies) -> None:
        device = kv_cache.device
        if copies.offload_blocks:
            blocks = torch.tensor(copies.offload_blocks, dtype=torch.long, device=device)
            rows = kv_cache.index_select(1, blocks).transpose(0, 1)  # [n, L, 2, bs, H, D]
            if self.is_cuda:
                rows = rows.contiguous()
                for i, slot in enumerate(copies.offload_slots):
                    self.slots[slot].copy_(rows[i], non_blocking=True)
            else:
                self.slots.index_copy_(0, torch.tensor(copies.offload_slots, dtype=torch.long), rows)
        if copies.load_blocks:
            slots = copies.load_slots
            if self.is_cuda:
                staged = torch.empty(
                    (len(slots), *self.slots.shape[1:]), dtype=self.slots.dtype, device=device
                )
                for i, slot in enumerate(slots):
                    staged[i].copy_(self.slots[slot], non_blocking=True)
            else:
                staged = self.slots.index_select(0, torch.tensor(slots, dtype=torch.long))
            blocks = torch.tensor(copies.load_blocks, dtype=torch.long, device=device)
            kv_cache.index_copy_(1, blocks, staged.transpose(0, 1))

    def _copy_signatures(self, kv_cache: torch.Tensor, copies: KvCopies) -> None:
        """The first ``sample_words`` words of each block's K and V, every layer: what a paced copy moves."""
        num_layers, num_blocks = kv_cache.shape[:2]
        words = kv_cache.view(num_layers, num_blocks, 2, -1).view(torch.int64)[..., : self.sample_words]
        if copies.offload_blocks:
            rows = words.index_select(1, torch.tensor(copies.offload_blocks, dtype=torch.long))
            self.slots.index_copy_(
                0, torch.tensor(copies.offload_slots, dtype=torch.long), rows.transpose(0, 1)
            )
        if copies.load_blocks:
            staged = self.slots.index_select(0, torch.tensor(copies.load_slots, dtype=torch.long))
            words.index_copy_(1, torch.tensor(copies.load_blocks, dtype=torch.long), staged.transpose(0, 1))

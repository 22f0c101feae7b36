"""The host tier's bytes (workers/host_tier.py keeps its bookkeeping): one rank's share of every block
it holds, ``[num_slots, num_layers, 2, block_size, num_kv_heads, head_dim]`` (a slot is contiguous), in
page-locked memory on CUDA so copies run beside the host.

``apply`` carries out one step's ``KvCopies`` before its forward: the offloads (device block -> slot),
then the loads (slot -> device block). On CUDA they are enqueued on the current stream, after the
previous step's kernels and before this step's, and the host does not wait for them; nothing on the host
reads or writes the slots, so only the stream's order matters. On CPU they are plain copies, timed for
the load rule (``LoadRule.observe_copy``).
"""

from __future__ import annotations

import time

import torch

from workers.host_tier import KvCopies

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


class HostKv:
    """One rank's host-tier memory (see the module docstring)."""

    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        num_layers, _, *block_shape = kv_cache.shape
        self.is_cuda = kv_cache.is_cuda
        self.slots = torch.zeros(
            (num_slots, num_layers, *block_shape), dtype=kv_cache.dtype, pin_memory=self.is_cuda
        )
        self.bytes_per_block = self.slots[0].numel() * self.slots.element_size()
        self.num_copied_bytes = 0  # offloaded and loaded, this rank
        self.copy_seconds = 0.0  # CPU: the wall time of those copies (CUDA: not timed)

    @classmethod
    def create(cls, kv_cache: torch.Tensor, kv_offload_gib: float) -> HostKv | None:
        """The tier ``kv_offload_gib`` buys for ``kv_cache``'s blocks (None: 0, no tier)."""
        num_slots = num_host_slots(kv_offload_gib, kv_cache[:, 0].numel() * kv_cache.element_size())
        return cls(kv_cache, num_slots) if num_slots else None

    @property
    def num_bytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    @torch.inference_mode()
    def apply(self, kv_cache: torch.Tensor, copies: KvCopies) -> None:
        """``copies``, in order: every offload, then every load (see the module docstring)."""
        t0 = time.perf_counter()
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
        num = len(copies.offload_blocks) + len(copies.load_blocks)
        self.num_copied_bytes += num * self.bytes_per_block
        if not self.is_cuda:
            self.copy_seconds += time.perf_counter() - t0

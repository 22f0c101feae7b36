"""KV handoffs of a tensor-parallel worker: its blocks as one rank's cache would hold them, all heads.

Every rank of a worker holds its own KV heads of every block (workers/models/parallel.py). A handoff moves
blocks in the one-rank layout, all KV heads of the checkpoint in order (``[2, block_size, num_kv_heads,
head_dim]`` a row), so a prefill worker of any tensor-parallel size hands off to a decode worker of any
size: the wire never depends on either. Rank 0 runs the worker's transfer (transfer/) and reaches the
other ranks' heads through its worker's KV groups (``TensorParallel.kv``: a second set, so a transfer
thread's collectives never interleave with the step thread's):

  - gather (sending): rank 0 broadcasts the op and the block ids, every rank selects its heads of those
    blocks of one layer, rank 0 gathers them and lays each head where the one-rank row has it (with
    fewer KV heads than ranks, a head's first holder gives it);
  - scatter (receiving): rank 0 broadcasts the op, the block ids and the verified rows; every rank
    writes its own heads into its cache.

The bytes on the wire are exactly the ranks' cached bytes (copies, no arithmetic): a decode rank holds
what the prefill ranks computed, byte for byte. The other ranks run ``KvFollower.run`` on a thread of
their own until rank 0 says stop (``KvRelay.close``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

import torch

from cluster.block_hash import hash_full_blocks
from workers.models.parallel import Sharding, TensorParallel

if TYPE_CHECKING:
    from workers.block_manager import KVCacheManager


class KvHolder(Protocol):
    """What ``cached_kv`` reads of a model runner."""

    kv_cache: torch.Tensor
    kv_relay: KvRelay | None


GATHER, SCATTER, STOP = 1, 2, 3
_HEADER = 3  # op, layer, number of blocks


class _KvRanks:
    """What every rank knows: its cache, its heads, the KV group."""

    def __init__(self, tp: TensorParallel, kv_cache: torch.Tensor, shard: Sharding) -> None:
        self.tp = tp
        self.kv = kv_cache  # [L, N, 2, bs, h, d]: this rank's heads
        self.head_start = shard.kv_head_start
        self.num_heads = shard.num_kv_heads
        self.total_heads = shard.arch.num_key_value_heads

    def _receive(self, header: torch.Tensor) -> tuple[int, int, torch.Tensor | None]:
        self.tp.broadcast(header, host=True)
        op, layer, n = header.tolist()
        if op == STOP:
            return op, layer, None
        index = torch.empty(n, dtype=torch.int64, device=self.kv.device)
        self.tp.broadcast(index)
        return op, layer, index

    def _gather_part(self, layer: int, index: torch.Tensor) -> list[torch.Tensor]:
        local = self.kv[layer].index_select(0, index).contiguous()
        return self.tp.gather_parts(local)

    def _scatter_part(self, layer: int, index: torch.Tensor, rows: torch.Tensor) -> None:
        self.tp.broadcast(rows)
        mine = rows[..., self.head_start : self.head_start + self.num_heads, :]
        self.kv[layer].index_copy_(0, index, mine)


class KvRelay(_KvRanks):
    """Rank 0: the worker's KV in the one-rank layout (``shape``), for its transfer threads (one op at a
    time: a lock orders them); a ``transfer.kv_source.KvSource``."""

    def __init__(self, tp: TensorParallel, kv_cache: torch.Tensor, shard: Sharding) -> None:
        super().__init__(tp, kv_cache, shard)
        arch = shard.arch
        layers, blocks, two, block_size, _, head_dim = kv_cache.shape
        self.shape = torch.Size((layers, blocks, two, block_size, self.total_heads, head_dim))
        self.dtype, self.device, self.is_cuda = kv_cache.dtype, kv_cache.device, kv_cache.is_cuda
        # the rank each head is taken from, and its place in that rank's heads
        self._owners = [Sharding(arch, r, tp.size) for r in range(tp.size)]
        self._lock = threading.Lock()
        self._closed = False
        # called when an op's collective fails, before the error propagates: a dead rank fails the
        # worker as a unit first (``RankGroup.fail_if_a_rank_died``), so no transfer reports it
        self.on_error: Callable[[], None] | None = None

    @property
    def local(self) -> torch.Tensor:
        """Rank 0's own heads (the first of them is the first head of all)."""
        return self.kv

    def gather(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """Blocks ``index`` of ``layer`` with every head: ``[n, 2, bs, num_kv_heads, d]``."""
        with self._lock, self._failing():
            self._send_op(GATHER, layer, index)
            parts = self._gather_part(layer, index)
        out = torch.empty((len(index), *self.shape[2:]), dtype=self.kv.dtype, device=self.kv.device)
        done: set[int] = set()
        for owner, part in zip(self._owners, parts, strict=True):
            if owner.kv_head_start in done:
                continue  # NOTE: a replicated head: its first holder gave it
            done.add(owner.kv_head_start)
            out[..., owner.kv_head_start : owner.kv_head_start + owner.num_kv_heads, :] = part
        return out

    def scatter(self, layer: int, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes ``rows`` (``[n, 2, bs, num_kv_heads, d]``, every head) into blocks ``index`` of
        ``layer`` on every rank, each rank its own heads."""
        with self._lock, self._failing():
            self._send_op(SCATTER, layer, index)
            self._scatter_part(layer, index, rows.contiguous())

    def close(self) -> None:
        """The other ranks' KV threads end (idempotent; at the worker's shutdown)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.tp.broadcast(torch.tensor([STOP, 0, 0], dtype=torch.int64), host=True)

    @contextmanager
    def _failing(self) -> Iterator[None]:
        try:
            yield
        except Exception:
            if self.on_error is not None:
                self.on_error()
            raise

    def _send_op(self, op: int, layer: int, index: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("the tensor-parallel KV relay is closed")
        index = index.to(device=self.kv.device, dtype=torch.int64)
        self.tp.broadcast(torch.tensor([op, layer, len(index)], dtype=torch.int64), host=True)
        self.tp.broadcast(index.clone())


class KvFollower(_KvRanks):
    """Ranks 1..N-1: serve rank 0's gathers and scatters until it says stop."""

    def run(self) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        with torch.inference_mode():
            while True:
                op, layer, index = self._receive(header)
                if op == STOP or index is None:
                    return
                if op == GATHER:
                    self._gather_part(layer, index)
                elif op == SCATTER:
                    two, block_size, _, head_dim = self.kv.shape[2:]
                    rows = torch.empty(
                        (len(index), two, block_size, self.total_heads, head_dim),
                        dtype=self.kv.dtype,
                        device=self.kv.device,
                    )
                    self._scatter_part(layer, index, rows)
                else:
                    raise RuntimeError(f"unknown tensor-parallel KV op {op}")


def cached_kv(runner: KvHolder, kv: KVCacheManager, token_ids: list[int]) -> torch.Tensor:
    """The KV a worker's prefix cache holds for ``token_ids``' full blocks, every head in the one-rank
    layout (``[L, n, 2, bs, num_kv_heads, d]``, n the blocks found): what a handoff delivered, to compare
    byte for byte (tests)."""
    blocks = (
        []
        if kv.prefix_cache is None
        else kv.prefix_cache.lookup(hash_full_blocks(token_ids, kv.block_size, 0, b""))
    )
    index = torch.tensor(blocks, dtype=torch.int64)
    relay = runner.kv_relay
    if relay is None:
        return runner.kv_cache[:, index].cpu()
    return torch.stack([relay.gather(layer, index) for layer in range(relay.shape[0])]).cpu()

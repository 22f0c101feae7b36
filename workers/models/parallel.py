"""Tensor parallelism inside one worker: the ranks' group, what each rank holds of the model, and the
collectives its forward calls.

A tensor-parallel worker is N processes on one node, one device each (workers/rank_process.py starts
ranks 1..N-1 as children of rank 0). They form one standalone torch.distributed group (gloo on CPU,
NCCL on CUDA), plus a gloo group on the host for each step's header. Megatron-style sharding
(``Sharding``): q/k/v and gate/up are split by output rows (column-parallel), o_proj and down_proj by
input columns (row-parallel, one all-reduce each); KV heads are split over the ranks, or replicated when
there are fewer KV heads than ranks (vLLM's rule: rank r holds KV head r // (N / num_kv_heads)); the
vocabulary is split for the embedding (masked lookup, then an all-reduce: exact, the other ranks add
zeros) and for the LM head, whose logits are gathered on rank 0 (exact: each logit is one rank's dot
product). Rank 0 alone schedules and samples; the other ranks run the forward it broadcasts.

The group in force while a model is built is the process's one ``TensorParallel`` (``current()``):
layers read their shard from it when constructed and keep it for their collectives.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from workers.models.arch import ArchConfig


@dataclass(frozen=True)
class Sharding:
    """Which part of ``arch`` rank ``rank`` of ``size`` holds."""

    arch: ArchConfig
    rank: int
    size: int

    @staticmethod
    def check(arch: ArchConfig, size: int) -> None:
        """Raises ValueError naming the size that does not divide (before any process starts)."""
        if size == 1:
            return
        heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        problems = []
        if heads % size:
            problems.append(f"num_attention_heads {heads}")
        if kv_heads % size and size % kv_heads:
            problems.append(f"num_key_value_heads {kv_heads} (nor does it divide the size)")
        if arch.intermediate_size % size:
            problems.append(f"intermediate_size {arch.intermediate_size}")
        if problems:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide {', '.join(problems)} of {arch.architecture}"
            )

    @property
    def num_heads(self) -> int:
        return self.arch.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.arch.num_key_value_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        """The first KV head this rank holds (of the checkpoint's)."""
        kv_heads = self.arch.num_key_value_heads
        if kv_heads >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // kv_heads)

    @property
    def intermediate_size(self) -> int:
        return self.arch.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.arch.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> int:
        """Checkpoint rows of the vocabulary this rank holds (the last rank's shard may be padded)."""
        return max(0, min(self.vocab_per_rank, self.arch.vocab_size - self.vocab_start))

    def q_rows(self) -> tuple[int, int]:
        size = self.num_heads * self.arch.head_dim
        return self.rank * size, size

    def kv_rows(self) -> tuple[int, int]:
        size = self.num_kv_heads * self.arch.head_dim
        return self.kv_head_start * self.arch.head_dim, size

    def mlp_rows(self) -> tuple[int, int]:
        return self.rank * self.intermediate_size, self.intermediate_size


class TensorParallel:
    """This process's rank in its worker's group, and the collectives the forward needs.

    ``group``: the device group (gloo on CPU, NCCL on CUDA); ``host_group``: a gloo group for the step
    headers rank 0 broadcasts (the same object on CPU). Both None when ``size`` is 1."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        group: Any = None,
        host_group: Any = None,
        kv: TensorParallel | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.group = group
        self.host_group = host_group if host_group is not None else group
        # the same ranks' second set of groups, for KV handoffs (workers/parallel_kv.py): a transfer
        # thread's collectives never interleave with the step thread's
        self.kv = kv

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: schedules, samples and talks to the rest of the cluster."""
        return self.rank == 0

    def sharding(self, arch: ArchConfig) -> Sharding:
        return Sharding(arch, self.rank, self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place (every rank gets the same bytes)."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rank 0: ``[N, vocab_size]`` from every rank's ``[N, vocab_per_rank]``; the others: ``local``."""
        if self.size == 1:
            return local
        local = local.contiguous()
        parts = self.gather_parts(local)
        return torch.cat(parts, dim=-1)[:, :vocab_size] if self.rank == 0 else local

    def gather_parts(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Rank 0: every rank's ``local`` (same shape on every rank), in rank order; the others: []."""
        import torch.distributed as dist

        outputs = [[torch.empty_like(local) for _ in range(self.size)]] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self.group.gather(outputs, [local], options).wait()
        return outputs[0] if self.rank == 0 else []

    def broadcast(self, x: torch.Tensor, host: bool = False) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (in place), over the device group or the host group."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        (self.host_group if host else self.group).broadcast([x], options).wait()
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` of every rank (e.g. the KV blocks each rank's memory holds)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        self.host_group.allreduce([t], options).wait()
        return int(t.item())


SINGLE = TensorParallel()
_current: TensorParallel = SINGLE


def current() -> TensorParallel:
    """The group the model being built belongs to (``SINGLE`` outside ``building``)."""
    return _current


@contextmanager
def building(tp: TensorParallel) -> Iterator[TensorParallel]:
    """Models constructed inside take their shard of ``tp`` (and keep ``tp`` for their collectives)."""
    global _current
    previous, _current = _current, tp
    try:
        yield tp
    finally:
        _current = previous

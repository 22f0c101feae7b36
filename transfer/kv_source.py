"""A KV cache that one process holds only in part: what a tensor-parallel worker's transfer moves.

A worker of several ranks holds each block's KV heads spread over its ranks (workers/models/parallel.py). Its
rank 0 runs the worker's transfer with a `KvSource`: the cache as one rank would hold it,
``[L, num_blocks, 2, block_size, num_kv_heads, head_dim]`` with every head in the checkpoint's order,
reached one layer's blocks at a time (``gather`` / ``scatter``: workers/parallel_kv.py asks the other
ranks for theirs). The wire never depends on either end's ranks: the header's layout is this one-rank
layout, so a prefill worker of any size hands off to a decode worker of any size, and every check
(header, chunk digest or MAC) is the one a one-rank cache gets. `SourceRows` is what `kv_rows` is for
a tensor: the chunk gathers and scatters of transfer/ring.py go through it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from transfer.staging import ChunkPlan


@runtime_checkable
class KvSource(Protocol):
    """A KV cache reached through ``gather`` / ``scatter`` of one layer's blocks (see the module)."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def is_cuda(self) -> bool: ...

    @property
    def local(self) -> torch.Tensor:
        """This process's part of the cache, ``[L, num_blocks, 2, block_size, heads held, head_dim]``,
        whose first head is the whole cache's first (a paced handoff's sample: transfer/paced_link.py)."""
        ...

    def gather(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """Blocks ``index`` of ``layer``: ``[n, 2, block_size, num_kv_heads, head_dim]``."""
        ...

    def scatter(self, layer: int, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes ``rows`` (``[n, 2, block_size, num_kv_heads, head_dim]``) into blocks ``index``."""
        ...


class SourceRows:
    """The whole-block rows of a `KvSource`, as transfer/ring.py gathers and scatters a chunk's."""

    def __init__(self, source: KvSource) -> None:
        self.source = source
        self.row_shape = tuple(source.shape[2:])

    def gather(self, index: torch.Tensor, plan: ChunkPlan, chunk: int, out: torch.Tensor) -> None:
        """``staging.gather_rows`` of a source: the chunk's rows into ``out`` (its payload rows)."""
        for layer, first, last, row in plan.segments(chunk):
            blocks = self.source.gather(layer, index[first:last])
            dst = out[row : row + last - first]
            dst.view(torch.uint8).view(-1).copy_(blocks.reshape(-1).view(torch.uint8))

    def scatter(self, index: torch.Tensor, plan: ChunkPlan, chunk: int, src: torch.Tensor) -> None:
        """``staging.scatter_rows`` of a source: the chunk's verified rows ``src`` into its blocks."""
        dtype = self.source.dtype
        for layer, first, last, row in plan.segments(chunk):
            part = src[row : row + last - first].contiguous().view(torch.uint8).view(dtype)
            self.source.scatter(layer, index[first:last], part.view(last - first, *self.row_shape))

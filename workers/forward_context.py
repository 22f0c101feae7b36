"""The one piece of scoped state: what the current forward pass attends over.

The model runner enters ``forward_context(...)`` around ``model(input_ids, positions)`` so model code keeps
that plain signature; each attention layer reads its KV cache and the batch metadata from here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from workers.attention.base import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    """``fused_ops``: run the layers' elementwise work as fused Triton kernels (``models/triton_ops``)
    instead of torch operators (the oracle path); the runner turns it on with the Triton backend."""

    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one [num_blocks, 2, block_size, num_kv_heads, head_dim] per layer
    backend: AttentionBackend
    fused_ops: bool = False


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError(
            "no forward context: call the model inside workers.forward_context.forward_context()"
        )
    return _current

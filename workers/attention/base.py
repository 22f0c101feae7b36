"""What every attention backend receives: one flat ragged batch over a paged KV cache.

KV cache of one layer: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (index 0 of dim 1 is K,
1 is V). Block 0 is reserved (never handed to a request): padding rows of a block table point at it and
padding tokens carry slot -1, so a backend never has to special-case them beyond "slot < 0: skip write".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """Per-layer constants. sliding_window w: a query at position p sees keys at positions > p - w."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    logit_soft_cap: float | None = None
    sliding_window: int | None = None


@dataclass
class AttentionMetadata:
    """B sequences, T tokens, packed without padding (CUDA-graph replays may append padding tokens).

    Sequence i owns rows ``query_start_loc[i]:query_start_loc[i+1]`` of q/k/v. Those are its newest
    tokens, at positions ``seq_lens[i] - query_len_i .. seq_lens[i] - 1``; everything before them is
    already in its blocks ``block_tables[i, : ceil(seq_lens[i] / block_size)]``. Attention is causal.
    The scheduler puts decode-like sequences (query_len == 1) first: sequences ``[0, num_decodes)`` and
    tokens ``[0, num_decodes)``.

    ``*_cpu`` fields are host copies of the same values so a backend can size work without a device sync.
    """

    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset; -1 = do not write
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    query_start_loc_cpu: torch.Tensor  # [B + 1] int32 on CPU
    seq_lens_cpu: torch.Tensor  # [B] int32 on CPU
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens_cpu.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionBackend(ABC):
    """Writes the new K/V into the paged cache, then attends each query over its sequence's cache."""

    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:  # [T, num_heads, head_dim], dtype of q
        ...

"""Decode attention in length buckets (torch backend): where the rows are split, and that a batch of many
decodes of mixed lengths (several buckets) equals a naive dense attention per sequence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.workers.test_torch_attention import naive_attention
from workers.attention.base import AttentionMetadata, AttentionSpec
from workers.attention.torch_backend import TorchAttentionBackend, decode_buckets

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 8, 4


def test_bucket_split_points() -> None:
    assert decode_buckets(np.array([1] * 20 + [10] * 20)) == [(0, 20), (20, 40)]
    assert decode_buckets(np.array([5] * 64)) == [(0, 64)]  # no padding to save
    assert decode_buckets(np.array([1] * 10 + [10] * 10)) == [(0, 20)]  # too few rows to split
    ranges = decode_buckets(np.array([1] * 40 + [4] * 40 + [16] * 40 + [64] * 40))
    assert ranges == [(0, 40), (40, 80), (80, 120), (120, 160)]


@pytest.mark.parametrize("window", [None, 6])
def test_many_decodes_of_mixed_lengths_match_naive(window: int | None) -> None:
    gen = torch.Generator().manual_seed(5)
    seq_lens = sorted([1, 2, 3] * 6 + [17, 19, 23] * 6 + [60, 64, 70] * 6)  # 54 decodes, 3 length groups
    assert len(decode_buckets(-(-np.array(seq_lens) // BLOCK_SIZE))) > 1
    max_blocks = math.ceil(max(seq_lens) / BLOCK_SIZE)
    num_blocks = 1 + sum(math.ceil(s / BLOCK_SIZE) for s in seq_lens)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    kv_cache = torch.randn(num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    tables, slots, ks, vs, dense = [], [], [], [], []
    for seq_len in seq_lens:
        table = [free.pop() for _ in range(math.ceil(seq_len / BLOCK_SIZE))]
        tables.append(table + [0] * (max_blocks - len(table)))
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        for pos in range(seq_len - 1):  # the prefix is cached; the newest token is written by the call
            kv_cache[table[pos // BLOCK_SIZE], 0, pos % BLOCK_SIZE] = k[pos]
            kv_cache[table[pos // BLOCK_SIZE], 1, pos % BLOCK_SIZE] = v[pos]
        last = seq_len - 1
        slots.append(table[last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE)
        ks.append(k[-1:])
        vs.append(v[-1:])
        dense.append((k, v))
    n = len(seq_lens)
    starts = torch.arange(n + 1, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=starts,
        seq_lens=lens,
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_start_loc_cpu=starts.clone(),
        seq_lens_cpu=lens.clone(),
        num_decodes=n,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_size=BLOCK_SIZE,
    )
    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale=0.3, sliding_window=window)
    q = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen)
    out = TorchAttentionBackend().forward(q, torch.cat(ks), torch.cat(vs), kv_cache, meta, spec)
    expected = torch.cat([naive_attention(q[i : i + 1], k, v, spec) for i, (k, v) in enumerate(dense)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

"""Triton attention backend vs. a naive dense reference and the torch oracle backend.

Without CUDA the kernels run in the Triton interpreter. Triton picks interpreter vs. compiler when a
kernel is *decorated*, so TRITON_INTERPRET must be set before ``workers.attention.triton_kernels`` is
first imported in this process: it is set here at import time (pytest imports every test module before
running any test) and ``triton_kernels`` also sets it itself when CUDA is absent.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math
from dataclasses import dataclass

import pytest

from workers.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec
from workers.attention.triton_backend import TritonAttentionBackend, TritonLaunchConfig

try:
    from workers.attention.torch_backend import TorchAttentionBackend
except ImportError:  # NOTE: written concurrently; the naive reference below is always checked
    TorchAttentionBackend = None  # type: ignore[assignment,misc]

# Tiny tiles so tiny shapes still run several KV tiles, several Q tiles and the split-K path.
TINY = TritonLaunchConfig(
    prefill_block_m=16, prefill_block_n=16, decode_block_n=16, min_kv_per_split=16, target_programs=64
)


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    meta: AttentionMetadata
    keys: list[torch.Tensor]  # per sequence, all seq_len keys [S, Hkv, D] (prefix + new)
    values: list[torch.Tensor]
    query_lens: list[int]


def make_batch(
    seqs: list[tuple[int, int]],  # (cached prefix length, query length); decodes (query 1) first
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    num_pad_tokens: int = 0,
    seed: int = 0,
) -> Batch:
    """Random batch whose prefixes are already in shuffled cache blocks; block 0 is never used."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in seqs]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 3
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    block_tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
    qs, ks, vs, slots, keys, values = [], [], [], [], [], []
    for i, ((ctx, qlen), nblk) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        table = [ids.pop() for _ in range(nblk)]
        block_tables[i, :nblk] = torch.tensor(table, dtype=torch.int32)
        seq_slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(ctx + qlen)]
        )
        new_k = torch.randn(qlen, num_kv_heads, head_dim, generator=gen).to(dtype)
        new_v = torch.randn(qlen, num_kv_heads, head_dim, generator=gen).to(dtype)
        blk, off = seq_slots[:ctx] // block_size, seq_slots[:ctx] % block_size
        keys.append(torch.cat([cache[blk, 0, off], new_k]))
        values.append(torch.cat([cache[blk, 1, off], new_v]))
        qs.append(torch.randn(qlen, num_heads, head_dim, generator=gen).to(dtype))
        ks.append(new_k)
        vs.append(new_v)
        slots.append(seq_slots[ctx:])
    qs.append(torch.randn(num_pad_tokens, num_heads, head_dim, generator=gen).to(dtype))
    ks.append(torch.randn(num_pad_tokens, num_kv_heads, head_dim, generator=gen).to(dtype))
    vs.append(torch.randn(num_pad_tokens, num_kv_heads, head_dim, generator=gen).to(dtype))
    slots.append(torch.full((num_pad_tokens,), -1))
    query_lens = [n for _, n in seqs]
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(torch.int64),
        query_start_loc=qsl,
        seq_lens=lens,
        block_tables=block_tables,
        query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=lens.clone(),
        num_decodes=sum(1 for n in query_lens if n == 1),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    return Batch(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, keys, values, query_lens)


def naive_attention(batch: Batch, spec: AttentionSpec) -> torch.Tensor:
    """Dense fp32 attention per sequence from the known keys/values (no cache involved)."""
    out = torch.zeros(batch.q.shape, dtype=torch.float32)
    group = spec.num_heads // spec.num_kv_heads
    start = 0
    for keys, values, qlen in zip(batch.keys, batch.values, batch.query_lens, strict=True):
        seq_len = keys.shape[0]
        q = batch.q[start : start + qlen].float()
        k = keys.float().repeat_interleave(group, dim=1)
        v = values.float().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * spec.scale
        if spec.logit_soft_cap is not None:
            s = spec.logit_soft_cap * torch.tanh(s / spec.logit_soft_cap)
        q_pos = torch.arange(seq_len - qlen, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if spec.sliding_window is not None:
            visible &= k_pos > q_pos - spec.sliding_window
        s = s.masked_fill(~visible, float("-inf"))
        out[start : start + qlen] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        start += qlen
    return out


def run_backend(
    backend: AttentionBackend, batch: Batch, spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.q, batch.k, batch.v, cache, batch.meta, spec)
    return out, cache


def check(
    seqs: list[tuple[int, int]],
    *,
    block_size: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 1,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    soft_cap: float | None = None,
    window: int | None = None,
    config: TritonLaunchConfig | None = TINY,
    num_pad_tokens: int = 0,
) -> None:
    batch = make_batch(
        seqs,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        num_pad_tokens=num_pad_tokens,
    )
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5, soft_cap, window)
    out, cache = run_backend(TritonAttentionBackend(config), batch, spec)
    assert out.dtype == dtype and out.shape == batch.q.shape
    tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3}.get(dtype, 1e-5)
    num_real = int(batch.meta.query_start_loc_cpu[-1])
    torch.testing.assert_close(
        out[:num_real].float(), naive_attention(batch, spec)[:num_real], atol=tol, rtol=tol
    )
    assert torch.equal(out[num_real:], torch.zeros_like(out[num_real:]))
    if TorchAttentionBackend is not None:
        ref_out, ref_cache = run_backend(TorchAttentionBackend(), batch, spec)
        assert torch.equal(cache, ref_cache)
        torch.testing.assert_close(out[:num_real].float(), ref_out[:num_real].float(), atol=tol, rtol=tol)


def test_kv_write_exact_and_skips_negative_slots() -> None:
    batch = make_batch(
        [(5, 1), (0, 6), (3, 4)], block_size=4, num_heads=2, num_kv_heads=2, head_dim=16, num_pad_tokens=2
    )
    spec = AttentionSpec(2, 2, 16, 0.25)
    before = batch.kv_cache.clone()
    _, cache = run_backend(TritonAttentionBackend(TINY), batch, spec)
    expected = before.clone()
    real = batch.meta.slot_mapping >= 0
    blk, off = batch.meta.slot_mapping[real] // 4, batch.meta.slot_mapping[real] % 4
    expected[blk, 0, off] = batch.k[real]
    expected[blk, 1, off] = batch.v[real]
    assert torch.equal(cache, expected)
    assert not torch.equal(cache, before)


@pytest.mark.parametrize("config", [TINY, None], ids=["split", "default"])
def test_decode_long_context_gqa4(config: TritonLaunchConfig | None) -> None:
    # TINY: 4 splits of 32 keys (the 3-key sequence leaves 3 splits empty); default (CPU): 1 split.
    assert TINY.num_decode_splits(num_decodes=3, num_kv_heads=2, max_kv_len=111) == 4
    check([(110, 1), (37, 1), (2, 1)], block_size=4, num_heads=8, num_kv_heads=2, config=config)


def test_decode_mha_block_size_1() -> None:
    check([(20, 1), (7, 1)], block_size=1, num_heads=2, num_kv_heads=2, head_dim=32)


def test_prefill_block_size_16_mha() -> None:
    check([(0, 21), (0, 5)], block_size=16, num_heads=2, num_kv_heads=2)


def test_extend_cached_prefix_gqa4_block_size_1() -> None:
    check([(9, 7), (17, 3)], block_size=1, num_heads=4, num_kv_heads=1, head_dim=32)


def test_mixed_batch_with_padding_tokens() -> None:
    check([(30, 1), (4, 1), (6, 9), (0, 13)], block_size=4, num_heads=8, num_kv_heads=2, num_pad_tokens=3)


def test_soft_cap_mixed() -> None:
    check([(25, 1), (5, 8)], soft_cap=2.0)


def test_sliding_window_mixed() -> None:
    # window 6 < context: decode splits start mid-sequence, prefill tiles skip leading KV tiles.
    check([(40, 1), (3, 1), (20, 18)], window=6, num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_mixed(dtype: torch.dtype) -> None:
    check([(33, 1), (8, 6)], dtype=dtype, soft_cap=30.0, window=20, num_heads=8, num_kv_heads=2)


def test_split_rule() -> None:
    cfg = TritonLaunchConfig(min_kv_per_split=256, max_splits=32, target_programs=264)
    assert cfg.num_decode_splits(num_decodes=1, num_kv_heads=8, max_kv_len=8192) == 32
    assert cfg.num_decode_splits(num_decodes=4, num_kv_heads=8, max_kv_len=8192) == 8  # cdiv(264, 32) = 9
    assert cfg.num_decode_splits(num_decodes=1, num_kv_heads=8, max_kv_len=700) == 2  # 3 -> pow2 floor
    assert cfg.num_decode_splits(num_decodes=256, num_kv_heads=8, max_kv_len=8192) == 1
    assert cfg.num_decode_splits(num_decodes=1, num_kv_heads=8, max_kv_len=100) == 1


def test_non_power_of_two_head_dim() -> None:
    check([(12, 1), (5, 7)], head_dim=24, num_heads=6, num_kv_heads=2)


def _to_cuda(batch: Batch) -> Batch:
    dev = torch.device("cuda")
    m = batch.meta
    meta = AttentionMetadata(
        m.slot_mapping.to(dev), m.query_start_loc.to(dev), m.seq_lens.to(dev), m.block_tables.to(dev),
        m.query_start_loc_cpu, m.seq_lens_cpu, m.num_decodes, m.max_query_len, m.max_seq_len, m.block_size,
    )  # fmt: skip
    tensors = (batch.q.to(dev), batch.k.to(dev), batch.v.to(dev), batch.kv_cache.to(dev))
    return Batch(*tensors, meta, batch.keys, batch.values, batch.query_lens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("seqs_kind", "soft_cap", "window"),
    [("mixed", 50.0, 1024), ("long_decodes", None, None)],  # the second runs the default split-K path
)
def test_gpu_real_shapes_bf16(seqs_kind: str, soft_cap: float | None, window: int | None) -> None:
    gen = torch.Generator().manual_seed(1)
    if seqs_kind == "mixed":
        seqs = [(int(c), 1) for c in torch.randint(1, 3000, (48,), generator=gen)]
        seqs += [(0, 300), (700, 129), (1500, 64), (5, 2)]
    else:
        seqs = [(8000, 1), (3000, 1), (20, 1)]
    batch = make_batch(seqs, block_size=16, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    spec = AttentionSpec(32, 8, 128, 1 / math.sqrt(128), logit_soft_cap=soft_cap, sliding_window=window)
    gpu = _to_cuda(batch)
    out, cache = run_backend(TritonAttentionBackend(), gpu, spec)
    torch.testing.assert_close(out.float().cpu(), naive_attention(batch, spec), atol=2e-2, rtol=2e-2)
    if TorchAttentionBackend is not None:
        ref_out, ref_cache = run_backend(TorchAttentionBackend(), gpu, spec)
        assert torch.equal(cache, ref_cache)
        torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)

"""TorchAttentionBackend vs a naive dense per-sequence attention, on ragged paged batches."""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass

import pytest
import torch

import workers.attention.torch_backend as torch_backend
from workers.attention import create_attention_backend
from workers.attention.base import AttentionMetadata, AttentionSpec

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
# (query_len, seq_len): four decodes first, then a prefill, an extend over a cached prefix, another prefill.
SEQS = [(1, 1), (1, 5), (1, 17), (1, 40), (23, 23), (13, 32), (2, 2)]
NUM_PADDING = 3


def naive_attention(
    q: torch.Tensor,  # [Q, H, D] queries at positions seq_len - Q .. seq_len - 1
    k: torch.Tensor,  # [S, Hkv, D] every key of the sequence
    v: torch.Tensor,
    spec: AttentionSpec,
) -> torch.Tensor:
    num_queries, seq_len = q.shape[0], k.shape[0]
    group = spec.num_heads // spec.num_kv_heads
    k_full = k.repeat_interleave(group, dim=1).float()  # head h -> kv head h // group
    v_full = v.repeat_interleave(group, dim=1).float()
    out = torch.empty(num_queries, spec.num_heads, spec.head_dim)
    for i in range(num_queries):
        pos = seq_len - num_queries + i
        for h in range(spec.num_heads):
            scores = (k_full[:, h] @ q[i, h].float()) * spec.scale
            if spec.logit_soft_cap is not None:
                scores = spec.logit_soft_cap * torch.tanh(scores / spec.logit_soft_cap)
            for j in range(seq_len):
                too_old = spec.sliding_window is not None and j <= pos - spec.sliding_window
                if j > pos or too_old:
                    scores[j] = float("-inf")
            out[i, h] = torch.softmax(scores, dim=0) @ v_full[:, h]
    return out


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    meta: AttentionMetadata
    dense_k: list[torch.Tensor]
    dense_v: list[torch.Tensor]
    expected_cache: torch.Tensor  # kv_cache after a correct forward


def make_batch(block_size: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil(s / block_size) for _, s in SEQS)
    num_blocks = 1 + sum(math.ceil(s / block_size) for _, s in SEQS) + 2  # block 0 reserved, 2 spare
    free_blocks = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    kv_cache = torch.randn(num_blocks, 2, block_size, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    expected = kv_cache.clone()
    qs, ks, vs, slots, tables, dense_k, dense_v = [], [], [], [], [], [], []
    for query_len, seq_len in SEQS:
        table = [free_blocks.pop() for _ in range(math.ceil(seq_len / block_size))]
        tables.append(table + [0] * (max_blocks - len(table)))
        seq_k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        seq_v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        dense_k.append(seq_k)
        dense_v.append(seq_v)
        for pos in range(seq_len):
            block, offset = table[pos // block_size], pos % block_size
            expected[block, 0, offset], expected[block, 1, offset] = seq_k[pos], seq_v[pos]
            if pos < seq_len - query_len:  # the cached prefix was written by earlier steps
                kv_cache[block, 0, offset], kv_cache[block, 1, offset] = seq_k[pos], seq_v[pos]
            else:
                slots.append(block * block_size + offset)
        qs.append(torch.randn(query_len, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype))
        ks.append(seq_k[seq_len - query_len :])
        vs.append(seq_v[seq_len - query_len :])
    # Padding tokens (CUDA-graph style): slot -1, must write nothing.
    qs.append(torch.randn(NUM_PADDING, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype))
    ks.append(torch.full((NUM_PADDING, NUM_KV_HEADS, HEAD_DIM), 99.0, dtype=dtype))
    vs.append(torch.full((NUM_PADDING, NUM_KV_HEADS, HEAD_DIM), 99.0, dtype=dtype))
    slots += [-1] * NUM_PADDING
    starts = torch.tensor([0, *torch.tensor([ql for ql, _ in SEQS]).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([s for _, s in SEQS], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_start_loc_cpu=starts.clone(),
        seq_lens_cpu=seq_lens.clone(),
        num_decodes=sum(1 for ql, _ in SEQS if ql == 1),
        max_query_len=max(ql for ql, _ in SEQS),
        max_seq_len=max(s for _, s in SEQS),
        block_size=block_size,
    )
    return Batch(torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache, meta, dense_k, dense_v, expected)


def expected_output(batch: Batch, spec: AttentionSpec) -> torch.Tensor:
    outs = []
    starts = batch.meta.query_start_loc_cpu.tolist()
    for i in range(len(SEQS)):
        outs.append(
            naive_attention(batch.q[starts[i] : starts[i + 1]], batch.dense_k[i], batch.dense_v[i], spec)
        )
    outs.append(torch.zeros(NUM_PADDING, NUM_HEADS, HEAD_DIM))
    return torch.cat(outs)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("soft_cap", "window"), [(None, None), (2.0, None), (None, 8), (3.0, 5)])
def test_matches_naive_attention(block_size: int, soft_cap: float | None, window: int | None) -> None:
    batch = make_batch(block_size)
    spec = AttentionSpec(
        NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale=0.4, logit_soft_cap=soft_cap, sliding_window=window
    )
    out = create_attention_backend("torch").forward(
        batch.q, batch.k, batch.v, batch.kv_cache, batch.meta, spec
    )
    assert out.dtype == torch.float32 and out.shape == batch.q.shape
    torch.testing.assert_close(out, expected_output(batch, spec), atol=1e-5, rtol=1e-5)
    # Exactly the new tokens' slots were written (prefixes, spare blocks, block 0 untouched).
    assert torch.equal(batch.kv_cache, batch.expected_cache)


def test_padding_slots_write_nothing_and_block0_is_untouched() -> None:
    batch = make_batch(block_size=4, seed=1)
    block0 = batch.kv_cache[0].clone()
    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale=0.35)
    create_attention_backend("torch").forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.meta, spec)
    assert torch.equal(batch.kv_cache[0], block0)
    assert not bool((batch.kv_cache == 99.0).any())
    written = (batch.kv_cache != make_batch(block_size=4, seed=1).kv_cache).any(dim=(1, 3, 4))  # [blocks, bs]
    num_new_tokens = sum(ql for ql, _ in SEQS)
    assert int(written.sum()) == num_new_tokens


def test_prefill_query_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    # A tiny score budget forces the prefill path to split its queries into many chunks.
    monkeypatch.setattr(torch_backend, "_MAX_SCORE_ELEMENTS", 300)
    batch = make_batch(block_size=4, seed=2)
    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale=0.4, logit_soft_cap=4.0, sliding_window=6)
    out = torch_backend.TorchAttentionBackend().forward(
        batch.q, batch.k, batch.v, batch.kv_cache, batch.meta, spec
    )
    torch.testing.assert_close(out, expected_output(batch, spec), atol=1e-5, rtol=1e-5)


def test_bfloat16_inputs_return_bfloat16() -> None:
    batch = make_batch(block_size=4, dtype=torch.bfloat16, seed=3)
    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, scale=0.4, sliding_window=8)
    out = torch_backend.TorchAttentionBackend().forward(
        batch.q, batch.k, batch.v, batch.kv_cache, batch.meta, spec
    )
    assert out.dtype == torch.bfloat16
    # The backend computes in float32 from the bf16 values, like the naive reference.
    torch.testing.assert_close(out.float(), expected_output(batch, spec), atol=1e-2, rtol=1e-2)
    assert torch.equal(batch.kv_cache, batch.expected_cache)


def test_decode_attention_takes_sdpa_output_in_cudas_layout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """CUDA's SDPA kernels return [n, Hkv, G, D] stored as [n, G, Hkv, D] (a `view` of it as [n, H, D]
    failed on the first GPU run, grouped-query models only); the same values in that layout must give the
    same tokens."""
    from cluster.protocol import SamplingParams
    from tests.support.hf_models import make_random_hf_model
    from workers.llm import LLM

    path = str(make_random_hf_model("llama", tmp_path))  # 4 query heads over 2 KV heads
    prompts = [[5, 9, 11], [7] * 20, [3, 4]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(path, block_size=4).generate(prompts, params)]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def cuda_layout_sdpa(*args: object, **kwargs: object) -> torch.Tensor:
        out = sdpa(*args, **kwargs)  # type: ignore[arg-type]
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", cuda_layout_sdpa)
    assert [o.token_ids for o in LLM(path, block_size=4).generate(prompts, params)] == want

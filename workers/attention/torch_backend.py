"""Pure-torch paged attention: the reference every faster backend is tested against, and the CPU path.

Per layer call: write the new tokens' K/V at ``slot_mapping`` (slot < 0 skipped), then attend each query
over its own sequence's cached keys read through its block table. Math in float32, result in q's dtype.
Decodes (query_len 1, first in the batch) run as one batched gather + matmul; prefill/extend sequences
run one at a time (a step rarely holds more than a few), with query rows chunked to bound memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec

# Bound on one prefill chunk's score matrix (queries x heads x keys, float32): 16 Mi elements = 64 MiB.
_MAX_SCORE_ELEMENTS = 1 << 24


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``kv_cache[slot // bs, 0|1, slot % bs] = k|v`` for every token whose slot is >= 0."""
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    # NOTE: boolean indexing syncs on CUDA; this backend is the oracle there, the fast path is Triton.
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = k[valid].to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = v[valid].to(kv_cache.dtype)


def _gather(kv_cache: torch.Tensor, block_tables: torch.Tensor, index: int) -> torch.Tensor:
    """[B, nb] block ids -> [B, nb * block_size, kv_heads, head_dim] of K (index 0) or V (index 1)."""
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    # NOTE: an embedding lookup over flattened blocks is a row gather, several times faster on CPU than
    # advanced indexing of the 5-D cache.
    rows = kv_cache[:, index].reshape(num_blocks, block_size * num_kv_heads * head_dim)
    gathered = F.embedding(block_tables.long(), rows)
    return gathered.view(block_tables.shape[0], -1, num_kv_heads, head_dim)


def _attend(
    q: torch.Tensor,  # [B, Q, H, D] float32, already scaled
    k: torch.Tensor,  # [B, L, Hkv, D]
    v: torch.Tensor,  # [B, L, Hkv, D]
    bias: torch.Tensor,  # [B, Q | 1, L] float32: 0 where allowed, -inf where masked
    spec: AttentionSpec,
) -> torch.Tensor:  # [B, Q, H, D] float32
    batch, num_queries, num_heads, head_dim = q.shape
    group = num_heads // spec.num_kv_heads
    if spec.logit_soft_cap is None:
        # NOTE: without soft-capping, torch's fused CPU/CUDA SDPA is exact enough and several times faster.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.float().transpose(1, 2),
            v.float().transpose(1, 2),
            attn_mask=bias.unsqueeze(1),
            scale=1.0,
            enable_gqa=group > 1,
        )
        return out.transpose(1, 2)
    out = torch.empty_like(q)
    cap = spec.logit_soft_cap
    # NOTE: one bmm per KV head on strided views avoids a permute-copy of all of K/V.
    for h in range(spec.num_kv_heads):
        heads = slice(h * group, (h + 1) * group)
        q_h = q[:, :, heads].reshape(batch, num_queries * group, head_dim)  # rows ordered (query, g)
        scores = torch.bmm(q_h, k[:, :, h].float().transpose(1, 2))
        scores = torch.tanh(scores / cap) * cap
        scores = scores.view(batch, num_queries, group, -1) + bias.unsqueeze(2)
        probs = torch.softmax(scores, dim=-1).view(batch, num_queries * group, -1)
        out[:, :, heads] = torch.bmm(probs, v[:, :, h].float()).view(batch, num_queries, group, head_dim)
    return out


def _mask_bias(
    key_pos: torch.Tensor, query_pos: torch.Tensor, seq_lens: torch.Tensor | int, window: int | None
) -> torch.Tensor:
    """Causal (+ sliding window, HF: key > query - window) mask as an additive float32 bias."""
    allowed = (key_pos <= query_pos) & (key_pos < seq_lens)
    if window is not None:
        allowed = allowed & (key_pos > query_pos - window)
    zeros = torch.zeros((), dtype=torch.float32, device=key_pos.device)
    return zeros.masked_fill(~allowed, float("-inf")) if allowed.dim() else zeros


class TorchAttentionBackend(AttentionBackend):
    """Reference paged attention in plain torch (CPU and CUDA); see workers/attention/base.py."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        out = torch.zeros(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        # NOTE: query head h uses KV head h // (num_heads // num_kv_heads), HF's repeat_kv order.
        q32 = q.float() * spec.scale
        starts = meta.query_start_loc_cpu.tolist()
        seq_lens = meta.seq_lens_cpu.tolist()
        num_decodes = meta.num_decodes
        if num_decodes > 0:
            out[:num_decodes] = self._decode(q32[:num_decodes], kv_cache, meta, spec, seq_lens).to(q.dtype)
        for i in range(num_decodes, meta.num_seqs):
            start, end = starts[i], starts[i + 1]
            if end > start:
                out[start:end] = self._prefill(q32[start:end], kv_cache, meta, spec, i, seq_lens[i]).to(
                    q.dtype
                )
        return out

    def _decode(
        self,
        q32: torch.Tensor,  # [N, H, Dh]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
        seq_lens: list[int],
    ) -> torch.Tensor:
        num_decodes = q32.shape[0]
        block_size = meta.block_size
        num_blocks = -(-max(seq_lens[:num_decodes]) // block_size)
        tables = meta.block_tables[:num_decodes, :num_blocks]
        keys, values = _gather(kv_cache, tables, 0), _gather(kv_cache, tables, 1)
        lens = meta.seq_lens[:num_decodes].to(torch.int64).view(-1, 1, 1)
        key_pos = torch.arange(num_blocks * block_size, device=q32.device).view(1, 1, -1)
        bias = _mask_bias(key_pos, lens - 1, lens, spec.sliding_window)  # [N, 1, L]
        return _attend(q32.unsqueeze(1), keys, values, bias, spec).squeeze(1)

    def _prefill(
        self,
        q32: torch.Tensor,  # [Q, H, Dh]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
        seq_idx: int,
        seq_len: int,
    ) -> torch.Tensor:
        num_queries = q32.shape[0]
        block_size = meta.block_size
        first_query_pos = seq_len - num_queries
        # Keys before the window of the first query can never be seen: skip whole blocks of them.
        first_key = 0 if spec.sliding_window is None else max(0, first_query_pos - spec.sliding_window + 1)
        first_block = first_key // block_size
        num_blocks = -(-seq_len // block_size)
        table = meta.block_tables[seq_idx : seq_idx + 1, first_block:num_blocks]
        keys, values = _gather(kv_cache, table, 0), _gather(kv_cache, table, 1)
        key_pos = torch.arange(first_block * block_size, num_blocks * block_size, device=q32.device).view(
            1, -1
        )
        chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, q32.shape[1] * keys.shape[1]))
        out = torch.empty_like(q32)
        for q_start in range(0, num_queries, chunk):
            q_end = min(num_queries, q_start + chunk)
            query_pos = torch.arange(first_query_pos + q_start, first_query_pos + q_end, device=q32.device)
            bias = _mask_bias(key_pos, query_pos.view(-1, 1), seq_len, spec.sliding_window)  # [q, L]
            out[q_start:q_end] = _attend(q32[None, q_start:q_end], keys, values, bias[None], spec)[0]
        return out

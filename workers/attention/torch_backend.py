"""Pure-torch paged attention: the reference every faster backend is tested against, and the CPU path.

Per layer call: write the new tokens' K/V at ``slot_mapping`` (slot < 0 skipped), then attend each query
over its own sequence's cached keys read through its block table. Math in float32, result in q's dtype.

What depends only on the step (row indices of the KV writes, the decodes' key mask, host copies of the
offsets) is derived once, at the first layer, and reused by every other layer (``_StepPlan``).
Decodes (query_len 1, first in the batch) run as one batched gather + one SDPA call in which the query
heads that share a KV head act as that head's queries (grouped-query attention folded into the query
length). A prompt computed from its first token (no cached prefix) attends over its own new K/V with a
causal SDPA, without reading the cache; other prefill/extend sequences run one at a time over their
gathered blocks, with query rows chunked to bound memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from workers.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec

# Bound on one prefill chunk's score matrix (queries x heads x keys, float32): 16 Mi elements = 64 MiB.
_MAX_SCORE_ELEMENTS = 1 << 24
# Decodes are padded to the longest one in their SDPA call. Rows ordered by length (the model runner
# sorts them for this backend) are split into up to this many contiguous buckets, each padded to its
# own longest, when a split saves >= _MIN_BUCKET_SAVING of the padded keys of the range it splits and
# leaves >= _MIN_BUCKET_ROWS rows on each side (a bucket costs a few more ops per layer).
_MAX_DECODE_BUCKETS = 4
_MIN_BUCKET_ROWS = 16
_MIN_BUCKET_SAVING = 0.2


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
    return _gather_rows(kv_cache, block_tables.long() * 2 + index)


def _gather_rows(kv_cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[B, nb] indices into the cache seen as [num_blocks * 2, block of K or V] (``2 * block`` is its K,
    ``2 * block + 1`` its V) -> [B, nb * block_size, kv_heads, head_dim]."""
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    # NOTE: an embedding lookup is a row gather, several times faster on CPU than advanced indexing of
    # the 5-D cache, and ~2x faster from the whole (contiguous) cache than from its strided K or V half.
    flat = kv_cache.reshape(num_blocks * 2, block_size * num_kv_heads * head_dim)  # a view: contiguous
    gathered = F.embedding(rows, flat)
    return gathered.view(rows.shape[0], -1, num_kv_heads, head_dim)


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


@dataclass
class _DecodeBucket:
    """Decode rows ``[start, end)`` padded to ``num_blocks`` blocks: K rows of the cache (2 * block id)
    and the key mask per sliding window."""

    start: int
    end: int
    num_blocks: int
    rows: torch.Tensor  # [end - start, num_blocks]
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)


def decode_buckets(block_counts: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous row ranges covering ``block_counts`` (blocks each decode reads), split greedily where
    padding every row of a range to the range's maximum wastes most (see _MAX_DECODE_BUCKETS)."""
    ranges = [(0, len(block_counts))]
    while len(ranges) < _MAX_DECODE_BUCKETS:
        best: tuple[int, int, int] | None = None  # (saving, range index, split row)
        for index, (start, end) in enumerate(ranges):
            n = end - start
            if n < 2 * _MIN_BUCKET_ROWS:
                continue
            counts = block_counts[start:end]
            head_max = np.maximum.accumulate(counts)
            tail_max = np.maximum.accumulate(counts[::-1])[::-1]
            splits = np.arange(_MIN_BUCKET_ROWS, n - _MIN_BUCKET_ROWS + 1)
            costs = splits * head_max[splits - 1] + (n - splits) * tail_max[splits]
            i = int(np.argmin(costs))
            whole = n * int(head_max[-1])
            saving = whole - int(costs[i])
            if saving >= _MIN_BUCKET_SAVING * whole and (best is None or saving > best[0]):
                best = (saving, index, start + int(splits[i]))
        if best is None:
            break
        _, index, split = best
        start, end = ranges[index]
        ranges[index : index + 1] = [(start, split), (split, end)]
    return ranges


@dataclass
class _StepPlan:
    """What every layer of one step shares; built at the step's first layer (see the module docstring)."""

    meta: AttentionMetadata
    starts: list[int]
    seq_lens: list[int]
    kv_rows: torch.Tensor | None = None  # [T'] rows of the cache viewed as [blocks * 2 * bs, Hkv * D]
    valid_tokens: torch.Tensor | None = None  # [T'] tokens with a slot (None: all of them)
    decode_blocks: int = 0  # blocks of the longest decode
    decode_buckets: list[_DecodeBucket] = field(default_factory=list)


def _plan(meta: AttentionMetadata, block_size: int) -> _StepPlan:
    plan = _StepPlan(meta, meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist())
    slots = meta.slot_mapping
    # NOTE: one host check per step (a sync on CUDA, where this backend is only the oracle): padding
    # tokens (slot -1) come from CUDA-graph and warm-up steps only.
    if slots.numel() and bool((slots < 0).any()):
        plan.valid_tokens = torch.nonzero(slots >= 0).flatten()
        slots = slots[plan.valid_tokens]
    plan.kv_rows = torch.div(slots, block_size, rounding_mode="floor") * (2 * block_size) + slots % block_size
    num_decodes = meta.num_decodes
    if num_decodes:
        counts = -(-np.array(plan.seq_lens[:num_decodes]) // block_size)
        plan.decode_blocks = int(counts.max())
        rows = meta.block_tables[:num_decodes].long() * 2
        for start, end in decode_buckets(counts):
            num_blocks = int(counts[start:end].max())
            plan.decode_buckets.append(_DecodeBucket(start, end, num_blocks, rows[start:end, :num_blocks]))
    return plan


class TorchAttentionBackend(AttentionBackend):
    """Reference paged attention in plain torch (CPU and CUDA); see workers/attention/base.py."""

    name = "torch"

    def __init__(self) -> None:
        self._plan: _StepPlan | None = None

    def _step_plan(self, meta: AttentionMetadata, block_size: int) -> _StepPlan:
        plan = self._plan
        if plan is None or plan.meta is not meta:
            plan = self._plan = _plan(meta, block_size)
        return plan

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        plan = self._step_plan(meta, kv_cache.shape[2])
        self._write(k, v, kv_cache, plan)
        num_tokens, num_heads, head_dim = q.shape
        num_decodes = meta.num_decodes
        starts, seq_lens = plan.starts, plan.seq_lens
        if num_decodes == num_tokens and spec.logit_soft_cap is None:
            return self._decode_sdpa(q, kv_cache, meta, spec, plan).to(q.dtype)
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        if starts[-1] < num_tokens:
            out[starts[-1] :].zero_()  # padding tokens belong to no sequence
        if num_decodes > 0:
            if spec.logit_soft_cap is None:
                out[:num_decodes] = self._decode_sdpa(q[:num_decodes], kv_cache, meta, spec, plan)
            else:
                out[:num_decodes] = self._decode(
                    q[:num_decodes].float() * spec.scale, kv_cache, meta, spec, plan
                )
        for i in range(num_decodes, meta.num_seqs):
            start, end = starts[i], starts[i + 1]
            if end == start:
                continue
            if self._is_fresh_prompt(end - start, seq_lens[i], spec):
                out[start:end] = self._fresh_prefill(q[start:end], k[start:end], v[start:end], spec)
            else:
                q32 = q[start:end].float() * spec.scale
                out[start:end] = self._prefill(q32, kv_cache, meta, spec, i, seq_lens[i])
        return out

    @staticmethod
    def _write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan) -> None:
        """K/V of the step's tokens into their slots: two row copies into the cache seen as rows."""
        if not kv_cache.is_contiguous() or plan.kv_rows is None:
            write_kv(k, v, kv_cache, plan.meta.slot_mapping)
            return
        num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        rows = kv_cache.view(num_blocks * 2 * block_size, num_kv_heads * head_dim)
        k_rows, v_rows = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
        if plan.valid_tokens is not None:
            k_rows, v_rows = k_rows[plan.valid_tokens], v_rows[plan.valid_tokens]
        rows.index_copy_(0, plan.kv_rows, k_rows.to(kv_cache.dtype))
        rows.index_copy_(0, plan.kv_rows + block_size, v_rows.to(kv_cache.dtype))

    @staticmethod
    def _is_fresh_prompt(num_queries: int, seq_len: int, spec: AttentionSpec) -> bool:
        """A chunk that starts at position 0 sees only its own keys; the causal SDPA needs no mask then
        (unless a soft-cap or a window shorter than the chunk changes the scores)."""
        window_ok = spec.sliding_window is None or spec.sliding_window >= seq_len
        return num_queries == seq_len and spec.logit_soft_cap is None and window_ok

    @staticmethod
    def _fresh_prefill(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.float().transpose(0, 1).unsqueeze(0),
            k.float().transpose(0, 1).unsqueeze(0),
            v.float().transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=spec.scale,
            enable_gqa=spec.num_heads != spec.num_kv_heads,
        )
        return out[0].transpose(0, 1)

    @staticmethod
    def _decode_mask(bucket: _DecodeBucket, meta: AttentionMetadata, window: int | None) -> torch.Tensor:
        """[n, 1, 1, L] float32 bias, 0 where the bucket's decode i may attend key position l and -inf
        elsewhere, shared by every layer of the step (SDPA would turn a bool mask into this per call)."""
        mask = bucket.masks.get(window)
        if mask is None:
            lens = meta.seq_lens[bucket.start : bucket.end].to(torch.int64).view(-1, 1, 1, 1)
            key_pos = torch.arange(bucket.num_blocks * meta.block_size, device=lens.device)
            allowed = key_pos < lens
            if window is not None:
                allowed &= key_pos > lens - 1 - window
            mask = torch.zeros(allowed.shape, dtype=torch.float32, device=lens.device)
            mask.masked_fill_(~allowed, float("-inf"))
            bucket.masks[window] = mask
        return mask

    def _decode_sdpa(
        self,
        q: torch.Tensor,  # [N, H, D] the decodes' queries
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
        plan: _StepPlan,
    ) -> torch.Tensor:  # [N, H, D] float32
        """One SDPA call per bucket of decodes: the ``H / Hkv`` query heads of a KV head are its
        queries (grouped-query attention folded into the query length)."""
        num_decodes, num_heads, head_dim = q.shape
        q4 = q.float().reshape(num_decodes, spec.num_kv_heads, num_heads // spec.num_kv_heads, head_dim)
        out = None if len(plan.decode_buckets) == 1 else q4.new_empty(q4.shape)
        for bucket in plan.decode_buckets:
            keys = _gather_rows(kv_cache, bucket.rows)  # [n, L, Hkv, D]
            values = _gather_rows(kv_cache, bucket.rows + 1)
            part = F.scaled_dot_product_attention(
                q4[bucket.start : bucket.end],
                keys.float().transpose(1, 2),
                values.float().transpose(1, 2),
                attn_mask=self._decode_mask(bucket, meta, spec.sliding_window),
                scale=spec.scale,
            )
            if out is None:
                # NOTE: reshape: the CUDA SDPA kernels return a permuted layout (view fails there; CPU is contiguous)
                return part.reshape(num_decodes, num_heads, head_dim)
            out[bucket.start : bucket.end] = part
        if out is None:
            raise RuntimeError("a decode attention call in a step the plan saw no decodes in")
        return out.view(num_decodes, num_heads, head_dim)

    @staticmethod
    def _decode(
        q32: torch.Tensor,  # [N, H, Dh]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
        plan: _StepPlan,
    ) -> torch.Tensor:
        num_decodes = q32.shape[0]
        block_size = meta.block_size
        num_blocks = plan.decode_blocks
        tables = meta.block_tables[:num_decodes, :num_blocks]
        keys, values = _gather(kv_cache, tables, 0), _gather(kv_cache, tables, 1)
        lens = meta.seq_lens[:num_decodes].to(torch.int64).view(-1, 1, 1)
        key_pos = torch.arange(num_blocks * block_size, device=q32.device).view(1, 1, -1)
        bias = _mask_bias(key_pos, lens - 1, lens, spec.sliding_window)  # [N, 1, L]
        return _attend(q32.unsqueeze(1), keys, values, bias, spec).squeeze(1)

    @staticmethod
    def _prefill(
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

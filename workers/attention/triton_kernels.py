# NOTE: @triton.jit bodies are Triton DSL (constexpr/pointer parameters), not annotatable Python.
# mypy: disable-error-code="no-untyped-def"
"""Triton kernels of the paged-KV attention backend (launched from ``triton_backend.py``).

Cache layout of one layer: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``. Every kernel finds a
token's row through the sequence's block table, one gather per KV position, so a KV tile of BLOCK_N
positions may span several pages and any block size works (1, 4, 16, ...).

Integer arguments that change from step to step (block-table row stride, decode split count, the index
of the first prefill sequence, split-scratch strides, the window) are listed in ``do_not_specialize``:
Triton would otherwise compile a new variant whenever one of them becomes 1 or a multiple of 16, in the
middle of a run. Constant strides stay specialised (divisibility helps vectorised loads).

Scores are kept in log2 units (``exp2`` is the native instruction); all accumulation is fp32.
GQA: one program owns one KV head and all query heads mapped onto it, so each K/V tile is read once for
the whole group (the rows of the Q tile are (query, head-in-group) pairs).
"""

from __future__ import annotations

import os

import torch

# NOTE: without CUDA the only way a Triton kernel can run is the interpreter, and Triton decides that when a
# kernel is decorated (module import), not at launch; setting it here makes the backend usable on CPU no
# matter which module imported triton first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET") == "1" and type(tl.zeros).__name__ == "JITFunction":
    raise RuntimeError(
        "triton was imported before TRITON_INTERPRET=1 was set, so its library functions are compiled-mode and "
        "cannot run in the interpreter; set TRITON_INTERPRET=1 in the environment (no CUDA device here)"
    )


@triton.jit
def _scores_log2(qk, sm_scale, soft_cap, USE_SOFT_CAP: tl.constexpr):
    """Raw q.k -> scaled (optionally soft-capped) logits in log2 units."""
    if USE_SOFT_CAP:
        x = qk * (sm_scale / soft_cap)
        # NOTE: tanh from exp2 of a non-positive argument: portable (no libdevice) and cannot overflow.
        t = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
        th = (1.0 - t) / (1.0 + t)
        s = tl.where(x < 0, -th, th) * (soft_cap * 1.4426950408889634)
    else:
        s = qk * (sm_scale * 1.4426950408889634)
    return s


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    if UPCAST_DOT:
        # NOTE: the Triton interpreter multiplies bf16 operands as their uint16 storage (garbage); fp32
        # products of bf16 values are exact, so upcasting keeps the GPU's bf16-in/fp32-acc semantics.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def kv_write_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_c_blk,
    stride_c_kv,
    stride_c_slot,
    stride_c_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Grid (T,): copy token t's K and V rows (all KV heads) to its slot; slot < 0 is skipped."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = tl.arange(0, DIM_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        k_row = tl.load(k_ptr + t * stride_k_t + h * stride_k_h + d, mask=mask)
        v_row = tl.load(v_ptr + t * stride_v_t + h * stride_v_h + d, mask=mask)
        dst = cache_ptr + blk * stride_c_blk + off * stride_c_slot + h * stride_c_h + d
        tl.store(dst, k_row, mask=mask)
        tl.store(dst + stride_c_kv, v_row, mask=mask)


@triton.jit
def _load_kv_tile(
    cache_ptr, bt_row_ptr, pos, load_mask, kv_head, d, dim_mask,
    stride_c_blk, stride_c_kv, stride_c_slot, stride_c_h,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """K and V tiles [BLOCK_N, DIM_PAD] for KV positions ``pos`` of one sequence (masked rows read 0)."""
    blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=load_mask, other=0).to(tl.int64)
    row = blk * stride_c_blk + (pos % BLOCK_SIZE) * stride_c_slot + kv_head * stride_c_h
    ptrs = cache_ptr + row[:, None] + d[None, :]
    mask = load_mask[:, None] & dim_mask[None, :]
    k = tl.load(ptrs, mask=mask, other=0.0)
    v = tl.load(ptrs + stride_c_kv, mask=mask, other=0.0)
    return k, v


_DECODE_PER_STEP = (
    "stride_bt", "stride_po_s", "stride_po_h", "stride_po_split", "stride_pl_s", "stride_pl_h", "window", "num_splits",
)  # fmt: skip


@triton.jit(do_not_specialize=_DECODE_PER_STEP)
def decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_blk, stride_c_kv, stride_c_slot, stride_c_h, stride_bt,
    stride_po_s, stride_po_h, stride_po_split, stride_pl_s, stride_pl_h,
    sm_scale, soft_cap, window, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr, IS_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """Grid (num_decodes, num_kv_heads, num_splits): one query token per sequence (token row == seq).

    Split ``s`` covers a BLOCK_N-aligned slice of the visible keys. With IS_SPLIT it writes its normalized
    partial output and log2-sum-exp to the scratch buffers for ``decode_reduce_kernel``; otherwise
    (num_splits == 1) it writes the final output directly.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - kv_lo, num_splits), BLOCK_N) * BLOCK_N
    start = kv_lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    head = kv_head * GROUP + g
    dim_mask = d < HEAD_DIM
    q_mask = (g < GROUP)[:, None] & dim_mask[None, :]
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_q_t + head[:, None] * stride_q_h + d[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, DIM_PAD], 0.0, tl.float32)
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        k, v = _load_kv_tile(
            cache_ptr, bt_row_ptr, pos, valid, kv_head, d, dim_mask,
            stride_c_blk, stride_c_kv, stride_c_slot, stride_c_h, BLOCK_SIZE,
        )  # fmt: skip
        qk = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT)
        s = _scores_log2(qk, sm_scale, soft_cap, USE_SOFT_CAP)
        s = tl.where(valid[None, :], s, float("-inf"))
        # NOTE: every tile here has >= 1 valid key, so m_new is finite and no -inf - -inf can occur.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    is_empty = l_i == 0.0  # only an empty split (start >= end) of a short sequence
    out = acc / tl.where(is_empty, 1.0, l_i)[:, None]
    if IS_SPLIT:
        lse = tl.where(is_empty, float("-inf"), m_i + tl.log2(tl.where(is_empty, 1.0, l_i)))
        base = seq.to(tl.int64) * stride_po_s + split * stride_po_split
        tl.store(part_out_ptr + base + head[:, None] * stride_po_h + d[None, :], out, mask=q_mask)
        lse_ptrs = part_lse_ptr + seq.to(tl.int64) * stride_pl_s + head * stride_pl_h + split
        tl.store(lse_ptrs, lse, mask=g < GROUP)
    else:
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_o_t + head[:, None] * stride_o_h + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit(
    do_not_specialize=(
        "stride_po_s",
        "stride_po_h",
        "stride_po_split",
        "stride_pl_s",
        "stride_pl_h",
        "num_splits",
    )
)
def decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_po_s, stride_po_h, stride_po_split, stride_pl_s, stride_pl_h, stride_o_t, stride_o_h,
    num_splits,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):  # fmt: skip
    """Grid (num_decodes, num_heads): merge the split partials with weights 2^(lse_s - max lse).

    One split at a time with a running max (no split-count-sized tile, so any split count runs the
    same compiled variant).
    """
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, DIM_PAD)
    d_mask = d < HEAD_DIM
    lse_row = part_lse_ptr + seq * stride_pl_s + head * stride_pl_h
    part_row = part_out_ptr + seq * stride_po_s + head * stride_po_h + d
    # NOTE: split 0 starts at the first visible key and every sequence sees >= 1 key, so its lse is
    # finite and m is finite from the first iteration on; empty splits (lse -inf) get weight 0.
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([DIM_PAD], dtype=tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(lse_row + s)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        part = tl.load(part_row + s * stride_po_split, mask=d_mask, other=0.0)
        acc = acc * alpha + part * w
        total = total * alpha + w
        m = m_new
    o_ptrs = out_ptr + seq * stride_o_t + head * stride_o_h + d
    tl.store(o_ptrs, (acc / total).to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit(do_not_specialize=("stride_bt", "window", "first_seq"))
def prefill_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_blk, stride_c_kv, stride_c_slot, stride_c_h, stride_bt,
    sm_scale, soft_cap, window, first_seq,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """Grid (num_prefill_seqs, cdiv(max_query_len, BLOCK_Q), num_kv_heads): one tile of BLOCK_Q queries.

    Q tile rows are (query, head-in-group) pairs: BLOCK_M = BLOCK_Q * GROUP (rounded to a power of two).
    The new tokens' K/V were already written to the cache, so prefix and new keys are read alike through
    the block table; causality (and the window) is a mask on absolute positions.
    """
    seq = first_seq + tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx_len = seq_len - q_len
        r = tl.arange(0, BLOCK_M)
        q_idx = q_tile * BLOCK_Q + r // GROUP
        head = kv_head * GROUP + r % GROUP
        row_valid = (q_idx < q_len) & (r < BLOCK_Q * GROUP)
        q_pos = ctx_len + q_idx
        d = tl.arange(0, DIM_PAD)
        dim_mask = d < HEAD_DIM
        row_off = (q_start + q_idx).to(tl.int64)
        io_mask = row_valid[:, None] & dim_mask[None, :]
        q_ptrs = q_ptr + row_off[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :]
        q = tl.load(q_ptrs, mask=io_mask, other=0.0)

        kv_hi = tl.minimum(seq_len, ctx_len + (q_tile + 1) * BLOCK_Q)
        kv_lo = 0
        if USE_WINDOW:
            kv_lo = tl.maximum(ctx_len + q_tile * BLOCK_Q - window + 1, 0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, DIM_PAD], 0.0, tl.float32)
        bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for n0 in range(kv_lo, kv_hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            k, v = _load_kv_tile(
                cache_ptr, bt_row_ptr, pos, pos < kv_hi, kv_head, d, dim_mask,
                stride_c_blk, stride_c_kv, stride_c_slot, stride_c_h, BLOCK_SIZE,
            )  # fmt: skip
            qk = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT)
            s = _scores_log2(qk, sm_scale, soft_cap, USE_SOFT_CAP)
            visible = (pos[None, :] <= q_pos[:, None]) & (pos < kv_hi)[None, :]
            if USE_WINDOW:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # NOTE: a row may see nothing in this tile yet (window, padding rows): keep exp2 args finite.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
            m_i = m_new

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + row_off[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


# NOTE: decided once, when the kernels above were decorated; an interpreted launch needs UPCAST_DOT for bf16.
IS_INTERPRETED = type(decode_kernel).__name__ == "InterpretedFunction"

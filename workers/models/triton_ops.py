# NOTE: @triton.jit bodies are Triton DSL (constexpr/pointer parameters), not annotatable Python.
# mypy: disable-error-code="no-untyped-def"
"""Fused Triton kernels for the decoder layers' elementwise work (the Triton backend's model path).

Each replaces a chain of small torch operators with one launch and rounds where the torch path (the
oracle, HF's arithmetic) rounds to the model dtype, so bf16 results differ from it only by the order of
fp32 reductions and the rounding of intermediate products inside one fused expression:

- ``rms_norm``: RMSNorm (Llama ``w * norm(x).to(dtype)`` or Gemma ``norm(x) * (1 + w)``), optionally
  after adding the residual stream (written back in place), optionally with a second RMSNorm applied to
  the branch output before the add (Gemma's post-attention / post-feed-forward norms).
- ``rotary_qk_``: RoPE on q and k in place (views into the fused qkv projection), optionally after
  Qwen3's per-head q/k RMSNorm.
- ``gated_act``: ``act(gate) * up`` over the fused gate/up projection (SiLU, tanh-GELU, erf-GELU).
- ``logits_to_fp32``: the head's output upcast to float32 with the final soft-cap, in one pass.

The row count and the launch grid vary per step; no integer argument depends on it, so a kernel never
recompiles for a new batch shape. Under ``TRITON_INTERPRET=1`` (no CUDA) they run on CPU tensors.
"""

from __future__ import annotations

import torch

# NOTE: import for its side effect: TRITON_INTERPRET must be set (no CUDA) before triton is imported.
import workers.attention.triton_kernels  # noqa: F401  # isort: skip
import triton  # isort: skip
import triton.language as tl  # isort: skip

ACT_CODES = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}
_LOG2E = 1.4426950408889634


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 -> ``dtype`` rounding to nearest even, as torch does.

    NOTE: the interpreter truncates fp32 -> bf16 casts; rounding the bits first (the usual integer
    trick) makes the cast exact on both the GPU and the interpreter, so bf16 tests compare like with like.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _rms_norm_row(x, w_ptr, cols, mask, eps, N: tl.constexpr, GEMMA: tl.constexpr, dtype: tl.constexpr):
    """RMSNorm of one fp32 row -> the model dtype, rounding where the torch path rounds."""
    var = tl.sum(x * x, 0) / N
    normed = x * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        y = _round(normed * (1.0 + w), dtype)
    else:
        y = _round(w * _round(normed, dtype).to(tl.float32), dtype)
    return y


@triton.jit
def rms_norm_kernel(
    x_ptr, res_ptr, pre_w_ptr, w_ptr, out_ptr,
    stride_x, stride_r, stride_o, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_PRE_NORM: tl.constexpr,
    GEMMA: tl.constexpr,
):  # fmt: skip
    """Grid (rows,): ``s = res + pre_norm(x)`` (stored back to res), ``out = norm(s)``; each part optional."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_PRE_NORM:
        x = _rms_norm_row(x, pre_w_ptr, cols, mask, eps, N, GEMMA, dtype).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = _round(x + r, dtype)
        tl.store(res_ptr + row * stride_r + cols, s, mask=mask)
        x = s.to(tl.float32)
    y = _rms_norm_row(x, w_ptr, cols, mask, eps, N, GEMMA, dtype)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


@triton.jit
def _rotate_heads(
    ptr, stride_t, t, cos, sin, norm_w_ptr, eps,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    QK_NORM: tl.constexpr,
):  # fmt: skip
    """RoPE (after an optional per-head RMSNorm) of token t's heads, in place; heads are HEAD_DIM apart."""
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < NUM_HEADS) & (d < HALF)
    dtype = ptr.dtype.element_ty
    lo_ptrs = ptr + t * stride_t + h * (2 * HALF) + d
    x1 = tl.load(lo_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
        inv = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(norm_w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(norm_w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        x1 = _round(w1 * _round(x1 * inv, dtype).to(tl.float32), dtype).to(tl.float32)
        x2 = _round(w2 * _round(x2 * inv, dtype).to(tl.float32), dtype).to(tl.float32)
    tl.store(lo_ptrs, _round(x1 * cos - x2 * sin, dtype), mask=mask)
    tl.store(lo_ptrs + HALF, _round(x2 * cos + x1 * sin, dtype), mask=mask)


@triton.jit
def rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr,
    stride_q, stride_k, stride_cs, eps,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, Q_PAD: tl.constexpr, K_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, QK_NORM: tl.constexpr,
):  # fmt: skip
    """Grid (tokens,): HF's non-interleaved RoPE on every q and k head of one token, in place.

    cos/sin rows are ``cat(freqs, freqs)`` (both halves equal), so only the first half is read."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_ptr + t * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, stride_q, t, cos, sin, q_norm_ptr, eps, NUM_Q_HEADS, Q_PAD, HALF, HALF_PAD, QK_NORM)
    _rotate_heads(k_ptr, stride_k, t, cos, sin, k_norm_ptr, eps, NUM_K_HEADS, K_PAD, HALF, HALF_PAD, QK_NORM)


@triton.jit
def _tanh(x):
    # NOTE: from exp2 of a non-positive argument: portable (no libdevice) and cannot overflow.
    t = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -th, th)


@triton.jit
def gated_act_kernel(
    x_ptr, out_ptr, stride_x, stride_o,
    INTER: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr,
):  # fmt: skip
    """Grid (rows, cdiv(INTER, BLOCK)): ``out = act(x[:, :INTER]) * x[:, INTER:]``; act rounded first."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = gate / (1.0 + tl.exp2(-1.4426950408889634 * gate))
    elif ACT == 1:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (1.0 + _tanh(inner))
    else:
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    out = _round(_round(act, dtype).to(tl.float32) * up, dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


@triton.jit
def logits_kernel(
    x_ptr, out_ptr, stride_x, stride_o, vocab_size, cap, BLOCK: tl.constexpr, HAS_CAP: tl.constexpr
):
    """Grid (rows, cdiv(V, BLOCK)): ``out = tanh(x / cap) * cap`` (or just ``x``) in float32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_CAP:
        x = _tanh(x / cap) * cap
    tl.store(out_ptr + row * stride_o + cols, x, mask=mask)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, cols] with unit column stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gemma: bool,
    residual: torch.Tensor | None = None,
    pre_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``norm(residual + pre_norm(x))`` over the last dim. ``residual`` (contiguous [rows, N], x's dtype)
    is updated in place to the sum; ``pre_weight`` applies a norm of the same kind to ``x`` first."""
    x2 = _rows(x)
    num_rows, n = x2.shape
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if residual is not None and (residual.stride(-1) != 1 or residual.shape != x2.shape):
        raise ValueError(
            f"residual {tuple(residual.shape)} must be a contiguous match of x {tuple(x2.shape)}"
        )
    if num_rows:
        res = residual if residual is not None else x2
        rms_norm_kernel[(num_rows,)](
            x2, res, pre_weight if pre_weight is not None else weight, weight, out,
            x2.stride(0), res.stride(0), out.stride(0), eps,
            N=n, BLOCK=_pow2(n), HAS_RESIDUAL=residual is not None, HAS_PRE_NORM=pre_weight is not None,
            GEMMA=gemma,
        )  # fmt: skip
    return out.view(x.shape)


def rotary_qk_(
    q: torch.Tensor,  # [T, num_heads, head_dim], unit stride in the last two dims' head layout
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [T, 1 | absent, head_dim]
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """RoPE on q and k in place (after Qwen3's per-head RMSNorm when norm weights are given)."""
    num_tokens, num_heads, head_dim = q.shape
    for x in (q, k):
        if x.stride(2) != 1 or x.stride(1) != head_dim:
            raise ValueError(
                f"q/k heads must be contiguous rows of head_dim {head_dim}, strides {x.stride()}"
            )
    cos2, sin2 = cos.reshape(num_tokens, head_dim), sin.reshape(num_tokens, head_dim)
    if num_tokens == 0:
        return
    has_norm = q_norm_weight is not None and k_norm_weight is not None
    half = head_dim // 2
    rotary_kernel[(num_tokens,)](
        q, k, cos2, sin2, q_norm_weight if has_norm else cos2, k_norm_weight if has_norm else cos2,
        q.stride(0), k.stride(0), cos2.stride(0), eps,
        NUM_Q_HEADS=num_heads, NUM_K_HEADS=k.shape[1], Q_PAD=_pow2(num_heads), K_PAD=_pow2(k.shape[1]),
        HALF=half, HALF_PAD=_pow2(half), QK_NORM=has_norm,
    )  # fmt: skip


def gated_act(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` where ``gate_up = cat(gate, up)`` on the last dim."""
    x2 = _rows(gate_up)
    num_rows, width = x2.shape
    inter = width // 2
    out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(inter))
    if num_rows:
        gated_act_kernel[(num_rows, triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), INTER=inter, BLOCK=block, ACT=ACT_CODES[act]
        )
    return out.view(*gate_up.shape[:-1], inter)


def logits_to_fp32(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """[N, V] head output (any float dtype) -> float32, soft-capped by ``cap`` when given."""
    x2 = _rows(logits)
    num_rows, vocab_size = x2.shape
    out = torch.empty((num_rows, vocab_size), dtype=torch.float32, device=logits.device)
    if num_rows:
        block = 1024
        logits_kernel[(num_rows, triton.cdiv(vocab_size, block))](
            x2, out, x2.stride(0), out.stride(0), vocab_size, cap or 1.0, BLOCK=block, HAS_CAP=cap is not None
        )
    return out

"""Fused Triton layer kernels (``workers/models/triton_ops``) against the torch path they replace.

Without CUDA they run in the Triton interpreter. fp32 must match the torch modules to float rounding;
bf16 may differ by the rounding of products inside one fused expression (the torch path rounds each
operator's result to bf16), never more than a bf16 ulp or two; a plain residual add rounds alike in both
paths, so the updated residual stream is bit-identical. End to end, the Triton path (fused kernels
+ Triton attention) gives transformers' greedy tokens.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from cluster.protocol import SamplingParams
from tests.support.hf_models import hf_greedy, make_random_hf_model
from workers.models.layers import ACTIVATIONS, RMSNorm, apply_rotary
from workers.models.triton_ops import gated_act, logits_to_fp32, rms_norm, rotary_qk_

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1.6e-2, "atol": 1.6e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}


def _norm(dim: int, gemma: bool, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, gemma=gemma)
    gen = torch.Generator().manual_seed(seed)
    norm.weight.data = (torch.rand(dim, generator=gen) + (-0.5 if gemma else 0.5)).to(dtype)
    return norm


def _rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("dim", [64, 100])  # 100: a masked tail in the power-of-two tile
def test_rms_norm_with_and_without_residual(dtype: torch.dtype, gemma: bool, dim: int) -> None:
    norm = _norm(dim, gemma, dtype, seed=1)
    x = _rand(7, dim, dtype=dtype, seed=2)
    residual = _rand(7, dim, dtype=dtype, seed=3)
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps, gemma), norm(x), **_tol(dtype))

    expected_stream = residual + x
    stream = residual.clone()
    out = rms_norm(x, norm.weight, norm.eps, gemma, residual=stream)
    assert torch.equal(stream, expected_stream)
    torch.testing.assert_close(out, norm(expected_stream), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_post_norm_add_pre_norm(dtype: torch.dtype) -> None:
    """Gemma's ``residual + post_norm(x)`` then ``pre_norm(residual)`` as one kernel."""
    post, pre = _norm(96, True, dtype, seed=4), _norm(96, True, dtype, seed=5)
    x, residual = _rand(5, 96, dtype=dtype, seed=6), _rand(5, 96, dtype=dtype, seed=7)
    expected_stream = residual + post(x)
    stream = residual.clone()
    out = rms_norm(x, pre.weight, pre.eps, True, residual=stream, pre_weight=post.weight)
    torch.testing.assert_close(stream, expected_stream, **_tol(dtype))
    torch.testing.assert_close(out, pre(expected_stream), **_tol(dtype))
    assert not torch.equal(stream, residual)


def _rope(num_tokens: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.tensor([0, 1, 7, 300, 4095, 12][:num_tokens], dtype=torch.float32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_in_place_on_qkv_views(dtype: torch.dtype, qk_norm: bool) -> None:
    num_tokens, num_heads, num_kv_heads, head_dim = 6, 6, 2, 32
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _rand(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=8)
    cos, sin = _rope(num_tokens, head_dim, dtype)
    q, k, v = qkv.clone().split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
    q_norm, k_norm = _norm(head_dim, False, dtype, seed=9), _norm(head_dim, False, dtype, seed=10)
    if qk_norm:
        q, k = q_norm(q), k_norm(k)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    fused = qkv.clone()
    fq, fk, fv = fused.split([q_size, kv_size, kv_size], dim=-1)
    fq, fk = fq.view(num_tokens, num_heads, head_dim), fk.view(num_tokens, num_kv_heads, head_dim)
    weights = (q_norm.weight, k_norm.weight, q_norm.eps) if qk_norm else (None, None, 0.0)
    rotary_qk_(fq, fk, cos, sin, *weights)
    torch.testing.assert_close(fq, expected_q, **_tol(dtype))
    torch.testing.assert_close(fk, expected_k, **_tol(dtype))
    assert torch.equal(fv, v)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_gated_activation(dtype: torch.dtype, act: str) -> None:
    inter = 1300  # two column blocks, the second one masked
    gate_up = _rand(3, 2 * inter, dtype=dtype, seed=11)
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(gated_act(gate_up, act), ACTIVATIONS[act](gate) * up, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cap", [None, 30.0])
def test_logits_upcast_and_soft_cap(dtype: torch.dtype, cap: float | None) -> None:
    raw = _rand(4, 1500, dtype=dtype, seed=12, scale=40.0)
    expected = raw.float() if cap is None else torch.tanh(raw.float() / cap) * cap
    out = logits_to_fp32(raw, cap)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.argmax(dim=-1), raw.argmax(dim=-1))  # why a greedy batch may skip it


def test_empty_batches_launch_nothing() -> None:
    norm = _norm(16, False, torch.float32, seed=0)
    assert rms_norm(torch.empty(0, 16), norm.weight, 1e-6, False).shape == (0, 16)
    assert gated_act(torch.empty(0, 32), "silu").shape == (0, 16)


# NOTE: Llama's fused path runs in test_engine.py (the bundled Llama model, Triton backend); Qwen2 adds
# only linear biases to it. Gemma-2 (sandwich norms, GeGLU, soft-caps) and Qwen3 (q/k norm) run here.
@pytest.mark.parametrize("arch", ["gemma2", "qwen3"])
def test_triton_path_greedy_equals_transformers(arch: str, tmp_path: pathlib.Path) -> None:
    from workers.llm import LLM

    path = make_random_hf_model(arch, tmp_path)
    prompts = [[5, 9, 33, 2, 100, 7, 7, 41], list(range(3, 24)), [300, 301]]
    max_tokens = [5, 4, 6]
    reference = hf_greedy(path, prompts, max_tokens)
    llm = LLM(str(path), attention_backend="triton", block_size=4, max_num_batched_tokens=16)
    assert llm.engine.runner.fused_ops
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    assert llm.stats().num_mixed_steps > 0
    llm.check_no_leaks()

"""The torch path's fewer-op forms give the same bits as HF's op-by-op forms: RMSNorm as one
``F.rms_norm`` call in float32, and q/k norm + RoPE over q and k at once."""

from __future__ import annotations

import pytest
import torch

from workers.models.arch import ArchConfig
from workers.models.layers import Attention, RMSNorm, apply_rotary


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("shape", [(1, 256), (7, 256), (300, 1024), (5, 16, 128), (64, 3, 32)])
def test_rms_norm_is_bitwise_hf(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = torch.randn(shape[-1], generator=gen)
    for scale in (1e-3, 1.0, 1e3):
        x = torch.randn(*shape, generator=gen) * scale
        assert torch.equal(norm(x), _hf_rms_norm(x, norm.weight, 1e-6))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_joint_qk_norm_and_rotary_equal_separate_passes(qk_norm: bool) -> None:
    arch = ArchConfig(
        architecture="Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM",
        model_type="qwen3" if qk_norm else "llama",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attention_bias=False,
        hidden_act="silu",
    )
    assert arch.has_qk_norm == qk_norm
    gen = torch.Generator().manual_seed(1)
    attn = Attention(arch, 0)
    for p in attn.parameters():
        p.data = torch.randn(p.shape, generator=gen)
    num_tokens = 9
    qkv = torch.randn(num_tokens, arch.q_size + 2 * arch.kv_size, generator=gen)
    angles = torch.randn(num_tokens, 1, arch.head_dim, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    q, k = attn._norm_rotary_qk(qkv, cos, sin)
    q_ref = qkv[:, : arch.q_size].reshape(num_tokens, 4, 16)
    k_ref = qkv[:, arch.q_size : arch.q_size + arch.kv_size].reshape(num_tokens, 2, 16)
    if qk_norm:
        assert attn.q_norm is not None and attn.k_norm is not None
        q_ref = _hf_rms_norm(q_ref, attn.q_norm.weight, 1e-6)
        k_ref = _hf_rms_norm(k_ref, attn.k_norm.weight, 1e-6)
    assert torch.equal(q, apply_rotary(q_ref, cos, sin))
    assert torch.equal(k, apply_rotary(k_ref, cos, sin))

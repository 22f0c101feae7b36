"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3): differences are data in ArchConfig.

Qwen2 adds q/k/v biases, Qwen3 adds per-head q/k RMSNorm, Mistral may slide every layer; the module
tree mirrors HF's names (``model.layers.N.self_attn...``) so checkpoints load by name, with q/k/v and
gate/up fused.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.models.arch import ArchConfig
from workers.models.layers import (
    Attention,
    CausalLM,
    DecoderModel,
    Embedding,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(arch, layer_idx)
        self.mlp = GatedMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(DecoderModel):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__(arch)
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(arch, i) for i in range(arch.num_hidden_layers)])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.norm(hidden)


class LlamaForCausalLM(CausalLM):
    """Causal LM over one flat ragged batch; attention state comes from the forward context."""

    model_class = LlamaModel


# NOTE: Mistral/Qwen2/Qwen3 differ from Llama only in ArchConfig-driven details (biases, q/k norm, window).
MistralForCausalLM = LlamaForCausalLM
Qwen2ForCausalLM = LlamaForCausalLM
Qwen3ForCausalLM = LlamaForCausalLM

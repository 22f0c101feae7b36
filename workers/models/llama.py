"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3): differences are data in ArchConfig.

Qwen2 adds q/k/v biases, Qwen3 adds per-head q/k RMSNorm, Mistral may slide every layer; the module
tree mirrors HF's names (``model.layers.N.self_attn...``) so checkpoints load by name, with q/k/v and
gate/up fused.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.forward_context import get_forward_context
from workers.models.arch import ArchConfig
from workers.models.layers import (
    Attention,
    CausalLM,
    DecoderModel,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    fused_norm,
    vocab_embedding,
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
        self.embed_tokens = vocab_embedding(arch)
        self.layers = nn.ModuleList([LlamaDecoderLayer(arch, i) for i in range(arch.num_hidden_layers)])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        if get_forward_context().fused_ops:
            return self._forward_fused(hidden, cos, sin)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.norm(hidden)

    def _forward_fused(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The same layers with each residual add fused into the RMSNorm that follows it: ``residual``
        carries the stream (updated in place), ``x`` the branch output waiting to be added."""
        layers: list[LlamaDecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        residual = hidden
        x = fused_norm(layers[0].input_layernorm, hidden)
        for i, layer in enumerate(layers):
            if i > 0:
                x = fused_norm(layer.input_layernorm, x, residual)
            x = layer.self_attn(x, cos, sin)
            x = fused_norm(layer.post_attention_layernorm, x, residual)
            x = layer.mlp(x)
        return fused_norm(self.norm, x, residual)


class LlamaForCausalLM(CausalLM):
    """Causal LM over one flat ragged batch; attention state comes from the forward context."""

    model_class = LlamaModel


# NOTE: Mistral/Qwen2/Qwen3 differ from Llama only in ArchConfig-driven details (biases, q/k norm, window).
MistralForCausalLM = LlamaForCausalLM
Qwen2ForCausalLM = LlamaForCausalLM
Qwen3ForCausalLM = LlamaForCausalLM

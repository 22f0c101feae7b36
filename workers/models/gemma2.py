"""Gemma2 decoder: (1 + w) RMSNorm, pre/post attention and feed-forward norms, GeGLU, embeddings scaled by
sqrt(hidden) in the model dtype, attention logit soft-capping, sliding window on alternating layers
(per ``ArchConfig.layer_types``) and final logit soft-capping in ``compute_logits``.
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


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        dim, eps = arch.hidden_size, arch.rms_norm_eps
        self.self_attn = Attention(arch, layer_idx)
        self.mlp = GatedMLP(arch)
        self.input_layernorm = RMSNorm(dim, eps, gemma=True)
        self.post_attention_layernorm = RMSNorm(dim, eps, gemma=True)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, gemma=True)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, gemma=True)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma2Model(DecoderModel):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__(arch)
        self.hidden_size = arch.hidden_size
        self.embed_tokens = vocab_embedding(arch)
        self.layers = nn.ModuleList([Gemma2DecoderLayer(arch, i) for i in range(arch.num_hidden_layers)])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, gemma=True)
        self.rotary_emb = RotaryEmbedding(arch)
        self._embed_scales: dict[torch.dtype, float] = {}

    def embed_scale(self, dtype: torch.dtype) -> float:
        # NOTE: HF rounds sqrt(hidden) to the model dtype first (bf16: sqrt(2304)=48 stays, 55.43 -> 55.5).
        if dtype not in self._embed_scales:
            self._embed_scales[dtype] = float(torch.tensor(self.hidden_size**0.5, dtype=dtype).item())
        return self._embed_scales[dtype]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * self.embed_scale(hidden.dtype)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        if get_forward_context().fused_ops:
            return self._forward_fused(hidden, cos, sin)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.norm(hidden)

    def _forward_fused(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The same layers with each sandwich norm, residual add and following norm fused into one
        kernel: ``residual`` carries the stream (updated in place), ``x`` the branch output whose own
        post-norm (the previous feed-forward's, for a layer's input) is applied inside the next kernel."""
        layers: list[Gemma2DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        residual = hidden
        x = fused_norm(layers[0].input_layernorm, hidden)
        for i, layer in enumerate(layers):
            if i > 0:
                x = fused_norm(
                    layer.input_layernorm, x, residual, pre=layers[i - 1].post_feedforward_layernorm
                )
            x = layer.self_attn(x, cos, sin)
            x = fused_norm(layer.pre_feedforward_layernorm, x, residual, pre=layer.post_attention_layernorm)
            x = layer.mlp(x)
        return fused_norm(self.norm, x, residual, pre=layers[-1].post_feedforward_layernorm)


class Gemma2ForCausalLM(CausalLM):
    """Gemma2 causal LM; ``compute_logits`` applies final_logit_softcapping (from ArchConfig)."""

    model_class = Gemma2Model

"""Model registry: HF ``architectures[0]`` name -> model class (``cls(arch: ArchConfig)``)."""

from __future__ import annotations

from workers.models.arch import ArchConfig
from workers.models.gemma2 import Gemma2ForCausalLM
from workers.models.layers import CausalLM
from workers.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
}


def get_model_class(arch: ArchConfig) -> type[CausalLM]:
    if arch.architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported architecture {arch.architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[arch.architecture]


__all__ = ["MODEL_REGISTRY", "ArchConfig", "CausalLM", "get_model_class"]

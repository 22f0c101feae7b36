"""Attention backend registry: ``create_attention_backend("torch" | "triton")``."""

from __future__ import annotations

from workers.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec


def create_attention_backend(name: str) -> AttentionBackend:
    """The pure-torch backend is the oracle every faster backend is tested against."""
    if name == "torch":
        from workers.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from workers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be one of ('torch', 'triton'), got {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionSpec", "create_attention_backend"]

"""Frozen configuration dataclasses.

Every value a user sets lives here; values discovered at run time (resolved dtype, device, number of KV
blocks sized from memory) live on the engine, never back on a config. Unknown keys are an error.
This module imports nothing of the project.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("torch", "triton")

T = TypeVar("T")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to serve and how.

    path: a Hugging Face checkpoint directory (config.json + *.safetensors [+ tokenizer.json]);
    empty means the bundled tiny model. dtype "auto" takes the checkpoint's torch_dtype on CUDA and
    float32 on CPU. max_model_len None means the model's max_position_embeddings.
    """

    path: str = ""
    dtype: str = "auto"
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len must be >= 1, got {self.max_model_len}",
        )


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling and KV-cache settings of one paged-KV engine."""

    model: ModelConfig = field(default_factory=ModelConfig)
    device: str = "auto"
    block_size: int = 16
    # None: sized from memory (gpu_memory_utilization on CUDA, cpu_kv_cache_bytes on CPU).
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    attention_backend: str = "torch"
    enforce_eager: bool = False
    cuda_graph_max_batch_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        _require(1 <= self.block_size <= 1024, f"block_size must be in [1, 1024], got {self.block_size}")
        _require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 2,
            f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}",
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )

    @classmethod
    def from_options(cls, model: str = "", **options: Any) -> EngineConfig:
        """Build from flat keyword options (the offline API's `LLM(model, **options)`)."""
        model_keys = {f.name for f in dataclasses.fields(ModelConfig)} - {"path"}
        model_opts = {k: options.pop(k) for k in list(options) if k in model_keys}
        return from_dict(cls, {**options, "model": ModelConfig(path=model, **model_opts)})


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Construct dataclass `cls` from a mapping; unknown keys raise ValueError naming them."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} option(s) {unknown}; known: {sorted(names)}")
    return cls(**data)

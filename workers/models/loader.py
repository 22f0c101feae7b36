"""Build a model on its device: from a safetensors checkpoint directory, or with random weights.

Both paths construct the module tree on the ``meta`` device, cast it to the target dtype there (free),
then materialise it with ``to_empty`` directly on the target device: no CPU copy of the weights is
ever made for a CUDA model, and no init work is spent on values that are overwritten.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from cluster.hub import weight_files
from workers.models import get_model_class
from workers.models.arch import ArchConfig
from workers.models.layers import CausalLM, Linear, RMSNorm, RotaryEmbedding


def _materialize(arch: ArchConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Uninitialised parameters of ``arch`` in ``dtype`` on ``device``; derived buffers recomputed."""
    cls = get_model_class(arch)
    with torch.device("meta"):
        model = cls(arch)
    model.to(dtype=dtype).to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            # NOTE: to(dtype) cast the float32 inv_freq and to_empty left garbage; rebuild it in float32.
            module.reset_buffers()
    return model.eval()


def iter_safetensors(model_dir: str, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` one tensor at a time from the checkpoint's weight files: the shards that
    ``model.safetensors.index.json`` names, else ``model.safetensors``, else every ``*.safetensors``
    (``cluster.hub.weight_files``; a ``consolidated.safetensors`` beside indexed shards is not read).

    Each tensor is read straight onto ``device``; the caller copies it into its parameter and drops it,
    so at most one checkpoint tensor is alive beside the model.
    """
    files = [Path(model_dir) / name for name in weight_files(model_dir)]
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model directory {model_dir!r}")
    for path in files:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device) -> tuple[CausalLM, ArchConfig]:
    """Reads config.json + *.safetensors from ``model_dir``; returns the eval-mode model and its ArchConfig."""
    arch = ArchConfig.from_pretrained(model_dir)
    model = _materialize(arch, dtype, device)
    with torch.no_grad():
        model.load_weights(iter_safetensors(model_dir, device))
    return model, arch


def build_random_model(arch: ArchConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> CausalLM:
    """A model with random weights initialised on ``device`` (for benchmarks; no checkpoint needed).

    Weights and embeddings ~ N(0, 0.02), biases 0, RMSNorm weights 1 (0 for Gemma's ``(1 + w)`` form).
    """
    model = _materialize(arch, dtype, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(0.0 if module.gemma else 1.0)
            elif isinstance(module, Linear) and module.bias is not None:
                module.bias.zero_()
            for name, param in module.named_parameters(recurse=False):
                if not isinstance(module, RMSNorm) and name == "weight":
                    param.normal_(0.0, 0.02, generator=generator)
    return model

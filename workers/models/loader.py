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
from workers.models.layers import PACKED_MODULES, CausalLM, Linear, RMSNorm, RotaryEmbedding
from workers.models.parallel import SINGLE, Sharding, TensorParallel, building

# our fused module -> the HF modules it packs, in shard order
_UNPACKED = {
    fused: [hf for hf, (f, _) in sorted(PACKED_MODULES.items(), key=lambda kv: kv[1][1]) if f == fused]
    for fused, _ in PACKED_MODULES.values()
}


def _materialize(
    arch: ArchConfig, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE
) -> CausalLM:
    """Uninitialised parameters of ``arch`` (``tp``'s shard of them) in ``dtype`` on ``device``; derived
    buffers recomputed."""
    cls = get_model_class(arch)
    Sharding.check(arch, tp.size)
    with torch.device("meta"), building(tp):
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


def load_model(
    model_dir: str, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE
) -> tuple[CausalLM, ArchConfig]:
    """Reads config.json + *.safetensors from ``model_dir``; returns the eval-mode model (``tp``'s shard
    of it: every rank reads the checkpoint and keeps its part) and its ArchConfig."""
    arch = ArchConfig.from_pretrained(model_dir)
    model = _materialize(arch, dtype, device, tp)
    with torch.no_grad():
        model.load_weights(iter_safetensors(model_dir, device))
    return model, arch


def build_random_model(
    arch: ArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    tp: TensorParallel = SINGLE,
) -> CausalLM:
    """A model with random weights initialised on ``device`` (for benchmarks; no checkpoint needed).

    Weights and embeddings ~ N(0, 0.02), biases 0, RMSNorm weights 1 (0 for Gemma's ``(1 + w)`` form).
    Under tensor parallelism each rank keeps its shard of the same weights as the one-rank model's (the
    full tensors are drawn one at a time, in the same order, and narrowed as a checkpoint's are).
    """
    if tp.is_parallel:
        model = _materialize(arch, dtype, device, tp)
        with torch.no_grad():
            model.load_weights(_random_weights(arch, dtype, device, seed))
        return model
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


def _random_weights(
    arch: ArchConfig, dtype: torch.dtype, device: torch.device, seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The one-rank random model's tensors under HF names, drawn in ``build_random_model``'s order."""
    with torch.device("meta"):
        layout = get_model_class(arch)(arch)
    generator = torch.Generator(device=device).manual_seed(seed)
    for module_name, module in layout.named_modules():
        for name, param in module.named_parameters(recurse=False):
            full = torch.empty(param.shape, dtype=dtype, device=device)
            if isinstance(module, RMSNorm):
                full.fill_(0.0 if module.gemma else 1.0)
            elif isinstance(module, Linear) and name == "bias":
                full.zero_()
            elif name == "weight":
                full.normal_(0.0, 0.02, generator=generator)
            else:
                raise ValueError(f"no random init for {module_name}.{name}")
            fused = module_name.rsplit(".", 1)[-1]
            if isinstance(module, Linear) and fused in _UNPACKED:
                parent = module_name.rsplit(".", 1)[0]
                for i, hf in enumerate(_UNPACKED[fused]):
                    yield f"{parent}.{hf}.{name}", module.shard(full, i)
            else:
                yield f"{module_name}.{name}", full

"""GPU cost profiles as roofline estimates, from stated hardware figures and a model's config.json.

These are estimates, not measurements: achievable FLOP/s and bandwidth are the datasheet figures times
an efficiency, the per-step overhead is a guess at the engine's host time, and attention is counted as
dense (no sliding window). A GPU run of ``pdserve plan calibrate`` on the target replaces them with a
fitted profile.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cluster.cost_model import CostProfile, RooflineStepCost, TransferCost

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Hardware:
    """Datasheet figures of one accelerator (dense bf16 matmul, HBM, the link between two of them).

    ``link_gb_per_s``: one direction between two GPUs of one node (NVLink; PCIe on an L4 box);
    ``nic_gb_per_s``: one GPU's share of the network between nodes (its NIC, one direction);
    ``allreduce_latency_s``: the fixed cost of one small all-reduce inside a node (launch + link hops);
    ``host_link_gb_per_s``: one GPU's copies to or from pinned host memory, one direction (the host KV
    tier's offloads and loads).

    NOTE: ``host_link_gb_per_s`` is 80% of the PCIe link's raw rate a direction (x16 lanes, 128b/130b:
    Gen4 31.5 GB/s, Gen5 63 GB/s), about what CUDA's bandwidthTest reports for pinned copies of MiB-sized
    buffers (a host tier block: 2 MiB of an 8B model, copied whole); not measured on these boxes. On
    boards where two GPUs share a PCIe switch's uplink, it halves while both copy at once."""

    name: str
    matmul_tflops: float
    hbm_gb_per_s: float
    memory_gb: float
    link_gb_per_s: float
    matmul_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    step_overhead_s: float = 2e-3  # host time per engine step (scheduling, input prep, launches)
    link_latency_s: float = 1e-3  # handshake of one KV handoff
    nic_gb_per_s: float = 50.0  # 400 Gb/s InfiniBand / RoCE per GPU
    allreduce_latency_s: float = 10e-6
    host_link_gb_per_s: float = 25.0  # PCIe Gen4 x16


HARDWARE = {
    # NOTE: H100 and H200 SXM reach the host over PCIe Gen5 x16
    "h100": Hardware("H100 SXM", 989.0, 3350.0, 80.0, 450.0, host_link_gb_per_s=50.0),
    "h200": Hardware("H200 SXM", 989.0, 4800.0, 141.0, 450.0, host_link_gb_per_s=50.0),
    "a100": Hardware("A100 SXM 80GB", 312.0, 2039.0, 80.0, 300.0, nic_gb_per_s=25.0),
    # NOTE: L4 boxes have no NVLink: GPUs talk over PCIe 4.0 x16 and a 100 GbE NIC
    "l4": Hardware("L4", 121.0, 300.0, 24.0, 32.0, nic_gb_per_s=12.5, allreduce_latency_s=30e-6),
}


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a decoder-only transformer."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int
    tie_word_embeddings: bool = False

    @property
    def layer_params(self) -> int:
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attn + mlp)

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        """What a step reads of the weights: every layer and the LM head (the embedding is only indexed)."""
        return (self.layer_params + self.lm_head_params) * self.dtype_bytes

    @property
    def resident_weight_bytes(self) -> int:
        """What the weights take in memory: ``weight_bytes`` and the embedding table (unless tied)."""
        embedding = 0 if self.tie_word_embeddings else self.hidden_size * self.vocab_size
        return self.weight_bytes + embedding * self.dtype_bytes

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one of ``tp`` ranks holds: split, or one each (replicated) when there are fewer heads
        than ranks (as vLLM does). ValueError when the heads cannot be shared so."""
        heads = self.num_kv_heads
        if tp < 1 or (heads % tp and tp % heads) or self.num_heads % tp:
            raise ValueError(
                f"{self.name}: tensor_parallel_size {tp} must divide its {self.num_heads} query heads, "
                f"and divide its {heads} KV heads or be a multiple of them"
            )
        return max(1, heads // tp)

    def kv_bytes_per_token_per_rank(self, tp: int) -> int:
        return 2 * self.num_layers * self.kv_heads_per_rank(tp) * self.head_dim * self.dtype_bytes

    @classmethod
    def from_config(cls, model_dir: str | Path, dtype: str = "auto") -> ModelShape:
        path = Path(model_dir)
        cfg = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        text = cfg.get("text_config", cfg)
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        name = dtype if dtype != "auto" else str(text.get("torch_dtype") or text.get("dtype") or "bfloat16")
        return cls(
            name=path.name,
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            vocab_size=int(text["vocab_size"]),
            dtype_bytes=DTYPE_BYTES.get(name, 2),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        )


def roofline_profile(hw: Hardware, model: ModelShape, tp: int = 1) -> CostProfile:
    """The roofline estimate of ``model`` on workers of ``tp`` ``hw`` GPUs (``with_tensor_parallel``
    takes it to another size): two all-reduces a layer of hidden x dtype bytes a token, over the link
    inside a node."""
    model.kv_heads_per_rank(tp)  # NOTE: refuses a size the heads cannot be split over
    # NOTE: the LM head runs once per sampled sequence, not per prompt token; spreading it over every
    # token overstates prefill by vocab/(layers x width) -- small for the models this targets.
    flops_per_token = 2.0 * (model.layer_params + model.lm_head_params)
    step = RooflineStepCost(
        overhead_s=hw.step_overhead_s,
        flops_per_s=hw.matmul_tflops * 1e12 * hw.matmul_efficiency,
        bytes_per_s=hw.hbm_gb_per_s * 1e9 * hw.memory_efficiency,
        flops_per_token=flops_per_token,
        attention_flops_per_pair=4.0 * model.num_layers * model.num_heads * model.head_dim,
        weight_bytes=float(model.weight_bytes),
        kv_bytes_per_token=float(model.kv_bytes_per_token),
        tensor_parallel_size=tp,
        allreduces_per_step=2 * model.num_layers,
        allreduce_bytes_per_token=float(model.hidden_size * model.dtype_bytes),
        link_bytes_per_s=hw.link_gb_per_s * 1e9,
        allreduce_latency_s=hw.allreduce_latency_s,
        num_kv_heads=model.num_kv_heads,
    )
    return CostProfile(
        name=f"{hw.name} / {model.name}",
        source=(
            f"roofline estimate: {hw.matmul_tflops:g} TFLOP/s x {hw.matmul_efficiency:g}, HBM "
            f"{hw.hbm_gb_per_s:g} GB/s x {hw.memory_efficiency:g}, link {hw.link_gb_per_s:g} GB/s, "
            f"all-reduce latency {hw.allreduce_latency_s * 1e6:g} us, host link {hw.host_link_gb_per_s:g} GB/s; "
            "not calibrated on the device"
        ),
        step=step,
        transfer=TransferCost(hw.link_latency_s, hw.link_gb_per_s * 1e9),
        kv_bytes_per_token=model.kv_bytes_per_token,
        hop_s=3e-4,
        http_s=1e-3,
        host_cpus=None,
        host_link_bytes_per_s=hw.host_link_gb_per_s * 1e9,
    )


def gpu_kv_blocks(
    hw: Hardware, model: ModelShape, block_size: int, gpu_memory_utilization: float = 0.9, tp: int = 1
) -> int:
    """KV blocks a worker of ``tp`` GPUs holds, as the runner sizes them: on each rank, what its share of
    the weights leaves of ``gpu_memory_utilization`` of its memory (1 GiB kept back for activations),
    in blocks of its share of the KV heads. ValueError, with the figures, when the model does not fit."""
    per_rank = hw.memory_gb * 1e9 * gpu_memory_utilization
    weights = model.resident_weight_bytes / tp
    free = per_rank - weights - 2**30
    num_blocks = int(free // (block_size * model.kv_bytes_per_token_per_rank(tp))) if free > 0 else 0
    if num_blocks < 2:
        where = f"one {hw.name}" if tp == 1 else f"{tp} x {hw.name} (TP{tp})"
        raise ValueError(
            f"{model.name} does not fit on {where}: {weights / 1e9:.1f} GB of weights a GPU + 1 GiB "
            f"for activations leave no room for KV in {gpu_memory_utilization:g} x {hw.memory_gb:g} GB"
        )
    return num_blocks

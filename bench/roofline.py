"""The CPU matmul roofline of an offline run: the model math a workload needs, and the fp32 matmul rate
this machine reaches (at 2048^3 and at the model's own weight shapes), measured in the same process.

Model FLOPs count what any engine must compute for the workload, whatever it pads or wastes: every
prompt and output token goes through every layer once (2 FLOPs per weight of the q/k/v, o, gate/up and
down projections, plus 4 * heads * head_dim FLOPs per attended key for QK^T and PV, causal), and each
output token costs one row of logits (2 * hidden * vocab).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.models.arch import ArchConfig


@dataclass(frozen=True)
class ModelFlops:
    layers: float  # the projections of every layer, every token
    attention: float  # QK^T and PV over the causal context
    logits: float  # one row of logits per output token

    @property
    def total(self) -> float:
        return self.layers + self.attention + self.logits


def layer_weight_shapes(arch: ArchConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of one decoder layer's matmuls (q/k/v and gate/up fused, as run)."""
    h, i = arch.hidden_size, arch.intermediate_size
    return [(arch.q_size + 2 * arch.kv_size, h), (h, arch.q_size), (2 * i, h), (h, i)]


def workload_flops(arch: ArchConfig, prompt_lens: Sequence[int], output_lens: Sequence[int]) -> ModelFlops:
    per_token = 2.0 * sum(o * i for o, i in layer_weight_shapes(arch)) * arch.num_hidden_layers
    attn_per_key = 4.0 * arch.num_attention_heads * arch.head_dim * arch.num_hidden_layers
    layers = attention = 0.0
    for p, o in zip(prompt_lens, output_lens, strict=True):
        n = p + o
        layers += per_token * n
        attention += attn_per_key * n * (n + 1) / 2  # token at position t attends t + 1 keys
    logits = 2.0 * arch.hidden_size * arch.vocab_size * sum(output_lens)
    return ModelFlops(layers, attention, logits)


@dataclass(frozen=True)
class MatmulRate:
    label: str
    best_gflops: float
    median_gflops: float


def _time_rate(
    label: str, flops: float, fn: Callable[[], object], repeats: int, min_sample_s: float = 0.05
) -> MatmulRate:
    """Best and median rate over ``repeats`` samples; a sample repeats ``fn`` for >= ``min_sample_s``."""
    t0 = time.perf_counter()
    fn()  # warm-up (allocations, MKL/oneDNN dispatch), and a first estimate of its time
    calls = max(1, int(min_sample_s / max(time.perf_counter() - t0, 1e-6)))
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rates.append(calls * flops / (time.perf_counter() - t0) / 1e9)
    return MatmulRate(label, max(rates), statistics.median(rates))


def square_matmul_rate(n: int = 2048, repeats: int = 5) -> MatmulRate:
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    return _time_rate(f"{n}^3", 2.0 * n**3, lambda: torch.mm(a, b, out=out), repeats)


def model_shape_rate(arch: ArchConfig, num_tokens: int, repeats: int = 5) -> MatmulRate:
    """One pass of every matmul of one layer plus the logits head, ``num_tokens`` rows each."""
    weights = [torch.randn(o, i) * 0.02 for o, i in layer_weight_shapes(arch)]
    weights.append(torch.randn(arch.vocab_size, arch.hidden_size) * 0.02)
    inputs = [torch.randn(num_tokens, w.shape[1]) for w in weights]
    flops = sum(2.0 * num_tokens * w.shape[0] * w.shape[1] for w in weights)

    def run() -> None:
        for x, w in zip(inputs, weights, strict=True):
            F.linear(x, w)

    return _time_rate(f"model shapes, {num_tokens} rows", flops, run, repeats)


def measure_rates(arch: ArchConfig, token_counts: Sequence[int] = (128, 2048)) -> list[MatmulRate]:
    return [square_matmul_rate(), *(model_shape_rate(arch, m) for m in token_counts)]

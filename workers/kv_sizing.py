"""KV-cache sizing on CUDA: measure what a step needs beside the weights, give the rest to the KV cache."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cluster.config import EngineConfig
from cluster.protocol import SamplingParams
from workers.attention import AttentionBackend
from workers.forward_context import ForwardContext, forward_context
from workers.models.arch import ArchConfig
from workers.models.layers import CausalLM
from workers.sampler import Sampler
from workers.scheduler import ScheduledRequest, SchedulerOutput
from workers.step_inputs import StepArrays, StepInputs, build_step_arrays

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfiledModel:
    """What a profiling step runs, taken from the model runner before its KV cache exists: the model,
    sampler, attention backend and op path, the layout of a KV block, and ``fresh_inputs(arrays, out)``,
    the runner's way to put a step's inputs on the device (freshly allocated)."""

    model: CausalLM
    sampler: Sampler
    backend: AttentionBackend
    fused_ops: bool
    arch: ArchConfig
    dtype: torch.dtype
    device: torch.device
    block_size: int
    bytes_per_block: int
    fresh_inputs: Callable[[StepArrays, SchedulerOutput], StepInputs]


def _profile_schedule(block_size: int, query_lens: list[int], params: SamplingParams) -> SchedulerOutput:
    """Fresh sequences of the given lengths over consecutive blocks 1.. (block 0 stays null)."""
    scheduled: list[ScheduledRequest] = []
    next_block = 1
    for i, n in enumerate(query_lens):
        num_blocks = -(-n // block_size)
        blocks = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        scheduled.append(ScheduledRequest(f"profile-{i}", [0] * n, 0, blocks, True, False, params, 0))
    return SchedulerOutput(scheduled, sum(query_lens))


def _profile_peak(
    runner: ProfiledModel, query_lens: list[int], num_logits_rows: int, params: SamplingParams
) -> int:
    """Peak bytes a step of fresh sequences allocates beyond what is held now (model forward, then
    ``num_logits_rows`` rows of logits through the most expensive sampling path)."""
    out = _profile_schedule(runner.block_size, query_lens, params)
    arrays = build_step_arrays(out.scheduled, runner.block_size)
    num_profile_blocks = int(arrays.block_tables.max()) + 1
    shape = (num_profile_blocks, 2, runner.block_size, runner.arch.num_key_value_heads, runner.arch.head_dim)
    caches = [
        torch.zeros(shape, dtype=runner.dtype, device=runner.device)
        for _ in range(runner.arch.num_hidden_layers)
    ]
    torch.cuda.synchronize(runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    before = torch.cuda.memory_allocated(runner.device)
    inputs = runner.fresh_inputs(arrays, out)
    if inputs.meta is None:
        raise RuntimeError("profile step unexpectedly has no attention metadata")
    ctx = ForwardContext(inputs.meta, caches, runner.backend, runner.fused_ops)
    with torch.inference_mode(), forward_context(ctx):
        hidden = runner.model(inputs.input_ids, inputs.positions)
        rows = torch.arange(num_logits_rows, device=runner.device) % hidden.shape[0]
        logits = runner.model.compute_logits(hidden[rows])
        del hidden
        runner.sampler(logits, [params] * num_logits_rows, [None] * num_logits_rows)
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - before
    del caches, inputs, logits
    return peak


def size_kv_cache_cuda(
    runner: ProfiledModel,
    config: EngineConfig,
    max_model_len: int,
    graph_sizes: Sequence[int],
    params: SamplingParams,
    graph_allowance_bytes: int,
) -> int:
    """Blocks that fit in gpu_memory_utilization of the card, after what a step can need on top of
    the weights: the peak of a profiling step of max_num_batched_tokens prompt tokens (split into
    sequences no longer than ``max_model_len``, the configured one) with max_num_seqs rows sampled,
    plus, when decode graphs will be captured (``graph_sizes``), their pool (peak of a decode step at
    the largest graph size) and a per-graph allowance for the graph objects. The sum is what stays free
    beside the KV cache."""
    num_tokens = config.max_num_batched_tokens
    max_len = max_model_len
    lens = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
    activation_peak = _profile_peak(runner, lens, config.max_num_seqs, params)
    graph_reserve = 0
    if graph_sizes:
        graph_reserve = _profile_peak(runner, [1] * max(graph_sizes), 1, params)
        graph_reserve += graph_allowance_bytes * len(graph_sizes)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    kv_bytes = free - total * (1.0 - config.gpu_memory_utilization) - activation_peak - graph_reserve
    num_blocks = int(kv_bytes // runner.bytes_per_block)
    if num_blocks < 2:
        raise RuntimeError(
            f"no room for a KV cache: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB, "
            f"activation peak {activation_peak / 2**30:.2f} GiB, graph reserve "
            f"{graph_reserve / 2**30:.2f} GiB; raise gpu_memory_utilization"
        )
    logger.info(
        "KV cache: %d blocks (%.2f GiB); activation peak %.2f GiB, graph reserve %.2f GiB",
        num_blocks, num_blocks * runner.bytes_per_block / 2**30, activation_peak / 2**30, graph_reserve / 2**30,
    )  # fmt: skip
    return num_blocks

"""KV-cache sizing on CUDA: measure what a step needs beside the weights, reserve what the process will
allocate after sizing, give the rest to the KV cache.

The KV pool gets ``total * gpu_memory_utilization - used now - sum(reserve)``. The arithmetic is
``plan_kv_budget``, a pure function of plain numbers (tested on CPU); ``size_kv_cache_cuda`` only gathers
the measurements. Every term of the reserve (``KvReserve``) is logged on one line at start-up.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from cluster.config import EngineConfig
from cluster.protocol import SamplingParams
from transfer.ring import StagingRing
from transfer.side import DEFAULT_CHUNK_BYTES, NUM_SLOTS
from transfer.staging import ChunkPlan
from workers.attention import AttentionBackend
from workers.forward_context import ForwardContext, forward_context
from workers.models.arch import ArchConfig
from workers.models.layers import CausalLM
from workers.sampler import Sampler
from workers.scheduler import ScheduledRequest, SchedulerOutput
from workers.step_inputs import StepArrays, StepInputs, build_step_arrays

logger = logging.getLogger(__name__)

_MIB = 1 << 20

# NOTE: torch's cuBLAS workspace per (handle, stream), parsed as ATen's CublasHandlePool.cpp does:
# CUBLAS_WORKSPACE_CONFIG ":SIZE_KIB:COUNT[:SIZE_KIB:COUNT...]", else ":4096:8" (32 MiB) on compute
# capability 9.x-12.x (Hopper, Blackwell) and ":4096:2:16:8" (8 MiB + 128 KiB) before.
_CUBLAS_CONFIG_ITEM = re.compile(r":([0-9]+):([0-9]+)")
_CUBLAS_32MIB_MAJORS = (9, 10, 11, 12)
# NOTE: cuBLASLt takes its own workspace per (handle, stream) unless torch unifies the two
# (TORCH_CUBLAS_WORKSPACE_CACHE): CUBLASLT_WORKSPACE_SIZE in KiB, 1024 by default. Both are counted, an
# upper bound when unified.
_CUBLASLT_DEFAULT_KIB = 1024
# NOTE: a stated reserve, not measured on a GPU yet: warm_up_kernels and the graph capture run after
# sizing and load the Triton variants the profile did not (split decode, graph launch configurations);
# the 20 @triton.jit kernels of workers/ in a few variants each make ~100 modules of at most ~256 KiB of
# code and constants (~25 MiB), and the rest covers the driver growing its local-memory pool (bytes per
# thread x 2048 threads x SMs, ~34 MiB on an H100 at 128 bytes a thread) for a kernel that spills.
TRITON_MODULE_RESERVE_BYTES = 64 * _MIB
# NOTE: a stated margin, not measured: the caching allocator rounds large blocks up to 2 MiB (20 MiB
# segments under 10 MiB) and cannot merge blocks split across step shapes, so what it reserves runs
# ahead of the measured allocated peaks; 10% of them (activations and the graph pool).
FRAGMENTATION_FRACTION = 0.10
# NOTE: NCCL's documented NCCL_BUFFSIZE default (the Simple protocol's FIFO per channel per peer).
NCCL_DEFAULT_BUFFSIZE = 4 * _MIB
# NOTE: an estimate: a 2-rank send/recv communicator connects over several p2p channels (NCCL_MAX_NCHANNELS
# caps them when set); each holds the Simple FIFO and about as much again for the LL/LL128 FIFOs and the
# communicator's device structures. 8 channels x 2 x 4 MiB = 64 MiB per pair.
NCCL_CHANNELS_ESTIMATE = 8
_NCCL_BUFFERS_PER_CHANNEL = 2


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
    num_kv_heads: int  # this rank's (tensor parallelism splits them)
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
    shape = (num_profile_blocks, 2, runner.block_size, runner.num_kv_heads, runner.arch.head_dim)
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


@dataclass(frozen=True)
class TransferFootprint:
    """What this worker's KV transfers will hold on its GPU: one NCCL communicator per pair with a peer
    of the other pool (``num_nccl_pairs``; 0 with gloo or without transfers) and the staging ring of each
    transfer side it runs (``num_staging_sides``: 1 for a prefill worker's KVSender or a decode worker's
    KVReceiver, 0 colocated)."""

    num_nccl_pairs: int
    num_staging_sides: int

    def __post_init__(self) -> None:
        if self.num_nccl_pairs < 0 or self.num_staging_sides < 0:
            raise ValueError(f"TransferFootprint counts must be >= 0, got {self}")


NO_TRANSFER = TransferFootprint(num_nccl_pairs=0, num_staging_sides=0)
# NOTE: the engine's config does not say which pool it serves nor how many peers the other pool has; until
# the caller passes its real footprint, sizing assumes a transfer side with one NCCL pair (~80 MiB on an
# H100 at the default chunk size: a small price for an offline engine, an OOM avoided for a worker).
UNKNOWN_TRANSFER = TransferFootprint(num_nccl_pairs=1, num_staging_sides=1)


def transfer_footprint(backend: str, num_peers: int, is_transfer_side: bool) -> TransferFootprint:
    """The footprint of a worker of a pool that transfers KV (``is_transfer_side``: prefill or decode)
    with ``num_peers`` workers of the other pool over ``backend`` ("nccl" or "gloo", resolved)."""
    if not is_transfer_side:
        return NO_TRANSFER
    return TransferFootprint(num_peers if backend == "nccl" else 0, 1)


@dataclass(frozen=True)
class KvReserve:
    """Bytes kept free beside the KV cache, one field per thing that needs them (see plan_kv_budget)."""

    activation_peak: int  # measured: a profile step of the token budget, with max_num_seqs rows sampled
    graph_pool: int  # measured: a decode step at the largest graph size (the graphs' shared pool)
    graph_objects: int  # per captured graph: kernel nodes and parameters, outside the allocator
    cublas_workspace: int  # per extra stream that runs matmuls (the graph-capture stream)
    triton_modules: int  # kernels loaded after sizing (warm-up, capture)
    fragmentation: int  # the allocator's rounding and splitting over the measured peaks
    nccl_buffers: int  # per NCCL pair (communicator) with the other pool
    transfer_staging: int  # the transfer side's staging ring on this GPU
    tp_nccl_buffers: int = 0  # a tensor-parallel worker's two communicators (steps, KV relay) on this rank

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in dataclasses.fields(self))

    def describe(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name) / _MIB:.1f} MiB" for f in dataclasses.fields(self))


@dataclass(frozen=True)
class KvBudget:
    """The KV pool's bytes: ``total_bytes * gpu_memory_utilization - used_bytes - reserve.total``."""

    total_bytes: int
    used_bytes: int  # in use when sized: weights, context, workspaces already allocated
    gpu_memory_utilization: float
    reserve: KvReserve

    @property
    def allowed_bytes(self) -> int:
        return int(self.total_bytes * self.gpu_memory_utilization)

    @property
    def kv_bytes(self) -> int:
        return self.allowed_bytes - self.used_bytes - self.reserve.total

    def describe(self) -> str:
        return (
            f"gpu_memory_utilization {self.gpu_memory_utilization} of {self.total_bytes / _MIB:.1f} MiB "
            f"allows {self.allowed_bytes / _MIB:.1f} MiB; in use {self.used_bytes / _MIB:.1f} MiB; "
            f"reserve {self.reserve.total / _MIB:.1f} MiB ({self.reserve.describe()}); "
            f"KV {self.kv_bytes / _MIB:.1f} MiB"
        )

    def num_blocks(self, bytes_per_block: int) -> int:
        """Whole KV blocks that fit; RuntimeError naming every term when fewer than 2 (block 0 is null)."""
        num_blocks = self.kv_bytes // bytes_per_block
        if num_blocks < 2:
            raise RuntimeError(
                f"no room for a KV cache (2 blocks of {bytes_per_block / _MIB:.1f} MiB at least): "
                f"{self.describe()}; raise gpu_memory_utilization or lower max_num_batched_tokens / "
                "max_num_seqs / cuda_graph_max_batch_size"
            )
        return num_blocks


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None:
        return None
    try:
        parsed = int(value)
    except ValueError:
        return None
    return parsed if parsed >= 0 else None


def cublas_workspace_bytes(compute_capability: tuple[int, int], env: Mapping[str, str]) -> int:
    """Bytes of torch's cuBLAS workspace for one (handle, stream): CUBLAS_WORKSPACE_CONFIG, else the
    default for the compute capability."""
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    items = _CUBLAS_CONFIG_ITEM.findall(config) if config is not None else []
    if items:  # NOTE: like torch, a config without any ":SIZE:COUNT" falls back to the default
        return sum(int(size_kib) * 1024 * int(count) for size_kib, count in items)
    if compute_capability[0] in _CUBLAS_32MIB_MAJORS:
        return 4096 * 1024 * 8
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def cublaslt_workspace_bytes(env: Mapping[str, str]) -> int:
    """Bytes of torch's cuBLASLt workspace for one (handle, stream): CUBLASLT_WORKSPACE_SIZE KiB."""
    kib = _env_int(env, "CUBLASLT_WORKSPACE_SIZE")
    return (_CUBLASLT_DEFAULT_KIB if kib is None else kib) * 1024


def nccl_bytes_per_pair(env: Mapping[str, str]) -> int:
    """Estimated device bytes of one 2-rank NCCL communicator used for send/recv (see the NOTE above)."""
    buffsize = _env_int(env, "NCCL_BUFFSIZE") or NCCL_DEFAULT_BUFFSIZE
    channels = _env_int(env, "NCCL_MAX_NCHANNELS") or NCCL_CHANNELS_ESTIMATE
    return channels * _NCCL_BUFFERS_PER_CHANNEL * buffsize


def staging_ring_bytes(
    row_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES, num_slots: int = NUM_SLOTS
) -> int:
    """Device bytes of one transfer side's staging: the largest ring it keeps (``num_slots`` chunks cut
    from ``chunk_bytes`` in whole rows of ``row_bytes``, one layer's K and V of a block). With nccl the
    wire buffer is on the GPU, with gloo its device mirror; either way one ring (transfer/side.py)."""
    plan = ChunkPlan.create(num_layers=1, num_blocks=1, row_bytes=row_bytes, chunk_bytes=chunk_bytes)
    return StagingRing.nbytes(plan, num_slots)


def plan_kv_budget(
    *,
    total_bytes: int,
    free_bytes: int,
    gpu_memory_utilization: float,
    activation_peak: int,
    graph_pool: int,
    num_graphs: int,
    graph_allowance_bytes: int,
    compute_capability: tuple[int, int],
    env: Mapping[str, str],
    transfer: TransferFootprint,
    row_bytes: int,
    triton_modules: int = TRITON_MODULE_RESERVE_BYTES,
    fragmentation_fraction: float = FRAGMENTATION_FRACTION,
    tensor_parallel_size: int = 1,
) -> KvBudget:
    """The KV budget from plain numbers: the card's ``total_bytes`` and ``free_bytes`` now (after the
    profile, its cache emptied), the measured peaks, ``num_graphs`` decode graphs to capture, the device's
    compute capability, the process environment (CUBLAS_WORKSPACE_CONFIG, CUBLASLT_WORKSPACE_SIZE,
    NCCL_BUFFSIZE, NCCL_MAX_NCHANNELS), the transfer footprint and the KV row size its staging is cut in.
    A rank of a tensor-parallel worker (``tensor_parallel_size`` > 1) also keeps its two communicators'
    buffers: each rank of a ring talks to two neighbours (one when there are two ranks), a pair's buffers
    each."""
    # NOTE: the profile ran on the default stream, whose workspace it measured; the graphs are captured
    # on torch's capture stream, which takes its own. The transfer side's stream runs no matmul.
    num_matmul_streams = 1 if num_graphs else 0
    reserve = KvReserve(
        activation_peak=activation_peak,
        graph_pool=graph_pool,
        graph_objects=graph_allowance_bytes * num_graphs,
        cublas_workspace=num_matmul_streams
        * (cublas_workspace_bytes(compute_capability, env) + cublaslt_workspace_bytes(env)),
        triton_modules=triton_modules,
        fragmentation=math.ceil(fragmentation_fraction * (activation_peak + graph_pool)),
        nccl_buffers=transfer.num_nccl_pairs * nccl_bytes_per_pair(env),
        transfer_staging=transfer.num_staging_sides * staging_ring_bytes(row_bytes),
        tp_nccl_buffers=(2 * min(2, tensor_parallel_size - 1) * nccl_bytes_per_pair(env))
        if tensor_parallel_size > 1
        else 0,
    )
    return KvBudget(total_bytes, total_bytes - free_bytes, gpu_memory_utilization, reserve)


def size_kv_cache_cuda(
    runner: ProfiledModel,
    config: EngineConfig,
    max_model_len: int,
    graph_sizes: Sequence[int],
    params: SamplingParams,
    graph_allowance_bytes: int,
    transfer: TransferFootprint = UNKNOWN_TRANSFER,
) -> int:
    """Blocks that fit in gpu_memory_utilization of the card beside what is in use now and the reserve
    (``plan_kv_budget``). Measured here: the peak of a profiling step of max_num_batched_tokens prompt
    tokens (split into sequences no longer than ``max_model_len``, the configured one) with max_num_seqs
    rows sampled, and, when decode graphs will be captured (``graph_sizes``), their pool (the peak of a
    decode step at the largest graph size). Logs the budget on one line."""
    num_tokens = config.max_num_batched_tokens
    max_len = max_model_len
    lens = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
    activation_peak = _profile_peak(runner, lens, config.max_num_seqs, params)
    graph_pool = _profile_peak(runner, [1] * max(graph_sizes), 1, params) if graph_sizes else 0
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    budget = plan_kv_budget(
        total_bytes=total,
        free_bytes=free,
        gpu_memory_utilization=config.gpu_memory_utilization,
        activation_peak=activation_peak,
        graph_pool=graph_pool,
        num_graphs=len(graph_sizes),
        graph_allowance_bytes=graph_allowance_bytes,
        compute_capability=torch.cuda.get_device_capability(runner.device),
        env=os.environ,
        transfer=transfer,
        row_bytes=runner.bytes_per_block // runner.arch.num_hidden_layers,
        tensor_parallel_size=config.tensor_parallel_size,
    )
    num_blocks = budget.num_blocks(runner.bytes_per_block)
    logger.info("KV cache: %d blocks; %s", num_blocks, budget.describe())
    return num_blocks

"""CUDA KV sizing's arithmetic on CPU: every reserved term, exactly, and the refusal of a budget too small."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from workers.kv_sizing import (
    NO_TRANSFER,
    UNKNOWN_TRANSFER,
    KvBudget,
    KvReserve,
    TransferFootprint,
    cublas_workspace_bytes,
    cublaslt_workspace_bytes,
    nccl_bytes_per_pair,
    plan_kv_budget,
    staging_ring_bytes,
    transfer_footprint,
)

MIB = 1 << 20
GIB = 1 << 30
HOPPER = (9, 0)
ROW_BYTES = 64 << 10  # one layer's K and V of a block: 2 x 16 tokens x 8 heads x 128 x bf16
RING_BYTES = 4 * (4 * MIB + 64)  # 4 slots of a 4 MiB chunk + its 8-byte trailer, 64-byte aligned


def plan(**overrides: Any) -> KvBudget:
    """A budget with every reserved term off unless ``overrides`` turns it on."""
    kwargs: dict[str, Any] = {
        "total_bytes": 80 * GIB,
        "free_bytes": 60 * GIB,
        "gpu_memory_utilization": 0.75,
        "activation_peak": 0,
        "graph_pool": 0,
        "num_graphs": 0,
        "graph_allowance_bytes": 4 * MIB,
        "compute_capability": HOPPER,
        "env": {},
        "transfer": NO_TRANSFER,
        "row_bytes": ROW_BYTES,
        "triton_modules": 0,
        "fragmentation_fraction": 0.0,
    }
    kwargs.update(overrides)
    return plan_kv_budget(**kwargs)


def test_kv_bytes_are_utilization_minus_used_minus_every_reserved_term() -> None:
    budget = plan(
        activation_peak=3 * GIB,
        graph_pool=1 * GIB,
        num_graphs=34,
        transfer=TransferFootprint(num_nccl_pairs=3, num_staging_sides=1),
        triton_modules=64 * MIB,
        fragmentation_fraction=0.1,
    )
    assert budget.reserve == KvReserve(
        activation_peak=3 * GIB,
        graph_pool=1 * GIB,
        graph_objects=34 * 4 * MIB,
        cublas_workspace=32 * MIB + 1 * MIB,
        triton_modules=64 * MIB,
        fragmentation=429_496_730,  # ceil(0.1 x 4 GiB)
        nccl_buffers=3 * 64 * MIB,
        transfer_staging=RING_BYTES,
    )
    assert budget.allowed_bytes == 60 * GIB
    assert budget.used_bytes == 20 * GIB
    reserved = 4 * GIB + 136 * MIB + 33 * MIB + 64 * MIB + 429_496_730 + 192 * MIB + RING_BYTES
    assert budget.reserve.total == reserved
    assert budget.kv_bytes == 40 * GIB - reserved
    assert budget.num_blocks(2 * MIB) == (40 * GIB - reserved) // (2 * MIB)


def test_with_every_term_off_the_pool_is_utilization_minus_used() -> None:
    budget = plan()
    assert budget.reserve.total == 0
    assert budget.kv_bytes == 40 * GIB


@pytest.mark.parametrize(
    ("overrides", "field", "amount"),
    [
        ({"activation_peak": 5 * MIB}, "activation_peak", 5 * MIB),
        ({"graph_pool": 7 * MIB}, "graph_pool", 7 * MIB),
        ({"triton_modules": 64 * MIB}, "triton_modules", 64 * MIB),
        ({"transfer": TransferFootprint(3, 0)}, "nccl_buffers", 3 * 64 * MIB),
        ({"transfer": TransferFootprint(0, 1)}, "transfer_staging", RING_BYTES),
    ],
)
def test_each_term_takes_exactly_its_amount_from_the_pool(
    overrides: dict[str, Any], field: str, amount: int
) -> None:
    base, budget = plan(), plan(**overrides)
    assert base.kv_bytes - budget.kv_bytes == amount
    assert dataclasses.replace(budget.reserve, **{field: 0}) == base.reserve
    assert getattr(budget.reserve, field) == amount


def test_graphs_take_their_objects_and_the_capture_streams_cublas_workspaces() -> None:
    base, budget = plan(), plan(num_graphs=3)
    assert budget.reserve.graph_objects == 3 * 4 * MIB
    assert budget.reserve.cublas_workspace == 32 * MIB + 1 * MIB  # one stream: cuBLAS + cuBLASLt
    assert base.kv_bytes - budget.kv_bytes == 12 * MIB + 33 * MIB
    eager = plan(num_graphs=0, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert eager.reserve.cublas_workspace == 0


def test_fragmentation_is_its_fraction_of_the_measured_peaks() -> None:
    peaks = plan(activation_peak=8 * MIB, graph_pool=4 * MIB)
    budget = plan(activation_peak=8 * MIB, graph_pool=4 * MIB, fragmentation_fraction=0.25)
    assert budget.reserve.fragmentation == 3 * MIB
    assert peaks.kv_bytes - budget.kv_bytes == 3 * MIB
    # NOTE: rounded up: a fraction of a byte is a byte
    assert plan(activation_peak=3, fragmentation_fraction=0.5).reserve.fragmentation == 2


def test_default_reserves_are_the_stated_ones() -> None:
    budget = plan_kv_budget(
        total_bytes=80 * GIB,
        free_bytes=60 * GIB,
        gpu_memory_utilization=0.75,
        activation_peak=1 * GIB,
        graph_pool=0,
        num_graphs=0,
        graph_allowance_bytes=4 * MIB,
        compute_capability=HOPPER,
        env={},
        transfer=UNKNOWN_TRANSFER,
        row_bytes=ROW_BYTES,
    )
    assert budget.reserve.triton_modules == 64 * MIB
    assert budget.reserve.fragmentation == 107_374_183  # ceil(0.1 x 1 GiB)
    assert budget.reserve.nccl_buffers == 64 * MIB
    assert budget.reserve.transfer_staging == RING_BYTES


@pytest.mark.parametrize(
    ("compute_capability", "config", "expected"),
    [
        (HOPPER, None, 32 * MIB),
        ((10, 0), None, 32 * MIB),
        ((12, 0), None, 32 * MIB),
        ((8, 0), None, 8 * MIB + 128 * 1024),
        ((7, 5), None, 8 * MIB + 128 * 1024),
        ((8, 0), ":4096:8", 32 * MIB),
        (HOPPER, ":16:8", 128 * 1024),
        (HOPPER, ":4096:2:16:8", 8 * MIB + 128 * 1024),
        (HOPPER, ":4096:1", 4 * MIB),
        (HOPPER, ":0:0", 0),
        (HOPPER, "garbage", 32 * MIB),  # like torch: unparsable falls back to the default
        ((8, 6), "", 8 * MIB + 128 * 1024),
    ],
)
def test_cublas_workspace_follows_cublas_workspace_config(
    compute_capability: tuple[int, int], config: str | None, expected: int
) -> None:
    env = {} if config is None else {"CUBLAS_WORKSPACE_CONFIG": config}
    assert cublas_workspace_bytes(compute_capability, env) == expected


@pytest.mark.parametrize(
    ("value", "expected"), [(None, 1 * MIB), ("4096", 4 * MIB), ("0", 0), ("lots", 1 * MIB)]
)
def test_cublaslt_workspace_follows_its_env_in_kib(value: str | None, expected: int) -> None:
    env = {} if value is None else {"CUBLASLT_WORKSPACE_SIZE": value}
    assert cublaslt_workspace_bytes(env) == expected


def test_the_capture_streams_workspace_follows_the_env() -> None:
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "256"}
    assert plan(num_graphs=1, env=env).reserve.cublas_workspace == 128 * 1024 + 256 * 1024


def test_nccl_per_pair_follows_buffsize_and_channels() -> None:
    assert nccl_bytes_per_pair({}) == 8 * 2 * 4 * MIB
    assert nccl_bytes_per_pair({"NCCL_BUFFSIZE": str(2 * MIB), "NCCL_MAX_NCHANNELS": "2"}) == 2 * 2 * 2 * MIB
    assert nccl_bytes_per_pair({"NCCL_BUFFSIZE": "big", "NCCL_MAX_NCHANNELS": "-1"}) == 64 * MIB


def test_zero_pairs_reserve_no_nccl_buffers() -> None:
    budget = plan(transfer=TransferFootprint(num_nccl_pairs=0, num_staging_sides=1))
    assert budget.reserve.nccl_buffers == 0
    assert budget.reserve.transfer_staging == RING_BYTES


def test_transfer_footprint_of_each_pool() -> None:
    assert transfer_footprint("nccl", 4, is_transfer_side=True) == TransferFootprint(4, 1)
    assert transfer_footprint("gloo", 4, is_transfer_side=True) == TransferFootprint(0, 1)
    assert transfer_footprint("nccl", 4, is_transfer_side=False) == NO_TRANSFER
    with pytest.raises(ValueError, match="counts must be >= 0"):
        TransferFootprint(-1, 1)


@pytest.mark.parametrize(
    ("row_bytes", "expected"),
    [
        (ROW_BYTES, RING_BYTES),  # 64 rows a chunk
        (3 * MIB, 4 * (3 * MIB + 64)),  # one row a chunk
        (5 * MIB, 4 * (5 * MIB + 64)),  # a row larger than the chunk size is still one chunk
        (1000 * 1000, 4 * 4_000_064),  # 4 rows, 4_000_008 bytes with the trailer, aligned up to 64
    ],
)
def test_staging_is_the_transfer_sides_ring(row_bytes: int, expected: int) -> None:
    assert staging_ring_bytes(row_bytes) == expected


def test_a_pool_of_two_blocks_fits_and_one_less_byte_does_not() -> None:
    # 80 GiB x 0.75 - 20 GiB in use - 1 MiB of activations leaves 40 GiB - 1 MiB
    budget = plan(activation_peak=1 * MIB)
    block = (40 * GIB - 1 * MIB) // 2
    assert budget.num_blocks(block) == 2
    with pytest.raises(RuntimeError, match="no room for a KV cache"):
        budget.num_blocks(block + 1)


def test_a_budget_below_zero_is_refused_naming_utilization_and_every_term() -> None:
    budget = plan(
        total_bytes=1024 * MIB,
        free_bytes=512 * MIB,
        gpu_memory_utilization=0.5,
        activation_peak=1 * MIB,
        transfer=TransferFootprint(1, 1),
    )
    assert budget.kv_bytes == -1 * MIB - 64 * MIB - RING_BYTES
    with pytest.raises(RuntimeError) as caught:
        budget.num_blocks(1 * MIB)
    assert str(caught.value) == (
        "no room for a KV cache (2 blocks of 1.0 MiB at least): gpu_memory_utilization 0.5 of 1024.0 MiB "
        "allows 512.0 MiB; in use 512.0 MiB; reserve 81.0 MiB (activation_peak 1.0 MiB, graph_pool 0.0 MiB, "
        "graph_objects 0.0 MiB, cublas_workspace 0.0 MiB, triton_modules 0.0 MiB, fragmentation 0.0 MiB, "
        "nccl_buffers 64.0 MiB, transfer_staging 16.0 MiB, tp_nccl_buffers 0.0 MiB); KV -81.0 MiB; raise "
        "gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs / cuda_graph_max_batch_size"
    )


def test_a_tensor_parallel_rank_keeps_its_two_communicators_buffers() -> None:
    one = plan(tensor_parallel_size=1).reserve
    two = plan(tensor_parallel_size=2).reserve
    four = plan(tensor_parallel_size=4).reserve
    assert one.tp_nccl_buffers == 0
    assert two.tp_nccl_buffers == 2 * 64 * MIB  # steps + KV relay, one neighbour each
    assert four.tp_nccl_buffers == 2 * 2 * 64 * MIB  # a ring: two neighbours each
    assert four.total - one.total == four.tp_nccl_buffers
